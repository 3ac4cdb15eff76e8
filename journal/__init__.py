"""The agent-side step journal and httpx integration (issue 4; not built yet)."""
