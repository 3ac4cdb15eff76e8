"""The schema: versioned migrations in gateway/migrations/*.sql, applied under an advisory lock.

``migrate`` is the owner's: it makes and changes the tables. ``ready`` is what every other command
runs at start: it checks that the schema is current and that the role has what serving needs, and
runs no DDL when it is, so that serve can run with a role of reads and writes only.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources

import asyncpg

from gateway import locks, partitions, roles
from gateway.errors import (
    NoSuchRole,
    PrivilegesMissing,
    SchemaBehind,
    SchemaNewer,
    StoreRejected,
    StoreUnavailable,
)
from gateway.pg_failures import FAILURES, connecting, kind

log = logging.getLogger("effect_gateway")

MIGRATION_LOCK = locks.MIGRATION
# How long a migration waits for a table's lock. While it waits, every statement on that table queues
# behind it: a long transaction (a report, a pg_dump) would stop the gateways on the table until it ended.
# Well below the gateways' own lock_timeout (2 s by default), so that a statement queued behind it still
# goes through; and below deadlock_timeout (1 s), as gateway.partitions explains for making partitions:
# a retention's detach waiting beside it could otherwise be the side Postgres aborts.
MIGRATION_LOCK_WAIT = "500ms"


def migration_files() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every file in gateway/migrations, in order."""
    found = []
    for entry in (resources.files("gateway") / "migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text()))
    return sorted(found)


def _quiet(_: str) -> None:
    pass


@asynccontextmanager
async def _connected(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of its own, closed after; an outage, on connecting or later, is StoreUnavailable."""
    with connecting():
        conn = await asyncpg.connect(dsn)
    try:
        yield conn
    except FAILURES as exc:
        if kind(exc) != "outage":
            raise
        raise StoreUnavailable(f"Postgres went away: {type(exc).__name__}: {exc}") from exc
    finally:
        await conn.close()


async def ready(dsn: str, progress: Callable[[str], None] = _quiet) -> list[str]:
    """Make sure the schema is this gateway's and its role may serve; returns the migrations applied.

    A current schema is read, not changed: no migration statement runs, and the role needs no more than
    roles.RUNTIME_PRIVILEGES (any it lacks are named, to grant). A schema behind is migrated when the
    role may (it owns the tables, or there are none yet and it may make them: one role for everything,
    as with the embedded Postgres); otherwise the owner must, and this says so.
    """
    async with _connected(dsn) as conn:
        version = await _version(conn)
        known = migration_files()
        latest = known[-1][0]
        if version > latest:
            raise SchemaNewer(_newer(version, known[-1][1]))
        if version < latest:
            if not await _may_migrate(conn, version):
                owner = await roles.owner_of_tables(conn) if version else None
                who = f"the owner of the tables ({owner})" if owner else "the role that is to own the tables"
                raise SchemaBehind(
                    f"the schema is at migration {version}, this gateway needs {latest}: run "
                    f"`effect-gateway migrate` as {who}"
                )
        else:
            lacking = await roles.missing(conn)
            if lacking:
                raise PrivilegesMissing(await _grant_them(conn, lacking))
            await _warn_of_create(conn)
            return []
    return await migrate(dsn, progress)


async def _warn_of_create(conn: asyncpg.Connection) -> None:
    """Say so when a role that does not own the tables may still create tables beside them.

    Postgres up to 14 grants CREATE on the public schema to every role. Such a role could make a table
    under the name of a partition to come (a day of bodies ahead), and the partition could then not be
    made: writes would fail once the days made ahead ran out. The owner revokes it (docs/operations.md).
    """
    row = await conn.fetchrow(
        "select pg_has_role(current_user, relowner, 'usage') as owns, "
        "has_schema_privilege(relnamespace, 'create') as may_create "
        "from pg_class where oid = 'effect_gateway_migrations'::regclass"
    )
    if row is not None and row["may_create"] and not row["owns"]:
        log.warning(
            "the gateway's database role may create tables in the effects' schema, which it needs not "
            "(Postgres up to 14 grants that to every role): as the owner, run `revoke create on schema "
            "public from public` (docs/operations.md, Database roles)"
        )


async def _version(conn: asyncpg.Connection) -> int:
    """The last migration applied to the database (0: none, not even the table that records them)."""
    if await conn.fetchval("select to_regclass('effect_gateway_migrations')") is None:
        return 0
    try:
        last: int | None = await conn.fetchval("select max(version) from effect_gateway_migrations")
    except asyncpg.exceptions.InsufficientPrivilegeError:
        raise PrivilegesMissing(
            await _grant_them(conn, ["select on table effect_gateway_migrations"])
        ) from None
    return last or 0


async def _may_migrate(conn: asyncpg.Connection, version: int) -> bool:
    if version:  # changing the tables takes their owner's privileges
        owns: bool = await conn.fetchval(
            "select pg_has_role(current_user, relowner, 'usage') from pg_class "
            "where oid = 'effect_gateway_migrations'::regclass"
        )
        return owns
    may_create: bool = await conn.fetchval("select has_schema_privilege(current_schema(), 'create')")
    return may_create


async def _grant_them(conn: asyncpg.Connection, lacking: list[str]) -> str:
    user = await conn.fetchval("select current_user")
    owner = await roles.owner_of_tables(conn)
    return (
        f"the role {user} lacks {', '.join(lacking)}: run `effect-gateway migrate --grant-to {user}` as the "
        f"owner of the tables ({owner})"
    )


async def grant_to(dsn: str, role: str) -> None:
    """Grant ``role`` what serving needs (roles.RUNTIME_PRIVILEGES); run by the owner, after migrating."""
    async with _connected(dsn) as conn:
        if not await conn.fetchval("select exists (select from pg_roles where rolname = $1)", role):
            raise NoSuchRole(
                f"no role named {role!r}: make it first (create role ... login password ...), then grant"
            )
        try:
            await roles.grant(conn, role)
        except asyncpg.exceptions.InsufficientPrivilegeError as exc:
            raise PrivilegesMissing(
                f"cannot grant {role} what serving needs ({exc}): run this as the owner of the tables "
                f"({await roles.owner_of_tables(conn)})"
            ) from None


async def migrate(dsn: str, progress: Callable[[str], None] = _quiet) -> list[str]:
    """Apply pending migrations under an advisory lock (replicas may start at once); returns the applied.

    Then makes the time partitions that today's and the coming days' rows go into.
    """
    with connecting():
        conn = await asyncpg.connect(dsn)
    try:
        # Waits its turn behind another replica's migrations for as long as they take (whatever
        # lock_timeout or statement_timeout the role or the database sets); the statements after it
        # give up on a lock after MIGRATION_LOCK_WAIT (making partitions, after its own shorter wait),
        # and have no bound on their time: a migration that rewrites a table takes a minute per
        # million effects, and behind a pooler the role's defaults hold the hot path's bound.
        await conn.execute("set lock_timeout = 0; set statement_timeout = 0")
        await conn.execute("select pg_advisory_lock($1)", MIGRATION_LOCK)
        try:
            await conn.execute(f"set lock_timeout = '{MIGRATION_LOCK_WAIT}'")
            return await _apply_pending(conn, progress)
        finally:
            if not conn.is_closed():  # else the lock went with the session
                await conn.execute("select pg_advisory_unlock($1)", MIGRATION_LOCK)
    except asyncpg.exceptions.LockNotAvailableError as exc:
        raise StoreUnavailable(
            f"migrating gave up after waiting {MIGRATION_LOCK_WAIT} for a lock on effect_gateway_migrations "
            "or its schema that another session holds (see pg_stat_activity); nothing was applied: run it "
            "again"
        ) from exc
    except FAILURES as exc:
        if kind(exc) != "outage":
            raise
        raise StoreUnavailable(f"Postgres went away while migrating: {type(exc).__name__}: {exc}") from exc
    finally:
        await conn.close()


async def _apply_pending(conn: asyncpg.Connection, progress: Callable[[str], None]) -> list[str]:
    version = await _version(conn)
    if not await _may_migrate(conn, version):
        # A role that does not own the tables changes nothing here: with nothing to apply, nothing is
        # done (the partitions ahead are the gateways' to make); with something, the owner must.
        if version >= migration_files()[-1][0]:
            return []
        owner = await roles.owner_of_tables(conn) if version else None
        who = f"the owner of the tables ({owner})" if owner else "the role that is to own the tables"
        raise SchemaBehind(
            f"this role may not change the schema (at migration {version}, this gateway needs "
            f"{migration_files()[-1][0]}): run `effect-gateway migrate` as {who}"
        )
    await conn.execute(
        """create table if not exists effect_gateway_migrations (
               version integer primary key, name text not null,
               applied_at timestamptz not null default now())"""
    )
    done = {r["version"] for r in await conn.fetch("select version from effect_gateway_migrations")}
    known = migration_files()
    if done and max(done) > known[-1][0]:
        raise SchemaNewer(_newer(max(done), known[-1][1]))
    applied: list[str] = []
    for version, name, sql in known:
        if version not in done:
            progress(f"applying {name}")
            await _apply(conn, version, name, sql)
            applied.append(name)
    await partitions.make_ahead(conn)
    return applied


def _newer(version: int, last: str) -> str:
    # A rollback past a migration: this version would read and write rows it does not know the form
    # of (a deflated body as the bytes sent, say). Refusing to start is the safe answer.
    return (
        f"the database's schema is at migration {version}, newer than this gateway's last ({last}): run "
        "the version of the gateway that migrated it, or a newer one"
    )


async def _apply(conn: asyncpg.Connection, version: int, name: str, sql: str) -> None:
    """One migration in one transaction: if it fails, nothing of it is left behind."""
    try:
        async with conn.transaction():
            await conn.execute(sql)
            await conn.execute(
                "insert into effect_gateway_migrations (version, name) values ($1, $2)", version, name
            )
    except asyncpg.exceptions.LockNotAvailableError as exc:
        raise StoreUnavailable(
            f"migration {name} gave up after waiting {MIGRATION_LOCK_WAIT} for a lock that another "
            "session holds (a long transaction on the table: see pg_stat_activity), so that the "
            "statements queued behind it could go on; nothing of it was applied: run it again"
        ) from exc
    except FAILURES as exc:
        if kind(exc) == "refused":
            # The usual cause is a schema changed by hand, or a migrations table emptied over existing
            # tables: an operator must look before it can be tried again.
            raise StoreRejected(
                f"migration {name} failed, and nothing of it was applied: {type(exc).__name__}: {exc}"
            ) from exc
        # Postgres went away, or a lock or a deadlock with another session got in the way: the same
        # command may work later. (Once the connection is gone, ending the transaction fails too: say
        # why it went.)
        cause = exc.__context__ if isinstance(exc, asyncpg.InterfaceError) and exc.__context__ else exc
        why = f"{type(cause).__name__}: {cause}"
        raise StoreUnavailable(
            f"migration {name} was interrupted, and nothing of it was applied: {why}"
        ) from exc
