"""What the upstream receives: the stamp and native key are the gateway's alone; agent headers as sent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.support import Upstream, effect_rows, gateway_server

PROBLEM = "application/problem+json"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def problem(body: bytes) -> str:
    return str(json.loads(body)["type"]).rsplit("/", 1)[1]


STAMPS: dict[str, dict[str, Any]] = {
    "header": {"stamp": {"header": "X-Ref"}},
    "native": {"native_key": {"header": "X-Idem"}},
    "form": {"stamp": {"form_field": "metadata[idempotency_key]"}},
    "query": {"stamp": {"query_param": "ref"}},
    "json": {"stamp": {"json_field": "metadata.ref"}},
}
# A request of the agent's that sets the name the gateway sets: (headers, query, content type, body).
PLANTED: dict[str, tuple[dict[str, str], str, str, bytes]] = {
    "header": ({"x-ref": "eg_forged"}, "", "application/json", b"{}"),
    "native": ({"X-IDEM": "eg_forged"}, "", "application/json", b"{}"),
    "form": ({}, "", "application/x-www-form-urlencoded", b"a=1&metadata%5Bidempotency_key%5D=eg_forged"),
    "query": ({}, "?a=1&r%65f=eg_forged", "application/json", b"{}"),
    "json": ({}, "", "application/json", b'{"metadata":{"a":1,"ref":"eg_forged"}}'),
}


@pytest.mark.parametrize("where", sorted(STAMPS))
@pytest.mark.parametrize("key", ["k", None], ids=["keyed", "keyless"])
async def test_an_agent_cannot_set_the_stamp_or_native_key(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, where: str, key: str | None
) -> None:
    """A header (any case), form field, query parameter or JSON field under the gateway's name: 400."""
    headers, query, content_type, body = PLANTED[where]
    cfg = {"shop": {"base_url": upstream.url, **STAMPS[where]}}
    async with (
        gateway_server(dsn, upstreams=cfg) as gw,
        http.put(
            f"{gw.url}/shop/orders{query}",
            data=body,
            headers={"Content-Type": content_type, **headers, **({"Idempotency-Key": key} if key else {})},
        ) as resp,
    ):
        assert resp.status == 400
        assert resp.content_type == PROBLEM
        assert problem(await resp.read()) == "stamp-reserved"
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


async def test_a_native_key_named_idempotency_key_is_no_conflict(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The agent's Idempotency-Key is the gateway's input: the upstream gets only the derived one."""
    cfg = {"shop": {"base_url": upstream.url, "native_key": {"header": "Idempotency-Key"}}}
    async with (
        gateway_server(dsn, upstreams=cfg) as gw,
        http.post(f"{gw.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "mine"}) as r,
    ):
        assert r.status == 201
    sent = [v for k, v in upstream.calls[0].header_list if k.lower() == "idempotency-key"]
    assert sent == [(await effect_rows(dsn))[0]["derived_key"]]


async def test_a_fragment_in_the_target_is_refused(dsn: str, upstream: Upstream) -> None:
    """'#' would hide a query stamp added after it, so the target is refused and nothing is sent."""
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"query_param": "ref"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        raw = await _raw(gw.url, b"POST /shop/orders?a=1#frag HTTP/1.1\r\nHost: x\r\nIdempotency-Key: h\r\n")
        assert raw.split(b" ", 2)[1] == b"400"
        assert b"problems/path-refused" in raw
        raw = await _raw(gw.url, b"POST /shop/caf\xc3\xa9 HTTP/1.1\r\nHost: x\r\nIdempotency-Key: u\r\n")
        assert raw.split(b" ", 2)[1] == b"400"
    assert upstream.calls == []


async def test_headers_reach_the_upstream_as_the_agent_sent_them(
    dsn: str, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeated headers stay repeated; hop-by-hop and Connection-named ones stop here; credentials win."""
    monkeypatch.setenv("SHOP_SECRET", "Bearer sk_injected")
    cfg = {"shop": {"base_url": upstream.url, "inject_headers": {"Authorization": "env:SHOP_SECRET"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        raw = await _raw(
            gw.url,
            b"POST /shop/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: hh\r\nX-Tag: a\r\nX-Tag: b\r\n"
            b"Connection: keep-alive, X-Hop\r\nX-Hop: secret\r\nKeep-Alive: timeout=5\r\n"
            b"authorization: Bearer agent\r\nAUTHORIZATION: Bearer agent2\r\n",
        )
        assert raw.split(b" ", 2)[1] == b"201", raw
    sent = upstream.calls[0].header_list
    assert [v for k, v in sent if k == "X-Tag"] == ["a", "b"]
    assert not [k for k, _ in sent if k.lower() in ("x-hop", "keep-alive")]
    assert "X-Hop" not in " ".join(v for k, v in sent if k.lower() == "connection")
    assert [v for k, v in sent if k.lower() == "authorization"] == ["Bearer sk_injected"]


async def _raw(url: str, head: bytes, body: bytes = b"{}") -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return raw
