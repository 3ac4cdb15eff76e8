"""The workers' sessions behind a pooler (PgBouncer, a managed service's), which passes no settings on.

Connected to Postgres itself, each connection sends its session settings (gateway.store
session_settings) at login. A pooler refuses them there (PgBouncer: "unsupported startup parameter"),
and a SET would stay on whichever server connection ran it, for another client to inherit. Behind a
pooler they are the role's own defaults in the database, which every server connection the pooler
opens as that role takes. Any role may set its own, so a worker whose sessions lack them sets them
(ALTER ROLE changes the catalog, not the session: it passes through a pooler in any mode) and says so:
the server connections the pooler opened before keep what they had until it opens new ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import asyncpg

from gateway.partitions import AnyConn
from gateway.roles import quoted

# What a session has, in the units session_settings gives them in (timeouts in milliseconds).
_SEEN = "select name, setting from pg_settings where name = any($1::text[])"
# The defaults of this role in this database, as ALTER ROLE .. IN DATABASE .. SET wrote them.
_DEFAULTS = """
    select coalesce((select setconfig from pg_db_role_setting
                     where setrole = (select oid from pg_roles where rolname = current_user)
                       and setdatabase = (select oid from pg_database where datname = current_database())),
                    '{}')
"""


def role_defaults(role: str, database: str, wanted: Mapping[str, str]) -> list[str]:
    """The statements that make ``wanted`` the defaults of ``role``'s sessions in ``database``."""
    where = f"alter role {quoted(role)} in database {quoted(database)}"
    return [f"{where} set {name} = '{value}'" for name, value in wanted.items()]


async def make_defaults(conn: AnyConn, wanted: Mapping[str, str]) -> str | None:
    """Make ``wanted`` the defaults of the connection's role when its session lacks them; what was done
    or what is wrong, for the log, or None when the session has them."""
    seen = {row["name"]: row["setting"] for row in await conn.fetch(_SEEN, list(wanted))}
    wrong = {name: seen.get(name, "(unknown)") for name, value in wanted.items() if seen.get(name) != value}
    if not wrong:
        return None
    have = ", ".join(f"{name} = {value}" for name, value in wrong.items())
    who = await conn.fetchrow("select current_user as role, current_database() as database")
    assert who is not None  # one row, always
    role, database = who["role"], who["database"]
    set_already = {entry.partition("=")[::2] for entry in await conn.fetchval(_DEFAULTS)}
    missing = {name: wanted[name] for name in wrong if (name, wanted[name]) not in set_already}
    statements = role_defaults(role, database, missing)
    try:
        for statement in statements:
            await conn.execute(statement)
    except asyncpg.PostgresError as exc:
        return (
            f"the sessions behind the pooler have {have}, not what this gateway is configured with, and "
            f"they could not be made the defaults of the role {role} ({type(exc).__name__}: {exc}); "
            f"run: {'; '.join(statements)}"
        )
    made = f"made them the defaults of the role {role} in {database}; " if missing else ""
    return (
        f"the sessions behind the pooler have {have}, not what this gateway is configured with: {made}"
        "the pooler's server connections take them once it opens new ones (PgBouncer: RECONNECT on its "
        "console, or server_lifetime)"
    )
