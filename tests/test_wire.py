"""Upstream answers relayed and replayed byte for byte, read from raw sockets at both ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import problems
from gateway.decision import MAYBE_HAPPENED, NOTHING_HAPPENED
from gateway.effects_json import parse_resolution
from gateway.proxy import response_of
from gateway.record import StoredResponse
from gateway.upstream import storable_headers
from tests.database import effect_rows
from tests.gateways import Gateway, gateway_server
from tests.upstreams import RawUpstream, raw_exchange, raw_upstream


async def raw_request(url: str, head: bytes, body: bytes = b"{}") -> tuple[bytes, list[bytes], bytes]:
    """(status line, header lines, body) exactly as the bytes came."""
    head_bytes, _, rest = (await raw_exchange(url, head, body)).partition(b"\r\n\r\n")
    status, *lines = head_bytes.split(b"\r\n")
    return status, lines, rest


GET = b"GET /shop/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def post(key: str) -> bytes:
    return b"POST /shop/x HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: " + key.encode() + b"\r\n"


def answer(*lines: bytes, status: bytes = b"201 Created") -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\n"
        + b"".join(x + b"\r\n" for x in lines)
        + b"Content-Length: 2\r\n\r\nok"
    )


@pytest.fixture
async def upstream_raw() -> AsyncIterator[RawUpstream]:
    # Every test sets the answer its case needs; this one is only there until it does.
    async with raw_upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as upstream:
        yield upstream


@pytest.fixture
async def gateway(dsn: str, upstream_raw: RawUpstream) -> AsyncIterator[Gateway]:
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream_raw.url, "timeout": "2s"}}) as gw:
        yield gw


async def test_a_header_that_is_not_utf8_reaches_the_agent_byte_for_byte(
    gateway: Gateway, upstream_raw: RawUpstream
) -> None:
    """X-Bin: caf\\xe9 from the upstream is X-Bin: caf\\xe9 at the agent, not 'caf'."""
    upstream_raw.answer = answer(b"X-Bin: caf\xe9", b"X-Text: caf\xc3\xa9")
    status, lines, body = await raw_request(gateway.url, GET)
    assert status.startswith(b"HTTP/1.1 201")
    assert b"X-Bin: caf\xe9" in lines
    assert b"X-Text: caf\xc3\xa9" in lines
    assert body == b"ok"


async def test_the_gateway_invents_no_content_type_or_server_for_an_answer(
    gateway: Gateway, upstream_raw: RawUpstream
) -> None:
    """An answer without Content-Type or Server reaches the agent without them, not as octet-stream."""
    upstream_raw.answer = answer(b"X-Only: 1")
    _, lines, _ = await raw_request(gateway.url, GET)
    names = [line.split(b":")[0].lower() for line in lines]
    assert b"content-type" not in names
    assert b"server" not in names


async def _serve_stored(stored: StoredResponse, *, replayed: bool) -> list[bytes]:
    """The head of ``stored`` as the gateway's response writer puts it on a real socket."""

    async def handler(_: web.Request) -> web.StreamResponse:
        return response_of(stored, replayed=replayed)

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        _, lines, _ = await raw_request(
            f"http://127.0.0.1:{runner.addresses[0][1]}", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        )
    finally:
        await runner.cleanup()
    return lines


async def test_a_stored_answer_is_replayed_with_the_upstreams_bytes() -> None:
    """A replay writes the stored header bytes (surrogate escapes) exactly, plus Idempotent-Replayed."""
    headers = storable_headers([(b"X-Bin", b"caf\xe9"), (b"X-Multi", b"a"), (b"X-Multi", b"b")])
    lines = await _serve_stored(StoredResponse(201, headers, b"ok"), replayed=True)
    assert lines[:4] == [b"X-Bin: caf\xe9", b"X-Multi: a", b"X-Multi: b", b"Idempotent-Replayed: true"]


async def test_a_keyed_answer_with_raw_header_bytes_is_recorded_and_replayed_identically(
    gateway: Gateway, upstream_raw: RawUpstream
) -> None:
    """First relay and replay carry the same header bytes; the upstream is called once."""
    upstream_raw.answer = answer(b"X-Bin: caf\xe9")
    first = await raw_request(gateway.url, post("bin"))
    second = await raw_request(gateway.url, post("bin"))
    assert b"X-Bin: caf\xe9" in first[1]
    assert [line for line in second[1] if line.startswith(b"X-")] == [b"X-Bin: caf\xe9"]
    assert len(upstream_raw.requests) == 1


