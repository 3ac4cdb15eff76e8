"""Recovery relies only on what covers the effect in doubt (issue 28's attack on recovery).

Each test failed on the commit before its fix: the effect was sent a second time. Real gateway, real
upstream on loopback, real Postgres.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web

from tests.database import effect_rows
from tests.gateways import gateway_server
from tests.upstreams import ORDER_SEARCH, Upstream

STAMP = {"json_field": "client_reference"}
# The shop's order search, as examples/gateway.toml's: it finds orders, and names them as its routes. Its
# "not found" is trusted at once (lag 0s), so that a wrong trust shows in the first retry.
SEARCH = {**ORDER_SEARCH, "lag": "0s"}


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str = "run-7:5"
) -> tuple[int, dict[str, Any]]:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    async with http.post(url, data=json.dumps(body).encode(), headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


async def sent_to_review(dsn: str, status: int, body: dict[str, Any], why: str) -> None:
    """The retry was answered 409 outcome-unknown, and the effect waits for an operator, saying ``why``."""
    assert (status, body["type"].rsplit("/", 1)[1]) == (409, "outcome-unknown")
    (row,) = await effect_rows(dsn)
    assert row["state"] == "needs_review"
    assert why in json.dumps(row["history"])


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
    await sent_to_review(dsn, status, body, "does not search POST /orders/ord_1/refund")


class Shop:
    """A shop with no idempotency of its own but the native key it may be told to honour: it places an
    order (after ``takes`` seconds) and answers ``status``; its search lists an order ``lag`` seconds after
    it was placed, by the value at ``field`` in the order's JSON."""

    def __init__(self, upstream: Upstream, status: int = 502, takes: float = 0.0, lag: float = 0.0) -> None:
        self.orders: list[tuple[float, dict[str, Any]]] = []
        self.seen_keys: set[str] = set()
        self.status = status
        self.takes = takes
        self.lag = lag
        upstream.routes["/orders"] = self.place
        upstream.routes["/orders/search"] = self.search

    async def place(self, request: web.Request) -> web.Response:
        doc = json.loads(await request.read())
        key = request.headers.get("Idempotency-Key")
        if key is not None and key in self.seen_keys:
            return web.json_response({"order": "the same"}, status=201)  # honours a key it has seen
        await asyncio.sleep(self.takes)
        self.orders.append((asyncio.get_running_loop().time(), doc))
        if key is not None:
            self.seen_keys.add(key)
        return web.json_response({"error": "upstream proxy error"}, status=self.status)  # placed; lost

    async def search(self, request: web.Request) -> web.Response:
        path, ref = request.query["field"].split("."), request.query["ref"]
        now = asyncio.get_running_loop().time()
        listed = [doc for at, doc in self.orders if now - at >= self.lag and _dig(doc, path) == ref]
        return web.json_response({"items": listed})


def _dig(doc: Any, path: list[str]) -> Any:
    for part in path:
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def stamped_shop(url: str, field: str = "client_reference", **settings: Any) -> dict[str, Any]:
    """The shop's settings: stamped in the JSON field ``field``, probed by a search on that field."""
    probe = {**SEARCH, "path": f"/orders/search?field={field}&ref={{key}}"}
    return {"shop": {"base_url": url, "stamp": {"json_field": field}, "probe": probe, **settings}}


ORDER = {"items": ["atta"]}


