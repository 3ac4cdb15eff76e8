"""The test Postgres: a database per worker, the runtime role, and reading or changing rows by hand."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import asyncpg

from gateway import packing
from gateway.decision import review as review_move
from gateway.record import EffectRecord
from gateway.schema import grant_to
from gateway.store import Store, opened
from tests.factories import new_effect

# The role the suite's gateways run with: made by tests/conftest.py (unless TEST_RUNTIME_DATABASE_URL
# names one made beforehand) and granted what docs/operations.md says serve needs, by the code behind
# `effect-gateway migrate --grant-to`, and nothing else: a statement that needs more fails in the suite.
RUNTIME_ROLE = "effect_gateway_test_runtime"


RUNTIME_PASSWORD = "runtime-of-the-tests"  # a test server's role, reachable only from this machine


def runtime_role() -> tuple[str, str]:
    """The runtime role's name and password: TEST_RUNTIME_DATABASE_URL's user, else the suite's own."""
    given = os.environ.get("TEST_RUNTIME_DATABASE_URL")
    if not given:
        return RUNTIME_ROLE, RUNTIME_PASSWORD
    parts = urlsplit(given)
    if not parts.username:
        raise RuntimeError("TEST_RUNTIME_DATABASE_URL names no user")
    return unquote(parts.username), unquote(parts.password or "")


def runtime_url(dsn: str) -> str:
    """``dsn``'s database as the runtime role reaches it: the same server and database, its own login."""
    user, password = runtime_role()
    return with_login(dsn, f"{quote(user, safe='')}:{quote(password, safe='')}")


def with_login(url: str, login: str) -> str:
    """``url`` with ``login`` (``user:password``, escaped) in place of its own."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{login}@{parts.netloc.rpartition('@')[2]}"))


async def worker_database(dsn: str, worker: str, *, drop: bool = False) -> str:
    """The URL of a database of its own for one pytest-xdist ``worker``, made empty beside ``dsn``'s (or
    dropped, with ``drop``)."""
    parts = urlsplit(dsn)
    name = f"{unquote(parts.path.lstrip('/')) or parts.username}_{worker}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'drop database if exists "{name}" with (force)')
        if not drop:
            await conn.execute(f'create database "{name}"')
    finally:
        await conn.close()
    return urlunsplit(parts._replace(path="/" + quote(name, safe="")))


async def grant_runtime(dsn: str) -> None:
    """The runtime role granted what serve needs in ``dsn``'s database (migrated), as its owner grants it;
    made first (login, password) unless TEST_RUNTIME_DATABASE_URL names one, which takes the right to
    make roles (superuser or CREATEROLE)."""
    user, password = runtime_role()
    if not os.environ.get("TEST_RUNTIME_DATABASE_URL"):
        conn = await asyncpg.connect(dsn)
        try:
            exists = await conn.fetchval("select exists (select from pg_roles where rolname = $1)", user)
            # The password is a literal: a role's password cannot be a statement's parameter.
            how = f"login password '{password}'"
            try:
                await conn.execute(f"{'alter' if exists else 'create'} role {user} {how}")
            except asyncpg.exceptions.DuplicateObjectError:
                # Another pytest-xdist worker made it meanwhile (roles belong to the whole server).
                await conn.execute(f"alter role {user} {how}")
        except asyncpg.exceptions.InsufficientPrivilegeError as exc:
            raise RuntimeError(
                f"the tests' database user may not make the role {user} ({exc}): give it CREATEROLE, or make "
                "a role with login and a password and name it in TEST_RUNTIME_DATABASE_URL"
            ) from None
        finally:
            await conn.close()
    await grant_to(dsn, user)


async def empty_effects(dsn: str) -> None:
    """No effects at all, and ids from 1 again: each test starts from an empty audit."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "truncate effects, effect_keys, effect_bodies, open_effects, effect_gateway_alarms, "
            "unchained, audit_chain, chained_tenants, audit_heads, effect_notifications; "
            "alter sequence effect_ids restart"
        )
    finally:
        await conn.close()


def other_database(dsn: str, name: str) -> str:
    """The same server as ``dsn``, another database (for tests that must not touch the shared one)."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


@dataclass
class FailingDatabase:
    """A migrated database of its own on the test server, whose sessions a test can cut and restore."""

    dsn: str
    name: str
    admin: asyncpg.Connection

    async def cut(self) -> None:
        """The database goes away for its clients: their sessions are cut and new ones refused."""
        await self.admin.execute(f"alter database {self.name} allow_connections false")
        await self.admin.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity where datname = $1", self.name
        )

    async def restore(self) -> None:
        await self.admin.execute(f"alter database {self.name} allow_connections true")


@asynccontextmanager
async def failing_database(server_dsn: str, name: str) -> AsyncIterator[FailingDatabase]:
    from gateway.schema import migrate

    admin = await asyncpg.connect(server_dsn)
    await admin.execute(f"drop database if exists {name}")
    await admin.execute(f"create database {name}")
    db = FailingDatabase(other_database(server_dsn, name), name, admin)
    await migrate(db.dsn)
    await grant_runtime(db.dsn)
    try:
        yield db
    finally:
        await db.restore()
        await admin.execute(f"drop database {name} with (force)")
        await admin.close()


def _unpacked(row: dict[str, Any], *pairs: str) -> dict[str, Any]:
    """``row`` with each body of the (coding column, body column) ``pairs`` as it was sent."""
    for coding, body in zip(pairs[::2], pairs[1::2], strict=True):
        stored_as = row.pop(coding, None)
        if stored_as is not None and row[body] is not None:
            row[body] = packing.unpack(stored_as, bytes(row[body]))
    return row


async def effect_rows(dsn: str) -> list[dict[str, Any]]:
    """Every effect's audit row, with the request and the response on record (None once purged)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        rows = await conn.fetch(
            """
            select e.*, q.headers as request_headers, q.coding as request_coding, q.content as request_body,
                   r.headers as response_headers, r.coding as response_coding, r.content as response_body
            from effects e
            left join effect_bodies r
                on r.effect_id = e.id and r.kind = 'response' and r.stored_at = e.response_at
            left join lateral (select headers, coding, content from effect_bodies q
                               where q.effect_id = e.id and q.kind = 'request'
                               order by stored_at desc limit 1) q on true
            order by e.id
            """
        )
        pairs = ("request_coding", "request_body", "response_coding", "response_body")
        return [_unpacked(dict(row), *pairs) for row in rows]
    finally:
        await conn.close()


