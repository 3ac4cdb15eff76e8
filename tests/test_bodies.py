"""Request bodies end to end: the upstream gets the agent's bytes plus the stamp, and nothing else."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import threading
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

import gateway.inbound
from gateway import jsonbody, urlencoded
from tests.database import effect_rows
from tests.gateways import Gateway, gateway_server
from tests.strategies import DIFFERENT_NUMBERS
from tests.upstreams import Upstream

PROBLEM = "application/problem+json"
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"


@pytest.fixture
async def stamped(dsn: str, upstream: Upstream) -> AsyncIterator[Gateway]:
    """A gateway whose shop takes its key in a nested JSON field, metadata.ref."""
    cfg = {"shop": {"base_url": upstream.url, "timeout": "2s", "stamp": {"json_field": "metadata.ref"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        yield gw


async def send(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    content_type: str = JSON,
    key: str | None = "k1",
    **more: str,
) -> tuple[int, bytes]:
    headers = {"Content-Type": content_type, **{k.replace("_", "-"): v for k, v in more.items()}}
    if key is not None:
        headers["Idempotency-Key"] = key
    async with http.post(url, data=body, headers=headers) as resp:
        return resp.status, await resp.read()


def problem(body: bytes) -> str:
    return str(json.loads(body)["type"]).rsplit("/", 1)[1]


async def test_the_upstream_gets_the_agents_json_bytes_with_only_the_stamp_added(
    stamped: Gateway, upstream: Upstream, http: aiohttp.ClientSession, dsn: str
) -> None:
    """Numbers, key order, escapes and whitespace arrive as sent; the stamp is the only addition."""
    body = b'{ "amount": 12345678901234567.89, "price": 10.50, "big": 1e400,\n  "note": "caf\\u00e9" }'
    status, _ = await send(http, f"{stamped.url}/shop/orders", body)
    assert status == 201
    derived = (await effect_rows(dsn))[0]["derived_key"]
    assert upstream.calls[0].body == body[:-2] + b',"metadata":{"ref":"' + derived.encode() + b'"} }'


@pytest.mark.parametrize(("first", "second"), DIFFERENT_NUMBERS)
async def test_numbers_written_differently_are_different_requests(
    stamped: Gateway, upstream: Upstream, http: aiohttp.ClientSession, first: bytes, second: bytes
) -> None:
    """The same key with 10.50 and then 10.5 (or -0 and 0) is a reused key: 422, one effect."""
    assert (await send(http, f"{stamped.url}/shop/orders", first))[0] == 201
    status, body = await send(http, f"{stamped.url}/shop/orders", second)
    assert status == 422
    assert problem(body) == "key-reused"
    assert len(upstream.effects()) == 1


async def test_the_same_document_respelled_is_the_same_request(
    stamped: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Key order and whitespace are all a retry may change: it is replayed, not refused."""
    assert (await send(http, f"{stamped.url}/shop/orders", b'{"a":1,"b":[1.50,"x"]}'))[0] == 201
    status, _ = await send(http, f"{stamped.url}/shop/orders", b'{ "b" : [ 1.50, "\\u0078" ],\n"a":1 }')
    assert status == 201
    assert len(upstream.effects()) == 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":1,"a":2}',
        b'{"a":NaN}',
        b'{"a":Infinity}',
        b'{"a":-Infinity}',
        b"[" * 10_000 + b"]" * 10_000,
        b'{"a":"caf\xe9"}',
        b'{"a":1} trailing',
    ],
    ids=["duplicate-key", "nan", "infinity", "minus-infinity", "10000-deep", "not-utf8", "trailing"],
)
@pytest.mark.parametrize("key", ["k", None], ids=["keyed", "keyless"])
async def test_json_that_parsers_read_differently_is_refused_and_nothing_is_sent(
    stamped: Gateway, upstream: Upstream, http: aiohttp.ClientSession, dsn: str, body: bytes, key: str | None
) -> None:
    """Ambiguous JSON is a 400 body-malformed (never a 500): nothing recorded, nothing sent."""
    async with http.put(
        f"{stamped.url}/shop/orders",
        data=body,
        headers={"Content-Type": JSON, **({"Idempotency-Key": key} if key else {})},
    ) as resp:
        assert resp.status == 400
        assert resp.content_type == PROBLEM
        assert problem(await resp.read()) == "body-malformed"
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


