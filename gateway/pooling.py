"""The workers' sessions behind a pooler (PgBouncer, a managed service's), which passes no settings on.

Connected to Postgres itself, each connection sends its session settings (gateway.store
session_settings) at login. A pooler refuses them there (PgBouncer: "unsupported startup parameter"),
and a SET would stay on whichever server connection ran it, for another client to inherit. Behind a
pooler they are the role's own defaults, which every server connection the pooler opens as that role
takes: ``effect-gateway migrate --grant-to ROLE`` sets them, and each worker checks what its sessions
have and warns, with the statement that sets them, when they differ.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.partitions import AnyConn
from gateway.roles import quoted

# What a session has, in the units session_settings gives them in (timeouts in milliseconds).
_SEEN = "select name, setting from pg_settings where name = any($1::text[])"


async def differing(conn: AnyConn, wanted: Mapping[str, str]) -> dict[str, str]:
    """The settings of ``conn``'s session that differ from ``wanted``, with the value they have."""
    seen = {row["name"]: row["setting"] for row in await conn.fetch(_SEEN, list(wanted))}
    return {name: seen.get(name, "(unknown)") for name, value in wanted.items() if seen.get(name) != value}


def role_defaults(role: str, database: str, wanted: Mapping[str, str]) -> list[str]:
    """The statements that make ``wanted`` the defaults of ``role``'s sessions in ``database``."""
    where = f"alter role {quoted(role)} in database {quoted(database)}"
    return [f"{where} set {name} = '{value}'" for name, value in wanted.items()]


async def set_role_defaults(conn: AnyConn, role: str, wanted: Mapping[str, str]) -> None:
    """Make ``wanted`` the defaults of ``role``'s new sessions in ``conn``'s database."""
    database = await conn.fetchval("select current_database()")
    for statement in role_defaults(role, database, wanted):
        await conn.execute(statement)


async def warning(conn: AnyConn, wanted: Mapping[str, str]) -> str | None:
    """What is wrong with the sessions behind the pooler, and the statements that set it right."""
    wrong = await differing(conn, wanted)
    if not wrong:
        return None
    who = await conn.fetchrow("select current_user as role, current_database() as database")
    assert who is not None  # one row, always
    role, database = who["role"], who["database"]
    have = ", ".join(f"{name} = {value}" for name, value in wrong.items())
    fix = "; ".join(role_defaults(role, database, {name: wanted[name] for name in wrong}))
    return (
        f"the sessions behind the pooler have {have}, not what this gateway is configured with: a pooler "
        "passes no settings on, so they must be the role's defaults; run `effect-gateway migrate "
        f"--grant-to {role}` as the tables' owner, or: {fix}"
    )
