"""Requests that wait (Prefer: wait) for another request with their key: they stop when their client
leaves, and only so many wait for one key in a worker; the next is told 409 at once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway import waiting
from gateway.audit_query import EffectFilter
from tests.database import effect_rows
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream

BODY = b'{"items":["atta"]}'
# A cap small enough for the test (max_waiters_per_key is 64 by default); the rule is the same.
CAP = 4
# After its client hangs up, a waiter rereads the record at most once more: it polls every 0.2 s at the
# slowest. Half a second is well past that, and the window after it shows any polling that goes on
# (the bug polled five times a second for as long as Prefer: wait allowed, up to a minute).
SETTLE = 0.5
WINDOW = 1.0
# The request past the cap is answered at once (a few ms); without the cap it waited for the call in
# flight, which this test holds until the end: anything near this bound is that wait.
AT_ONCE = 10.0


@pytest.fixture
async def held(upstream: Upstream) -> AsyncIterator[asyncio.Event]:
    """The shop places an order only once the test lets it: until then the first request is in flight."""
    release = asyncio.Event()

    async def create(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"order": len(upstream.effects("/orders"))}, status=201)

    upstream.routes["/orders"] = create
    try:
        yield release
    finally:
        release.set()


async def order(http: aiohttp.ClientSession, url: str, wait: int = 0) -> tuple[int, dict[str, str], Any]:
    headers = {"Idempotency-Key": "k", "Content-Type": "application/json"}
    if wait:
        headers["Prefer"] = f"wait={wait}"
    async with http.post(f"{url}/shop/orders", data=BODY, headers=headers) as resp:
        return resp.status, dict(resp.headers), json.loads(await resp.read())


async def rereads(http: aiohttp.ClientSession, gw: Gateway) -> float:
    """How many times the gateway has read a record again (what a waiter does at each poll)."""
    async with http.get(f"{gw.admin_url}/_gateway/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "effect_gateway_store_duration_seconds_count" and sample.labels == {
                "statement": "reread"
            }:
                return sample.value
    raise AssertionError("no count of rereads in the metrics")


async def seated(gw: Gateway, count: int) -> None:
    """Until ``count`` requests wait for the one effect in flight (a loaded machine may take a while)."""
    [effect] = await gw.runtime.store.find(EffectFilter())
    for _ in range(int(AT_ONCE / 0.01)):
        if gw.runtime.service.waiting(effect.id) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{gw.runtime.service.waiting(effect.id)} of {count} requests wait")


async def test_a_waiter_whose_client_hangs_up_stops_polling(
    dsn: str, upstream: Upstream, held: asyncio.Event
) -> None:
    """An agent that hangs up while waiting for another request with its key costs Postgres nothing more;
    that request still ends."""
    async with (
        gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw,
        aiohttp.ClientSession() as http,
    ):
        first = asyncio.create_task(order(http, gw.url))
        await upstream.received.wait()
        start = await rereads(http, gw)
        host, port = gw.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /shop/orders HTTP/1.1\r\nHost: %s:%s\r\nIdempotency-Key: k\r\nPrefer: wait=60\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (host.encode(), port.encode(), len(BODY), BODY)
        )
        await writer.drain()
        for _ in range(500):  # until it polls
            if await rereads(http, gw) >= start + 2:
                break
            await asyncio.sleep(0.01)
        writer.close()  # the agent gives up and hangs up
        await writer.wait_closed()
        await asyncio.sleep(SETTLE)
        before = await rereads(http, gw)
        await asyncio.sleep(WINDOW)
        after = await rereads(http, gw)
        held.set()
        status, _, body = await first
    assert before >= start + 2, "the request never waited"
    assert after - before == 0, f"{after - before:g} rereads in {WINDOW:g}s after the client left"
    assert (status, body) == (201, {"order": 1})
    assert [row["state"] for row in await effect_rows(dsn)] == ["completed"]
    assert len(upstream.effects()) == 1


async def test_one_waiter_past_the_cap_is_told_409_at_once_and_the_others_get_the_answer(
    dsn: str, upstream: Upstream, held: asyncio.Event
) -> None:
    """max_waiters_per_key + 1 wait for one call in flight: one gets 409 with Retry-After at once, the
    others the call's answer once it ends."""
    shop = {"shop": {"base_url": upstream.url}}
    async with (
        gateway_server(dsn, upstreams=shop, max_waiters_per_key=CAP) as gw,
        aiohttp.ClientSession() as http,
    ):
        first = asyncio.create_task(order(http, gw.url))
        await upstream.received.wait()
        waiters = [asyncio.create_task(order(http, gw.url, wait=60)) for _ in range(CAP + 1)]
        done, _ = await asyncio.wait(waiters, timeout=AT_ONCE, return_when=asyncio.FIRST_COMPLETED)
        answered_at_once = [task.result() for task in done]
        still_in_flight = not first.done()
        held.set()
        answers = await asyncio.gather(first, *(task for task in waiters if task not in done))
    assert still_in_flight, "the call in flight ended before any waiter was answered"
    assert [(status, body["type"].rsplit("/", 1)[1]) for status, _, body in answered_at_once] == [
        (409, "in-flight")
    ]
    [(_, headers, body)] = answered_at_once
    assert int(headers["Retry-After"]) >= 1
    assert f"{CAP} requests wait for it already" in body["detail"]
    assert [(status, body) for status, _, body in answers] == [(201, {"order": 1})] * (CAP + 1)
    assert [headers.get("Idempotent-Replayed") for _, headers, _ in answers[1:]] == ["true"] * CAP
    assert len(upstream.effects()) == 1


async def test_a_waiter_that_leaves_does_not_take_the_others_wake_up_with_it(
    dsn: str, upstream: Upstream, held: asyncio.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiters still seated are woken by the call's end, though one past the cap has come and gone."""
    # They poll once in half a minute here: only the wake-up the call's end sends answers them sooner.
    monkeypatch.setattr(waiting, "FIRST_POLL", 30.0)
    monkeypatch.setattr(waiting, "MAX_POLL", 30.0)
    shop = {"shop": {"base_url": upstream.url, "timeout": "60s"}}
    async with (
        gateway_server(dsn, upstreams=shop, max_waiters_per_key=CAP) as gw,
        aiohttp.ClientSession() as http,
    ):
        first = asyncio.create_task(order(http, gw.url))
        await upstream.received.wait()
        waiters = [asyncio.create_task(order(http, gw.url, wait=60)) for _ in range(CAP)]
        await seated(gw, CAP)  # each in its first long wait
        refused, _, _ = await order(http, gw.url, wait=60)
        held.set()
        # A liveness bound: woken, they answer within milliseconds; not woken, after their 30 s poll.
        async with asyncio.timeout(AT_ONCE):
            answers = await asyncio.gather(first, *waiters)
    assert refused == 409
    assert [status for status, _, _ in answers] == [201] * (CAP + 1)
