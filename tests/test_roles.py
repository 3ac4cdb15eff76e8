"""Least privilege: serve runs with a role of reads and writes only, and rows never run out of partitions.

The suite's gateways all run as the runtime role (tests/database.py runtime_url), granted exactly what
docs/operations.md lists; these tests check what that role can and cannot do, what the owner alone
does, and that an answer is stored whatever became of the partition it goes into.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from gateway import partitions, roles
from gateway import store as store_module
from gateway.schema import migrate, migration_files, ready
from gateway.store import opened
from tests.commands import Done, in_thread
from tests.database import effect_rows, grant_runtime, other_database, runtime_role, runtime_url
from tests.gateways import gateway_server, start_gateway_process
from tests.support import ROOT
from tests.test_cli import cli, one_line_error
from tests.test_migrations import own_database as empty_database
from tests.upstreams import Upstream

BODY = b'{"items":["atta"]}'
RETENTION = timedelta(days=7)


async def order(http: aiohttp.ClientSession, url: str, key: str) -> tuple[int, dict[str, str], Any]:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    async with http.post(f"{url}/shop/orders", data=BODY, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


@asynccontextmanager
async def own_database(postgres_dsn: str, name: str) -> AsyncIterator[str]:
    """A database of its own, migrated by the owner and granted to the runtime role; dropped after."""
    async with empty_database(postgres_dsn, name) as dsn:
        await migrate(dsn)
        await grant_runtime(dsn)
        yield dsn


async def _fetchval(dsn: str, sql: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


def _config(tmp_path: Path, database_url: str, upstream: str, workers: int = 1) -> Path:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{database_url}"\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
        f"workers = {workers}\n"
        f'[upstreams.shop]\nbase_url = "{upstream}"\n'
    )
    return config


# --- serve as the runtime role --------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_starts_and_serves_as_a_role_of_reads_and_writes_only(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path, workers: int
) -> None:
    """`effect-gateway serve` as a role that may make no table starts on a current schema, places an
    order and replays it, and says once that the retention is left to the owner's purge."""
    runtime = runtime_url(dsn)
    assert not await _fetchval(runtime, "select has_schema_privilege(current_schema(), 'create')")
    assert not await _fetchval(
        runtime, "select rolsuper or rolcreaterole from pg_roles where rolname = current_user"
    )
    gateway = start_gateway_process(_config(tmp_path, runtime, upstream.url, workers))
    assert gateway.stderr is not None
    note = "leaves the retention to `effect-gateway purge`"
    try:
        placed = await order(http, gateway.url, "least-1")
        replayed = await order(http, gateway.url, "least-1")
        # Each worker's first maintenance round runs as it starts, in a moment; 30 s only bounds a hang.
        for _ in range(300):
            if sum(note in line for line in gateway.stderr.lines) >= workers:
                break
            await asyncio.sleep(0.1)
    finally:
        gateway.stop()
    assert gateway.proc.returncode == 0
    assert placed[0] == 201
    assert (replayed[0], replayed[2], replayed[1].get("Idempotent-Replayed")) == (201, placed[2], "true")
    assert len(upstream.effects()) == 1
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["response_status"]) == ("completed", 201)
    said = [line for line in gateway.stderr.whole() if note in line]
    assert len(said) == workers, "once per worker process, at its start"


async def test_a_role_lacking_a_privilege_is_told_which_at_start(
    postgres_dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """serve as a role that lacks one of the runtime privileges stops at start with one line naming it
    and the command that grants it, instead of failing the first effect that needs it."""
    async with own_database(postgres_dsn, "lacking_update") as dsn:
        role, _ = runtime_role()
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"revoke update on effects from {roles.quoted(role)}")
            owner = await conn.fetchval("select current_user")
        finally:
            await conn.close()
        done = await asyncio.to_thread(cli, "serve", config=_config(tmp_path, runtime_url(dsn), upstream.url))
    assert one_line_error(done) == (
        f"effect-gateway: the role {role} lacks update on table effects: run "
        f"`effect-gateway migrate --grant-to {role}` as the owner of the tables ({owner})"
    )


