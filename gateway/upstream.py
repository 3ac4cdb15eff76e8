"""The one HTTP seam: build the outbound request, send it, and say what came of it.

aiohttp's exceptions end here: the rest of the gateway sees only :mod:`gateway.outcome` values. The
line between "nothing left" and "it may have arrived" is drawn by aiohttp's own trace signal that the
request headers were written, not by guessing from exception types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
from yarl import URL

from gateway.outcome import Answered, NoAnswer, NotSent, Outcome
from gateway.policy import UpstreamPolicy
from gateway.stamp import stamp_request

# RFC 9110 section 7.6.1: meaningful for one connection only, so never forwarded nor stored.
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
GATEWAY_REQUEST_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "idempotency-key",
        "effect-gateway-token",
        "effect-gateway-run",
        "effect-gateway-step",
        "prefer",
    }
)
# Not stored for replay: lengths are recomputed, and a cookie is a credential the audit must not keep.
UNSTORED_RESPONSE_HEADERS = HOP_BY_HOP | {"content-length", "set-cookie"}


@dataclass(frozen=True, slots=True)
class Outbound:
    method: str
    url: URL
    headers: dict[str, str]
    body: bytes


def build_outbound(
    policy: UpstreamPolicy,
    derived_key: str | None,
    method: str,
    path: str,
    query: str,
    headers: Mapping[str, str],
    body: bytes,
) -> Outbound:
    """The request the upstream receives: the agent's, with the derived key, stamp and credentials."""
    out = {
        name: value
        for name, value in headers.items()
        if name.lower() not in HOP_BY_HOP and name.lower() not in GATEWAY_REQUEST_HEADERS
    }
    # Without a key (derived_key is None) the request is forwarded as it is: no derived key, no stamp.
    if derived_key is not None and policy.native_header:
        out[policy.native_header] = derived_key
    if derived_key is not None and policy.stamp is not None:
        kind, name = policy.stamp
        query, body = stamp_request(kind, name, derived_key, query=query, headers=out, body=body)
    # Injected credentials win over anything the agent sent: agents hold no secrets.
    lowered = {name.lower() for name in policy.inject.headers}
    out = {name: value for name, value in out.items() if name.lower() not in lowered}
    out.update(policy.inject.headers)
    target = policy.base_url + path + (f"?{query}" if query else "")
    return Outbound(method=method, url=URL(target, encoded=True), headers=out, body=body)


def storable_headers(headers: Mapping[str, str] | Any) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in headers.items() if k.lower() not in UNSTORED_RESPONSE_HEADERS)


def _headers_sent(_session: Any, ctx: SimpleNamespace, _params: Any) -> Any:
    # Requests of our own that need no such flag (probes) pass no trace context.
    if ctx.trace_request_ctx is not None:
        ctx.trace_request_ctx.sent = True
    return _noop()


async def _noop() -> None:
    return None


class UpstreamClient:
    """One aiohttp session for all upstreams; call :meth:`close` at shutdown."""

    def __init__(self, max_response_bytes: int) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_headers_sent)
        self._session = aiohttp.ClientSession(
            # Shorter than any common server's idle timeout, so a pooled connection is rarely found
            # closed by the peer; a POST on such a connection would be left in doubt.
            connector=aiohttp.TCPConnector(limit=200, keepalive_timeout=10),
            trace_configs=[trace],
            # Bodies are stored and replayed byte for byte, so they are never decoded on the way.
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._max_response_bytes = max_response_bytes

    async def close(self) -> None:
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    async def send(self, request: Outbound, timeout: float) -> Outcome:
        flag = SimpleNamespace(sent=False)
        try:
            async with self._session.request(
                request.method,
                request.url,
                headers=request.headers,
                data=request.body or None,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
                trace_request_ctx=flag,
            ) as resp:
                body = await self._read_limited(resp)
                if body is None:
                    return NoAnswer(
                        f"the response is larger than {self._max_response_bytes} bytes", too_large=True
                    )
                return Answered(status=resp.status, headers=storable_headers(resp.headers), body=body)
        except TimeoutError:
            if not flag.sent:
                return NotSent(f"could not connect within {timeout:g}s")
            return NoAnswer(f"no answer within {timeout:g}s", timed_out=True)
        except (aiohttp.ClientError, OSError) as exc:
            if not flag.sent:
                return NotSent(f"could not send: {type(exc).__name__}: {exc}")
            return NoAnswer(f"the connection broke after sending: {type(exc).__name__}: {exc}")

    async def _read_limited(self, resp: aiohttp.ClientResponse) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > self._max_response_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)
