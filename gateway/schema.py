"""The schema: versioned migrations in gateway/migrations/*.sql, applied under an advisory lock."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

import asyncpg

from gateway import partitions
from gateway.errors import SchemaNewer, StoreRejected, StoreUnavailable
from gateway.store import OUTAGE, RETRYABLE_SQLSTATES, cannot_connect

# Any constant will do, as long as no other application on the database uses it for another lock.
MIGRATION_LOCK = 0x65666665637473  # "effects"
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


async def migrate(dsn: str, progress: Callable[[str], None] = _quiet) -> list[str]:
    """Apply pending migrations under an advisory lock (replicas may start at once); returns the applied.

    Then makes the time partitions that today's and the coming days' rows go into.
    """
    try:
        conn = await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError) as exc:
        raise cannot_connect(exc) from exc
    try:
        # Waits its turn behind another replica's migrations for as long as they take (whatever
        # lock_timeout or statement_timeout the role or the database sets, which apply again to the
        # migrations themselves); the statements after it give up on a lock after
        # MIGRATION_LOCK_WAIT (making partitions, after its own shorter wait).
        await conn.execute("set lock_timeout = 0; set statement_timeout = 0")
        await conn.execute("select pg_advisory_lock($1)", MIGRATION_LOCK)
        try:
            await conn.execute(f"set lock_timeout = '{MIGRATION_LOCK_WAIT}'; reset statement_timeout")
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
    except (*OUTAGE, asyncpg.InterfaceError) as exc:
        raise StoreUnavailable(f"Postgres went away while migrating: {type(exc).__name__}: {exc}") from exc
    finally:
        await conn.close()


async def _apply_pending(conn: asyncpg.Connection, progress: Callable[[str], None]) -> list[str]:
    await conn.execute(
        """create table if not exists effect_gateway_migrations (
               version integer primary key, name text not null,
               applied_at timestamptz not null default now())"""
    )
    done = {r["version"] for r in await conn.fetch("select version from effect_gateway_migrations")}
    known = migration_files()
    if done and max(done) > known[-1][0]:
        # A rollback past a migration: this version would read and write rows it does not know the form
        # of (a deflated body as the bytes sent, say). Refusing to start is the safe answer.
        raise SchemaNewer(
            f"the database's schema is at migration {max(done)}, newer than this gateway's last "
            f"({known[-1][1]}): run the version of the gateway that migrated it, or a newer one"
        )
    applied: list[str] = []
    for version, name, sql in known:
        if version not in done:
            progress(f"applying {name}")
            await _apply(conn, version, name, sql)
            applied.append(name)
    await partitions.ensure(conn)
    return applied


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
    except (*OUTAGE, *RETRYABLE_SQLSTATES, asyncpg.InterfaceError) as exc:
        # Postgres went away, or a lock or a deadlock with another session got in the way: the same
        # command may work later. (Once the connection is gone, ending the transaction fails too: say
        # why it went.)
        cause = exc.__context__ if isinstance(exc, asyncpg.InterfaceError) and exc.__context__ else exc
        why = f"{type(cause).__name__}: {cause}"
        raise StoreUnavailable(
            f"migration {name} was interrupted, and nothing of it was applied: {why}"
        ) from exc
    except asyncpg.PostgresError as exc:
        # The usual cause is a schema changed by hand, or a migrations table emptied over existing
        # tables: an operator must look before it can be tried again.
        raise StoreRejected(
            f"migration {name} failed, and nothing of it was applied: {type(exc).__name__}: {exc}"
        ) from exc
