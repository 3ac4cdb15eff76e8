"""The audit's chain in Postgres: settlements linked into it, its tips signed, a period exported.

The statements that settle an effect add the settlement to ``unchained`` (gateway.phases). A round
(:func:`chain_round`) takes them from there in the order they settled, links them after each tenant's
newest entry (gateway.chain.link), and signs the tips that are due, all in one transaction. One
gateway at a time runs a round: the others find the round's lock taken and skip it. The lock is a
transaction's, so it holds through a pooler in transaction mode too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import asyncpg

from gateway import chain, locks
from gateway.chain import GENESIS, ROUND, Entry, Head, Round, Settled, Signer
from gateway.rows import Conn
from gateway.settings import Settings

# The workers' pooled connections run the rounds; the export command runs on one of its own.
AnyConn: TypeAlias = "Conn | asyncpg.Connection"

# The round's lock among all gateways on the database.
CHAIN_LOCK = locks.CHAIN
_TAKE = """
    delete from unchained
    where (scope, effect_id, attempt) in (
        select scope, effect_id, attempt from unchained order by settled_at, effect_id, attempt limit $1
    )
    returning *
"""

_ADD = """
    insert into audit_chain (tenant, seq, scope, effect_id, attempt, upstream, method, path, fingerprint,
        outcome, status, response, recovered_by, by, run_id, step, created_at, settled_at, hash)
    select tenant, seq, scope, effect_id, attempt, upstream, method, path, fingerprint, outcome, status,
        decode(response, 'hex'), recovered_by, by, run_id, step, created_at, settled_at, decode(hash, 'hex')
    from unnest($1::text[], $2::bigint[], $3::uuid[], $4::bigint[], $5::integer[], $6::text[],
        $7::text[], $8::text[], $9::text[], $10::text[], $11::integer[], $12::text[], $13::text[],
        $14::text[], $15::text[], $16::text[], $17::timestamptz[], $18::timestamptz[], $19::text[])
        as u(tenant, seq, scope, effect_id, attempt, upstream, method, path, fingerprint, outcome, status,
             response, recovered_by, by, run_id, step, created_at, settled_at, hash)
"""

# Each tenant's newest entry (its tip), read backwards down the chain's primary key: the chain itself
# says where it goes on, and the gateway's role, which may not update it, cannot move that back.
_TIPS = """
    select t.tenant, c.seq, encode(c.hash, 'hex') as hash
    from unnest($1::text[]) t(tenant) join lateral (
        select seq, hash from audit_chain where tenant = t.tenant order by seq desc limit 1
    ) c on true
"""

# Each tenant's tip beside its newest signed head, and the database's time (heads are signed by its
# clock, as every time that decides anything is).
_TIPS_AND_HEADS = """
    select t.tenant, c.seq, encode(c.hash, 'hex') as hash, h.seq as signed, h.signed_at, now() as now
    from chained_tenants t join lateral (
        select seq, hash from audit_chain where tenant = t.tenant order by seq desc limit 1
    ) c on true left join lateral (
        select seq, signed_at from audit_heads where tenant = t.tenant order by seq desc limit 1
    ) h on true
"""


def signer_of(settings: Settings) -> Signer | None:
    """What signs the heads, from the settings: None without a key, or with an "env:" key whose
    variable a command that needs only the database left unset (it then signs nothing)."""
    key = settings.audit.signing_key
    if key is None or key.get_secret_value().startswith("env:"):
        return None
    return Signer(chain.signing_key(key.get_secret_value()), settings.audit.sign_every)


async def chain_round(conn: AnyConn, signer: Signer | None, *, sign_now: bool = False) -> Round:
    """Link up to :data:`ROUND` settlements into their tenants' chains, and sign the tips that are due
    (all that moved, with ``sign_now``), in one transaction."""
    async with conn.transaction():
        if not await conn.fetchval("select pg_try_advisory_xact_lock($1)", CHAIN_LOCK):
            return Round(0, [], busy=True)
        settled = sorted((_settled(row) for row in await conn.fetch(_TAKE, ROUND)), key=chain.order)
        if settled:
            await _append(conn, settled)
        signed = await _sign_due(conn, signer, sign_now) if signer is not None else []
        return Round(len(settled), signed)


async def _append(conn: AnyConn, settled: list[Settled]) -> None:
    chains = chain.by_tenant(settled)
    tenants = list(chains)
    tips = {row["tenant"]: (row["seq"], row["hash"]) for row in await conn.fetch(_TIPS, tenants)}
    entries: list[Entry] = []
    for tenant, settlements in chains.items():
        seq, prev = tips.get(tenant, (0, GENESIS))
        entries += chain.link(seq, prev, settlements)
    rows = [_entry_row(entry) for entry in entries]
    await conn.execute(_ADD, *(list(column) for column in zip(*rows, strict=True)))
    if new := [tenant for tenant in tenants if tenant not in tips]:
        await conn.execute(
            "insert into chained_tenants select unnest($1::text[]) on conflict do nothing", new
        )


def _entry_row(entry: Entry) -> tuple[Any, ...]:
    s = entry.settlement
    return (
        s.tenant,
        entry.seq,
        s.scope,
        s.effect,
        s.attempt,
        s.upstream,
        s.method,
        s.path,
        s.fingerprint,
        s.outcome,
        s.status,
        s.response,
        s.recovered_by,
        s.by,
        s.run,
        s.step,
        s.created_at,
        s.settled_at,
        entry.hash,
    )


def _hex(digest: bytes | None) -> str | None:
    """A digest as the chain writes it: hex (Postgres keeps its 32 bytes)."""
    return digest.hex() if digest is not None else None


def _settled(row: Any) -> Settled:
    return Settled(
        tenant=row["tenant"],
        effect=row["effect_id"],
        attempt=row["attempt"],
        scope=str(row["scope"]),
        upstream=row["upstream"],
        method=row["method"],
        path=row["path"],
        fingerprint=row["fingerprint"],
        outcome=row["outcome"],
        status=row["status"],
        response=_hex(row["response"]),
        recovered_by=row["recovered_by"],
        by=row["by"],
        run=row["run_id"],
        step=row["step"],
        created_at=row["created_at"],
        settled_at=row["settled_at"],
    )


async def _sign_due(conn: AnyConn, signer: Signer, sign_now: bool) -> list[Head]:
    """Sign each tip that moved since its last head, once ``signer.every`` has passed since that head
    (at once with ``sign_now``, and for a chain never signed)."""
    heads = []
    for row in await conn.fetch(_TIPS_AND_HEADS):
        last = (row["signed"], row["signed_at"]) if row["signed"] is not None else None
        if not chain.due(row["seq"], last, row["now"], signer.every, sign_now):
            continue
        heads.append(chain.sign(signer.key, row["tenant"], row["seq"], row["hash"], row["now"]))
    if heads:
        await conn.executemany(
            "insert into audit_heads (tenant, seq, hash, signed_at, key, signature)"
            " values ($1, $2, $3, $4, $5, $6)",
            [(h.tenant, h.seq, h.hash, h.signed_at, h.key, h.signature) for h in heads],
        )
    return heads


# --- export -----------------------------------------------------------------------------------------

# An export reads the chain a page at a time: 1,000 entries are about 500 kB.
PAGE = 1000


@dataclass(frozen=True, slots=True)
class Exported:
    """One tenant's part of an export: its entries first to last, and the heads among them."""

    tenant: str
    first: int
    last: int
    heads: int


