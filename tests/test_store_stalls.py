"""Postgres that stops answering without closing anything (a frozen host, a network partition): the
server's statement_timeout never fires then, and the gateway must still answer, 503, and send nothing
twice once Postgres is back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import parse_qs, urlsplit, urlunsplit

import aiohttp
import pytest

from gateway.errors import StoreUnavailable
from gateway.store import Store, StoreLimits
from tests.support import Upstream, gateway_server

LIMITS = StoreLimits(acquire=timedelta(seconds=1), statement=timedelta(seconds=1), lock=timedelta(seconds=1))
# Far past what the bound above allows: a call still waiting then is waiting for good.
HANG = 15


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
    user = f"{parts.username}@" if parts.username else ""
    freezer.dsn = urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{relay_port}", query=""))
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
    """The store gives up on a frozen Postgres a moment after statement_timeout, as a 503 would say."""
    async with frozen_at_will(dsn) as postgres:
        store = await Store.connect(postgres.dsn, min_size=1, max_size=1, limits=LIMITS)
        try:
            await store.ping()
            postgres.freeze()
            with pytest.raises(StoreUnavailable):
                await asyncio.wait_for(store.ping(), HANG)
            postgres.thaw()
            await asyncio.wait_for(store.ping(), HANG)  # and it serves again once Postgres answers
        finally:
            await asyncio.wait_for(store.close(), HANG)


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
            pool_timeout="1s",
            statement_timeout="1s",
            lock_timeout="1s",
        ) as gw,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as http,
    ):
        postgres.freeze()
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=headers) as resp:
            frozen = resp.status, resp.headers.get("Retry-After"), await resp.json()
        async with http.get(f"{gw.url}/_gateway/health") as resp:
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