async def test_a_runtime_role_that_may_create_tables_is_warned_of_at_start(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A runtime role that may create tables beside the effects' (any role may, before Postgres 15) is
    named in the log at start, with the statement that revokes it; one that may not, is not."""
    async with own_database(postgres_dsn, "may_create") as dsn:
        role, _ = runtime_role()
        with caplog.at_level(logging.WARNING, logger="effect_gateway"):
            await ready(runtime_url(dsn))
            assert not [r for r in caplog.records if "create tables" in r.getMessage()]
            conn = await asyncpg.connect(dsn)
            try:
                await conn.execute(f"grant create on schema public to {roles.quoted(role)}")
                await ready(runtime_url(dsn))
                await conn.execute(f"revoke create on schema public from {roles.quoted(role)}")
            finally:
                await conn.close()
    (warned,) = [r.getMessage() for r in caplog.records if "create tables" in r.getMessage()]
    assert "revoke create on schema public from public" in warned


async def test_a_schema_behind_is_one_line_for_the_runtime_role_and_migrated_by_the_owner(
    postgres_dsn: str, upstream: Upstream, tmp_path: Path, run: Callable[..., Done]
) -> None:
    """A schema one migration behind: serve or migrate as the runtime role stops with one line asking for
    the owner's migrate and changes nothing; the owner's `migrate --grant-to` brings it up."""
    # The one before the last by its number, not the last less one: numbers may skip (a migration
    # being written on another branch at the same time holds the one between).
    before, latest = (version for version, _, _ in migration_files()[-2:])
    async with own_database(postgres_dsn, "behind_one") as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("delete from effect_gateway_migrations where version = $1", latest)
            owner = await conn.fetchval("select current_user")
        finally:
            await conn.close()
        config = _config(tmp_path, runtime_url(dsn), upstream.url)
        refused = await asyncio.to_thread(cli, "serve", config=config)
        as_runtime = {"EFFECT_GATEWAY_DATABASE_URL": runtime_url(dsn)}
        not_migrated = await in_thread(run, "migrate", env=as_runtime)
        assert await _fetchval(dsn, "select max(version) from effect_gateway_migrations") == before
        role, _ = runtime_role()
        migrated = await in_thread(
            run, "migrate", "--grant-to", role, env={"EFFECT_GATEWAY_DATABASE_URL": dsn}
        )
        nothing_to_do = await in_thread(run, "migrate", env=as_runtime)
        gateway = start_gateway_process(config)
        gateway.stop()
    assert one_line_error(refused) == (
        f"effect-gateway: the schema is at migration {before}, this gateway needs {latest}: run "
        f"`effect-gateway migrate` as the owner of the tables ({owner})"
    )
    assert one_line_error(not_migrated) == (
        f"effect-gateway: this role may not change the schema (at migration {before}, this gateway "
        f"needs {latest}): run `effect-gateway migrate` as the owner of the tables ({owner})"
    )
    assert nothing_to_do.status == 0, nothing_to_do.err
    assert migrated.status == 0, migrated.err
    assert f"granted {role} what serve needs" in migrated.out
    assert gateway.proc.returncode == 0


def test_granting_to_a_role_that_is_not_there_is_one_line(
    postgres_dsn: str, run: Callable[..., Done]
) -> None:
    """`migrate --grant-to` a role nobody made: one line saying to make it first, exit 2."""
    done = run("migrate", "--grant-to", "no_such_role", env={"EFFECT_GATEWAY_DATABASE_URL": postgres_dsn})
    assert one_line_error(done) == (
        "effect-gateway: no role named 'no_such_role': make it first (create role ... login password ...), "
        "then grant"
    )


def test_purge_as_the_runtime_role_names_the_owner(postgres_dsn: str, run: Callable[..., Done]) -> None:
    """`effect-gateway purge` as the runtime role drops nothing and says who must run it, in one line."""
    owner = asyncio.run(_fetchval(postgres_dsn, "select current_user"))
    done = run("purge", env={"EFFECT_GATEWAY_DATABASE_URL": runtime_url(postgres_dsn)})
    assert one_line_error(done) == (
        f"effect-gateway: dropping days of bodies takes the privileges of the owner of the tables ({owner}): "
        f"run effect-gateway purge as {owner}"
    )


async def test_the_retention_runs_only_for_the_owner_and_the_runtime_role_says_so_once(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A day of bodies past the retention: the runtime role's maintenance leaves it (and logs so once, however
    many rounds), the owner's drops it. One role for both (the embedded Postgres) does both."""
    conn = await asyncpg.connect(dsn)
    try:
        day = await conn.fetchval("select now() - interval '30 days'")
        assert await partitions.ensure(conn, day)  # a day a month back, past the 7 days kept
        named = "select count(*) from pg_class where relname = $1"
        past = f"effect_bodies_{day:%Y_%m_%d}"
        caplog.set_level(logging.INFO, logger="effect_gateway")
        async with opened(runtime_url(dsn)) as store:
            for _ in range(2):
                assert await store.maintain(RETENTION) == []
        assert await conn.fetchval(named, past) == 1
        async with opened(dsn) as store:
            dropped = await store.maintain(RETENTION)
        assert past in [part.name for part in dropped]
        assert await conn.fetchval(named, past) == 0
    finally:
        await conn.close()
    notes = [r for r in caplog.records if "leaves the retention" in r.getMessage()]
    assert len(notes) == 1


async def test_the_runtime_role_has_exactly_the_privileges_operations_md_lists(dsn: str) -> None:
    """What the suite's runtime role holds on the schema's tables, sequences and functions is exactly the
    table of docs/operations.md (granted by migrate --grant-to), and no partition grants it anything."""
    role, _ = runtime_role()
    conn = await asyncpg.connect(dsn)
    try:
        held = await conn.fetch(
            """
            select case c.relkind when 'S' then 'sequence' else 'table' end as kind, c.relname as name,
                   lower(a.privilege_type) as action
            from pg_class c, aclexplode(c.relacl) a
            where c.relnamespace = current_schema()::regnamespace and a.grantee = $1::regrole
            union all
            select 'function', p.oid::regprocedure::text, lower(a.privilege_type)
            from pg_proc p, aclexplode(p.proacl) a
            where p.pronamespace = current_schema()::regnamespace and a.grantee = $1::regrole
            """,
            role,
        )
    finally:
        await conn.close()
    granted = {(r["kind"], r["name"].replace(",", ", "), r["action"]) for r in held}
    expected = {(p.kind, p.name, action) for p in roles.RUNTIME_PRIVILEGES for action in p.actions}
    assert granted == expected
    documented = set()
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide[guide.index("## Database roles") :].split("\n## ", 1)[0]
    for line in section.splitlines():
        found = re.fullmatch(
            r"\| `(\w+(?:\([\w, ]*\))?)` \| (table|sequence|function) \| ([\w ,]+) \|.*", line
        )
        if found:
            name, kind, actions = found.groups()
            documented |= {(kind, name, action.strip()) for action in actions.split(",")}
    assert documented == expected


# --- an answer always has a home ------------------------------------------------------------------------


async def _move_todays_bodies_aside(owner: asyncpg.Connection) -> str:
    """Today's day of bodies detached and renamed, as if nobody had made it; returns its new name."""
    name = await owner.fetchval("select 'effect_bodies_' || to_char(now() at time zone 'UTC', 'YYYY_MM_DD')")
    await owner.execute(f'alter table effect_bodies detach partition "{name}"')
    await owner.execute(f'alter table "{name}" rename to "{name}_aside"')
    return f"{name}_aside"


async def _first_round_done(caplog: pytest.LogCaptureFixture) -> None:
    """Wait for the gateway's first maintenance round, which runs as it starts and makes the partitions
    ahead: a test that takes partitions away must do so after it, or the round would put them back.

    It ends with the runtime role's note that the retention is the owner's, in a moment; 30 s only
    bounds a hang."""
    for _ in range(300):
        if any("leaves the retention" in r.getMessage() for r in caplog.records):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the gateway's first maintenance round never ended")


def _held_until(arrived: asyncio.Event, go_on: asyncio.Event) -> Callable[[web.Request], Any]:
    async def create(request: web.Request) -> web.Response:
        arrived.set()
        await go_on.wait()
        return web.json_response({"order": "ord_1"}, status=201)

    return create


@pytest.mark.parametrize("locked", [False, True], ids=["missing", "missing and locked"])
async def test_an_answer_whose_day_has_no_partition_is_stored_and_replayed(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, locked: bool
) -> None:
    """The upstream answers 201 after its day of bodies went away (and, locked, while another session holds
    the table for a second): the runtime role's gateway makes the day as the owner, stores the answer and
    relays it; the effect is completed and its retry replays the 201, with one order made."""
    arrived, go_on = asyncio.Event(), asyncio.Event()
    upstream.routes["/orders"] = _held_until(arrived, go_on)
    owner = await asyncpg.connect(dsn)
    aside = ""
    caplog.set_level(logging.INFO, logger="effect_gateway")
    try:
        async with gateway_server(
            dsn, upstreams={"shop": {"base_url": upstream.url}}, replay_cache_bytes=0
        ) as gw:
            await _first_round_done(caplog)
            sent = asyncio.create_task(order(http, gw.url, "homeless-1"))
            await asyncio.wait_for(arrived.wait(), 30)
            aside = await _move_todays_bodies_aside(owner)
            holder = owner.transaction()
            if locked:
                await holder.start()
                # The lock a retention's detach or another gateway making partitions holds: making one waits.
                await owner.execute("lock table effect_bodies in share update exclusive mode")
            go_on.set()
            if locked:
                # Held a second, a tenth of what the store waits for it (PARTITIONS_WAIT, 10 s).
                await asyncio.sleep(1.0)
                await holder.rollback()
            placed = await asyncio.wait_for(sent, 30)
            replayed = await order(http, gw.url, "homeless-1")
    finally:
        if aside:
            await owner.execute(f'drop table if exists "{aside}"')
        await owner.close()
    assert (placed[0], placed[2]) == (201, {"order": "ord_1"})
    assert (replayed[0], replayed[2], replayed[1].get("Idempotent-Replayed")) == (201, placed[2], "true")
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["response_status"]) == ("completed", 201)
    assert json.loads(row["response_body"]) == {"order": "ord_1"}
    assert len(upstream.effects()) == 1


