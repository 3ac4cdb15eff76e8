"""The replay cache: least recently used out first, expired answers never served, and its bound in bytes
close to the memory a worker really spends on it (what ``replay_cache_bytes`` promises an operator)."""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from datetime import UTC, datetime

import aiohttp
import asyncpg
import pytest

from gateway import replays
from gateway.keys import key_digest
from gateway.record import StoredResponse
from gateway.replays import Completed, ReplayCache, Scope
from gateway.upstream import storable_headers
from tests.gateways import gateway_server
from tests.upstreams import Upstream


def _entry(i: int, body_bytes: int, headers: int, expires: float = 1e12) -> tuple[Scope, Completed]:
    """An entry built as the gateway builds one: each string and bytes object its own, as if read."""
    raw = [(b"Content-Type", b"application/json; charset=utf-8"), (b"Date", b"Thu, 03 Dec 2026 19:32:00 GMT")]
    raw += [(f"X-Header-{n}".encode(), os.urandom(12).hex().encode()) for n in range(headers - len(raw))]
    scope = (b"tenant-a".decode(), b"shop".decode(), f"{os.urandom(8).hex()}-run-{i}-step-{i % 20}")
    response = StoredResponse(201, storable_headers(raw), os.urandom(body_bytes // 2).hex().encode())
    return scope, Completed(
        10**9 + i, datetime.now(UTC), key_digest(scope[2]), os.urandom(32).hex(), response, expires
    )


@pytest.mark.parametrize(("body_bytes", "headers"), [(40, 2), (1024, 6), (16 * 1024, 12)])
def test_the_bound_in_bytes_is_close_to_the_memory_the_entries_take(body_bytes: int, headers: int) -> None:
    """What the cache counts against replay_cache_bytes is within 25% of the memory its entries hold."""
    made = [_entry(i, body_bytes, headers) for i in range(3000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = ReplayCache(10**12)
        for scope, effect in made:
            cache.put(scope, effect, 0.0)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The entries were made before tracing began, so that was the cache's own structure; the entries'
    # memory is measured by making a second set like them under the trace.
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        again = [_entry(i, body_bytes, headers) for i in range(3000)]
        entries = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del again
    real = held + entries
    assert 0.75 * real <= cache.bytes <= 1.25 * real, (cache.bytes, real)


def test_the_least_recently_used_entry_goes_first_and_the_bound_holds() -> None:
    """Past its capacity the cache drops what was used longest ago, and never holds more than it may."""
    entries = [_entry(i, 40, 2) for i in range(10)]
    probe = ReplayCache(10**9)
    probe.put(*entries[0], 0.0)
    cost = probe.bytes
    cache = ReplayCache(cost * 16 + cost // 2)  # room for 16 such entries and a half, never 17
    for scope, effect in entries[:10]:
        cache.put(scope, effect, 0.0)
    assert cache.get(entries[0][0], 0.0) is not None  # used: now the most recent
    more = [_entry(100 + i, 40, 2) for i in range(7)]
    for scope, effect in more:
        cache.put(scope, effect, 0.0)
    assert cache.bytes <= cost * 16 + cost // 2
    assert cache.get(entries[0][0], 0.0) is not None
    assert cache.get(entries[1][0], 0.0) is None  # the oldest unused went first
    assert cache.get(more[-1][0], 0.0) is not None


def test_an_answer_past_its_expiry_is_never_served() -> None:
    """A copy whose retention has run out is dropped when asked for, not replayed."""
    scope, effect = _entry(1, 40, 2, expires=100.0)
    cache = ReplayCache(10**9)
    cache.put(scope, effect, 0.0)
    assert cache.get(scope, 99.0) is effect
    assert cache.get(scope, 100.0) is None
    assert (len(cache), cache.bytes) == (0, 0)


def test_an_answer_larger_than_a_sixteenth_of_the_cache_is_not_kept() -> None:
    """One large answer is not allowed to push out many small ones."""
    scope, effect = _entry(1, 64 * 1024, 2)
    cache = ReplayCache(512 * 1024)
    cache.put(scope, effect, 0.0)
    assert cache.get(scope, 0.0) is None
    assert cache.bytes == 0


def test_an_answer_already_past_its_expiry_is_not_kept() -> None:
    """A copy that could never be served takes no room from the ones that can."""
    scope, effect = _entry(1, 40, 2, expires=100.0)
    cache = ReplayCache(10**9)
    cache.put(scope, effect, 100.0)
    assert (len(cache), cache.bytes) == (0, 0)


async def test_replays_counted_while_a_batch_is_written_are_written_too(
    dsn: str, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replays that come while the last batch of counts waits on Postgres reach the audit as well."""
    monkeypatch.setattr(replays, "REPLAY_FLUSH", 0.1)
    headers = {"Idempotency-Key": "counted", "Content-Type": "application/json"}
    holder = await asyncpg.connect(dsn)
    try:
        async with (
            gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw,
            aiohttp.ClientSession() as http,
        ):

            async def post(times: int) -> None:
                for _ in range(times):
                    async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=headers) as resp:
                        assert resp.status == 201

            await post(1)
            tx = holder.transaction()
            await tx.start()
            await holder.execute("select from effects where key = 'counted' for update")
            await post(5)  # their batch is written in a moment, and waits on the row
            await asyncio.sleep(0.5)
            await post(7)  # counted while that batch waits
            await tx.rollback()
            for _ in range(100):
                counted = await holder.fetchval("select replays from effects where key = 'counted'")
                if counted == 12:
                    break
                await asyncio.sleep(0.05)
    finally:
        await holder.close()
    assert counted == 12
