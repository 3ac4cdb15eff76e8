"""Requests that a web browser sends: the proxy refuses them unless the upstream lists the page's origin.

An agent's HTTP client (httpx, aiohttp, an SDK) sends neither ``Origin`` nor ``Sec-Fetch-Site``; a browser
sends ``Sec-Fetch-Site`` on every request to a loopback or https address and ``Origin`` on every request a
page's script or form makes (and on CORS preflights). A page in the operator's browser, on any origin,
could otherwise send effects through the gateway with the credentials it injects, or read what the
upstreams answer. A browser's request that does go through leaves its cookies behind. No I/O here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from multidict import CIMultiDict

# Ports a browser leaves out of an origin: it sends https://x, never https://x:443.
DEFAULT_PORTS = {"http": 80, "https": 443}
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
    """Whether these are the headers of a browser's request: it carries Origin or Sec-Fetch-Site.

    Not any Sec-Fetch-* header: Node's built-in fetch (undici) sends Sec-Fetch-Mode on every request of
    an agent's, with neither of these.
    """
    return "Origin" in headers or "Sec-Fetch-Site" in headers


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


def _parts(origin: str) -> tuple[str, str, int | None]:
    """(scheme, host, port or None) of ``scheme://host[:port]``; an IPv6 host keeps its brackets.

    Raises ValueError for a port that is not a number from 1 to 65535 written as browsers write it.
    """
    scheme, _, authority = origin.partition("://")
    host, colon, port = authority.rpartition(":") if not authority.endswith("]") else (authority, "", "")
    if not colon:
        return scheme, authority, None
    if not port.isascii() or not port.isdigit() or port != str(int(port)) or not 0 < int(port) <= 65535:
        raise ValueError(f"{port!r} is not a port as browsers write it (1 to 65535, no leading zero)")
    return scheme, host, int(port)


def origin_flaw(origin: str) -> str | None:
    """Why a browser never sends ``origin`` as written, so listing it would admit nothing; or None.

    ``origin`` is already ``http(s)://host[:port]`` in lower case.
    """
    try:
        scheme, host, port = _parts(origin)
    except ValueError as exc:
        return str(exc)
    if not host:
        return "it names no host"
    if not host.isascii():
        return "browsers send a host name in its ASCII form (xn--...), as the address bar shows it punycoded"
    if port == DEFAULT_PORTS[scheme]:
        return f"browsers leave the default port out: write {scheme}://{host}"
    if host.startswith("["):
        try:
            written = str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            return f"{host} is not an IPv6 address"
        return None if f"[{written}]" == host else f"browsers write this address as [{written}]"
    if host.rpartition(".")[2].isdigit() and not _four_numbers(host):
        # A host ending in a number is an IPv4 address to a browser, which writes it as four numbers.
        return f"browsers write an IPv4 address as four numbers from 0 to 255 (127.0.0.1), not {host}"
    return None


def _four_numbers(host: str) -> bool:
    try:
        return str(ipaddress.IPv4Address(host)) == host
    except ValueError:
        return False


def _loopback(host: str) -> bool:
    """Whether ``host`` (a name, an address, or one in brackets) names this machine's loopback."""
    if host == "localhost" or host.endswith(".localhost"):
        return True  # browsers resolve every *.localhost name to loopback themselves
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def served_at(origin: str, host: str, port: int) -> bool:
    """Whether pages of ``origin`` could be what a listener on ``host``:``port`` serves (plain HTTP).

    On loopback, any loopback spelling of the port is that listener (``localhost``, ``127.0.0.1``,
    ``[::1]``). Beyond it, any name may lead there (DNS is not asked at start-up), so every http origin
    with that port is taken for it. Port 0 is chosen when the socket is bound, and can be matched by none.
    """
    scheme, origin_host, origin_port = _parts(origin)
    if scheme != "http" or port == 0 or (origin_port or DEFAULT_PORTS[scheme]) != port:
        return False
    return _loopback(origin_host) or not _loopback(host)
