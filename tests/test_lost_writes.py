"""A database that forgot writes a gateway committed is noticed, and nothing it forgot is sent again.

Here the loss is made by hand on the test database (the owner deletes a claim, as a restore to an
earlier point would have lost it, and ends the gateway's connections, as a failover does); the
failover tests (tests/test_failover.py) make it with a real backup brought up in the primary's place.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import asyncpg

from tests.database import runtime_role
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream


async def _order(http: aiohttp.ClientSession, gw: Gateway, key: str) -> tuple[int, dict[str, Any]]:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    body = json.dumps({"order": key}).encode()
    async with http.post(f"{gw.url}/shop/orders", data=body, headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


async def _forget(dsn: str, key: str, *, end_connections: bool = True) -> None:
    """Lose the claim of ``key`` and end the gateway's connections, as a restore and a failover do
    (a pooler in front keeps the gateway's connections: ``end_connections=False``)."""
    conn = await asyncpg.connect(dsn)
    try:
        effect_id = await conn.fetchval("select id from effects where key = $1", key)
        await conn.execute("delete from effect_bodies where effect_id = $1", effect_id)
        await conn.execute("delete from open_effects where id = $1", effect_id)
        await conn.execute("delete from effect_keys where effect_id = $1", effect_id)
        await conn.execute("delete from effects where id = $1", effect_id)
        if end_connections:
            await _end_runtime_sessions(conn)
    finally:
        await conn.close()


async def _end_runtime_sessions(conn: asyncpg.Connection) -> None:
    """End the gateways' sessions on this database (not other workers' on a shared server), as a
    failover does."""
    await conn.execute(
        "select pg_terminate_backend(pid) from pg_stat_activity"
        " where usename = $1 and datname = current_database()",
        runtime_role()[0],
    )


async def _until_lost_writes(http: aiohttp.ClientSession, gw: Gateway, key: str) -> dict[str, Any]:
    """The answer to ``key`` once the gateway has reconnected: never a new effect."""
    for _ in range(20):
        status, problem = await _order(http, gw, key)
        assert status == 503, (key, status, problem)
        if problem["type"].endswith("/database-lost-writes"):
            return problem
    raise AssertionError("the lost write was never noticed")


async def test_a_forgotten_claim_stops_new_effects_for_every_gateway_until_the_alarm_is_cleared(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The retry of a forgotten claim, and any new key, are refused (503 database-lost-writes), also by
    a gateway started afterwards, until the owner deletes the alarm; then new effects go again. A key
    the database still holds is replayed meanwhile, and the health route a liveness probe asks stays
    up (a restart would change nothing)."""
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    async with gateway_server(dsn, upstreams=shop, replay_cache_bytes=0) as gw:
        kept = await _order(http, gw, "kept:1")
        assert kept[0] == 201
        assert (await _order(http, gw, "lost:1"))[0] == 201
        await _forget(dsn, "lost:1")
        problem = await _until_lost_writes(http, gw, "lost:1")
        assert "no longer holds effect" in problem["detail"]
        await _until_lost_writes(http, gw, "new:1")
        # A key the database still holds is answered as before: a replay of its first answer.
        assert await _order(http, gw, "kept:1") == kept
        async with http.get(f"{gw.url}/_gateway/health") as resp:
            assert resp.status == 200
    async with gateway_server(dsn, upstreams=shop, replay_cache_bytes=0) as restarted:
        await _until_lost_writes(http, restarted, "new:1")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("delete from effect_gateway_alarms")  # the operator has reconciled
    finally:
        await conn.close()
    async with gateway_server(dsn, upstreams=shop, replay_cache_bytes=0) as cleared:
        assert (await _order(http, cleared, "new:1"))[0] == 201
    orders = [json.loads(call.body)["order"] for call in upstream.effects()]
    assert orders == ["kept:1", "lost:1", "new:1"]


async def test_a_gateway_that_reconnected_before_the_alarm_heeds_it_at_its_next_claim(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Two gateways: the one whose claim was lost raises the alarm; the other, back on the database
    before that and with nothing of its own lost, refuses the lost key's retry all the same (the claim
    statement itself heeds the alarm), where it sent it a second time. Once the operator deletes the
    alarm, both send new effects again."""
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    async with (
        gateway_server(dsn, upstreams=shop, replay_cache_bytes=0) as noticing,
        gateway_server(dsn, upstreams=shop, replay_cache_bytes=0) as other,
    ):
        assert (await _order(http, noticing, "lost:1"))[0] == 201
        assert (await _order(http, other, "other:1"))[0] == 201
        await _forget(dsn, "lost:1")
        for _ in range(5):  # the other gateway back on the database, its own claim still there
            if (await _order(http, other, "other:1"))[0] == 201:
                break
        await _until_lost_writes(http, noticing, "lost:1")
        await _until_lost_writes(http, other, "lost:1")
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("delete from effect_gateway_alarms")  # the operator has reconciled
            await _end_runtime_sessions(conn)
        finally:
            await conn.close()
        for gw, key in ((noticing, "after:1"), (other, "after:2")):
            for _ in range(5):  # each back on the database, the alarm gone
                status, _ = await _order(http, gw, key)
                if status == 201:
                    break
            assert status == 201, key
    orders = [json.loads(call.body)["order"] for call in upstream.effects()]
    assert orders.count("lost:1") == 1
    assert orders == ["lost:1", "other:1", "after:1", "after:2"]


async def test_a_loss_under_connections_kept_open_is_caught_by_the_next_claim(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """With its connections kept open across the loss, as a pooler keeps them, the gateway refuses the
    first retry of the forgotten key in the claim statement itself, and the shop sees the order once."""
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    async with gateway_server(dsn, upstreams=shop, replay_cache_bytes=0) as gw:
        assert (await _order(http, gw, "lost:1"))[0] == 201
        await _forget(dsn, "lost:1", end_connections=False)
        status, problem = await _order(http, gw, "lost:1")
        assert (status, problem["type"].rsplit("/", 1)[-1]) == (503, "database-lost-writes")
        assert "no longer holds effect" in problem["detail"]
    orders = [json.loads(call.body)["order"] for call in upstream.effects()]
    assert orders == ["lost:1"]


async def test_an_alarm_that_could_not_be_written_is_written_at_the_next_claim_and_nothing_is_sent_again(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A worker that found the loss but could not write the alarm refuses the lost key again at the
    next retry and writes the alarm then, instead of taking the missing row for an operator's deletion."""
    shop = {"shop": {"base_url": upstream.url, "timeout": "2s"}}
    role = runtime_role()[0]
    async with gateway_server(dsn, upstreams=shop, replay_cache_bytes=0) as gw:
        assert (await _order(http, gw, "lost:1"))[0] == 201
        owner = await asyncpg.connect(dsn)
        try:
            await owner.execute(f"revoke insert on effect_gateway_alarms from {role}")
            try:
                await _forget(dsn, "lost:1", end_connections=False)
                unwritten, _ = await _order(http, gw, "lost:1")
            finally:
                await owner.execute(f"grant insert on effect_gateway_alarms to {role}")
            status, problem = await _order(http, gw, "lost:1")
            alarms = await owner.fetchval("select count(*) from effect_gateway_alarms")
        finally:
            await owner.close()
    assert unwritten >= 500
    assert (status, problem["type"].rsplit("/", 1)[-1]) == (503, "database-lost-writes")
    assert alarms == 1
    orders = [json.loads(call.body)["order"] for call in upstream.effects()]
    assert orders == ["lost:1"]
