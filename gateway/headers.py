"""Which headers cross the gateway, and which stop at it. Plain data, shared by both directions."""

from __future__ import annotations

from collections.abc import Iterable

# RFC 9110 section 7.6.1: meaningful for one connection only, so never forwarded nor stored; so are the
# headers a message's own Connection header names.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
    }
)
# Headers that belong to the gateway (or that aiohttp computes itself) and are not forwarded upstream.
# Expect belongs to the agent's connection (aiohttp answered it); the body goes upstream decoded, so its
# Content-Encoding stays here (see gateway.codings).
GATEWAY_REQUEST_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "content-encoding",
        "expect",
        "idempotency-key",
        "effect-gateway-token",
        "effect-gateway-run",
        "effect-gateway-step",
        "prefer",
    }
)
# Not stored for replay: lengths are recomputed, a cookie is a credential the audit must not keep, and
# only the gateway says whether an answer is a replay.
UNSTORED_RESPONSE_HEADERS = HOP_BY_HOP | {"content-length", "set-cookie", "idempotent-replayed"}


def connection_scoped(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """Lower-cased names that must not cross the gateway: hop-by-hop ones and those Connection names."""
    named = {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    }
    return HOP_BY_HOP | named


def same_header(name: str) -> str:
    """A header name as the most lenient server reads it: CGI and WSGI turn ``-`` and ``_`` into one."""
    return name.lower().replace("_", "-")
