"""The SQL that reads the audit, built from what a page or a count asks for: no I/O here.

A page names only the filters given, so that the index for them applies; the statement reads down the
index whose leading columns the page is filtered on, newest first, and costs its own rows however wide
the span and however many effects others have. Counts of the open states read open_effects only, never
the completed rows. gateway.store runs these statements; sim.store follows the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.states import State

# The columns every statement of the store reads (gateway.rows.record_of makes the record of them): what
# the decision and the driver need, and the database's clock.
RECORD_COLUMNS = """
    e.id, e.created_at, e.tenant, e.upstream, e.key, e.derived_key, e.method, e.path, e.query,
    e.fingerprint, e.state, e.attempt, e.may_have_sent, e.lease_expires_at, e.response_status,
    e.response_at, e.recovered_by, e.run_id, e.step, e.first_sent_at, e.last_sent_at, e.completed_at,
    e.replays, e.keyless, e.key_carriers, e.send_lease, e.tool, e.scope, clock_timestamp() as read_at
"""


@dataclass(frozen=True, slots=True)
class EffectFilter:
    tenant: str | None = None
    state: State | None = None
    upstream: str | None = None
    run_id: str | None = None
    key: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    before_id: int | None = None
    # The creation time of before_id's effect, when the reader looked it up already (gateway.scopes,
    # reading several tenants' pages with one cursor): a page read by time then goes on from
    # (before_at, before_id) without looking the cursor up among this tenant's own effects.
    before_at: datetime | None = None
    limit: int = 50


OPEN_STATES = tuple(state for state in State if state is not State.COMPLETED)
# An open state is counted exactly up to this many effects (a range of open_effects' key, well under a
# millisecond to read); beyond, nobody needs the exact figure and Postgres's estimate stands in.
EXACT_OPEN_COUNT = 1000
# Per open state: the exact count up to the bound (a range of open_effects' key, (state, id)), and the
# estimate from the statistics of open_effects (its row count times the state's share). Each count is
# ordered by the index it reads so that the generic plan reads a range of it: with the limit alone,
# Postgres may guess that a scan of the table reaches the bound sooner, and a state with few effects
# then reads the whole table (119 ms at 1M open effects).
_OPEN_COUNTS = """
    select s.state,
        (select count(*) from (select from open_effects o where o.state = s.state
                               order by o.state, o.id limit $2) as c) as n,
        coalesce((select greatest(c.reltuples, 0) from pg_class c where c.oid = 'open_effects'::regclass)
                 * (select f.freq
                    from pg_stats st
                    cross join unnest(st.most_common_vals::text::text[], st.most_common_freqs) as f(val, freq)
                    where st.tablename = 'open_effects' and st.attname = 'state' and f.val = s.state
                      and st.schemaname = (select n.nspname from pg_class c
                                           join pg_namespace n on n.oid = c.relnamespace
                                           where c.oid = 'open_effects'::regclass)),
                 0)::bigint as estimate
    from unnest($1::text[]) as s(state)
"""


# The predicate of migration 017's indexes by upstream (which says why they leave pending effects out),
# spelt as a constant: Postgres uses a partial index only for a statement that implies its predicate,
# and in a generic plan a state given as a parameter implies nothing.
_WAITING = f"o.state <> '{State.PENDING.value}'"


def _open_range(leading: list[tuple[str, str]], state: str, before: str | None = None) -> str:
    """The open effects in ``state`` whose ``leading`` columns (tenant, upstream or both, in that order)
    have the values given, with ids below ``before`` if given: a range of the index on (those columns,
    state, id), migration 007's or 017's. Never pending effects at an upstream: 017's indexes hold none.

    The range is spelt as one on the index's leading columns, which only that index can read: as
    "tenant = $2 and state = ..." Postgres could also read the state's range of the key and filter on
    the tenant, and does when one tenant holds nearly every open effect (its statistics then see one
    tenant): the others' counts then read that tenant's rows. ``before`` is in the range's upper end:
    as "id < $3" beside it, the index is not entered at that id but read down from the range's newest
    (12 ms at the 95,000th of a backlog, for a page of 50).
    """
    columns = "".join(f"o.{column}, " for column, _ in leading)
    values = "".join(f"{value}, " for _, value in leading)
    lead = f"({columns}o.state) >= ({values}{state})"
    if any(column == "upstream" for column, _ in leading):
        lead = f"{_WAITING} and {lead}"
    if before is None:
        return f"{lead} and ({columns}o.state) <= ({values}{state})"
    return f"{lead} and ({columns}o.state, o.id) < ({values}{state}, {before})"


# A tenant's: the exact count up to the bound, a range of open_effects_by_tenant that reads none of the
# other tenants' rows. A statement of its own rather than "tenant = $2 or $2 is null", for which the
# pool's generic plan read every open effect (174 ms at 1M).
_TENANT_OPEN_COUNTS = f"""
    select s.state,
        (select count(*) from (select from open_effects o
                               where {_open_range([("tenant", "$2")], "s.state")}
                               order by o.tenant, o.state, o.id limit $3) as c) as n
    from unnest($1::text[]) as s(state)
