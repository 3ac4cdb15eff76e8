"""The effects API's words, shared by its routes and the command line: a query to a filter, an effect
to JSON, and an operator's verdict from JSON. Nothing here knows aiohttp.
"""

from __future__ import annotations

import base64
import json
import re
from datetime import UTC, datetime
from typing import Any

from gateway import operators, problems
from gateway.audit_query import EffectFilter
from gateway.errors import HeaderRefused
from gateway.headers import UNSTORED_RESPONSE_HEADERS
from gateway.record import EffectRecord, StoredResponse
from gateway.settings import parse_duration
from gateway.states import State
from gateway.wire import header_line

# A page of the audit: enough to scan by eye, small enough to render at once.
DEFAULT_PAGE = 50
MAX_PAGE = 500
# Effect ids are Postgres bigints.
MAX_ID = 2**63 - 1


# ASCII digits only (str.isdigit() also takes '²' and other scripts' digits, which int() then refuses),
# and few enough that int() never meets its own limit.
_WHOLE_NUMBER = re.compile(r"[0-9]{1,19}")


def _body_fields(prefix: str, body: bytes | None) -> dict[str, Any]:
    if body is None:
        return {prefix: None}
    try:
        return {prefix: body.decode("utf-8")}
    except UnicodeDecodeError:
        return {prefix + "_base64": base64.b64encode(body).decode()}