@pytest.mark.parametrize("value", [b"a\x01b", b"a\x7fb", b"\x1b[31m", b"a\x0bb\x0cc"])
async def test_an_answer_with_control_bytes_in_a_header_is_relayed_and_replayed(
    dsn: str, gateway: Gateway, upstream_raw: RawUpstream, value: bytes
) -> None:
    """Control bytes that aiohttp's client accepts reach the agent as sent, on the relay and every replay.

    Before, the effect completed and every answer for it was a 500: the agent never learned that its
    order had been placed.
    """
    upstream_raw.answer = answer(b"X-Ctl: " + value)
    first = await raw_request(gateway.url, post("ctl"))
    second = await raw_request(gateway.url, post("ctl"))
    assert first[0].startswith(b"HTTP/1.1 201"), first
    assert b"X-Ctl: " + value in first[1]
    assert [line for line in second[1] if line.startswith(b"X-")] == [b"X-Ctl: " + value]
    assert second[2] == first[2] == b"ok"
    assert [r["state"] for r in await effect_rows(dsn)] == ["completed"]
    assert len(upstream_raw.requests) == 1


async def test_only_the_gateway_says_replayed_and_connection_named_headers_stop_here(
    gateway: Gateway, upstream_raw: RawUpstream
) -> None:
    """The upstream's Idempotent-Replayed and the headers its Connection names go no further."""
    upstream_raw.answer = answer(
        b"Idempotent-Replayed: true", b"Connection: X-Hop", b"X-Hop: 1", b"X-Keep: 1"
    )
    _, first, _ = await raw_request(gateway.url, post("rep"))
    _, second, _ = await raw_request(gateway.url, post("rep"))
    names = [line.split(b":")[0].lower() for line in first]
    assert b"idempotent-replayed" not in names
    assert b"x-hop" not in names
    assert b"X-Keep: 1" in first
    assert [line for line in second if line.lower().startswith(b"idempotent-replayed")] == [
        b"Idempotent-Replayed: true"
    ]


async def test_a_1xx_final_answer_is_no_answer_and_leaves_the_effect_in_doubt(
    gateway: Gateway, upstream_raw: RawUpstream, dsn: str
) -> None:
    """101 says nothing of the effect: 502 upstream-broken, in doubt, never a completed 101 to replay."""
    upstream_raw.answer = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"
    status, _, body = await raw_request(gateway.url, post("switch"))
    assert status.startswith(b"HTTP/1.1 502")
    assert json.loads(body)["type"].endswith("/upstream-broken")
    assert [r["state"] for r in await effect_rows(dsn)] == ["in_doubt"]


@pytest.mark.parametrize(
    "headers",
    [{"X-A": "1\r\nX-Injected: 1"}, {"X-A": "a\x00b"}, {"Bad Name": "1"}, {"Content-Length": "5"}],
    ids=["crlf", "nul", "bad-name", "content-length"],
)
def test_an_operator_cannot_store_headers_that_would_split_a_replay(headers: dict[str, str]) -> None:
    """A resolution whose headers hold CR, LF, NUL, a bad name or a length is refused with a 400."""
    with pytest.raises(problems.BadRequest):
        parse_resolution({"happened": True, "response": {"status": 200, "headers": headers}})


# --- properties ------------------------------------------------------------------------------------------

HEADER_NAME = st.from_regex(r"X-[A-Za-z0-9-]{1,8}", fullmatch=True)
# Visible ASCII, obs-text (any byte from 0x80) and inner spaces and tabs: what RFC 9110 lets a value hold;
# and the other control bytes, which aiohttp's client accepts too. Only CR, LF and NUL end or split a head.
HEADER_VALUE = st.binary(min_size=1, max_size=12).map(
    lambda raw: bytes(b if b >= 0x80 or 0x21 <= b <= 0x7E else 0x21 + b % 94 for b in raw)
) | st.sampled_from([b"caf\xe9", b"a b\tc", b"\xff\xfe", b"\xed\xa0\x80", b"a\x01b\x7f", b"\x1b[0m"])


