"""Whose effects a caller may read: every tenant's, or a set of them (one for a tenant's own token, any
number for a named operator), and the audit's reads narrowed to that set.

The store reads one tenant's effects or every tenant's, each down an index of its own. A caller who may
see several tenants gets one read per tenant, merged here in the page's order: each read stops at the
page's size, and the page is the first of their union, so the next page's cursor (the last effect
shown) is right for each tenant's read again.
"""

from __future__ import annotations

import heapq
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeAlias

from gateway.audit_query import EffectFilter, by_time
from gateway.errors import CursorUnknown
from gateway.record import EffectRecord
from gateway.seams import AuditReads

# The tenants whose effects one may see and resolve; None: every tenant's.
Scope: TypeAlias = "frozenset[str] | None"

# What to give the metrics' cached counts for a tenant (gateway.metrics.CachedCounts.get).
CountsOf = Callable[[str | None], Awaitable[dict[str, int] | None]]


def sees(scope: Scope, tenant: str) -> bool:
    return scope is None or tenant in scope


def within(where: EffectFilter, scope: Scope) -> list[EffectFilter]:
    """``where`` once for each tenant of ``scope`` it may read (every tenant at once for None). A filter
    that names a tenant keeps it if the scope holds it, and reads nothing otherwise."""
    if scope is None:
        return [where]
    tenants = sorted(scope if where.tenant is None else scope & {where.tenant})
    return [replace(where, tenant=tenant) for tenant in tenants]


async def find(store: AuditReads, where: EffectFilter, scope: Scope) -> list[EffectRecord]:
    """A page of the effects ``where`` asks for, among those ``scope`` sees."""
    wheres = within(where, scope)
    if len(wheres) == 1:
        return await store.find(wheres[0])
    if where.before_id is not None and by_time(where):
        # One cursor for every tenant's read: its time looked up once, among the tenants seen.
        cursor = await get(store, where.before_id, scope)
        if cursor is None:
            raise CursorUnknown(f"before={where.before_id} is no effect you can see")
        wheres = [replace(one, before_at=cursor.created_at) for one in wheres]
    reads = [await store.find(one) for one in wheres]
    # Newest first, as each read is: by creation time when the page is read by time, else by id.
    newest: Callable[[EffectRecord], tuple[object, ...]] = (
        (lambda r: (r.created_at, r.id)) if by_time(where) else (lambda r: (r.id,))
    )
    merged = heapq.merge(*reads, key=newest, reverse=True)
    return [record for record, _ in zip(merged, range(where.limit), strict=False)]


async def get(store: AuditReads, effect_id: int, scope: Scope) -> EffectRecord | None:
    """The effect, if ``scope`` sees it."""
    if scope is not None and len(scope) == 1:
        return await store.get(effect_id, next(iter(scope)))
    record = await store.get(effect_id)
    return record if record is not None and sees(scope, record.tenant) else None


async def counts(read: CountsOf, scope: Scope) -> dict[str, int] | None:
    """The effects by state ``scope`` sees: one tenant's, every tenant's, or the sum of several."""
    if scope is None:
        return await read(None)
    total: dict[str, int] = {}
    for tenant in sorted(scope):
        got = await read(tenant)
        if got is None:
            return None
        for state, n in got.items():
            total[state] = total.get(state, 0) + n
    return total