async def test_a_native_key_added_since_the_first_send_is_not_used_to_re_send_it(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An order sent with a stamp alone and answered 502 is found by its probe after the operator adds a
    native key: it is not re-sent under a header the first request never carried."""
    shop = Shop(upstream)
    async with gateway_server(dsn, upstreams=stamped_shop(upstream.url)) as gw:
        assert (await post(http, f"{gw.url}/shop/orders", ORDER))[0] == 502
    native = {"native_key": {"header": "Idempotency-Key", "ttl": "24h"}}
    async with gateway_server(dsn, upstreams=stamped_shop(upstream.url, **native)) as gw:
        status, _ = await post(http, f"{gw.url}/shop/orders", ORDER)
    assert len(shop.orders) == 1, "ordered twice"
    assert status == 201
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["recovered_by"]) == ("completed", "probe")


async def test_a_stamp_moved_since_the_first_send_is_not_searched_for_it(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An order stamped in client_reference and answered 502 goes to review once the stamp has moved to
    metadata.ref: a probe of metadata.ref would never find it, and its "not found" would order again."""
    shop = Shop(upstream)
    async with gateway_server(dsn, upstreams=stamped_shop(upstream.url)) as gw:
        assert (await post(http, f"{gw.url}/shop/orders", ORDER))[0] == 502
    async with gateway_server(dsn, upstreams=stamped_shop(upstream.url, "metadata.ref")) as gw:
        status, body = await post(http, f"{gw.url}/shop/orders", ORDER)
    assert len(shop.orders) == 1, "ordered twice"
    await sent_to_review(dsn, status, body, "its stamp or native key changed since")


async def test_a_timeout_shortened_since_the_first_send_does_not_shorten_its_lag(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A probe's lag counts from the end of the lease the attempt in doubt was given, not today's shorter
    one: the search has not listed the order yet, and its "not found" is not trusted to order again."""
    # The first attempt: a lease of 2.5 s (timeout 2 s, grace 0.5 s); the shop places the order 2.4 s after
    # it arrives, when the gateway has given up (504), and its search lists it 3 s later (probe.lag 3 s).
    # The retry comes 4.3 s after the first request, under a timeout of 0.5 s: a lease of 1 s, by which
    # the search would be trusted from 4 s, where the attempt's own lease trusts it from 5.5 s.
    shop = Shop(upstream, takes=2.4, lag=3.0)
    quick = {**SEARCH, "path": "/orders/search?field=client_reference&ref={key}", "lag": "3s"}
    before = {"base_url": upstream.url, "timeout": "2s", "stamp": STAMP, "probe": quick}
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with gateway_server(dsn, lease_grace="500ms", upstreams={"shop": before}) as gw:
        assert (await post(http, f"{gw.url}/shop/orders", ORDER))[0] == 504
    after = {**before, "timeout": "500ms"}
    async with gateway_server(dsn, lease_grace="500ms", upstreams={"shop": after}) as gw:
        await asyncio.sleep(started + 4.3 - loop.time())
        status, body = await post(http, f"{gw.url}/shop/orders", ORDER)
        assert (status, body["type"].rsplit("/", 1)[1]) == (503, "probe-too-soon"), "trusted too soon"
        for _ in range(5):  # each retry once the Retry-After has passed, as an agent would
            await asyncio.sleep(1.5)
            status, body = await post(http, f"{gw.url}/shop/orders", ORDER)
            if status != 503:
                break
    assert len(shop.orders) == 1, "ordered twice"
    assert status == 201


async def test_an_effect_in_doubt_from_before_the_upgrade_waits_for_an_operator(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An effect in doubt whose row does not say what carried its key (written before migration 015) is
    neither re-sent under the native key nor probed: it goes to review, and nothing is sent."""
    shop = Shop(upstream)
    native = {"native_key": {"header": "Idempotency-Key", "ttl": "24h"}}
    async with gateway_server(dsn, upstreams=stamped_shop(upstream.url, **native)) as gw:
        assert (await post(http, f"{gw.url}/shop/orders", ORDER))[0] == 502
        conn = await asyncpg.connect(dsn)
        try:  # as an earlier version left it
            await conn.execute("update effects set key_carriers = null, send_lease = null")
        finally:
            await conn.close()
        status, body = await post(http, f"{gw.url}/shop/orders", ORDER)
    assert len(shop.orders) == 1
    await sent_to_review(dsn, status, body, "was not recorded")


async def test_a_re_send_carries_the_request_as_first_sent_not_the_retrys(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A retry that differs only in a field the fingerprint ignores is re-sent under the native key with
    the first request's body: a mail API that, like Stripe, checks that a key is reused with the same
    parameters answers with the email it sent, not a 400 that would be replayed for ever."""
    sent: dict[str, tuple[bytes, dict[str, str]]] = {}

    async def send(request: web.Request) -> web.Response:
        key, body = request.headers["Idempotency-Key"], await request.read()
        if key in sent:
            first, answer = sent[key]
            if first != body:
                error = {
                    "type": "idempotency_error",
                    "message": "Keys can only be reused with the same parameters.",
                }
                return web.json_response({"error": error}, status=400)
            return web.json_response(answer, status=202)
        sent[key] = (body, {"message_id": f"msg_{len(sent) + 1}"})
        return web.json_response({"error": "bad gateway"}, status=500)  # sent; the answer lost

    upstream.routes["/messages"] = send
    mail = {
        "base_url": upstream.url,
        "native_key": {"header": "Idempotency-Key", "ttl": "24h"},
        "fingerprint_ignore": ["sent_at"],  # as examples/gateway.toml's mail: a re-run writes a new time
    }
    receipt = {"to": "a@example.com", "subject": "receipt"}
    async with gateway_server(dsn, upstreams={"mail": mail}) as gw:
        url = f"{gw.url}/mail/messages"
        assert (await post(http, url, {**receipt, "sent_at": "2026-01-01T09:00:00Z"}))[0] == 500
        status, body = await post(http, url, {**receipt, "sent_at": "2026-01-01T09:00:07Z"})
    assert len(sent) == 1
    assert (status, body) == (202, {"message_id": "msg_1"})
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["response_status"], row["recovered_by"]) == ("completed", 202, "native_key")