# --- how many days are left -----------------------------------------------------------------------------


async def _days_left(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any], dict[str, float]]:
    """Health's status and document, and the metric's days left per table."""
    async with http.get(f"{url}/_gateway/health") as resp:
        status, doc = resp.status, await resp.json()
    async with http.get(f"{url}/_gateway/metrics") as resp:
        text = await resp.text()
    gauge = dict(
        re.findall(r'^effect_gateway_partition_days_left\{table="(\w+)"\} (\S+)$', text, re.MULTILINE)
    )
    return status, doc, {table: float(days) for table, days in gauge.items()}


async def _drop_bodies_days_after(owner: asyncpg.Connection, days: int) -> None:
    """The days of bodies more than ``days`` after today dropped, as if none had been made since."""
    today = await owner.fetchval("select date_trunc('day', now() at time zone 'UTC') at time zone 'UTC'")
    for part in await partitions.listed(owner, partitions.BODIES):
        if part.lower > today + timedelta(days=days):
            await owner.execute(f'drop table "{part.name}"')


async def test_health_and_the_metric_say_how_many_days_are_left_and_warn(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Health (the admin's view) and effect_gateway_partition_days_left show two weeks of partitions ahead;
    with three days left both warn, the log too when making them fails, and readiness stays up; with
    none left the gateway makes them, and is down only while it cannot."""
    owner = await asyncpg.connect(dsn)
    caplog.set_level(logging.INFO, logger="effect_gateway")
    try:
        async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
            await _first_round_done(caplog)
            status, doc, gauge = await _days_left(http, gw.admin_url)
            assert (status, doc["status"], "warnings" in doc) == (200, "ok", False)
            assert doc["partitions"]["days_left"] >= partitions.BODY_DAYS_AHEAD
            assert gauge["effect_bodies"] >= partitions.BODY_DAYS_AHEAD
            assert gauge["effects"] >= 28  # the current month and the next

            await _drop_bodies_days_after(owner, 2)  # today and two more: under three days left
            status, doc, gauge = await _days_left(http, gw.admin_url)
            assert (status, doc["status"]) == (200, "warning")
            # Health rounds to a hundredth of a day: in the last quarter hour before midnight (UTC)
            # today's fraction rounds away, and "today and two more" reads 2.0.
            assert 2 <= doc["partitions"]["days_left"] <= 3
            (warning,) = doc["warnings"]
            assert warning.startswith("the partitions for new rows run out in ")
            assert 2 < gauge["effect_bodies"] <= 3

            # The maintenance round cannot make them (the table held past the 250 ms it waits): it warns.
            async with owner.transaction():
                await owner.execute("lock table effect_bodies in share update exclusive mode")
                async with opened(runtime_url(dsn)) as store:
                    await store.maintain(RETENTION)
            assert any("the partitions for new rows run out in" in r.getMessage() for r in caplog.records)

            await _drop_bodies_days_after(owner, -1)  # not even today's: health makes them
            status, doc, gauge = await _days_left(http, gw.admin_url)
            assert (status, doc["status"]) == (200, "ok")
            assert doc["partitions"]["days_left"] >= partitions.BODY_DAYS_AHEAD

            await _drop_bodies_days_after(owner, -1)
            async with owner.transaction():  # and they cannot be made while another session holds the table
                await owner.execute("lock table effect_bodies in share update exclusive mode")
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(store_module, "PARTITIONS_WAIT", 0.5)
                    async with http.get(f"{gw.admin_url}/_gateway/health") as resp:
                        down = (resp.status, await resp.json())
            assert down[0] == 503
            assert down[1]["type"].endswith("/store-unavailable")
            async with http.get(f"{gw.admin_url}/_gateway/health") as resp:
                assert resp.status == 200, "up again once they can be made"
    finally:
        await partitions.make_ahead(owner)
        await owner.close()


async def test_gateways_making_a_missing_day_at_once_all_find_it_made(postgres_dsn: str) -> None:
    """Four runtime sessions that find today's day of bodies missing make it at once: each call succeeds
    (one makes it, the others find it made), so no write that waited on it loses its answer."""
    async with own_database(postgres_dsn, "making_at_once") as dsn:
        owner = await asyncpg.connect(dsn)
        sessions = [await asyncpg.connect(runtime_url(dsn)) for _ in range(4)]
        outcomes: list[str] = []
        try:
            for _ in range(5):
                today = await owner.fetchval(
                    "select 'effect_bodies_' || to_char(now() at time zone 'UTC', 'YYYY_MM_DD')"
                )
                await owner.execute(f'alter table effect_bodies detach partition "{today}"')
                await owner.execute(f'drop table "{today}"')
                start = asyncio.Event()

                async def make(conn: asyncpg.Connection, start: asyncio.Event) -> str:
                    await start.wait()
                    try:
                        return "made" if await partitions.make_ahead(conn) else "lock held"
                    except asyncpg.PostgresError as exc:
                        return type(exc).__name__

                calls = [asyncio.create_task(make(conn, start)) for conn in sessions]
                await asyncio.sleep(0.05)
                start.set()
                outcomes += await asyncio.gather(*calls)
        finally:
            for conn in (owner, *sessions):
                await conn.close()
    assert set(outcomes) == {"made"}, outcomes


async def test_an_owner_that_is_no_superuser_migrates_grants_and_purges_as_on_a_managed_service(
    postgres_dsn: str,
    upstream: Upstream,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    run: Callable[..., Done],
) -> None:
    """The owner a managed service gives: an ordinary role (not a superuser, no CREATEROLE, CREATEDB or
    REPLICATION) that owns its database. It migrates, with no extension, grants the runtime role, and
    purges; the gateway serves as the runtime role. The runtime role's grants are checked above."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    owner, database = f"effect_gateway_test_owner_{worker}", f"managed_{worker}"
    admin = await asyncpg.connect(postgres_dsn)
    try:
        await admin.execute(f"drop database if exists {database} with (force)")
        await admin.execute(f"drop role if exists {owner}")
        await admin.execute(f"create role {owner} login password 'owner-of-the-tests' nocreaterole")
        await admin.execute(f"create database {database} owner {owner}")
        parts = urlsplit(other_database(postgres_dsn, database))
        where = parts.netloc.rpartition("@")[2]
        owner_url = urlunsplit(parts._replace(netloc=f"{owner}:owner-of-the-tests@{where}"))
        config = tmp_path / "owner.toml"
        config.write_text(f'database_url = "{owner_url}"\n')
        granted = await in_thread(run, "migrate", "--grant-to", runtime_role()[0], config=config)
        assert granted.status == 0, granted.err
        conn = await asyncpg.connect(owner_url)
        try:
            held = await conn.fetchrow(
                "select rolsuper, rolcreaterole, rolcreatedb, rolreplication from pg_roles "
                "where rolname = current_user"
            )
            assert held is not None
            assert not any(held.values())
            assert await conn.fetch("select extname from pg_extension where extname <> 'plpgsql'") == []
        finally:
            await conn.close()
        shop = {"shop": {"base_url": upstream.url}}
        async with gateway_server(owner_url, upstreams=shop) as gw:
            first = await order(http, gw.url, "managed:1")
            assert first[0] == 201
            assert (await order(http, gw.url, "managed:1"))[2] == first[2]
        purged = await in_thread(run, "purge", config=config)
        assert purged.status == 0, purged.err
        assert len(upstream.effects()) == 1
    finally:
        await admin.execute(f"drop database if exists {database} with (force)")
        await admin.execute(f"drop role if exists {owner}")
        await admin.close()