"""


def count_statement(tenant: str | None) -> tuple[str, list[Any]]:
    """The statement counting the open states (every effect's, or ``tenant``'s), and its arguments."""
    states = [s.value for s in OPEN_STATES]
    if tenant is None:
        return _OPEN_COUNTS, [states, EXACT_OPEN_COUNT]
    return _TENANT_OPEN_COUNTS, [states, tenant, EXACT_OPEN_COUNT]


def by_time(where: EffectFilter) -> bool:
    """Whether the audit's page for ``where`` is read by time: the newest by creation time first.

    Every page but a run's, a key's and an open state's, which have indexes of their own read in id
    order. A tenant's or an upstream's is read down its index on (tenant or upstream, created_at, id),
    any other from the index on (created_at, id): from the end of the span if one is given, so a page
    costs its own rows however wide the span and however many effects others have in it.
    """
    return where.run_id is None and where.key is None and _listed_state(where) is None


def _listed_state(where: EffectFilter) -> State | None:
    """The open state whose list the page for ``where`` is, read from open_effects; else None.

    Not a run's: its few effects are read down the run's index, each state checked on its audit row,
    where the state's list could step through a backlog of other runs' effects to find them.
    """
    if where.state is State.COMPLETED or where.key is not None or where.run_id is not None:
        return None
    return where.state


# An open effect's audit row, looked up from each open effect in the index's order until the page is
# full; (id, created_at) is the audit's primary key, so the limit drops nothing. It keeps the lookup out
# of the join: joined plainly, Postgres guesses the join at one row (nothing tells it that every open
# effect has exactly one audit row), so the page's limit stops nothing early, and with a backlog it
# hashed the whole audit for every page instead.
_AUDIT_ROW = (
    "select * from effects a where a.id = o.id and a.created_at = o.created_at and a.scope = o.scope limit 1"
)


def find_statement(where: EffectFilter) -> tuple[str, list[Any]]:
    """A page of the audit, newest first; only the filters given reach the SQL (so indexes apply).

    A key is found through effect_keys (its digest, the scope, leads that table's index); an open state
    is listed from open_effects (its key is (state, id): the page is a range of it; a tenant's, a range of
    open_effects_by_tenant; an upstream's, of open_effects_waiting_by_upstream; a tenant's at one
    upstream, of open_effects_waiting_by_tenant_upstream; pending ones at an upstream, the pending range
    of the key or of the tenant's index, kept by upstream); either is joined to the audit rows and read
    in id order. Any other page is read by time (see :func:`by_time` and :func:`_time_statement`).
    """
    if by_time(where):
        return _time_statement(where)
    listed = _listed_state(where)
    # open_effects holds the tenant, upstream, id and creation time of an open effect: filtering there
    # leaves the audit to be read only for the rows of the page.
    holder = "e" if listed is None else "o"
    clauses: list[str] = []
    args: list[Any] = []

    def arg(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    order = f"{holder}.id desc"
    before = arg(where.before_id) if where.before_id is not None else None
    # A tenant's or an upstream's list of an open state (or one upstream's of a tenant's) is a range of
    # its own index, read in that index's order: by id within the range. The indexes with the upstream
    # hold no pending effect (migration 017): pending ones at an upstream are read from the tenant's or
    # the gateway's pending range (as many rows as requests in flight), keeping that upstream's.
    in_range = {"tenant": where.tenant, "upstream": where.upstream}
    kept_upstream = in_range.pop("upstream") if listed is State.PENDING else None
    given = [(column, value) for column, value in in_range.items() if value is not None]
    if listed is not None and given:
        leading = [(column, arg(named)) for column, named in given]
        clauses.append(_open_range(leading, arg(listed.value), before))
        order = "".join(f"o.{column} desc, " for column, _ in leading) + "o.state desc, o.id desc"
    else:
        for column, named in given:
            clauses.append(f"e.{column} = {arg(named)}")
        if where.state is not None:
            clauses.append(f"{holder}.state = {arg(where.state.value)}")
        if before is not None:
            clauses.append(f"{holder}.id < {before}")
    if kept_upstream is not None:
        clauses.append(f"o.upstream = {arg(kept_upstream)}")
    for column, value in (("e.run_id", where.run_id), ("e.key", where.key)):
        if value is not None:
            clauses.append(f"{column} = {arg(value)}")
    if where.key is not None:
        clauses.append(f"k.scope = effect_key_digest(${len(args)})")
    if where.since is not None:
        clauses.append(f"{holder}.created_at >= {arg(where.since)}")
    if where.until is not None:
        clauses.append(f"{holder}.created_at < {arg(where.until)}")
    where_sql = " where " + " and ".join(clauses) if clauses else ""
    if where.key is not None:
        source = (
            "effect_keys k join effects e on e.id = k.effect_id and e.created_at = k.created_at "
            "and e.scope = k.scope"
        )
    elif listed is not None:
        source = f"open_effects o cross join lateral ({_AUDIT_ROW}) e"
    else:
        source = "effects e"
    sql = f"select {RECORD_COLUMNS} from {source}{where_sql} order by {order} limit {arg(where.limit)}"
    return sql, args


# The ends of a page read by time when no span is given (constants in the SQL, so the plan is generic).
_BEGINNING, _ENDLESS = "'-infinity'::timestamptz", "'infinity'::timestamptz"


def _time_statement(where: EffectFilter) -> tuple[str, list[Any]]:
    """A page read by time: a range of the index on (tenant, created_at, id) for a tenant's, on
    (upstream, created_at, id) for an upstream's, on (tenant, upstream, created_at, id) for a tenant's
    at one upstream, and on (created_at, id) for any other.

    The range is spelt as row comparisons on the index's leading columns, which only that index can
    read: spelt "tenant = $1 and created_at >= $2", the pool's generic plan guesses a share of the rows
    for any tenant and may read the span down (created_at, id) instead, throwing away every other
    tenant's effects in it. ``before`` is the last effect of the page before: the page goes on from its
    (created_at, id), which the ids alone do not give (ids are taken at claim time and created_at is
    the claim's transaction's start, so two claims at once can have them in opposite orders). It is
    looked up among all the viewer's effects, not the span's: a link kept from before the ``next``
    links named their span's times (gateway.effects_json.next_query) repeats a span such as since=1h, which
    starts later by the time it is followed, and its cursor may then lie before the span (the page is
    empty) but must not be refused. The span's end still bounds the page: a cursor after it gives the
    span's first page (a cursor of a ``next`` link lies inside the span, where the end changes nothing).
    """
    args: list[Any] = []

    def arg(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    lead: list[tuple[str, str]] = []  # the index's leading columns and their values
    clauses: list[str] = []
    if where.tenant is not None:
        lead.append(("e.tenant", arg(where.tenant)))
    if where.upstream is not None:
        lead.append(("e.upstream", arg(where.upstream)))
    if where.state is not None:  # only completed: an open state is listed from open_effects
        clauses.append(f"e.state = {arg(where.state.value)}")
    since = arg(where.since) if where.since is not None else _BEGINNING

    def row(*values: str) -> str:
        return "(" + ", ".join(values) + ")"

    columns = [column for column, _ in lead]
    values = [value for _, value in lead]
    clauses.append(f"{row(*columns, 'e.created_at')} >= {row(*values, since)}")
    if where.before_id is not None:
        # Looked up among the tenant's own; when there is no such effect the bound is null and the
        # page empty (see Store.find).
        before = arg(where.before_id)
        within = f" and c.tenant = {values[0]}" if where.tenant is not None else ""
        ended = (
            arg(where.before_at)
            if where.before_at is not None
            else f"(select c.created_at from effects c where c.id = {before}{within})"
        )
        clauses.append(f"{row(*columns, 'e.created_at', 'e.id')} < {row(*values, ended, before)}")
    if where.until is not None:
        clauses.append(f"{row(*columns, 'e.created_at')} < {row(*values, arg(where.until))}")
    elif where.before_id is None:
        clauses.append(f"{row(*columns, 'e.created_at')} <= {row(*values, _ENDLESS)}")
    order = ", ".join(f"{column} desc" for column in [*columns, "e.created_at", "e.id"])
    sql = (
        f"select {RECORD_COLUMNS} from effects e where {' and '.join(clauses)} "
        f"order by {order} limit {arg(where.limit)}"
    )
    return sql, args
