"""Failover under load: the gateway's Postgres is a primary streaming synchronously to a standby, and
agents send effects with retries while the primary is killed (SIGKILL) and the standby promoted.

Nothing may be done twice and no answer lost: every key's effect reaches the upstream once, every
agent ends with its 201, and a further retry replays it. Meanwhile the gateway answers 503 (nothing
sent) and comes back on the new primary by itself: its database URL names both servers, with
target_session_attrs=read-write. `make test` runs one failover; `make failover` several, longer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from gateway.schema import migrate
from tests.database import grant_runtime, runtime_url
from tests.gateways import gateway_server
from tests.replicas import Pair, backup, installed, replicated
from tests.upstreams import ORDER_SEARCH, Upstream

pytestmark = pytest.mark.crash

# The failovers and the agents: `make failover` sets FAILOVERS=5 AGENTS=300.
FAILOVERS = int(os.environ.get("FAILOVERS", "1"))
AGENTS = int(os.environ.get("AGENTS", "40"))
SEARCH = {**ORDER_SEARCH, "lag": "0s"}


ADMIN = {"token": "failover-admin-token"}
AS_ADMIN = {"Authorization": f"Bearer {ADMIN['token']}"}


@dataclass
class Tally:
    statuses: Counter[str] = field(default_factory=Counter)
    answers: dict[str, bytes] = field(default_factory=dict)
    # Each failover's time from the kill to the next new effect answered (promoting the standby and
    # making a new one included).
    outages: list[float] = field(default_factory=list)


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder the servers' system user may enter (pytest's own are root's alone)."""
    why = installed()
    if why is not None:
        pytest.fail(why)
    path = Path(tempfile.mkdtemp(prefix="effect-gateway-failover-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _agent(http: aiohttp.ClientSession, url: str, key: str, tally: Tally) -> None:
    """One effect, retried until it is answered 201, then once more (a replay)."""
    body = json.dumps({"order": key}).encode()
    headers = {"Idempotency-Key": key, "Content-Type": "application/json", "Prefer": "wait=5"}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            async with http.post(f"{url}/shop/orders", data=body, headers=headers) as resp:
                answer = await resp.read()
                tally.statuses[str(resp.status)] += 1
        except aiohttp.ClientError as exc:
            tally.statuses[type(exc).__name__] += 1
            await asyncio.sleep(0.1)
            continue
        if resp.status == 201:
            tally.answers[key] = answer
            return
        assert resp.status in (409, 503), (key, resp.status, answer)
        await asyncio.sleep(0.1)
    raise AssertionError(f"{key} was never answered")


async def _in_sync(pair: Pair) -> bool:
    conn = await asyncpg.connect(pair.primary.dsn)
    try:
        return await conn.fetchval("select sync_state from pg_stat_replication") == "sync"
    finally:
        await conn.close()


async def _later(seconds: float, then: Coroutine[Any, Any, None]) -> None:
    await asyncio.sleep(seconds)
    await then


async def _slow_order(request: web.Request) -> web.Response:
    """The shop places the order at once (the upstream records the call) and answers 0.3 s later."""
    await asyncio.sleep(0.3)
    return web.json_response({"placed": json.loads(await request.read())["order"]}, status=201)


async def _fail_over(pair: Pair, gateway_url: str, tally: Tally, http: aiohttp.ClientSession) -> None:
    """Kill the primary and promote the standby; then time until a new effect is answered again."""
    killed = time.monotonic()
    await asyncio.to_thread(pair.fail_over)
    probe = json.dumps({"order": f"probe-{killed}"}).encode()
    headers = {"Content-Type": "application/json", "Idempotency-Key": f"probe-{killed}", "Prefer": "wait=5"}
    while True:
        try:
            async with http.post(f"{gateway_url}/shop/orders", data=probe, headers=headers) as resp:
                if resp.status == 201:
                    tally.outages.append(time.monotonic() - killed)
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)


async def test_effects_survive_failovers_with_nothing_done_twice_and_no_answer_lost(
    folder: Path, upstream: Upstream
) -> None:
    upstream.serve_search(field_name="client_reference")
    upstream.routes["/orders"] = _slow_order
    with replicated(folder, sync=True) as pair:
        await migrate(pair.url)
        await grant_runtime(pair.url)
        shop = {
            "base_url": upstream.url,
            "timeout": "2s",
            "stamp": {"json_field": "client_reference"},
            "probe": SEARCH,
        }
        tally = Tally()
        async with (
            gateway_server(
                pair.url,
                upstreams={"shop": shop},
                lease_grace="500ms",
                admin=ADMIN,
                database_url=runtime_url(pair.url),
            ) as gw,
            aiohttp.ClientSession() as http,
        ):
            async with http.get(f"{gw.admin_url}/_gateway/health", headers=AS_ADMIN) as resp:
                health = await resp.json()
            assert "effects" in health, "read as the admin"
            assert not any("confirms a commit" in w for w in health.get("warnings", [])), health
            keys = [f"run-{i}:1" for i in range(AGENTS)]
            # The agents start one after another over the failovers, so that each failover finds
            # effects claimed, sent (the shop takes 0.3 s) and being recorded.
            spacing = FAILOVERS * 1.5 / AGENTS
            agents = [
                asyncio.create_task(_later(i * spacing, _agent(http, gw.url, key, tally)))
                for i, key in enumerate(keys)
            ]
            for _ in range(FAILOVERS):
                await asyncio.sleep(0.7)
                assert await _in_sync(pair), "the standby confirms each commit before the kill"
                await _fail_over(pair, gw.url, tally, http)
            await asyncio.gather(*agents)
            # Every key once more: each a replay of its first answer.
            for key in keys:
                async with http.post(
                    f"{gw.url}/shop/orders",
                    data=json.dumps({"order": key}).encode(),
                    headers={"Idempotency-Key": key, "Content-Type": "application/json"},
                ) as resp:
                    assert (resp.status, await resp.read()) == (201, tally.answers[key]), key
        done = Counter(json.loads(call.body)["order"] for call in upstream.effects("/orders"))
    twice = [key for key in keys if done[key] > 1]
    never = [key for key in keys if done[key] == 0]
    print(
        f"\nfailover: {AGENTS} agents, {FAILOVERS} failover(s); answers {dict(tally.statuses)}; "
        f"without service {', '.join(f'{s:.2f}s' for s in tally.outages)}"
    )
    assert twice == []
    assert never == []
    assert len(tally.answers) == AGENTS


async def test_a_database_that_lost_writes_is_noticed_and_no_lost_claim_is_sent_again(
    folder: Path, upstream: Upstream
) -> None:
    """The primary dies and a backup taken before the last claims comes up in its place (as a restore to
    an earlier point does, or a standby that had not received them): the key of a lost claim would look
    new and be sent again. The gateway finds its newest claim missing on its new connections, and
    refuses every new effect (503 database-lost-writes) and raises the alarm that makes every gateway
    refuse, instead: the lost keys' effects stay at one each."""
    with replicated(folder, sync=False) as pair:
        await migrate(pair.url)
        await grant_runtime(pair.url)
        shop = {"base_url": upstream.url, "timeout": "2s"}
        async with (
            # No answers kept in memory: every retry reads the database, as after a restart.
            gateway_server(
                pair.url,
                upstreams={"shop": shop},
                lease_grace="500ms",
                replay_cache_bytes=0,
                admin=ADMIN,
                database_url=runtime_url(pair.url),
            ) as gw,
            aiohttp.ClientSession() as http,
        ):

            async def order(key: str) -> tuple[int, dict[str, Any]]:
                headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
                body = json.dumps({"order": key}).encode()
                async with http.post(f"{gw.url}/shop/orders", data=body, headers=headers) as resp:
                    return resp.status, json.loads(await resp.read())

            assert (await order("kept:1"))[0] == 201
            # Asynchronous: the operators are told a failover could lose commits.
            async with http.get(f"{gw.admin_url}/_gateway/health", headers=AS_ADMIN) as resp:
                health = await resp.json()
            assert health["status"] == "warning", health
            assert any("synchronous_standby_names is empty" in w for w in health["warnings"]), health
            restored = await asyncio.to_thread(backup, pair.primary, "restored")
            for key in ("lost:1", "lost:2"):
                assert (await order(key))[0] == 201
            # The primary and its standby go; the backup comes up where the standby was.
            pair.primary.kill()
            pair.standby.stop()
            restored.port = pair.standby.port
            await asyncio.to_thread(restored.start)
            try:
                refused: list[dict[str, Any]] = []
                deadline = time.monotonic() + 30
                while len(refused) < 3 and time.monotonic() < deadline:
                    for key in ("lost:1", "lost:2", "new:1"):
                        status, problem = await order(key)
                        assert status == 503, (key, status, problem)  # never sent again
                        if problem["type"].endswith("/database-lost-writes"):
                            refused.append(problem)
                    await asyncio.sleep(0.2)
                assert len(refused) >= 3, "the lost writes were noticed"
                conn = await asyncpg.connect(restored.dsn)
                try:  # every gateway, and this one after a restart, will refuse too
                    alarm = await conn.fetchval("select detail from effect_gateway_alarms")
                finally:
                    await conn.close()
                assert "no longer holds effect" in alarm
            finally:
                restored.stop()
    done = Counter(json.loads(call.body)["order"] for call in upstream.effects())
    assert done == {"kept:1": 1, "lost:1": 1, "lost:2": 1}
