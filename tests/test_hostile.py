"""Regression tests for what an attack on the gateway found after issue 7 was closed.

Each failed on b689cc9, the commit the attack started from: a tenant got another tenant's effect, a
completed effect could not be answered, an operator could store an answer no agent can read, or odd input
was a 500.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from tests.database import effect_rows
from tests.gateways import gateway_server
from tests.upstreams import Handler, Upstream, raw_upstream

TENANTS = {"a": {"token": "token-a"}, "b": {"token": "token-b"}}


async def order(
    http: aiohttp.ClientSession, url: str, items: list[str], tenant: str, key: str = "k"
) -> tuple[int, Any]:
    headers = {"Idempotency-Key": key, "Effect-Gateway-Token": f"token-{tenant}"}
    async with http.post(f"{url}/shop/orders", json={"items": items}, headers=headers) as resp:
        return resp.status, await resp.json()


def probed_shop(upstream: Upstream, create: Handler, search: Handler, path: str, **settings: Any) -> Any:
    """A shop that places orders with ``create`` and finds them with ``search``, stamped and probed."""
    upstream.routes["/orders"] = create
    upstream.routes["/orders/search"] = search
    probe = {"path": path, "found": "items.0", "status": 201, "routes": ["POST /orders"]}
    stamp = {"json_field": "client_reference"}
    return {"shop": {"base_url": upstream.url, "stamp": stamp, "probe": probe, **settings}}


# --- probes ------------------------------------------------------------------------------------------------


async def test_a_search_that_ignores_the_key_cannot_hand_a_tenant_another_tenants_order(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A probe whose search lists every order is a failed probe: a's retry never gets b's order as its own.

    Before, the first item of the unfiltered list (b's order) completed a's effect: a read b's order, and
    a's own order, which the upstream never placed, was never placed.
    """
    orders: list[dict[str, Any]] = []

    async def create(request: web.Request) -> web.Response:
        doc = await request.json()
        if doc["items"] == ["slow"]:
            await asyncio.sleep(1)  # a's order: the gateway gives up first, and none is placed
            return web.json_response({}, status=500)
        orders.append({"order": len(orders) + 1, **doc})
        return web.json_response(orders[-1], status=201)

    async def search(request: web.Request) -> web.Response:
        return web.json_response({"items": orders})  # the filter it does not know is ignored

    cfg = probed_shop(upstream, create, search, "/orders/search?reference={key}", timeout="300ms")
    # A grace with room for a busy machine: the request must leave, not be late to send.
    async with gateway_server(dsn, upstreams=cfg, tenants=TENANTS, lease_grace="500ms") as gw:
        assert (await order(http, gw.url, ["b's secret"], "b"))[0] == 201
        assert (await order(http, gw.url, ["slow"], "a"))[0] == 504
        await asyncio.sleep(0.9)  # a's lease (300 ms + 500 ms) runs out
        status, body = await order(http, gw.url, ["slow"], "a")
    assert (status, body["type"].rsplit("/", 1)[1]) == (503, "probe-failed")
    assert "b's secret" not in json.dumps(body)
    rows = {row["tenant"]: row for row in await effect_rows(dsn)}
    assert rows["a"]["state"] == "in_doubt"
    assert rows["a"]["response_body"] is None or b"secret" not in rows["a"]["response_body"]


# --- leases ------------------------------------------------------------------------------------------------


async def test_a_request_that_waits_for_a_connection_past_its_grace_is_not_sent(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The only connection is busy beyond lease_grace: the request is never sent (502), so no late copy.

    Before, it waited up to connect_timeout and reached the upstream near the end of its lease; the
    upstream, well within its timeout of receiving it, placed the order after the lease ran out, when a
    retry had already probed, found nothing yet, and placed it again: two orders.
    """
    placed: list[dict[str, Any]] = []

    async def create(request: web.Request) -> web.Response:
        doc = await request.json()
        if doc["items"] == ["hog"]:
            await asyncio.sleep(1.5)  # holds the upstream's only connection
            return web.json_response({}, status=200)
        await asyncio.sleep(1.2)  # well within the upstream's timeout of receiving it
        placed.append(doc)
        return web.json_response({"order": len(placed), **doc}, status=201)

    async def search(request: web.Request) -> web.Response:
        ref = request.query["ref"]
        return web.json_response({"items": [o for o in placed if o["client_reference"] == ref]})

    cfg = probed_shop(
        upstream,
        create,
        search,
        "/orders/search?ref={key}",
        timeout="1500ms",
        connect_timeout="1500ms",
        max_connections=1,
    )
    async with gateway_server(dsn, upstreams=cfg, lease_grace="200ms") as gw:
        hog = asyncio.create_task(_put(http, f"{gw.url}/shop/orders", {"items": ["hog"]}))
        await asyncio.sleep(0.1)
        first = await _post(http, f"{gw.url}/shop/orders", {"items": ["atta"]})
        await asyncio.sleep(0.4)  # past the first attempt's lease (had it waited for the connection)
        await _post(http, f"{gw.url}/shop/orders", {"items": ["atta"]})
        await hog
        last = await _post(http, f"{gw.url}/shop/orders", {"items": ["atta"]})
        await asyncio.sleep(1.5)  # any copy still at the upstream has landed by now
    assert len(placed) == 1
    assert first[0] == 502, first
    assert first[1]["type"].endswith("/upstream-unreachable")
    assert last[0] == 201


async def _post(http: aiohttp.ClientSession, url: str, doc: Any) -> tuple[int, Any]:
    async with http.post(url, json=doc, headers={"Idempotency-Key": "b"}) as resp:
        return resp.status, await resp.json()


async def _put(http: aiohttp.ClientSession, url: str, doc: Any) -> int:
    async with http.put(url, json=doc) as resp:
        return resp.status


# --- the audit page ----------------------------------------------------------------------------------------


async def test_an_effect_whose_answer_has_header_bytes_that_are_not_utf8_has_a_page(dsn: str) -> None:
    """The effect's page shows an upstream's header byte that is not UTF-8 as \\xe9; it was a 500.

    An operator could not open such an effect's page, nor resolve it there.
    """
    async with (
        raw_upstream(b"HTTP/1.1 201 Created\r\nX-Bin: caf\xe9\r\nContent-Length: 2\r\n\r\nok") as up,
        gateway_server(dsn, upstreams={"shop": {"base_url": up.url}}) as gw,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "k"}) as resp:
            assert resp.status == 201
        async with http.get(f"{gw.admin_url}/_gateway/audit/1") as resp:
            page = await resp.text()
            assert resp.status == 200
    assert "caf\\xe9" in page