async def database_text(dsn: str) -> str:
    """Everything the effect tables hold (audit rows, keys, bodies), as one string to search for secrets."""
    conn = await asyncpg.connect(dsn)
    try:
        # Bodies as they were sent: a secret in a deflated body would not show in its stored bytes.
        rows = [
            _unpacked(dict(row), "coding", "content")
            for table in ("effects", "effect_keys", "effect_bodies", "open_effects")
            for row in await conn.fetch(f"select * from {table}")
        ]
    finally:
        await conn.close()
    return json.dumps(rows, default=lambda v: v.hex() if isinstance(v, bytes) else str(v))


# The retention drops bodies a week after they are stored; tests move them ten days back and purge as
# the tables' owner (the suite's gateways run as the runtime role, which leaves the retention to the
# owner), and keep no copies in memory, which would outlive the move.
RETAINED: dict[str, Any] = {"retention": "7d", "replay_cache_bytes": 0}


async def purge_as_owner(dsn: str, retention: timedelta = timedelta(days=7)) -> None:
    """What `effect-gateway purge` run by the tables' owner does: the days of bodies past ``retention``
    dropped (``dsn``: the owner's URL)."""
    async with opened(dsn) as store:
        await store.maintain(retention, purge=True)


async def backdate_bodies(dsn: str, days: int = 10) -> None:
    """Time passes for the stored bodies: they move ``days`` back, into a day the retention will drop."""
    from gateway import partitions
    from gateway.store import MAINTENANCE_LOCK

    conn = await asyncpg.connect(dsn)
    try:
        # The day the oldest body moves to (bodies backdated before move further back).
        past = await conn.fetchval(
            "select coalesce(min(stored_at), now()) - $1 * interval '1 day' from effect_bodies", days
        )
        # A day a gateway left half detached takes no rows: finish it as the next retention would,
        # as the maintainer (a running gateway's round may be finishing the same day).
        await conn.execute("select pg_advisory_lock($1)", MAINTENANCE_LOCK)
        try:
            await partitions.finish_interrupted(conn)
        finally:
            await conn.execute("select pg_advisory_unlock($1)", MAINTENANCE_LOCK)
        latest = await conn.fetchval("select now() - $1 * interval '1 day'", days)
        async with conn.transaction():
            # No detach (of a running gateway's retention) between making the days and filling them:
            # it would drop a day made here, still empty, as past the retention.
            await conn.execute("lock table effect_bodies in share update exclusive mode")
            # Every day the bodies move into: ensure makes a day and the days ahead of it.
            while past <= latest:
                if not await partitions.ensure(conn, past):
                    raise RuntimeError("the days to backdate into could not be made")
                past += timedelta(days=partitions.BODY_DAYS_AHEAD)
            # ensure's short lock wait outlives its savepoint: the updates wait for a gateway's rows.
            await conn.execute("set local lock_timeout = '10s'")
            await conn.execute("update effect_bodies set stored_at = stored_at - $1 * interval '1 day'", days)
            # The attempt that stored an answer moves with it: the answer stays its attempt's own
            # (stored since its claim), as when time really passes.
            await conn.execute(
                """
                update effects set response_at = response_at - $1 * interval '1 day',
                    last_sent_at = case when last_sent_at <= response_at
                                        then last_sent_at - $1 * interval '1 day' else last_sent_at end
                where response_at is not null
                """,
                days,
            )
    finally:
        await conn.close()


async def effect(dsn: str, *keys: str, review: bool = False, upstream: str = "shop") -> list[EffectRecord]:
    """Real effect records, written by the store as the gateway writes them (pending, or in review)."""
    records = []
    async with opened(dsn) as store:
        for key in keys:
            records.append(await claim_effect(store, key, review, upstream))
    return records


async def claim_effect(store: Store, key: str, review: bool, upstream: str) -> EffectRecord:
    new = new_effect(
        key,
        upstream=upstream,
        derived_key=f"dk-{key}",
        request_body=b'{"items":["atta"]}',
        run_id="run-1",
        step="4",
    )
    record, _ = await store.claim(new, timedelta(seconds=0) if review else timedelta(seconds=30))
    assert record is not None
    if review:
        reviewed = await store.send_to_review(record, review_move(record), "a test put it here")
        assert reviewed is not None
        record = reviewed
    return record
