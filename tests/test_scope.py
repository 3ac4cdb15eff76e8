"""Every statement the gateway runs for one effect names the effect's scope, and is planned on its index.

A distributed Postgres such as Citus spreads the tables over shards by the scope column (migration 020)
and sends a statement to one shard only when its where clause names that column. Citus does not install
here, so this proves it on one node: every phase of the store runs against the real Postgres while each
statement it sends is recorded; each that reads or writes the effect tables must name the scope, and
the planner's plan for it (a generic one, as the gateway's sessions get) must find every row it reads
through an index, with the scope in the index's condition.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import pytest

from gateway import lost_writes, phases, rows
from gateway import store as store_module
from gateway.decision import review, take_over
from gateway.record import EffectRecord
from gateway.states import State, Transition
from gateway.store import Store, StoreLimits, session_settings
from tests.plans import fill_effects
from tests.test_store_contract import DONE, EXPIRED, LATER, LEASE, OK, effect

# The tables of effects; their partitions are named after them with the month or day.
TABLES = ("effects", "effect_keys", "open_effects", "effect_bodies")
_TABLE = re.compile(r"\b(effects|effect_keys|open_effects|effect_bodies)\b")
_PARTITION = re.compile(r"^(effects|effect_bodies)_\d{4}_\d{2}(_\d{2})?$")


def _statement_functions() -> set[Callable[..., Any]]:
    """The functions of the store's hot path that send statements: the phases and the reads of rows."""
    own = [
        fn
        for module in (phases, rows)
        for _, fn in inspect.getmembers(module, inspect.iscoroutinefunction)
        if fn.__module__ == module.__name__
    ]
    return {*own, lost_writes.LostWrites.check}


Sent = list[tuple[str, tuple[Any, ...]]]  # each statement's text and arguments


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> tuple[Sent, set[str]]:
    """Every statement the store's pool sends (its text and arguments), and the statement functions of
    the hot path that ran: each is wrapped wherever a module of the store holds it."""
    sent: Sent = []
    ran: set[str] = set()
    init = store_module._init_connection

    async def logged(conn: asyncpg.Connection) -> None:
        await init(conn)
        conn.add_query_logger(lambda query: sent.append((query.query, tuple(query.args))))

    monkeypatch.setattr(store_module, "_init_connection", logged)
    for fn in _statement_functions():

        def counting(fn: Callable[..., Any] = fn) -> Callable[..., Any]:
            @functools.wraps(fn)
            async def counted(*args: Any, **kwargs: Any) -> Any:
                ran.add(fn.__qualname__)
                return await fn(*args, **kwargs)

            return counted

        wrapped = counting()
        for module in (phases, rows, store_module, lost_writes):
            for name, held in vars(module).items():
                if held is fn:
                    monkeypatch.setattr(module, name, wrapped)
        if fn is lost_writes.LostWrites.check:
            monkeypatch.setattr(lost_writes.LostWrites, "check", wrapped)
    return sent, ran


async def _every_phase(store: Store) -> EffectRecord:
    """Each phase of an effect at least once, with the records' bodies, as the gateway runs them."""
    # Claims together (one statement for several), the known key's read, settles together.
    claims = await asyncio.gather(*(store.claim(effect(f"batch-{n}"), LEASE) for n in range(3)))
    records = [record for record, created in claims if record is not None and created]
    assert len(records) == 3
    done = await asyncio.gather(*(store.settle(r, DONE, response=OK, recovered_by=None) for r in records))
    assert all(d is not None for d in done)
    held, created = await store.claim(effect("batch-0"), LEASE)
    assert held is not None
    assert (created, held.response) == (False, OK)
    await store.add_replays({held.row_key: 2})
    # The restore of an answer still stored writes nothing and reads the record again.
    kept, restored = await store.restore(held, Transition(State.COMPLETED, State.COMPLETED), LATER)
    assert (kept.response, restored) == (OK, False)
    # A take-over that sends reads the request back; its late holder is fenced out and noted.
    late = await _claimed(store, "taken-over")
    taken = await store.reclaim(late, take_over(late), LEASE, "native_key", sends=True)
    assert taken is not None
    assert taken.request_body is not None
    await store.note_fenced(late, "answered 201")
    # Review, and the operator's verdict.
    doubt = await _claimed(store, "reviewed")
    reviewed = await store.send_to_review(doubt, review(doubt), "nothing can tell")
    assert reviewed is not None
    resolved = await store.resolve(reviewed, Transition(State.NEEDS_REVIEW, State.COMPLETED), OK, "op")
    assert resolved is not None
    assert resolved.state is State.COMPLETED
    return resolved


async def _claimed(store: Store, key: str) -> EffectRecord:
    record, created = await store.claim(effect(key), EXPIRED)
    assert record is not None
    assert created
    return record


def _sql(text: str) -> str:
    """The statement without its comments, which may name anything."""
    return re.sub(r"--[^\n]*", "", text)


