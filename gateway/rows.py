"""Rows of the effect tables as records: the response on record found, bodies unpacked, heads split.

The store's statements read the audit's columns (gateway.audit_query.RECORD_COLUMNS) and, where the
caller needs them, the bodies of ``effect_bodies``; this module turns such rows into
:class:`~gateway.record.EffectRecord`, and the headers of a record into the bytes stored. It also holds
the SQL that finds the response on record and the one read that follows a row to it, which only the
way rows become records decides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeAlias

import asyncpg
import asyncpg.pool

from gateway import packing, partitions
from gateway.audit_query import RECORD_COLUMNS
from gateway.errors import BodyUnreadable
from gateway.record import EffectRecord, KeyCarriers, StoredResponse, head_pairs
from gateway.states import State

Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[asyncpg.Record]"

# The response on record, for a replay: found in effect_bodies at the time it was stored. The hot path
# reads it with a statement of its own (stored_response): a join cannot know which day's partition
# holds it, so Postgres would open and lock every partition of effect_bodies on each execution.
RESPONSE = """
    left join effect_bodies r on r.effect_id = e.id and r.kind = 'response' and r.stored_at = e.response_at
        and r.scope = e.scope
"""
WITH_RESPONSE = f"{RECORD_COLUMNS}, r.headers as r_headers, r.content as r_content, r.coding as r_coding"


# A row's history as an operator reads it: the claim first, then what the row's history column holds.
# The claim is not kept in the column, since its time is the row's created_at and its attempt always 1:
# kept, it would add about 90 bytes to every row, written to the WAL again by each update of the row.
# Rows written by earlier versions hold it, and are read as they are.
HISTORY = """case when jsonb_typeof(e.history) <> 'array' or e.history->0->>'event' = 'claimed' then e.history
    else jsonb_build_array(jsonb_build_object('event', 'claimed', 'attempt', 1, 'at', e.created_at))
        || e.history end"""


def _events(text: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """The history's events, and why any could not be read: the gateway writes a list of objects, each
    with its kind and Postgres's time, and the views read them as such. What a hand changed into
    something else is left out and named, instead of failing the operator's view of the effect.

    ``text`` is the column as Store.get reads it, as text: Postgres keeps jsonb that Python's json
    cannot read (nested past its recursion limit, a number of more than 4,300 digits)."""
    try:
        history = None if text is None else json.loads(text)
    except (RecursionError, ValueError) as exc:
        return [], f"cannot be parsed: {type(exc).__name__}: {str(exc)[:100]}"
    if not isinstance(history, list):
        return [], f"not a list of events but {_JSON_TYPES.get(type(history), 'a value')}"
    events, bad = [], []
    for n, event in enumerate(history):
        if (
            isinstance(event, dict)
            and isinstance(event.get("event"), str)
            and _readable_time(event.get("at"))
        ):
            events.append(event)
        else:
            bad.append(str(n))
    if not bad:
        return events, None
    entries = f"entry {bad[0]}" if len(bad) == 1 else f"entries {', '.join(bad)}"
    return events, f"{entries} of {len(history)} left out: not an event with a time that can be read"


_JSON_TYPES = {
    type(None): "null",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    dict: "an object",
}


def _readable_time(at: Any) -> bool:
    if at is None:
        return True
    try:
        datetime.fromisoformat(at).astimezone(UTC)  # as the views show it
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def stored_response(stored_at: datetime) -> str:
    """The statement reading a response stored at ``stored_at``, from that day's partition only."""
    return f"""
        select headers, coding, content from effect_bodies
        where effect_id = $1 and kind = 'response' and stored_at = $2 and scope = $3
          and {partitions.within("stored_at", partitions.day_of(stored_at))}
    """


async def with_request(conn: Conn, record: EffectRecord) -> EffectRecord:
    """``record`` with the request body it was claimed with (``request_body``), for an attempt that sends
    it again; None and the reason in ``unreadable`` when it cannot be read back.

    Stored at the claim, in the day the effect was created, and carried forward by the retention while
    the effect is open: a body is never stored before its effect, so the days before are left out (the
    bound is a constant, so the plan opens only the days from there on).
    """
    since = partitions.day_of(record.created_at)[0]
    row = await conn.fetchrow(
        f"""
        select coding, content from effect_bodies
        where effect_id = $1 and kind = 'request' and scope = $2 and stored_at >= '{since.isoformat()}'
        order by stored_at desc limit 1
        """,
        record.id,
        record.scope,
    )
    if row is None:
        return replace(record, unreadable={**record.unreadable, "request": "no request body is on record"})
    try:
        body = _unpacked(record.id, "request", row["coding"], bytes(row["content"]))
    except BodyUnreadable as exc:
        return replace(record, unreadable={**record.unreadable, "request": str(exc)})
    return replace(record, request_body=body)


