"""The gateway behind Debian's PgBouncer in transaction mode, with its direct URL for what needs a session.

The pooler keeps two server connections for each database and role, shared by all its clients, so the
gateway's connections share them and a client's next transaction often runs on another server connection: a
statement prepared by name, a setting sent at login or a session-level lock would show. The whole suite
runs behind it as well with ``make test-pgbouncer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import pytest

from gateway.errors import ConfigError, LoginRefused
from gateway.schema import migrate
from gateway.store import Store, StoreLimits, session_settings
from tests.database import runtime_role, with_login
from tests.gateways import gateway_server
from tests.poolers import pgbouncer
from tests.test_migrations import own_database
from tests.upstreams import Upstream


@pytest.fixture(scope="module")
def pooler(postgres_dsn: str) -> Iterator[str]:
    """PgBouncer in transaction mode in front of the test database; its URL as the runtime role."""
    with pgbouncer(postgres_dsn, server_connections=2) as url:
        yield url


def _as_owner(pooler: str, dsn: str) -> str:
    """The pooler's URL with the owner's login (``dsn``'s) instead of the runtime role's."""
    return with_login(pooler, urlsplit(dsn).netloc.rpartition("@")[0])


async def test_effects_and_their_retries_through_pgbouncer_are_sent_once(
    dsn: str, pooler: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """60 keys, each sent three times at once and retried once more: the shop sees each once, and
    every answer for a key is its first. The gateway's eight connections share two server connections."""
    shop = {"shop": {"base_url": upstream.url, "timeout": "5s"}}
    async with gateway_server(dsn, pooler=pooler, upstreams=shop, pool_size=8) as gw:

        async def order(key: str) -> tuple[int, bytes]:
            headers = {"Idempotency-Key": key, "Prefer": "wait=10", "Content-Type": "application/json"}
            body = json.dumps({"o": key})
            async with http.post(f"{gw.url}/shop/orders", data=body, headers=headers) as resp:
                return resp.status, await resp.read()

        keys = [f"order:{n}" for n in range(60)]
        first = await asyncio.gather(*(order(key) for key in keys for _ in range(3)))
        again = await asyncio.gather(*(order(key) for key in keys))
    for n, key in enumerate(keys):
        answers = {first[3 * n], first[3 * n + 1], first[3 * n + 2], again[n]}
        assert len(answers) == 1, (key, answers)
        assert next(iter(answers))[0] == 201
    sent = [json.loads(call.body)["o"] for call in upstream.effects()]
    assert sorted(sent) == sorted(keys)


async def test_the_partitions_upkeep_takes_its_lock_on_the_direct_connection(dsn: str, pooler: str) -> None:
    """The retention's session-level lock is taken on Postgres itself and let go: taken through the
    pooler, it would stay on a server connection that other clients go on using, and every other
    gateway would skip the retention for good."""
    store = await Store.connect(dsn, pooler=_as_owner(pooler, dsn), min_size=1, max_size=2)
    try:
        await store.maintain(timedelta(days=7))
        await store.ping()  # and the pool works through the pooler
    finally:
        await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        held = (
            "select count(*) from pg_locks l join pg_database d on d.oid = l.database"
            " where l.locktype = 'advisory' and d.datname = current_database()"
        )
        assert await conn.fetchval(held) == 0
    finally:
        await conn.close()


async def test_a_pooler_given_as_postgres_itself_is_refused_with_the_setting_to_use(
    postgres_dsn: str, pooler: str
) -> None:
    """Connected as if to Postgres itself, the gateway sends its settings at login and PgBouncer
    refuses them: the error names database_direct_url."""
    with pytest.raises(LoginRefused, match="database_direct_url"):
        await Store.connect(pooler, min_size=1, max_size=1)


async def _sessions_behind(postgres_dsn: str) -> dict[str, str]:
    """The settings a session gets behind a pooler that has just started (no server connection yet)."""
    with pgbouncer(postgres_dsn, server_connections=2) as url:
        conn = await asyncpg.connect(url, statement_cache_size=0)
        try:
            seen = await conn.fetch(
                "select name, setting from pg_settings where name = any($1::text[])",
                list(session_settings(StoreLimits())),
            )
        finally:
            await conn.close()
    return {row["name"]: row["setting"] for row in seen}


async def test_behind_the_pooler_a_worker_makes_its_session_settings_its_roles_defaults(
    dsn: str, postgres_dsn: str, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway whose sessions behind the pooler lack its settings makes them its role's defaults and
    says so once, and the sessions a pooler opens from then on have them."""
    role = runtime_role()[0]
    database = urlsplit(dsn).path.lstrip("/") or "postgres"
    owner = await asyncpg.connect(dsn)
    try:
        await owner.execute(f'alter role "{role}" in database "{database}" reset all')
        assert (await _sessions_behind(postgres_dsn))["statement_timeout"] == "0"
        shop = {"shop": {"base_url": upstream.url}}
        with (
            pgbouncer(postgres_dsn, server_connections=2) as url,
            caplog.at_level(logging.WARNING, logger="effect_gateway"),
        ):
            async with gateway_server(dsn, pooler=url, upstreams=shop, statement_timeout="7s"):
                pass
        said = [r.getMessage() for r in caplog.records if "sessions behind the pooler" in r.getMessage()]
        assert len(said) == 1, said
        assert "statement_timeout = 0" in said[0]
        assert f"made them the defaults of the role {role}" in said[0]
        assert await _sessions_behind(postgres_dsn) == session_settings(
            StoreLimits(statement=timedelta(seconds=7))
        )
    finally:
        await owner.execute(f'alter role "{role}" in database "{database}" reset all')
        await owner.close()


async def test_a_pooler_that_leads_to_another_database_is_refused_at_start(
    postgres_dsn: str, pooler: str
) -> None:
    """The pooler and database_direct_url must lead to one database, or the effects would be written
    into one while the migrations, the retention and the commands saw the other."""
    async with own_database(postgres_dsn, "elsewhere") as other:
        await migrate(other)
        with pytest.raises(ConfigError, match="lead to different databases"):
            await Store.connect(other, pooler=pooler, min_size=1, max_size=1)


async def test_behind_pgbouncer_in_session_mode_effects_are_sent_once_too(
    dsn: str, postgres_dsn: str, upstream: Upstream
) -> None:
    """In session mode (a server connection for each of the gateway's for as long as it lasts) a new
    effect is sent once and its retry replayed, the settings at login left out all the same."""
    shop = {"shop": {"base_url": upstream.url}}
    with pgbouncer(postgres_dsn, mode="session", server_connections=4) as url:
        async with (
            gateway_server(dsn, pooler=url, upstreams=shop, pool_size=3) as gw,
            aiohttp.ClientSession() as http,
        ):
            headers = {"Idempotency-Key": "session:1", "Content-Type": "application/json"}
            answers = []
            for _ in range(2):
                async with http.post(f"{gw.url}/shop/orders", data=b'{"o": 1}', headers=headers) as resp:
                    answers.append((resp.status, await resp.read(), resp.headers.get("Idempotent-Replayed")))
    assert [a[0] for a in answers] == [201, 201]
    assert answers[0][1] == answers[1][1]
    assert answers[1][2] == "true"
    assert len(upstream.effects()) == 1
