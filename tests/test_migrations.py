"""Schema migrations: versioned, applied once, safe when several replicas start at the same moment."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from gateway import partitions, schema
from gateway.audit_query import EffectFilter
from gateway.cli import FIX, main
from gateway.decision import settle
from gateway.errors import SchemaNewer, StoreRejected, StoreUnavailable
from gateway.keys import key_digest
from gateway.outcome import Answered
from gateway.record import EffectRecord, NewEffect
from gateway.schema import migrate, migration_files
from gateway.states import State
from gateway.store import opened
from tests.database import effect_rows, other_database
from tests.factories import new_effect
from tests.support import ROOT

# The newest migration: what `migrate` brings a database to.
LATEST = migration_files()[-1][0]


@asynccontextmanager
async def own_database(postgres_dsn: str, name: str) -> AsyncIterator[str]:
    """A database of its own on the test server (empty: the test migrates it), dropped afterwards."""
    admin = await asyncpg.connect(postgres_dsn)
    try:
        await admin.execute(f"drop database if exists {name}")
        await admin.execute(f"create database {name}")
        yield other_database(postgres_dsn, name)
    finally:
        await admin.execute(f"drop database if exists {name} with (force)")
        await admin.close()


async def test_replicas_starting_at_once_apply_each_migration_exactly_once(postgres_dsn: str) -> None:
    """Eight concurrent migrate() calls on a fresh database: no error, each version recorded once."""
    async with own_database(postgres_dsn, "replicas") as dsn:
        results = await asyncio.gather(*(migrate(dsn) for _ in range(8)))
        applied = [names for names in results if names]
        assert applied == [[name for _, name, _ in migration_files()]], "exactly one replica applied them"
        conn = await asyncpg.connect(dsn)
        try:
            versions = await conn.fetch("select version from effect_gateway_migrations order by version")
            assert [r["version"] for r in versions] == [v for v, _, _ in migration_files()]
            assert await conn.fetchval("select count(*) from effects") == 0
        finally:
            await conn.close()
        assert await migrate(dsn) == []  # and a later start has nothing to do


@pytest.mark.parametrize(
    ("statement", "refused"),
    [
        # A replay's read of the response, and a claim's write of the request, as a gateway before 009
        # wrote them: each must fail rather than hand on a deflated body or store one without its coding.
        (
            "select headers, body from effect_bodies where effect_id = 1",
            asyncpg.UndefinedColumnError,
        ),
        (
            "insert into effect_bodies (effect_id, stored_at, kind, headers, body)"
            " values (1, now(), 'request', '', '{}')",
            asyncpg.UndefinedColumnError,
        ),
        (
            "insert into effect_bodies (effect_id, stored_at, kind, headers, content)"
            " values (1, now(), 'request', '', '{}')",
            asyncpg.NotNullViolationError,
        ),
    ],
    ids=["read", "write", "write-without-coding"],
)
async def test_a_gateway_from_before_deflated_bodies_fails_instead_of_misreading_them(
    postgres_dsn: str, statement: str, refused: type[Exception]
) -> None:
    """Beside a newer gateway (a rolling upgrade), an older one's statements on bodies are errors."""
    conn = await asyncpg.connect(postgres_dsn)
    try:
        with pytest.raises(refused):
            await conn.execute(statement)
    finally:
        await conn.close()


