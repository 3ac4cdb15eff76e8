"""The database roles: an owner that migrates and runs the retention, a runtime role that reads and writes.

The owner runs ``effect-gateway migrate`` (it makes and changes the tables, so it owns them) and the
retention (detaching a day of bodies needs the table's ownership). ``serve`` needs no more than
:data:`RUNTIME_PRIVILEGES`: reads and writes of the effect tables, the ids' sequence, and the two
functions it calls, one of which makes the partitions ahead as the owner (migration 014). The owner
grants them with ``effect-gateway migrate --grant-to ROLE``; a gateway whose role lacks any of them
says which at start, instead of failing on the first effect that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import asyncpg

Kind = Literal["table", "sequence", "function"]


@dataclass(frozen=True, slots=True)
class Privilege:
    """What serve needs on one object of the schema."""

    kind: Kind
    name: str  # a function with its argument types, as GRANT and has_function_privilege name it
    actions: tuple[str, ...]

    def grant(self, role: str) -> str:
        """The GRANT statement giving ``role`` this privilege (``role`` already quoted)."""
        return f"grant {', '.join(self.actions)} on {self.kind} {self.name} to {role}"


# Exactly what serve's statements need, and no more: no DELETE on the audit, its keys or the bodies
# (only the retention removes bodies, by dropping whole days as the owner), no TRUNCATE, no DDL.
RUNTIME_PRIVILEGES = (
    Privilege("table", "effects", ("select", "insert", "update")),
    Privilege("table", "effect_keys", ("select", "insert")),
    # An effect leaves open_effects when it completes.
    Privilege("table", "open_effects", ("select", "insert", "update", "delete")),
    Privilege("table", "effect_bodies", ("select", "insert")),
    # The secret that derived keys are made with (migration 002), and the schema's version, checked at start.
    Privilege("table", "effect_gateway_secrets", ("select",)),
    Privilege("table", "effect_gateway_migrations", ("select",)),
    # A worker that finds the database lost its writes raises the alarm that stops every other one.
    Privilege("table", "effect_gateway_alarms", ("select", "insert")),
    # The audit's chain (migration 021): a settle adds its settlement, the chainer moves settlements into
    # the chain and signs its tips. Nothing in the chain is ever updated or deleted by a gateway.
    Privilege("table", "unchained", ("select", "insert", "delete")),
    Privilege("table", "audit_chain", ("select", "insert")),
    Privilege("table", "chained_tenants", ("select", "insert")),
    Privilege("table", "audit_heads", ("select", "insert")),
    # What a configured webhook was told (migration 022): noticed, delivered, and deleted a retention after.
    Privilege("table", "effect_notifications", ("select", "insert", "update", "delete")),
    # nextval() of the effects' ids
    Privilege("sequence", "effect_ids", ("usage",)),
    Privilege("function", "effect_key_digest(text)", ("execute",)),
    Privilege("function", "effect_gateway_make_partitions(integer, integer)", ("execute",)),
)

_HAS = {
    "table": "has_table_privilege",
    "sequence": "has_sequence_privilege",
    "function": "has_function_privilege",
}


def quoted(role: str) -> str:
    """``role`` as an SQL identifier (a role name cannot be a statement's parameter)."""
    return '"' + role.replace('"', '""') + '"'


async def missing(conn: asyncpg.Connection, role: str | None = None) -> list[str]:
    """What of :data:`RUNTIME_PRIVILEGES` (and USAGE on the tables' schema) ``role`` lacks, as the SQL
    naming each (``role``: the connection's own when None). Every object must exist: the schema is
    current."""
    who = role if role is not None else await conn.fetchval("select current_user")
    lacking = []
    if not await conn.fetchval("select has_schema_privilege($1, current_schema(), 'usage')", who):
        lacking.append(f"usage on schema {await conn.fetchval('select current_schema()')}")
    for privilege in RUNTIME_PRIVILEGES:
        for action in privilege.actions:
            if not await conn.fetchval(
                f"select {_HAS[privilege.kind]}($1, $2, $3)", who, privilege.name, action
            ):
                lacking.append(f"{action} on {privilege.kind} {privilege.name}")
    return lacking


async def grant(conn: asyncpg.Connection, role: str) -> None:
    """Give ``role`` what serve needs (:data:`RUNTIME_PRIVILEGES`): run by the owner of the tables.

    USAGE on the schema is granted only when ``role`` lacks it: the schema's owner may be someone else
    (in Postgres 15 and later, ``public`` belongs to the database's owner and lets everyone use it).
    """
    async with conn.transaction():
        if not await conn.fetchval("select has_schema_privilege($1, current_schema(), 'usage')", role):
            schema = await conn.fetchval("select current_schema()")
            await conn.execute(f"grant usage on schema {quoted(schema)} to {quoted(role)}")
        for privilege in RUNTIME_PRIVILEGES:
            await conn.execute(privilege.grant(quoted(role)))


async def runs_retention(conn: asyncpg.Connection) -> bool:
    """Whether the connection's role may run the retention: it has the privileges of the owner of
    effect_bodies (is it, is a member of it, or is a superuser), which detaching a day needs."""
    owns: bool = await conn.fetchval(
        "select pg_has_role(current_user, relowner, 'usage') from pg_class "
        "where oid = 'effect_bodies'::regclass"
    )
    return owns


async def owner_of_tables(conn: asyncpg.Connection) -> str:
    """The name of the role that owns the effect tables: the one that migrated them, and so owns the
    table recording the migrations (there from the first)."""
    name: str = await conn.fetchval(
        "select pg_get_userbyid(relowner) from pg_class where oid = 'effect_gateway_migrations'::regclass"
    )
    return name