async def test_form_bytes_and_query_bytes_are_compared_exactly(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """%FF and %FE are different requests (never both U+FFFD); the stamp is appended to the form."""
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"form_field": "metadata[idempotency_key]"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        url = f"{gw.url}/shop/charges"
        assert (await send(http, url, b"amount=1&note=%FF", FORM, key="f"))[0] == 201
        status, body = await send(http, url, b"amount=1&note=%FE", FORM, key="f")
        assert (status, problem(body)) == (422, "key-reused")
        assert (await send(http, url + "?q=%FF", b"", FORM, key="q"))[0] == 201
        status, body = await send(http, url + "?q=%FE", b"", FORM, key="q")
        assert (status, problem(body)) == (422, "key-reused")
    derived = (await effect_rows(dsn))[0]["derived_key"]
    assert upstream.calls[0].body == b"amount=1&note=%FF&metadata%5Bidempotency_key%5D=" + derived.encode()
    assert len(upstream.effects()) == 2


async def test_a_query_stamp_is_appended_to_the_agents_query(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The query arrives as sent, byte for byte, with the stamp as one more parameter."""
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"query_param": "ref"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await send(http, f"{gw.url}/shop/orders?b=%FF&a=1+2&a=3", b"{}"))[0] == 201
    derived = (await effect_rows(dsn))[0]["derived_key"]
    assert upstream.calls[0].query == f"b=%FF&a=1+2&a=3&ref={derived}"


# --- Content-Encoding ---------------------------------------------------------------------------------------


async def test_a_gzip_body_is_decoded_stamped_and_forwarded_plain(
    stamped: Gateway, upstream: Upstream, http: aiohttp.ClientSession, dsn: str
) -> None:
    """A gzip body reaches the upstream decoded, stamped, without Content-Encoding; a plain retry replays."""
    plain = b'{"items":["atta"],"total":10.50}'
    status, _ = await send(http, f"{stamped.url}/shop/orders", gzip.compress(plain), Content_Encoding="gzip")
    assert status == 201
    call = upstream.calls[0]
    assert "Content-Encoding" not in call.headers
    derived = (await effect_rows(dsn))[0]["derived_key"]
    assert call.body == plain[:-1] + b',"metadata":{"ref":"' + derived.encode() + b'"}}'
    deflated = zlib.compress(plain)
    status, _ = await send(http, f"{stamped.url}/shop/orders", deflated, Content_Encoding="deflate")
    assert status == 201  # the same document, however it was compressed: a replay
    assert (await send(http, f"{stamped.url}/shop/orders", plain))[0] == 201
    assert len(upstream.effects()) == 1


@pytest.mark.parametrize(
    ("body", "coding", "status", "kind"),
    [
        (gzip.compress(b"0" * 5_000_000), "gzip", 413, "body-too-large"),
        (b"\x1f\x8b not really gzip", "gzip", 400, "body-malformed"),
        (gzip.compress(b"{}")[:-4], "gzip", 400, "body-malformed"),
        (b"{}", "compress", 415, "encoding-unsupported"),
        (b"{}", "br", 415, "encoding-unsupported"),
    ],
    ids=["bomb", "garbage", "cut-short", "compress", "br"],
)
async def test_a_body_that_cannot_be_decoded_within_the_limit_is_refused(
    stamped: Gateway,
    upstream: Upstream,
    http: aiohttp.ClientSession,
    dsn: str,
    body: bytes,
    coding: str,
    status: int,
    kind: str,
) -> None:
    """A decompression bomb is a 413, bad data a 400, an unknown coding a 415: nothing claimed or sent."""
    got, answer = await send(http, f"{stamped.url}/shop/orders", body, Content_Encoding=coding)
    assert (got, problem(answer)) == (status, kind)
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


@pytest.mark.parametrize(("layers", "most", "status"), [(2, 1, 415), (3, 2, 415), (2, 2, 201)])
async def test_a_body_with_more_codings_than_allowed_is_refused_naming_the_setting(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, layers: int, most: int, status: int
) -> None:
    """More Content-Encoding layers than max_content_codings is a 415 naming it; up to it, one effect."""
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "ref"}}}
    body = b'{"items":["atta"]}'
    for _ in range(layers):
        body = gzip.compress(body)
    async with gateway_server(dsn, upstreams=cfg, max_content_codings=most) as gw:
        got, answer = await send(
            http, f"{gw.url}/shop/orders", body, Content_Encoding=", ".join(["gzip"] * layers)
        )
    assert got == status
    if status == 415:
        detail = json.loads(answer)["detail"]
        assert (problem(answer), f"at most {most}" in detail, "max_content_codings" in detail) == (
            "encoding-unsupported",
            True,
            True,
        )
        assert (upstream.calls, await effect_rows(dsn)) == ([], [])
    else:
        assert upstream.calls[0].body.startswith(b'{"items":["atta"],"ref":"eg_')


async def test_a_megabyte_made_to_be_slow_to_read_is_refused_while_health_answers(
    stamped: Gateway, upstream: Upstream, http: aiohttp.ClientSession, dsn: str
) -> None:
    """A megabyte of escaped quotes in a string that never ends is a 400; health answers meanwhile."""
    body = b'{"a":"' + b'\\"' * (512 * 1024 - 3)

    async def health() -> int:
        async with http.get(f"{stamped.admin_url}/_gateway/health") as resp:
            return resp.status

    # A liveness bound far above the expected time (the refusal takes tens of milliseconds): the depth
    # check that rescanned from every quote took hours on this body and held the whole process.
    async with asyncio.timeout(30):
        (status, answer), *healthy = await asyncio.gather(
            send(http, f"{stamped.url}/shop/orders", body), *(health() for _ in range(5))
        )
    assert (status, problem(answer), healthy) == (400, "body-malformed", [200] * 5)
    assert (upstream.calls, await effect_rows(dsn)) == ([], [])


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"items":[' + b"[]," * 19_000 + b'[]],"note":"' + b"x" * 70_000 + b'"}', JSON),  # 127 KB
        (b'{"items":[' + b"[]," * 2_000 + b"[]]}", JSON),  # 6 KB of 2,000 arrays
        (b"a=1&" * 5_000, FORM),  # 20 KB of 5,000 fields
        (b"note=" + b"%41" * 15_000, FORM),  # 45 KB of one field of 15,000 escapes
        (b"note=" + b"+" * 40_000, FORM),  # 40 KB of one field of 40,000 spaces
    ],
    ids=["large-json", "json-of-many-arrays", "form-of-many-fields", "form-of-escapes", "form-of-plus"],
)
async def test_a_body_costly_to_read_is_read_off_the_event_loop(
    dsn: str,
    upstream: Upstream,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    body: bytes,
    content_type: str,
) -> None:
    """A body large or of many parts is parsed and put in canonical form off the event loop's thread."""
    threads: list[threading.Thread] = []
    canonical, pairs = jsonbody.JsonDocument.canonical, urlencoded.pairs

    def canonical_spy(document: jsonbody.JsonDocument) -> bytes:
        threads.append(threading.current_thread())
        return canonical(document)

    def pairs_spy(raw: bytes) -> tuple[urlencoded.Pair, ...]:
        if raw == body:  # not the query's, which is read with the rest of the request
            threads.append(threading.current_thread())
        return pairs(raw)

    monkeypatch.setattr(jsonbody.JsonDocument, "canonical", canonical_spy)
    monkeypatch.setattr(urlencoded, "pairs", pairs_spy)
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        assert (await send(http, f"{gw.url}/shop/orders", body, content_type))[0] == 201
    assert threads, "the body was read"
    assert threading.main_thread() not in threads, "read on the thread that runs the event loop"


async def test_a_large_body_is_searched_for_the_stamps_name_off_the_event_loop(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large body is searched for a field named as the form stamp off the event loop's thread."""
    threads: list[threading.Thread] = []
    reserved_use = gateway.inbound.reserved_use

    def spy(*args: Any) -> str | None:
        threads.append(threading.current_thread())
        return reserved_use(*args)

    monkeypatch.setattr(gateway.inbound, "reserved_use", spy)
    cfg = {"pay": {"base_url": upstream.url, "stamp": {"form_field": "metadata[idempotency_key]"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        status, _ = await send(http, f"{gw.url}/pay/charges", b"amount=1&note=" + b"x" * 100_000, FORM)
    assert (status, len(threads)) == (201, 1)
    assert threading.main_thread() not in threads, "searched on the thread that runs the event loop"


# --- as stored ----------------------------------------------------------------------------------------------


async def stored_bodies(dsn: str) -> dict[str, tuple[str, int]]:
    """kind -> (coding, stored length) of the one effect's bodies, as Postgres holds them."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("select kind, coding, octet_length(content) as n from effect_bodies")
    finally:
        await conn.close()
    return {r["kind"]: (r["coding"], r["n"]) for r in rows}


ORDER = json.dumps({"order": "O-1", "lines": [{"sku": f"sku-{n}", "qty": n} for n in range(60)]}).encode()


@pytest.mark.parametrize(
    ("answer", "kept"),
    [(ORDER, "zlib"), (os.urandom(1500), "")],
    ids=["json", "random"],
)
async def test_bodies_are_kept_deflated_when_that_pays_and_replayed_byte_for_byte(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, answer: bytes, kept: str
) -> None:
    """Everyday JSON takes a fraction of its size in Postgres; a retry that another gateway (with nothing
    cached) answers from it gets the upstream's very bytes, and the audit shows what the agent sent."""
    sent_body = json.dumps({"items": [f"atta {n} kg" for n in range(40)]}).encode()

    async def order(_: web.Request) -> web.Response:
        return web.Response(status=201, body=answer, content_type="application/octet-stream")

    upstream.routes["/orders"] = order
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    async with gateway_server(dsn, upstreams=shop) as gw:
        assert await send(http, f"{gw.url}/shop/orders", sent_body) == (201, answer)
    stored = await stored_bodies(dsn)
    assert stored["request"][0] == "zlib"
    assert stored["request"][1] < len(sent_body) // 3
    assert stored["response"][0] == kept
    if kept:
        assert stored["response"][1] < len(answer) // 3
    async with gateway_server(dsn, upstreams=shop) as other:
        assert await send(http, f"{other.url}/shop/orders", sent_body) == (201, answer)
        async with http.get(f"{other.admin_url}/_gateway/effects/1") as resp:
            audit = await resp.json()
    assert len(upstream.effects()) == 1
    assert audit["request_body"] == sent_body.decode()


@pytest.mark.parametrize(
    "damage",
    [
        "set coding = 'zstd'",
        "set content = substring(content from 1 for 10)",
        "set content = content || content",
    ],
    ids=["unknown-coding", "cut-short", "bytes-after-its-end"],
)
async def test_a_stored_response_that_cannot_be_read_is_an_error_and_is_not_sent_again(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, damage: str
) -> None:
    """A response on record this gateway cannot read (written by a newer version, or damaged) is a 500
    saying so: never garbage handed to the agent, and never a second order."""

    async def order(_: web.Request) -> web.Response:
        return web.json_response({"order": "O-1", "lines": list(range(100))}, status=201)

    upstream.routes["/orders"] = order
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    async with gateway_server(dsn, upstreams=shop) as gw:
        assert (await send(http, f"{gw.url}/shop/orders", ORDER))[0] == 201
    assert (await stored_bodies(dsn))["response"][0] == "zlib"
    await damage_bodies(dsn, "response", damage)
    async with gateway_server(dsn, upstreams=shop) as other:  # nothing cached: it reads the table
        status, answer = await send(http, f"{other.url}/shop/orders", ORDER)
        async with http.get(f"{other.admin_url}/_gateway/effects/1") as resp:
            shown = (resp.status, await resp.json())
        async with http.get(f"{other.admin_url}/_gateway/audit/1") as resp:
            page = (resp.status, await resp.text())
    assert (status, problem(answer)) == (500, "internal")
    refused = json.loads(answer)
    assert refused["effect_id"] == 1
    assert refused["detail"].startswith("effect 1: its stored response cannot be read (a stored body ")
    assert refused["detail"].endswith("the effect is not sent again, and an operator must look at it")
    assert len(upstream.effects()) == 1
    # The operator still sees the effect, and why its response is missing (not "purged").
    assert (shown[0], shown[1]["state"], shown[1]["response_body"], shown[1]["response_purged"]) == (
        200, "completed", None, False,
    )  # fmt: skip
    assert list(shown[1]["unreadable"]) == ["response"]
    assert shown[1]["unreadable"]["response"].startswith("effect 1: its stored response cannot be read")
    assert json.loads(shown[1]["request_body"]) == json.loads(ORDER), "the readable request is still shown"
    assert page[0] == 200
    assert "The stored response body cannot be read back" in page[1]
    assert "A retry is answered 500 and the effect is not sent again." in page[1]
    assert "cannot be read back (see above)" in page[1]
    assert "No response on record" not in page[1]


async def damage_bodies(dsn: str, kind: str, damage: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.execute(f"update effect_bodies {damage} where kind = $1", kind) == "UPDATE 1"
    finally:
        await conn.close()


async def test_an_unreadable_request_leaves_the_replay_and_the_rest_of_the_audit_as_they_were(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Only the response is replayed: a stored request that cannot be read back costs the audit that body
    alone, named on the page, and the retry still gets the upstream's answer."""
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    async with gateway_server(dsn, upstreams=shop) as gw:
        status, first = await send(http, f"{gw.url}/shop/orders", ORDER)
    assert status == 201
    await damage_bodies(dsn, "request", "set coding = 'zstd'")
    async with gateway_server(dsn, upstreams=shop) as other:
        assert await send(http, f"{other.url}/shop/orders", ORDER) == (201, first)
        async with http.get(f"{other.admin_url}/_gateway/effects/1") as resp:
            shown = await resp.json()
        async with http.get(f"{other.admin_url}/_gateway/audit/1") as resp:
            page = await resp.text()
    assert (shown["request_body"], shown["response_body"]) == (None, first.decode())
    assert list(shown["unreadable"]) == ["request"]
    assert "The stored request body cannot be read back" in page
    assert "cannot be read back (see above)" in page
    assert "retention dropped it" not in page
    assert "A retry is answered 500" not in page
    assert len(upstream.effects()) == 1


async def test_an_unreadable_answer_of_an_attempt_that_may_be_retried_does_not_block_the_retry(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A 429's stored answer is never replayed: if it cannot be read back, the next retry sends as it
    would have anyway, and gets the order."""
    answers = [web.json_response({"error": "slow down", "lines": list(range(100))}, status=429)]

    async def order(_: web.Request) -> web.Response:
        return answers.pop() if answers else web.json_response({"order": "O-1"}, status=201)

    upstream.routes["/orders"] = order
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    async with gateway_server(dsn, upstreams=shop) as gw:
        assert (await send(http, f"{gw.url}/shop/orders", ORDER))[0] == 429
    assert (await stored_bodies(dsn))["response"][0] == "zlib"
    await damage_bodies(dsn, "response", "set content = content || content")
    async with gateway_server(dsn, upstreams=shop) as other:
        status, answer = await send(http, f"{other.url}/shop/orders", ORDER)
    assert (status, json.loads(answer)) == (201, {"order": "O-1"})
    assert len(upstream.effects()) == 2