def _scans(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The nodes of a plan that read rows of the effect tables (their writes are not reads)."""
    relation = plan.get("Relation Name", "")
    if plan["Node Type"] != "ModifyTable" and (relation in TABLES or _PARTITION.match(relation)):
        yield plan
    for child in plan.get("Plans", []):
        yield from _scans(child)


# A list of scopes (a batch's "scope = any($n)") after a column the lookup bounds by a range (the
# month): Postgres before 17 checks it on each entry the index scan finds instead of looking it up.
_LATER_LIST = re.compile(r"^\(scope = ANY \(\$\d+\)\)$")


def _by_index_on_scope(node: dict[str, Any], with_scope: set[str], version: int) -> bool:
    """Whether a scan finds its rows through an index holding the scope, the scope in its condition."""
    if node["Node Type"] in ("Index Scan", "Index Only Scan"):
        if "scope" in node.get("Index Cond", ""):
            return True
        return (
            version < 170000
            and node["Index Name"] in with_scope
            and bool(_LATER_LIST.match(node.get("Filter", "")))
        )
    if node["Node Type"] == "Bitmap Heap Scan":
        return "scope" in node.get("Recheck Cond", "")
    return False


async def _generic_plan(conn: asyncpg.Connection, text: str, args: tuple[Any, ...]) -> dict[str, Any]:
    """The plan the gateway's sessions run ``text`` with: the generic one (plan_cache_mode), which
    EXPLAIN shows only for a prepared statement executed with values written out (Postgres 15 has no
    EXPLAIN (GENERIC_PLAN)). Each value is written out by Postgres from its type."""
    types = [
        await conn.fetchval("select format_type($1::oid, null)", t.oid)
        for t in (await conn.prepare(text)).get_parameters()
    ]
    values = [
        "null" if arg is None else f"{await conn.fetchval(f'select quote_literal($1::{t}::text)', arg)}::{t}"
        for t, arg in zip(types, args, strict=True)
    ]
    await conn.execute(f"prepare hot_path ({', '.join(types)}) as {text}")
    try:
        explained = await conn.fetchval(f"explain (format json) execute hot_path ({', '.join(values)})")
    finally:
        await conn.execute("deallocate hot_path")
    plan: dict[str, Any] = json.loads(explained)[0]["Plan"]
    return plan


async def test_every_hot_path_statement_names_the_scope_and_is_planned_on_its_index(
    dsn: str, statements: tuple[Sent, set[str]]
) -> None:
    """Each statement of every phase that reads or writes an effect's rows names its scope, and the
    plan the gateway's sessions run it with finds each row it reads through an index on the scope."""
    sent, ran = statements
    # An audit of some size around the effects below, so that the plans are those of production.
    await fill_effects(dsn, "others", 10**9, 5_000, "in_doubt")
    store = await Store.connect(dsn)
    try:
        newest = await _every_phase(store)
    finally:
        await store.close()
    # A new connection of the pool looks up the worker's newest claim (here on one of its own, logged
    # alike: the pool opened its connections before the first claim).
    witness = lost_writes.LostWrites()
    witness.wrote(newest)
    conn = await asyncpg.connect(dsn)
    try:
        conn.add_query_logger(lambda query: sent.append((query.query, tuple(query.args))))
        await witness.check(conn)
    finally:
        await conn.close()
    assert witness.lost is None
    assert ran == {fn.__qualname__ for fn in _statement_functions()}, "a phase did not run"
    on_effects = {}
    for text, args in sent:
        if _TABLE.search(_sql(text)):
            on_effects.setdefault(text, args)
    unnamed = [text for text in on_effects if not re.search(r"\bscope\s*=", _sql(text))]
    assert unnamed == []
    conn = await asyncpg.connect(dsn, server_settings=session_settings(StoreLimits()))
    try:
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        # Whatever a table's size, an index that serves the statement is taken over reading it whole.
        await conn.execute("set enable_seqscan = off")
        version = await conn.fetchval("select current_setting('server_version_num')::int")
        with_scope = {
            r["name"]
            for r in await conn.fetch(
                "select c.relname as name from pg_index i join pg_class c on c.oid = i.indexrelid"
                " join pg_attribute a on a.attrelid = i.indrelid and a.attnum = any(i.indkey)"
                " where a.attname = 'scope'"
            )
        }
        off_index = []
        for text, args in on_effects.items():
            plan = await _generic_plan(conn, text, args)
            off_index += [
                (
                    node["Node Type"],
                    node.get("Index Name"),
                    node.get("Index Cond"),
                    node.get("Filter"),
                    text[:80],
                )
                for node in _scans(plan)
                if not _by_index_on_scope(node, with_scope, version)
            ]
    finally:
        await conn.close()
    assert off_index == []
    # The phases above send at least a dozen distinct statements: fewer means the log missed some, and
    # the checks above would have passed on nothing.
    assert len(on_effects) >= 12, sorted(on_effects)
