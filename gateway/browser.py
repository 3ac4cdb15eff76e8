"""Requests that a web browser sends: the proxy refuses them unless the upstream lists the page's origin.

An agent's HTTP client (httpx, aiohttp, an SDK) sends neither ``Origin`` nor ``Sec-Fetch-Site``; a browser
sends ``Sec-Fetch-Site`` on every request to a loopback or https address and ``Origin`` on every request a
page's script or form makes (and on CORS preflights). A page in the operator's browser, on any origin,
could otherwise send effects through the gateway with the credentials it injects, or read what the
upstreams answer. A browser's request that does go through leaves its cookies behind. No I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict

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


def sent_by_a_browser(headers: Mapping[str, str]) -> bool:
    """Whether these are the headers of a browser's request: it carries Origin or a Sec-Fetch-* header."""
    return "Origin" in headers or any(name.lower().startswith("sec-fetch-") for name in headers)


def cookieless(headers: Mapping[str, str]) -> Mapping[str, str]:
    """The headers to forward upstream: a browser's request without its Cookie header.

    A browser sends the cookies of the gateway's host, whatever their port (cookies ignore ports): the
    audit's session, and those of any other web app on the same host. None is the upstream's, which
    answers on another host and sets no cookie here (the gateway never relays Set-Cookie). An agent's
    own Cookie header goes through: some APIs take their credentials that way.
    """
    if not sent_by_a_browser(headers):
        return headers
    return CIMultiDict((name, value) for name, value in headers.items() if name.lower() != "cookie")