async def export(
    conn: AnyConn,
    write: Callable[[bytes], object],
    *,
    tenant: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[Exported]:
    """Write the entries that settled in [since, until) (all, when omitted) of one tenant or each, with
    their signed heads, as JSON Lines (gateway.chain.verify reads them).

    A tenant's part runs on to the first head signed after its last entry in the period, if any, so that
    a signature covers every entry written. Read in one repeatable-read transaction: a consistent view
    while the gateways go on chaining.
    """
    done = []
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        write(chain.format_line(await conn.fetchval("select now()")) + b"\n")
        tips = await conn.fetch(
            "select t.tenant, c.seq from chained_tenants t join lateral ("
            " select seq from audit_chain where tenant = t.tenant order by seq desc limit 1) c on true"
            " where $1::text is null or t.tenant = $1 order by t.tenant",
            tenant,
        )
        for tip in tips:
            span = await _span(conn, tip["tenant"], tip["seq"], since, until)
            if span is not None:
                done.append(await _export_tenant(conn, write, tip["tenant"], *span))
    return done


async def _span(
    conn: AnyConn, tenant: str, tip: int, since: datetime | None, until: datetime | None
) -> tuple[int, int] | None:
    """The first and last entries of ``tenant`` that settled in the period, the last moved on to the
    next signed head; None when none settled in it."""
    first, last = 1, tip
    if since is not None or until is not None:
        row = await conn.fetchrow(
            "select min(seq) as first, max(seq) as last from audit_chain where tenant = $1"
            " and ($2::timestamptz is null or settled_at >= $2)"
            " and ($3::timestamptz is null or settled_at < $3)",
            tenant,
            since,
            until,
        )
        if row is None or row["first"] is None:
            return None
        first, last = row["first"], row["last"]
    signed = await conn.fetchval(
        "select min(seq) from audit_heads where tenant = $1 and seq >= $2", tenant, last
    )
    return first, signed if signed is not None else last


async def _export_tenant(
    conn: AnyConn, write: Callable[[bytes], object], tenant: str, first: int, last: int
) -> Exported:
    prev = (
        await conn.fetchval(
            "select encode(hash, 'hex') from audit_chain where tenant = $1 and seq = $2", tenant, first - 1
        )
        if first > 1
        else GENESIS
    )
    write(chain.start_line(tenant, first, last, prev) + b"\n")
    heads = {
        row["seq"]: Head(
            row["tenant"], row["seq"], row["hash"], row["signed_at"], row["key"], row["signature"]
        )
        for row in await conn.fetch(
            "select * from audit_heads where tenant = $1 and seq between $2 and $3", tenant, first - 1, last
        )
    }
    if (before := heads.get(first - 1)) is not None:
        write(before.line() + b"\n")
    for start in itertools.count(first, PAGE):
        if start > last:
            break
        rows = await conn.fetch(
            "select * from audit_chain where tenant = $1 and seq between $2 and $3 order by seq",
            tenant,
            start,
            min(start + PAGE - 1, last),
        )
        for row in rows:
            write(Entry(_settled(row), row["seq"], prev, row["hash"].hex()).line() + b"\n")
            prev = row["hash"].hex()
            if (head := heads.get(row["seq"])) is not None:
                write(head.line() + b"\n")
    return Exported(tenant, first, last, len(heads))