@given(st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), min_size=1, max_size=5))
@settings(max_examples=max(5, settings.default.max_examples // 5))
async def test_any_header_bytes_are_relayed_and_replayed_byte_for_byte(
    gateway: Gateway, upstream_raw: RawUpstream, headers: list[tuple[str, bytes]]
) -> None:
    """Whatever bytes an upstream puts in its headers, the agent gets exactly them, relayed and replayed."""
    sent = [name.encode() + b": " + value for name, value in headers]
    upstream_raw.answer = answer(*sent)
    _, relayed, _ = await raw_request(gateway.url, GET)
    assert [line for line in relayed if line.startswith(b"X-")] == sent
    stored = storable_headers([(name.encode(), value) for name, value in headers])
    replayed = await _serve_stored(StoredResponse(201, stored, b"ok"), replayed=True)
    assert [line for line in replayed if line.startswith(b"X-")] == sent


ANSWER_HEADER = st.tuples(HEADER_NAME.map(str.encode), HEADER_VALUE)
# Codings the gateway never decodes on the way back (gzip of bytes that are not gzip among them).
CODING = st.sampled_from([b"gzip", b"deflate", b"br", b"identity", b"x-unknown", b"gzip, br"])
CONTENT_TYPE = st.sampled_from(
    [
        b"application/json",
        b"text/plain; charset=latin-1",
        b"application/octet-stream",
        b"application/problem+json",
    ]
)
_KEYS = iter(range(10**9))


@st.composite
def upstream_answers(draw: st.DrawFn) -> tuple[int, list[bytes], bytes, bytes]:
    """(status, end-to-end header lines, body, the answer's bytes): any status, header bytes and body.

    All but 307 and 308: a redirect that keeps the method is refused as 502 upstream-redirected, so a
    client that follows it cannot re-send past the gateway (tests/test_proxy.py shows that rule).
    """
    status = draw(st.integers(200, 599).filter(lambda s: s not in (307, 308)))
    lines = [name + b": " + value for name, value in draw(st.lists(ANSWER_HEADER, max_size=4))]
    if draw(st.booleans()):
        lines.append(b"Content-Encoding: " + draw(CODING))
    if draw(st.booleans()):
        lines.append(b"Content-Type: " + draw(CONTENT_TYPE))
    body = b"" if status in (204, 304) else draw(st.binary(max_size=300))
    head = b"HTTP/1.1 %d Any Reason\r\n" % status + b"".join(line + b"\r\n" for line in lines)
    if body and draw(st.booleans()):  # chunked, in two chunks: the framing stops at the gateway
        cut = draw(st.integers(1, len(body)))
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:cut], body[cut:]) if c)
        framed = head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    else:
        framed = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    return status, lines, body, framed


def _end_to_end(lines: list[bytes]) -> list[bytes]:
    return [
        line
        for line in lines
        if line.split(b":")[0].lower().startswith((b"x-", b"content-type", b"content-e"))
    ]


@given(upstream_answers())
@settings(max_examples=max(5, settings.default.max_examples // 5))
async def test_any_upstream_answer_is_relayed_recorded_and_replayed_as_it_came(
    gateway: Gateway, upstream_raw: RawUpstream, dsn: str, answer: tuple[int, list[bytes], bytes, bytes]
) -> None:
    """Status, header bytes, coding and body reach the agent as sent; a retry is what the state says."""
    status, lines, body, framed = answer
    upstream_raw.answer = framed
    key = f"answer-{next(_KEYS)}"
    before = len(upstream_raw.requests)
    first_status, first_lines, first_body = await raw_request(gateway.url, post(key))
    assert first_status.split(b" ")[1] == b"%d" % status
    assert _end_to_end(first_lines) == lines
    assert first_body == body
    assert not [line for line in first_lines if line.lower().startswith(b"idempotent-replayed")]
    again_status, again_lines, again_body = await raw_request(gateway.url, post(key))
    row = next(r for r in await effect_rows(dsn) if r["key"] == key)
    if status in NOTHING_HAPPENED:  # the upstream says nothing happened: the retry sends again
        assert (row["state"], len(upstream_raw.requests) - before) == ("retryable", 2)
        assert (again_status, _end_to_end(again_lines), again_body) == (first_status, lines, body)
    elif status in MAYBE_HAPPENED:  # it may have happened, and nothing here can tell: an operator must
        assert (row["state"], len(upstream_raw.requests) - before) == ("needs_review", 1)
        assert again_status.split(b" ")[1] == b"409"
        assert json.loads(again_body)["type"].endswith("/outcome-unknown")
    else:  # completed: the retry is the first answer, byte for byte, and nothing is sent
        assert (row["state"], row["response_status"], len(upstream_raw.requests) - before) == (
            "completed",
            status,
            1,
        )
        assert again_status.split(b" ")[1] == b"%d" % status
        assert _end_to_end(again_lines) == lines
        assert again_body == body
        assert [line for line in again_lines if line.lower().startswith(b"idempotent-replayed")] == [
            b"Idempotent-Replayed: true"
        ]
