"""Recovery relies only on what covers the effect in doubt (issue 28's attack on recovery).

Each test failed on the commit before its fix: the effect was sent a second time. Real gateway, real
upstream on loopback, real Postgres.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.support import Upstream, effect_rows, gateway_server

STAMP = {"json_field": "client_reference"}
# The shop's order search, as examples/gateway.toml's: it finds orders, and names them as its routes. Its
# "not found" is trusted at once (lag 0s), so that a wrong trust shows in the first retry.
SEARCH = {
    "path": "/orders/search?ref={key}",
    "found": "items.0",
    "status": 201,
    "lag": "0s",
    "routes": ["POST /orders"],
}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str = "run-7:5"
) -> tuple[int, dict[str, Any]]:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    async with http.post(url, data=json.dumps(body).encode(), headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


def search_orders(upstream: Upstream) -> None:
    """``GET /orders/search?ref=KEY`` lists the orders (``POST /orders``) stamped with KEY, and nothing else:
    a refund is not an order, stamped or not."""

    async def search(request: web.Request) -> web.Response:
        ref = request.query.get("ref")
        orders = [json.loads(call.body) for call in upstream.effects("/orders")]
        return web.json_response({"items": [o for o in orders if o.get("client_reference") == ref]})

    upstream.routes["/orders/search"] = search


async def test_a_refund_is_not_sent_again_on_the_word_of_the_order_search(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A refund in doubt on a shop whose probe searches orders goes to review: the search never lists a
    refund, so its "not found" is not taken as leave to refund a second time."""
    search_orders(upstream)

    async def refund(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": "bad gateway"}, status=500)  # refunded; the answer lost

    upstream.routes["/orders/ord_1/refund"] = refund
    shop = {"base_url": upstream.url, "stamp": STAMP, "probe": SEARCH}
    async with gateway_server(dsn, upstreams={"shop": shop}) as gw:
        url = f"{gw.url}/shop/orders/ord_1/refund"
        assert (await post(http, url, {"amount": 4200}))[0] == 500
        status, body = await post(http, url, {"amount": 4200})
    assert len(upstream.effects("/orders/ord_1/refund")) == 1, "refunded twice"
    assert (status, body["type"].rsplit("/", 1)[1]) == (409, "outcome-unknown")
    (row,) = await effect_rows(dsn)
    assert row["state"] == "needs_review"
    assert "does not search POST /orders/ord_1/refund" in json.dumps(row["history"])
