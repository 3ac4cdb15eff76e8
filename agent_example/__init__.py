"""The grocery agent, its demo upstreams and the crash matrix (issue 4; not built yet)."""