def _when(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def effect_json(record: EffectRecord, *, full: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": record.id,
        "tenant": record.tenant,
        "upstream": record.upstream,
        "key": record.key,
        "method": record.method,
        "path": record.path,
        "query": record.query,
        # The MCP tool called (its arguments and result are the request's and response's bodies).
        "tool": record.tool,
        "state": record.state.value,
        "attempt": record.attempt,
        # Whether an operator may resolve it now (waiting for one, no lease running): the verdict then
        # names this attempt, and holds only if the effect has not changed since.
        "resolvable": operators.resolvable(record),
        "response_status": record.response_status,
        "recovered_by": record.recovered_by,
        "run_id": record.run_id,
        "step": record.step,
        "created_at": _when(record.created_at),
        "first_sent_at": _when(record.first_sent_at),
        "last_sent_at": _when(record.last_sent_at),
        "completed_at": _when(record.completed_at),
        "replays": record.replays,
        "response_purged": record.purged,
    }
    if full:
        doc["derived_key"] = record.derived_key
        doc["fingerprint"] = record.fingerprint
        doc["may_have_sent"] = record.may_have_sent
        doc["lease_expires_at"] = _when(record.lease_expires_at)
        doc["request_headers"] = record.request_headers
        doc.update(_body_fields("request_body", record.request_body))
        doc["response_headers"] = [list(h) for h in record.response.headers] if record.response else None
        doc.update(_body_fields("response_body", record.response.body if record.response else None))
        doc["history"] = record.history
        # "request"/"response" -> why that stored body cannot be read back (it is then null above);
        # "history" -> why events of it were left out.
        doc["unreadable"] = record.unreadable or None
    return doc


def parse_moment(value: str, name: str) -> datetime:
    """Read an ISO time (UTC when it names no zone) or a duration back from now, such as ``1h``."""
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        pass
    else:
        try:
            # In UTC, as Postgres compares it: 9999-12-31T23:59-14:00 is past the last year Python holds.
            return (when if when.tzinfo is not None else when.replace(tzinfo=UTC)).astimezone(UTC)
        except OverflowError:
            raise problems.BadRequest(f"{name}={value!r} is outside the years 1 to 9999 in UTC") from None
    try:
        return datetime.now(UTC) - parse_duration(value)
    except (ValueError, OverflowError):
        raise problems.BadRequest(
            f"{name}={value!r} is neither an ISO time (2026-01-31T09:00Z) nor a duration like 1h "
            "(at most a century)"
        ) from None


def whole_number(value: str, low: int, high: int) -> int | None:
    """Read ``value`` as an int from ``low`` to ``high``; None when it is anything else."""
    if not _WHOLE_NUMBER.fullmatch(value) or not low <= int(value) <= high:
        return None
    return int(value)


def _int(value: str, name: str, low: int, high: int) -> int:
    number = whole_number(value, low, high)
    if number is None:
        raise problems.BadRequest(f"{name} must be a whole number from {low} to {high}")
    return number


def _text(query: dict[str, str], name: str) -> str | None:
    value = query.get(name)
    if value is not None and "\x00" in value:
        # No Postgres text holds a NUL: asked for one, it refuses the whole statement.
        raise problems.BadRequest(f"{name} may not hold a NUL character")
    return value


def parse_filter(query: dict[str, str], tenant: str | None = None) -> EffectFilter:
    state = query.get("state")
    if state is not None and state not in State.__members__.values():
        raise problems.BadRequest(f"state must be one of {', '.join(s.value for s in State)}")
    return EffectFilter(
        tenant=tenant,
        state=State(state) if state else None,
        upstream=_text(query, "upstream"),
        run_id=_text(query, "run"),
        key=_text(query, "key"),
        since=parse_moment(query["since"], "since") if "since" in query else None,
        until=parse_moment(query["until"], "until") if "until" in query else None,
        before_id=_int(query["before"], "before", 1, MAX_ID) if "before" in query else None,
        limit=_int(query["limit"], "limit", 1, MAX_PAGE) if "limit" in query else DEFAULT_PAGE,
    )


def next_query(where: EffectFilter, last: EffectRecord) -> dict[str, str]:
    """What the query of the page after one ending at ``last`` changes: ``before``, and a span's ends as
    the times this page read. Given as a duration (since=1h), an end would mean a later span by then,
    which may no longer hold ``last``: the next page would be refused, or skip what aged out meanwhile.
    """
    ends = (("since", where.since), ("until", where.until))
    return {**{name: at.isoformat() for name, at in ends if at is not None}, "before": str(last.id)}


def parse_resolution(doc: Any) -> tuple[bool, StoredResponse | None]:
    """``{"happened": false}`` or ``{"happened": true, "response": {"status", "headers", "body"|"json"}}``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("happened"), bool):
        raise problems.BadRequest('send {"happened": true, "response": {...}} or {"happened": false}')
    if not doc["happened"]:
        return False, None
    response = doc.get("response")
    if not isinstance(response, dict) or not isinstance(response.get("status"), int):
        raise problems.BadRequest('"happened": true needs "response": {"status": 201, ...} to replay')
    status = response["status"]
    if not 200 <= status <= 599:
        # A 1xx is no final answer: replayed, it leaves the agent waiting for one that never comes.
        raise problems.BadRequest("response.status must be a final HTTP status, from 200 to 599")
    headers_in = response.get("headers", {})
    if isinstance(headers_in, dict):
        headers = [(str(k), str(v)) for k, v in headers_in.items()]
    elif isinstance(headers_in, list) and all(isinstance(h, list) and len(h) == 2 for h in headers_in):
        headers = [(str(k), str(v)) for k, v in headers_in]
    else:
        raise problems.BadRequest("response.headers must be an object or a list of [name, value]")
    for name, value in headers:
        if name.lower() in UNSTORED_RESPONSE_HEADERS:
            raise problems.BadRequest(f"response.headers may not set {name}: the gateway writes it itself")
        try:
            header_line(name, value)
        except HeaderRefused as exc:
            raise problems.BadRequest(f"response.headers: {exc}") from None
    if "json" in response:
        body = json.dumps(response["json"]).encode()
        if not any(k.lower() == "content-type" for k, _ in headers):
            headers.append(("Content-Type", "application/json"))
    else:
        body_text = response.get("body", "")
        if not isinstance(body_text, str):
            raise problems.BadRequest("response.body must be a string (or give response.json)")
        try:
            body = body_text.encode()
        except UnicodeEncodeError:  # a lone surrogate, which JSON's \\u escapes can spell
            raise problems.BadRequest("response.body must be text (or give response.json)") from None
    return True, StoredResponse(status, tuple(headers), body)
