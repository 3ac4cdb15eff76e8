"""Postgres that stops answering without closing anything (a frozen host, a network partition): the
server's statement_timeout never fires then, and the gateway must still answer, 503, and send nothing
twice once Postgres is back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import parse_qs, urlsplit, urlunsplit

import aiohttp
import pytest
from aiohttp import web

from gateway.errors import StoreUnavailable
from gateway.store import Store, StoreLimits
from tests.gateways import gateway_server
from tests.upstreams import Upstream

# A pool wait far longer than the statement's: giving up must not wait on it as well.
LIMITS = StoreLimits(acquire=timedelta(seconds=10), statement=timedelta(seconds=2), lock=timedelta(seconds=1))
# The gateway's settings for the same: a stalled statement, lock or pool is a 503 within a second or two.
QUICK = {"pool_timeout": "1s", "statement_timeout": "1s", "lock_timeout": "1s"}
# Far past what the bounds above allow: a call still waiting then is waiting for good.
HANG = 30


@dataclass
class Freezer:
    """A loopback TCP relay to the test's Postgres that can stop relaying, keeping every connection open."""

    dsn: str
    flowing: asyncio.Event = field(default_factory=asyncio.Event)

    def freeze(self) -> None:
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()


async def _relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter, flowing: asyncio.Event) -> None:
    try:
        while chunk := await source.read(65536):
            await flowing.wait()
            sink.write(chunk)
            await sink.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        sink.close()


@asynccontextmanager
async def frozen_at_will(dsn: str) -> AsyncIterator[Freezer]:
    parts = urlsplit(dsn)
    socket_dir = parse_qs(parts.query).get("host", [None])[0]
    port = parts.port or 5432
    relays: set[asyncio.Task[None]] = set()
    freezer = Freezer("")
    freezer.thaw()

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if socket_dir is not None:
            return await asyncio.open_unix_connection(f"{socket_dir}/.s.PGSQL.{port}")
        return await asyncio.open_connection(parts.hostname, port)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await connect()
        for task in (
            _relay(reader, server_writer, freezer.flowing),
            _relay(server_reader, writer, freezer.flowing),
        ):
            relays.add(asyncio.create_task(task))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    relay_port = server.sockets[0].getsockname()[1]
    credentials = parts.netloc.rpartition("@")[0]  # user and password as given, if any
    at = f"{credentials}@" if credentials else ""
    freezer.dsn = urlunsplit(parts._replace(netloc=f"{at}127.0.0.1:{relay_port}", query=""))
    try:
        yield freezer
    finally:
        freezer.thaw()
        server.close()
        for task in relays:
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)


async def test_a_statement_postgres_never_answers_is_unavailable_within_the_statement_timeout(
    dsn: str,
) -> None:
    """The store gives up on a frozen Postgres a second after statement_timeout, as a 503 would say,
    and not after waiting as long again for a cancellation the frozen server cannot confirm."""
    async with frozen_at_will(dsn) as postgres:
        store = await Store.connect(postgres.dsn, min_size=1, max_size=1, limits=LIMITS)
        try:
            await store.ping()
            postgres.freeze()
            began = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(store.ping(), HANG)
            took = time.monotonic() - began
            postgres.thaw()
            await asyncio.wait_for(store.ping(), HANG)  # and it serves again once Postgres answers
        finally:
            await asyncio.wait_for(store.close(), HANG)
    assert LIMITS.answer is not None
    # The bound is 3 s; the cancellation's wait would have added 3 more (6 s in all).
    assert took < LIMITS.answer + 2.5, took


async def test_a_gateway_whose_postgres_stops_answering_says_503_and_sends_nothing_twice(
    dsn: str, upstream: Upstream
) -> None:
    """An agent's new effect and the readiness probe get a 503 while Postgres is frozen, not a hang;
    the agent's retry once it answers again reaches the upstream once."""
    headers = {"Idempotency-Key": "frozen", "Content-Type": "application/json"}
    async with (
        frozen_at_will(dsn) as postgres,
        gateway_server(
            postgres.dsn,
            upstreams={"shop": {"base_url": upstream.url}},
            **QUICK,
        ) as gw,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as http,
    ):
        postgres.freeze()
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=headers) as resp:
            frozen = resp.status, resp.headers.get("Retry-After"), await resp.json()
        async with http.get(f"{gw.admin_url}/_gateway/health") as resp:
            health = resp.status
        postgres.thaw()
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=headers) as resp:
            retried = resp.status
    assert frozen[0] == 503
    assert frozen[1] is not None
    assert frozen[2]["type"].endswith("store-unavailable")
    assert health == 503
    assert retried == 201
    assert len(upstream.effects()) == 1


async def test_postgres_frozen_after_the_upstream_acted_loses_nothing_and_sends_nothing_twice(
    dsn: str, upstream: Upstream
) -> None:
    """Postgres stops answering while the upstream takes the order: the agent gets a 503 saying the
    outcome could not be recorded, and its retry, once Postgres answers again and the attempt's lease
    has run out, finds the order by the shop's search and answers with it; the shop took one order."""
    headers = {"Idempotency-Key": "late", "Content-Type": "application/json"}
    upstream.serve_search()

    async def order_then_freeze(request: web.Request) -> web.Response:
        postgres.freeze()  # before the gateway writes down this answer
        return web.json_response({"order": "first"}, status=201)

    shop = {
        "base_url": upstream.url,
        "timeout": "1s",
        "stamp": {"json_field": "client_reference"},
        "probe": {
            "method": "GET",
            "path": "/orders/search?ref={key}",
            "found": "items.0",
            "status": 201,
            "routes": ["POST /orders"],
        },
    }
    upstream.routes["/orders"] = order_then_freeze
    async with (
        frozen_at_will(dsn) as postgres,
        gateway_server(postgres.dsn, upstreams={"shop": shop}, **QUICK) as gw,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as http,
    ):
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=headers) as resp:
            first = resp.status, await resp.json()
        postgres.thaw()
        retry = {**headers, "Prefer": "wait=10"}
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=retry) as resp:
            again = resp.status, resp.headers.get("Idempotent-Replayed")
    assert first[0] == 503
    assert "could not be recorded" in first[1]["detail"]
    assert again == (201, "true")
    assert len(upstream.effects()) == 1


async def test_a_gateway_stops_while_postgres_is_frozen_under_its_retention(
    dsn: str, upstream: Upstream
) -> None:
    """A gateway told to stop while its retention, and its pool, wait on a frozen Postgres stops all the
    same: the retention's connection has no bound on its statements, and shutting down waited on it."""
    settings = {"upstreams": {"shop": {"base_url": upstream.url}}, "purge_interval": "1s", **QUICK}
    async with frozen_at_will(dsn) as postgres:
        running = gateway_server(postgres.dsn, **settings)
        gw = await running.__aenter__()
        try:
            async with aiohttp.ClientSession() as http:
                headers = {"Idempotency-Key": "before", "Content-Type": "application/json"}
                async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=headers) as resp:
                    assert resp.status == 201
            postgres.freeze()
            await asyncio.sleep(2.5)  # the retention's next round starts, and waits on the server
        finally:
            stopped = await asyncio.wait_for(running.__aexit__(None, None, None), HANG)
    assert not stopped  # it ended without an error of its own


def test_no_statement_timeout_means_no_bound_on_the_client_either() -> None:
    """statement_timeout = 0 is Postgres's "no limit": the gateway does not cut statements at a second."""
    assert StoreLimits(statement=timedelta(0)).answer is None
    assert StoreLimits(statement=timedelta(seconds=10)).answer == 11.0