async def test_a_database_migrated_by_a_newer_gateway_is_refused(
    postgres_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollback past a migration stops at start, in one line naming both versions, and changes nothing."""
    async with own_database(postgres_dsn, "rolled_back") as dsn:
        await migrate(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "insert into effect_gateway_migrations (version, name) values (99, '099_next.sql')"
            )
            with pytest.raises(SchemaNewer, match=r"at migration 99, newer than this gateway's last \(\d+_"):
                await migrate(dsn)
            monkeypatch.setenv("EFFECT_GATEWAY_DATABASE_URL", dsn)
            assert await asyncio.to_thread(main, ["migrate"]) != 0
            [line] = capsys.readouterr().err.splitlines()
            assert line.startswith("effect-gateway: the database's schema is at migration 99, newer than")
            assert (
                await conn.fetchval("select count(*) from effect_gateway_migrations")
                == len(migration_files()) + 1
            )
        finally:
            await conn.close()


async def before_010(conn: asyncpg.Connection) -> None:
    """The schema as it was before migration 010, which is pending again with those after it."""
    await conn.execute("delete from effect_gateway_migrations where version >= 10")
    await conn.execute("alter table open_effects drop column upstream")
    await conn.execute("alter table effect_bodies rename column content to body")
    await conn.execute("alter table effect_bodies alter column coding set default ''")


async def test_a_migration_that_fails_is_one_line_naming_it_and_applies_nothing(
    postgres_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema changed by hand under a pending migration: `migrate` names the migration and why in one
    line, exits asking for a fix, and what its first statement did is undone with the rest."""
    async with own_database(postgres_dsn, "by_hand") as dsn:
        await migrate(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            # Changed by hand since: 010's rename works, its second statement fails.
            await before_010(conn)
            await conn.execute("alter table effect_bodies drop column coding")
            monkeypatch.setenv("EFFECT_GATEWAY_DATABASE_URL", dsn)
            assert await asyncio.to_thread(main, ["migrate"]) == FIX
            [line] = capsys.readouterr().err.splitlines()
            assert line.startswith(
                "effect-gateway: migration 010_body_content.sql failed, and nothing of it was applied: "
                'UndefinedColumnError: column "coding" of relation "effect_bodies" does not exist'
            ), line
            columns = await conn.fetch(
                "select attname from pg_attribute where attrelid = 'effect_bodies'::regclass and attnum > 0"
                " and not attisdropped"
            )
            assert "body" in {r["attname"] for r in columns}, "the rename was undone"
            assert await conn.fetchval("select max(version) from effect_gateway_migrations") == 9
        finally:
            await conn.close()


async def test_a_migration_cut_off_by_postgres_asks_to_try_again_and_applies_nothing(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration waiting for a lock whose session an operator ends: StoreUnavailable (the command may
    work later, exit 75), not a traceback, and the migration is still pending."""
    monkeypatch.setattr(schema, "MIGRATION_LOCK_WAIT", "30s")  # ended by the operator, not by its wait
    async with own_database(postgres_dsn, "cut_off") as dsn:
        await migrate(dsn)
        holder = await asyncpg.connect(dsn)
        watcher = await asyncpg.connect(dsn)
        try:
            await before_010(holder)
            async with holder.transaction():
                await holder.execute("lock table effect_bodies in access exclusive mode")
                migrating = asyncio.create_task(migrate(dsn))
                for _ in range(100):  # until it waits for the lock
                    # Asked outside the holder's transaction, in which pg_stat_activity stays as first read.
                    waiting = await watcher.fetchval(
                        "select pid from pg_stat_activity"
                        " where datname = 'cut_off' and wait_event_type = 'Lock'"
                    )
                    if waiting is not None:
                        break
                    await asyncio.sleep(0.05)
                assert waiting is not None, "migrate never waited for the lock"
                await holder.execute("select pg_terminate_backend($1)", waiting)
                with pytest.raises(
                    StoreUnavailable, match=r"migration 010_body_content\.sql was interrupted"
                ):
                    await migrating
            assert await holder.fetchval("select max(version) from effect_gateway_migrations") == 9
        finally:
            await watcher.close()
            await holder.close()


async def test_a_migration_behind_a_long_transaction_gives_up_and_lets_the_queue_behind_it_go_on(
    postgres_dsn: str,
) -> None:
    """A report holds a table open: the migration waits a bounded time for its lock and then steps
    aside, so that the gateways' statements queued behind it go on while the report still runs; it asks
    to be run again and is still pending."""
    async with own_database(postgres_dsn, "long_report") as dsn:
        await migrate(dsn)
        report = await asyncpg.connect(dsn)
        watcher = await asyncpg.connect(dsn)
        gateway = await asyncpg.connect(dsn)
        try:
            await before_010(report)
            async with report.transaction():
                await report.fetch("select * from effect_bodies limit 1")  # its lock held to the end
                migrating = asyncio.create_task(migrate(dsn))
                for _ in range(100):  # until the migration waits for its lock
                    waiting = await watcher.fetchval(
                        "select pid from pg_stat_activity"
                        " where datname = 'long_report' and wait_event_type = 'Lock'"
                    )
                    if waiting is not None:
                        break
                    await asyncio.sleep(0.02)
                assert waiting is not None, "migrate never waited for the lock"
                # A gateway's read queues behind the migration's lock request: it completes (once the
                # migration has stepped aside) while the report is still open.
                await gateway.execute("set statement_timeout = '30s'")
                assert await gateway.fetchval("select count(*) from effect_bodies") == 0
                with pytest.raises(StoreUnavailable, match=r"010_body_content\.sql gave up .* run it again"):
                    await migrating
                assert not report.is_closed()
            assert await watcher.fetchval("select max(version) from effect_gateway_migrations") == 9
        finally:
            await gateway.close()
            await watcher.close()
            await report.close()


async def test_migrate_behind_a_lock_on_its_own_table_gives_up_in_one_line(
    postgres_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session holding the migrations' own table: `migrate` gives up after its wait, in one line that
    asks to run it again (exit 75), instead of waiting for ever with every replica queued behind it."""
    async with own_database(postgres_dsn, "table_held") as dsn:
        await migrate(dsn)
        holder = await asyncpg.connect(dsn)
        try:
            async with holder.transaction():
                await holder.execute("lock table effect_gateway_migrations in access exclusive mode")
                monkeypatch.setenv("EFFECT_GATEWAY_DATABASE_URL", dsn)
                assert await asyncio.to_thread(main, ["migrate"]) == 75
        finally:
            await holder.close()
    assert capsys.readouterr().err.splitlines() == [
        "effect-gateway: migrating gave up after waiting 500ms for a lock on effect_gateway_migrations or "
        "its schema that another session holds (see pg_stat_activity); nothing was applied: run it again"
    ]


async def test_an_effects_table_with_rows_migrates_to_the_partitioned_layout(postgres_dsn: str) -> None:
    """Rows of the first layout (60 days, bodies kept or purged) keep their keys, bodies and replays."""
    async with own_database(postgres_dsn, "upgraded") as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
            version, name, first = migration_files()[0]
            await conn.execute(first)
            await conn.execute(
                "create table effect_gateway_migrations (version integer primary key, name text not null,"
                " applied_at timestamptz not null default now())"
            )
            await conn.execute(
                "insert into effect_gateway_migrations (version, name) values ($1, $2)", version, name
            )
            # The first layout: headers as [name, value] pairs in jsonb, bodies in the row.
            await conn.executemany(
                """
                insert into effects (tenant, upstream, key, derived_key, method, path, fingerprint,
                    request_headers, request_body, state, attempt, may_have_sent, response_status,
                    response_headers, response_body, created_at, completed_at, purged_at, history)
                values ($1, 'shop', $2, 'eg_' || $2, 'POST', '/orders', 'fp-' || $2, $3, $4, $5, 1, true,
                    $6, $7, $8, now() - $9 * interval '1 day', $10, $11, '[{"event": "claimed"}]')
                """,
                [
                    (
                        f"t{n % 2}",
                        f"k{n}",
                        {"Content-Type": "application/json"},
                        None if n < 40 else b'{"n": %d}' % n,
                        "completed" if n % 10 else "needs_review",
                        201 if n % 10 else None,
                        [["Content-Type", "application/json"], ["Set-Later", "a"], ["Set-Later", "b"]]
                        if n % 10 and n >= 40
                        else None,
                        b'{"order": %d}' % n if n % 10 and n >= 40 else None,
                        60 - n,
                        None if n % 10 == 0 else datetime.now(UTC),
                        datetime.now(UTC) if n < 40 and n % 10 else None,
                    )
                    for n in range(60)
                ],
            )
        finally:
            await conn.close()
        applied = await migrate(dsn)
        assert applied == [name for _, name, _ in migration_files()[1:]]
        rows = {row["key"]: row for row in await effect_rows(dsn)}
        conn = await asyncpg.connect(dsn)
        try:
            keys = await conn.fetchval("select count(*) from effect_keys")
            months = await conn.fetchval(
                "select count(*) from pg_inherits where inhparent = 'effects'::regclass"
            )
        finally:
            await conn.close()
    assert (len(rows), keys) == (60, 60)
    assert months >= 3  # 60 days back to today span at least three months
    kept = rows["k45"]
    assert (kept["state"], kept["response_status"], kept["derived_key"]) == ("completed", 201, "eg_k45")
    assert kept["response_body"] == b'{"order": 45}'
    assert kept["response_headers"] == b"Content-Type: application/json\r\nSet-Later: a\r\nSet-Later: b"
    assert kept["request_body"] == b'{"n": 45}'
    assert kept["request_headers"] == b"Content-Type: application/json"
    purged = rows["k15"]
    assert (purged["state"], purged["response_status"], purged["response_body"]) == ("completed", 201, None)
    assert rows["k20"]["state"] == "needs_review"


def _retry(tenant: str, key: str, upstream: str = "shop") -> NewEffect:
    return new_effect(key, tenant=tenant, upstream=upstream, fingerprint="fp-" + key)


async def _migrated_to(dsn: str, last: int) -> None:
    """The migrations up to version ``last`` applied, as a gateway of that version left them."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "create table effect_gateway_migrations (version integer primary key, name text not null,"
            " applied_at timestamptz not null default now())"
        )
        for version, name, sql in migration_files():
            if version <= last:
                async with conn.transaction():
                    await conn.execute(sql)
                    await conn.execute(
                        "insert into effect_gateway_migrations (version, name) values ($1, $2)", version, name
                    )
        await partitions.ensure(conn)
    finally:
        await conn.close()


async def test_effects_of_the_partitioned_layout_keep_their_keys_lists_and_counts_after_the_upgrade(
    postgres_dsn: str,
) -> None:
    """Effects stored under 003 are found by their keys, listed and counted by state, and settle as before."""
    admin = await asyncpg.connect(postgres_dsn)
    await admin.execute("drop database if exists upgraded_open")
    await admin.execute("create database upgraded_open")
    dsn = other_database(postgres_dsn, "upgraded_open")
    states = ["completed", "completed", "pending", "in_doubt", "needs_review", "needs_review", "completed"]
    upstreams = ["shop", "shop", "shop", "shop", "shop", "mail", "mail"]
    try:
        await _migrated_to(dsn, 3)
        conn = await asyncpg.connect(dsn)
        try:
            for n, state in enumerate(states):
                await partitions.ensure(conn, datetime.now(UTC) - timedelta(days=n))
                await conn.execute(
                    """
                    with k as (
                        insert into effect_keys (tenant, upstream, key, effect_id, created_at)
                        values ($1, $5, $2, nextval('effect_ids'), now() - $4 * interval '1 day')
                        returning effect_id, created_at
                    ), e as (
                        insert into effects (id, created_at, tenant, upstream, key, derived_key, method,
                            path, fingerprint, state, attempt, may_have_sent, lease_expires_at,
                            response_status, response_at, completed_at, history)
                        select effect_id, created_at, $1, $5, $2, 'eg_' || $2, 'POST', '/orders',
                            'fp-' || $2, $3, 1, true, created_at,
                            case when $3 = 'completed' then 201 end,
                            case when $3 = 'completed' then created_at end,
                            case when $3 = 'completed' then created_at end, '[{"event": "claimed"}]'
                        from k
                    )
                    insert into effect_bodies (effect_id, stored_at, kind, headers, body)
                    select effect_id, created_at, 'request', '', '{}' from k
                    """,
                    f"t{n % 2}",
                    f"k{n}",
                    state,
                    n,
                    upstreams[n],
                )
            index = await conn.fetchval("select to_regclass('effects_open')")
            assert index is not None, "migration 003 made the open-state index that 004 replaces"
        finally:
            await conn.close()
        assert await migrate(dsn) == [name for version, name, _ in migration_files() if version > 3]
        async with opened(dsn) as store:
            for n, state in enumerate(states):
                retry = _retry(f"t{n % 2}", f"k{n}", upstreams[n])
                again, created = await store.claim(retry, timedelta(seconds=30))
                assert again is not None
                assert (again.key, again.state.value, created) == (f"k{n}", state, False)
                full = await store.get(again.id)
                assert full is not None
                assert full.request_body == b"{}", "a body stored before 009 reads back as it was"
            assert [r.key for r in await store.find(EffectFilter(key="k3"))] == ["k3"]
            assert await store.state_counts() == {
                "pending": 1,
                "completed": 3,
                "retryable": 0,
                "in_doubt": 1,
                "needs_review": 2,
            }
            assert await store.state_counts("t0") == {
                "pending": 1,
                "retryable": 0,
                "in_doubt": 0,
                "needs_review": 1,
            }
            review = await store.find(EffectFilter(state=State.NEEDS_REVIEW))
            assert [r.key for r in review] == ["k5", "k4"]
            mail = await store.find(EffectFilter(state=State.NEEDS_REVIEW, upstream="mail"))
            assert [r.key for r in mail] == ["k5"], "011 gives each open effect its upstream"
            shop = await store.find(EffectFilter(tenant="t0", state=State.NEEDS_REVIEW, upstream="shop"))
            assert [r.key for r in shop] == ["k4"]
            [pending] = await store.find(EffectFilter(state=State.PENDING))
            record = await store.reread(pending)
            done = settle(Answered(201, (), b"{}"), earlier_doubt=True)
            assert await store.settle(record, done, response=None, recovered_by="probe") is not None
            assert await store.find(EffectFilter(state=State.PENDING)) == []
            assert (await store.state_counts())["completed"] == 4
            fresh, created = await store.claim(_retry("t0", "k-new"), timedelta(seconds=30))
            assert created
            assert fresh is not None
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("select to_regclass('effects_open')") is None
        finally:
            await conn.close()
    finally:
        await admin.execute("drop database upgraded_open with (force)")
        await admin.close()


async def _open_in_january(conn: asyncpg.Connection, key: str, upstream: str) -> None:
    """An effect waiting for review since January 2025, as a gateway at migration 010 wrote it."""
    await conn.execute(
        """
        with k as (
            insert into effect_keys (digest, tenant, upstream, effect_id, created_at)
            values (effect_key_digest($1), 'default', $2, nextval('effect_ids'), '2025-01-15 10:00+00')
            returning effect_id, created_at
        ), e as (
            insert into effects (id, created_at, tenant, upstream, key, derived_key, method, path,
                                 fingerprint, state, attempt, may_have_sent, lease_expires_at, history)
            select effect_id, created_at, 'default', $2, $1, 'eg_' || $1, 'POST', '/orders', 'fp',
                   'needs_review', 2, true, created_at, '[]'::jsonb from k
        )
        insert into open_effects (state, id, created_at, tenant)
        select 'needs_review', effect_id, created_at, 'default' from k
        """,
        key,
        upstream,
    )


async def test_011_upgrades_a_database_whose_month_was_archived_with_effects_still_open(
    postgres_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A month of the audit archived as the operations guide says, with two effects of it still waiting
    for review: 011 takes the upstream of the one whose key was kept from the key; for the one whose key
    was deleted too, `migrate` says in one line how many such effects there are and what to do, and
    applies nothing until they are dealt with.

    011 took each open effect's upstream from its audit row only, and failed on a null with Postgres's
    words alone: the upgrade was blocked, and the message named neither the rows nor a way out.
    """
    async with own_database(postgres_dsn, "archived_open") as dsn:
        await _migrated_to(dsn, 10)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "create table effects_2025_01 partition of effects"
                " for values from ('2025-01-01') to ('2025-02-01')"
            )
            await _open_in_january(conn, "kept", "mail")
            await _open_in_january(conn, "lost", "shop")
            await conn.execute("delete from effect_keys where upstream = 'shop'")
            await conn.execute("alter table effects detach partition effects_2025_01 concurrently")
            await conn.execute("drop table effects_2025_01")
            monkeypatch.setenv("EFFECT_GATEWAY_DATABASE_URL", dsn)
            assert await asyncio.to_thread(main, ["migrate"]) == FIX
            [line] = capsys.readouterr().err.splitlines()
            assert "open effects with neither an audit row nor a key: 1 (" in line, line
            assert "delete those rows if you know how each ended" in line, line
            assert await conn.fetchval("select max(version) from effect_gateway_migrations") == 10
            await conn.execute(
                "delete from open_effects o"
                " where not exists (select from effect_keys k where k.effect_id = o.id)"
            )
            assert await asyncio.to_thread(main, ["migrate"]) == 0
            assert await conn.fetch("select upstream, state from open_effects") == [("mail", "needs_review")]
        finally:
            await conn.close()
        async with opened(dsn) as store:
            assert (await store.state_counts())["needs_review"] == 1


async def test_013_builds_the_index_again_when_one_built_beforehand_was_left_unfinished(
    postgres_dsn: str,
) -> None:
    """The audit's index by tenant and upstream begun by hand (operations.md's way without blocking) and
    left with a month unattached is invalid, which Postgres never reads: 013 builds it whole."""
    async with own_database(postgres_dsn, "unfinished_013") as dsn:
        await migrate(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("delete from effect_gateway_migrations where version = 13")  # 013 alone
            await conn.execute("drop index effects_tenant_upstream")
            await conn.execute(
                "create index effects_tenant_upstream on only effects (tenant, upstream, created_at, id)"
            )
            valid = "select indisvalid from pg_index where indexrelid = 'effects_tenant_upstream'::regclass"
            assert await conn.fetchval(valid) is False
            await migrate(dsn)
            assert await conn.fetchval(valid) is True
        finally:
            await conn.close()


async def test_the_key_digest_a_claim_computes_is_the_one_stored_rows_were_found_by(dsn: str) -> None:
    """A claim computes its key's digest itself; it is byte for byte what effect_key_digest() gave every
    row stored before (migration 005) and still gives the audit's search by key: a key claimed then is
    found now, not made a second effect."""
    keys = ["k", "run-1:4", "keyless:" + "f" * 32, "x" * 255, "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"]
    conn = await asyncpg.connect(dsn)
    try:
        for key in keys:
            assert await conn.fetchval("select effect_key_digest($1)", key) == key_digest(key), key
        async with opened(dsn) as store:
            first, created = await store.claim(new_effect("run-1:4"), timedelta(seconds=30))
            again, created_again = await store.claim(new_effect("run-1:4"), timedelta(seconds=30))
        found = await conn.fetchval(
            "select effect_id from effect_keys where scope = effect_key_digest($1)", "run-1:4"
        )
    finally:
        await conn.close()
    assert (created, created_again) == (True, False)
    assert first is not None
    assert again is not None
    assert found == first.id == again.id


async def _effect_at_019(conn: asyncpg.Connection, key: str, state: str, created_at: datetime) -> int:
    """An effect as a gateway at migration 019 wrote it: its key, audit row, request body, its answer
    when completed, and its open state otherwise."""
    return await conn.fetchval(
        """
        with k as (
            insert into effect_keys (digest, tenant, upstream, effect_id, created_at)
            values (effect_key_digest($1), 'default', 'shop', nextval('effect_ids'), $3)
            returning effect_id, created_at
        ), e as (
            insert into effects (id, created_at, tenant, upstream, key, derived_key, method, path,
                                 fingerprint, state, attempt, may_have_sent, lease_expires_at,
                                 response_status, response_at, completed_at)
            select effect_id, created_at, 'default', 'shop', $1, 'eg_' || $1, 'POST', '/orders', 'fp-' || $1,
                   $2, 1, true, created_at, case when $2 = 'completed' then 201 end,
                   case when $2 = 'completed' then created_at end,
                   case when $2 = 'completed' then created_at end
            from k
        ), b as (
            insert into effect_bodies (effect_id, stored_at, kind, headers, coding, content)
            select effect_id, created_at, kind, ''::bytea, '', convert_to('{"order": "' || $1 || '"}', 'UTF8')
            from k, unnest(case when $2 = 'completed' then array['request', 'response']
                                else array['request'] end) as kind
        ), o as (
            insert into open_effects (state, id, created_at, tenant, upstream)
            select $2, effect_id, created_at, 'default', 'shop' from k where $2 <> 'completed'
        )
        select effect_id from k
        """,
        key,
        state,
        created_at,
    )


async def test_020_gives_every_row_its_scope_and_the_gateway_answers_for_what_was_stored_before(
    postgres_dsn: str,
) -> None:
    """A database at 019 with a completed effect, one in doubt, and one waiting for review whose month
    was archived: 020 gives every row of each the digest of its key as its scope, in every primary key.
    The store then replays the completed one's answer as stored, finds the one in doubt by its key, and
    counts the archived one among those waiting for review."""
    async with own_database(postgres_dsn, "scoped") as dsn:
        await _migrated_to(dsn, 19)
        conn = await asyncpg.connect(dsn)
        try:
            now = await conn.fetchval("select now()")
            await _effect_at_019(conn, "done", "completed", now)
            await _effect_at_019(conn, "doubt", "in_doubt", now)
            january = datetime(2025, 1, 15, tzinfo=UTC)
            await partitions.ensure(conn, january)
            archived = await _effect_at_019(conn, "archived", "needs_review", january)
            await conn.execute("alter table effects detach partition effects_2025_01")
            await conn.execute("drop table effects_2025_01")
            await migrate(dsn)
            for table, key in (
                ("effects", "id, scope, created_at"),
                ("open_effects", "state, id, scope"),
                ("effect_bodies", "effect_id, kind, stored_at, scope"),
                ("effect_keys", "scope, tenant, upstream"),
            ):
                definition = await conn.fetchval(
                    "select pg_get_constraintdef(oid) from pg_constraint"
                    " where conrelid = $1::regclass and contype = 'p'",
                    table,
                )
                assert definition == f"PRIMARY KEY ({key})", table
            scoped = await conn.fetch(
                """
                select 'keys' as t, k.scope = effect_key_digest(e.key) as right
                from effect_keys k join effects e on e.id = k.effect_id
                union all select 'audit', scope = effect_key_digest(key) from effects
                union all select 'open', o.scope = k.scope
                from open_effects o join effect_keys k on k.effect_id = o.id
                union all select 'bodies', b.scope = k.scope
                from effect_bodies b join effect_keys k on k.effect_id = b.effect_id
                """
            )
            assert sorted((r["t"], r["right"]) for r in scoped) == sorted(
                [("keys", True)] * 2 + [("audit", True)] * 2 + [("open", True)] * 2 + [("bodies", True)] * 4
            )
        finally:
            await conn.close()
        done = await _replayed(dsn, "done")
        assert done.response is not None
        assert done.response.body == b'{"order": "done"}'
        async with opened(dsn) as store:
            doubt, created = await store.claim(_retry("default", "doubt"), timedelta(seconds=30))
            assert doubt is not None
            assert (doubt.state, created) == (State.IN_DOUBT, False)
            waiting = await store.find(EffectFilter(state=State.NEEDS_REVIEW))
            assert [record.id for record in waiting] == []  # its audit row was archived with its month
            assert (await store.state_counts())["needs_review"] == 1
            assert archived not in {done.id, doubt.id}


def _reattach_steps(month: str, lower: str, upper: str) -> list[str]:
    """The statements docs/operations.md gives for attaching a month archived before 020, for ``month``."""
    guide = (ROOT / "docs" / "operations.md").read_text()
    start = guide.rindex("```sh", 0, guide.index("alter table effects_2026_01 add column scope uuid"))
    block = guide[start : guide.index("```", start + 5)]
    steps = re.findall(r'^psql "\$DATABASE_URL" -c "(.*)"$', block, re.MULTILINE)
    assert len(steps) == 5, steps
    for shown, meant in (("2026_01", month), ("2026-01-01", lower), ("2026-02-01", upper)):
        steps = [step.replace(shown, meant) for step in steps]
    return steps


async def test_a_month_archived_before_020_attaches_again_as_the_guide_says(postgres_dsn: str) -> None:
    """A month detached at 019 and kept as a table attaches again after 020 by the guide's steps, and
    a retry of its effect's key is answered with the answer it had."""
    async with own_database(postgres_dsn, "reattached") as dsn:
        await _migrated_to(dsn, 19)
        conn = await asyncpg.connect(dsn)
        try:
            january = datetime(2025, 1, 15, tzinfo=UTC)
            await partitions.ensure(conn, january)
            await _effect_at_019(conn, "old", "completed", january)
            await conn.execute("alter table effects detach partition effects_2025_01")
            await migrate(dsn)
            for step in _reattach_steps("2025_01", "2025-01-01", "2025-02-01"):
                await conn.execute(step)
        finally:
            await conn.close()
        old = await _replayed(dsn, "old")
        assert old.response is not None
        assert old.response.body == b'{"order": "old"}'


async def _replayed(dsn: str, key: str) -> EffectRecord:
    """The record a retry of ``key`` (the default tenant's, at shop) finds: the one on record, not new."""
    async with opened(dsn) as store:
        record, created = await store.claim(_retry("default", key), timedelta(seconds=30))
    assert record is not None
    assert not created
    return record


async def test_020_waits_for_a_detach_left_half_done_to_be_finished(postgres_dsn: str) -> None:
    """A day of bodies whose detach was interrupted at 019 would miss 020's column and could never be
    finished after it: `migrate` says in one line which day and how to finish it, applies nothing,
    and migrates once it is finished."""
    async with own_database(postgres_dsn, "half_detached") as dsn:
        await _migrated_to(dsn, 19)
        conn = await asyncpg.connect(dsn)
        try:
            old = await conn.fetchval("select now() - interval '10 days'")
            await partitions.ensure(conn, old)
            await _effect_at_019(conn, "old-done", "completed", old)
            day = f"effect_bodies_{old:%Y_%m_%d}"
            # Interrupted between its two transactions: cancelled while a reader holds the table.
            reader = await asyncpg.connect(dsn)
            detacher = await asyncpg.connect(dsn)
            try:
                reading = reader.transaction(isolation="repeatable_read")
                await reading.start()
                await reader.fetchval("select count(*) from effect_bodies")
                detach = asyncio.create_task(
                    detacher.execute(f'alter table effect_bodies detach partition "{day}" concurrently')
                )
                for _ in range(100):
                    if await conn.fetchval(
                        "select inhdetachpending from pg_inherits where inhrelid = $1::regclass", day
                    ):
                        break
                    await asyncio.sleep(0.05)
                await conn.execute("select pg_cancel_backend($1)", detacher.get_server_pid())
                with pytest.raises(asyncpg.exceptions.QueryCanceledError):
                    await detach
                await reading.rollback()
            finally:
                await reader.close()
                await detacher.close()
            with pytest.raises(
                StoreRejected, match=f"a detach of {day} was interrupted .* effect-gateway purge"
            ):
                await migrate(dsn)
            assert await conn.fetchval("select max(version) from effect_gateway_migrations") == 19
            # What the earlier version's purge does with it (after carrying open effects' bodies).
            await conn.execute(f'alter table effect_bodies detach partition "{day}" finalize')
            await conn.execute(f'drop table "{day}"')
            await migrate(dsn)
            assert await conn.fetchval("select max(version) from effect_gateway_migrations") == LATEST
        finally:
            await conn.close()


async def test_022_applies_again_over_the_notifications_it_made(postgres_dsn: str) -> None:
    """A database restored with its notifications but an older migrations table migrates again without
    an error, and keeps what the webhook was told."""
    [(version, name, _)] = [m for m in migration_files() if m[1].startswith("022_")]
    async with own_database(postgres_dsn, "again_022") as dsn:
        await migrate(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                """insert into effect_notifications (scope, effect_id, event, attempt, state, tenant,
                       upstream, method, path, created_at, waiting_since, delivered_at)
                   values (gen_random_uuid(), 1, 'needs_review', 1, 'needs_review', 'default', 'shop',
                       'POST', '/orders', now(), now(), now())"""
            )
            await conn.execute("delete from effect_gateway_migrations where version = $1", version)
            assert await migrate(dsn) == [name]
            assert (
                await conn.fetchval(
                    "select count(*) from effect_notifications where delivered_at is not null"
                )
                == 1
            )
        finally:
            await conn.close()
