"""The gateway behind Debian's PgBouncer in transaction mode, with its direct URL for what needs a session.

The pooler has two server connections for every client of a database and role, so the gateway's
connections share them and a client's next transaction often runs on another server connection: a
statement prepared by name, a setting sent at login or a session-level lock would show. The whole suite
runs behind it as well with ``make test-pgbouncer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest

from gateway.errors import LoginRefused
from gateway.store import Store, StoreLimits, session_settings
from tests.database import runtime_role
from tests.gateways import gateway_server
from tests.poolers import pgbouncer
from tests.support import ROOT
from tests.upstreams import Upstream


@pytest.fixture(scope="module")
def pooler(postgres_dsn: str) -> Iterator[str]:
    """PgBouncer in transaction mode in front of the test database; its URL as the runtime role."""
    with pgbouncer(postgres_dsn, server_connections=2) as url:
        yield url


def _as_owner(pooler: str, dsn: str) -> str:
    """The pooler's URL with the owner's login (``dsn``'s) instead of the runtime role's."""
    login = urlsplit(dsn).netloc.rpartition("@")[0]
    where = urlsplit(pooler).netloc.rpartition("@")[2]
    return urlunsplit(urlsplit(pooler)._replace(netloc=f"{login}@{where}"))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


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


def _migrate_grant(config: Path) -> subprocess.CompletedProcess[str]:
    role = runtime_role()[0]
    return subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config), "migrate", "--grant-to", role],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("EFFECT_GATEWAY_")},
    )


async def test_behind_the_pooler_the_session_settings_are_the_roles_defaults(
    dsn: str, postgres_dsn: str, tmp_path: Path, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    """Without them, a gateway behind the pooler warns and says how to set them; `migrate --grant-to`
    with the pooler configured sets them, and the sessions behind a pooler then have them."""
    role = runtime_role()[0]
    database = urlsplit(dsn).path.lstrip("/") or "postgres"
    owner = await asyncpg.connect(dsn)
    try:
        await owner.execute(f'alter role "{role}" in database "{database}" reset all')
        shop = {"shop": {"base_url": upstream.url}}
        with (
            pgbouncer(postgres_dsn, server_connections=2) as url,
            caplog.at_level(logging.WARNING, logger="effect_gateway"),
        ):
            async with gateway_server(dsn, pooler=url, upstreams=shop):
                pass
        warned = [r.getMessage() for r in caplog.records if "sessions behind the pooler" in r.getMessage()]
        assert len(warned) == 1, warned
        assert "statement_timeout = 0" in warned[0]
        assert f"migrate --grant-to {role}" in warned[0]
        config = tmp_path / "gateway.toml"
        pooled = _as_owner(url, dsn)
        lines = [f'database_url = "{pooled}"', f'database_direct_url = "{dsn}"', 'statement_timeout = "7s"']
        config.write_text("\n".join(lines) + "\n")
        done = _migrate_grant(config)
        assert done.returncode == 0, done.stderr
        assert "session settings the defaults" in done.stderr + done.stdout
        with pgbouncer(postgres_dsn, server_connections=2) as url:
            conn = await asyncpg.connect(url, statement_cache_size=0)
            try:
                seen = await conn.fetch(
                    "select name, setting from pg_settings where name = any($1::text[])",
                    list(session_settings(StoreLimits())),
                )
            finally:
                await conn.close()
        assert dict(seen) == session_settings(StoreLimits(statement=timedelta(seconds=7)))
    finally:
        await owner.execute(f'alter role "{role}" in database "{database}" reset all')
        await owner.close()
