"""Requests that a web browser sends: the proxy refuses them unless the upstream lists the page's origin.

An agent's HTTP client (httpx, aiohttp, an SDK) sends neither ``Origin`` nor ``Sec-Fetch-Site``; a browser
sends ``Sec-Fetch-Site`` on every request and ``Origin`` on every request a page's script or form makes
(and on CORS preflights). A page in the operator's browser, on any origin, could otherwise send effects
through the gateway with the credentials it injects, or read what the upstreams answer. No I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping

# Sec-Fetch-Site (W3C Fetch Metadata): "none" is a request the person made themselves (the address bar,
# a bookmark), which no page can make for them; every other value is a page's doing.
_PERSON = "none"


def refusal(headers: Mapping[str, str], allowed: frozenset[str]) -> str | None:
    """Why a request with these headers is refused as a page's, or None: not a page's, or an allowed one."""
    origin = headers.get("Origin")
    if origin is not None:
        return None if origin in allowed else f"the request comes from a page on {origin[:100]!r}"
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site != _PERSON:
        return f"the request comes from a page in a browser (Sec-Fetch-Site: {site[:20]})"
    return None
