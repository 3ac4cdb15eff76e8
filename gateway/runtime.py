"""What the aiohttp handlers share: the running gateway's parts, and the checks every request passes."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway import problems
from gateway.errors import ClientGone
from gateway.keys import LogHash
from gateway.mcp import ToolKind
from gateway.metrics import CachedCounts
from gateway.policy import UpstreamPolicy, longest_lease
from gateway.record import EffectRecord
from gateway.service import EffectService
from gateway.settings import Settings, is_loopback
from gateway.store import Store
from gateway.telemetry import Observed
from gateway.upstream import UpstreamClient


@dataclass(slots=True)
class Runtime:
    # Replaced together by a reload (reconfigure, gateway.reload says what may change): a request
    # reads them as it arrives (its caller's token, its upstream's policy) and goes on with what it read.
    settings: Settings
    policies: dict[str, UpstreamPolicy]
    store: Store
    service: EffectService
    telemetry: Observed
    # The effects by state for the metrics, read from the store at most every few seconds.
    state_counts: CachedCounts
    # The oldest effects waiting in doubt or for review, likewise.
    oldest_waiting: CachedCounts
    log_hash: LogHash
    # The upstreams' HTTP sessions, for what passes through an MCP server unrecorded (gateway.mcp_proxy).
    client: UpstreamClient
    # What an MCP endpoint's tools/list annotations said of its tools, by (upstream, path), as this
    # worker last saw them pass.
    tool_hints: dict[tuple[str, str], dict[str, ToolKind]] = field(default_factory=dict)
    # The event streams passing through from MCP servers, ended when the gateway stops: a stream lasts
    # as long as its session, and shutdown would wait out its timeout for them.
    streams: set[asyncio.Future[Any]] = field(default_factory=set)
    # The longest lease a call under way may hold, in seconds: what shutdown waits for at most. A reload
    # that shortens a timeout leaves the calls sent under the longer one running to their end.
    longest_lease: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.longest_lease = longest_lease(self.policies)

    def reconfigure(self, settings: Settings, policies: dict[str, UpstreamPolicy]) -> None:
        """Serve the next requests with ``settings`` (only what gateway.reload lets change differs)."""
        self.settings, self.policies = settings, policies
        self.longest_lease = max(self.longest_lease, longest_lease(policies))


RUNTIME = web.AppKey("runtime", Runtime)
log = logging.getLogger("effect_gateway")


def verdict_given(runtime: Runtime, record: EffectRecord, happened: bool, by: str | None) -> None:
    """Count an operator's verdict given through the gateway (the API or the audit page), and log it."""
    runtime.telemetry.verdict(record.upstream, happened)
    log.info(
        "effect %s resolved by an operator (%s): %s",
        record.id,
        by,
        "happened" if happened else "did not happen",
    )


# Headers read as one value: a second copy would let the gateway act on one and the upstream (or a
# log) on the other. Content-Type decides how the body is parsed for the fingerprint and the stamp.
SINGLE_HEADERS = (
    "Idempotency-Key",
    "Effect-Gateway-Token",
    "Effect-Gateway-Run",
    "Effect-Gateway-Step",
    "Content-Type",
)


def check_headers(request: web.Request) -> None:
    """Refuse headers the gateway cannot read unambiguously, before any route looks at them."""
    for name, value in request.headers.items():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # aiohttp keeps bytes that are not UTF-8 as lone surrogates
            raise problems.BadRequest(f"header {name} is not valid UTF-8") from None
    for name in SINGLE_HEADERS:
        count = len(request.headers.getall(name, ()))
        if count > 1:
            detail = f"{name} is sent {count} times; send it once"
            raise (problems.KeyMalformed if name == "Idempotency-Key" else problems.BadRequest)(detail)


# A Host header: a name or IPv4 address, or an IPv6 address in brackets, and an optional port.
_HOST = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]]+))(?::[0-9]{1,5})?")


# Every request asks it of the same one or two Host values; a client sending a new one each time only
# cycles the cache.
@functools.lru_cache(maxsize=64)
def _names_loopback(host: str) -> bool:
    if is_loopback(host):  # an address as aiohttp gives a whole URL's host: IPv6 without brackets
        return True
    found = _HOST.fullmatch(host)
    return found is not None and is_loopback((found["v6"] or found["name"]).lower())


def check_host(request: web.Request) -> None:
    """Answer only requests addressed to a loopback name, on a listener that asks its callers for no token.

    Such a listener is on loopback, so only this machine's processes reach it, but a person's browser
    does too: a web page on a name whose DNS answer is then switched to 127.0.0.1 (DNS rebinding) is
    same-origin with the gateway, and could send effects through it with the injected credentials,
    read the audit and resolve effects. Such a page's requests carry its own name as Host.
    """
    # aiohttp's host is the Host header's, except that a request line naming a whole URL names the host
    # itself, whatever Host says (RFC 9112 3.2.2); without either, the loopback address it arrived on.
    host = request.host
    if not _names_loopback(host):
        raise problems.BadRequest(
            f"Host {host!r} is not a loopback name: a listener that asks for no token answers only "
            "requests to localhost, 127.0.0.1 or [::1] (configure [tenants], and an [admin] token for the "
            "admin listener, to reach it by another name)"
        )


async def read_request_body(request: web.Request, settings: Settings) -> bytes:
    """The body as sent, within ``request_body_timeout`` (408 after it) and ``max_body_bytes`` (413)."""
    try:
        if request.content.is_eof():
            # All of it came with the head (most requests): reading it waits for nothing, so needs no
            # timer, which would cost a timeout handle scheduled and cancelled on every request.
            return await request.read()
        async with asyncio.timeout(settings.request_body_timeout.total_seconds()):
            return await request.read()
    except TimeoutError:
        raise problems.RequestTimeout(
            f"the body did not arrive within {settings.request_body_timeout.total_seconds():g}s; "
            "nothing was sent"
        ) from None
    except web.RequestPayloadError as exc:  # e.g. broken chunked encoding
        raise problems.BodyMalformed(f"the body could not be read: {exc}") from None
    except ConnectionError as exc:
        raise ClientGone(str(exc)) from None