# No response on record (none stored, or its day dropped by the retention).
NO_BODY: Mapping[str, Any] = {"headers": None, "coding": None, "content": None}


async def reread(conn: Conn, record: EffectRecord) -> EffectRecord:
    """The record as it is now, with its response: what the decision needs to be taken again."""
    row = await conn.fetchrow(
        f"select {RECORD_COLUMNS} from effects e where e.id = $1 and e.created_at = $2 and e.scope = $3 "
        f"and {partitions.in_month(record.created_at)}",
        record.id,
        record.created_at,
        record.scope,
    )
    assert row is not None, "effects are never deleted while in use"
    return await read_with_response(conn, row)


async def read_with_response(conn: Conn, row: asyncpg.Record) -> EffectRecord:
    """The record of ``row`` (read without the bodies) with the response on record, if there is one."""
    if row["response_status"] is None or row["response_at"] is None:
        return record_of(row, response=True, body=NO_BODY)
    at = row["response_at"]
    body = await conn.fetchrow(stored_response(at), row["id"], at, row["scope"])
    return record_of(row, response=True, body=body or NO_BODY)


def _unpacked(effect_id: int, kind: str, coding: str, content: bytes) -> bytes:
    try:
        return packing.unpack(coding, content)
    except BodyUnreadable as exc:
        raise BodyUnreadable(
            f"effect {effect_id}: its stored {kind} cannot be read ({exc})", effect_id
        ) from exc


def _stored(
    effect_id: int, status: int | None, headers: bytes | None, coding: str | None, content: bytes | None
) -> StoredResponse | None:
    if status is None or headers is None or coding is None or content is None:
        return None
    body = _unpacked(effect_id, "response", coding, bytes(content))
    return StoredResponse(status=status, headers=head_pairs(bytes(headers)), body=body)


def record_of(
    row: asyncpg.Record | Mapping[str, Any],
    *,
    response: bool = False,
    full: bool = False,
    body: asyncpg.Record | Mapping[str, Any] | None = None,
) -> EffectRecord:
    """The record of ``row``, with the response on record when ``response``: from ``body`` (a row of
    stored_response) when given, else from the row's own r_headers and r_content; with the request's
    headers, body and the history when ``full`` (an operator's view).

    Raises :class:`BodyUnreadable` for a completed effect's response that cannot be read back, unless
    ``full``: that response would be replayed, and garbage must not be, nor the effect sent again.
    """
    unreadable: dict[str, str] = {}
    stored = None
    if response:
        held = (
            body
            if body is not None
            else {"headers": row["r_headers"], "coding": row["r_coding"], "content": row["r_content"]}
        )
        try:
            stored = _stored(
                row["id"], row["response_status"], held["headers"], held["coding"], held["content"]
            )
        except BodyUnreadable as exc:
            unreadable["response"] = str(exc)
    request_body = None
    if full and row["q_content"] is not None:
        try:
            request_body = _unpacked(row["id"], "request", row["q_coding"], bytes(row["q_content"]))
        except BodyUnreadable as exc:
            unreadable["request"] = str(exc)
    history: list[dict[str, Any]] = []
    if full:
        history, why = _events(row["history"])
        if why is not None:
            unreadable["history"] = why
    record = EffectRecord(
        id=row["id"],
        tenant=row["tenant"],
        upstream=row["upstream"],
        key=row["key"],
        derived_key=row["derived_key"],
        method=row["method"],
        path=row["path"],
        query=row["query"],
        fingerprint=row["fingerprint"],
        state=State(row["state"]),
        attempt=row["attempt"],
        may_have_sent=row["may_have_sent"],
        lease_expires_at=row["lease_expires_at"],
        first_sent_at=row["first_sent_at"],
        last_sent_at=row["last_sent_at"],
        completed_at=row["completed_at"],
        created_at=row["created_at"],
        response=stored,
        response_status=row["response_status"],
        response_at=row["response_at"],
        response_read=response,
        recovered_by=row["recovered_by"],
        replays=row["replays"],
        run_id=row["run_id"],
        step=row["step"],
        request_headers=dict(head_pairs(bytes(row["q_headers"] or b""))) if full else {},
        request_body=request_body,
        history=history,
        read_at=row["read_at"],
        keyless=row["keyless"],
        unreadable=unreadable,
        key_carriers=KeyCarriers.from_json(row["key_carriers"]) if row["key_carriers"] is not None else None,
        send_lease=row["send_lease"],
        tool=row["tool"],
    )
    if record.replay_refused and not full:
        # In any other state the response is what the last attempt saw, which no decision reads; an
        # operator's view shows the rest of the effect and why this part is missing.
        raise BodyUnreadable(record.unreadable["response"], record.id)
    return record
