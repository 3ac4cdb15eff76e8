"""What the operator's command line prints for a person: tables, one effect in full, an upstream's protection.

Plain functions from values to lines of text; ``--json`` prints the same documents as JSON instead. The
command line prints every line through :func:`printable`, so a value here may hold any character; a
line is one entry of the list (a value holding a line break is escaped with the rest, and cannot pass
for another line).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway.legible import printable
from gateway.policy import HttpProbe, PythonProbe, ToolProbe, UpstreamPolicy

# Bodies longer than this are cut in the readable view of an effect; --json shows them whole.
BODY_PREVIEW = 2000
_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))


def duration(value: timedelta) -> str:
    """``timedelta(days=7)`` as ``7d``, the way the configuration writes it."""
    seconds = value.total_seconds()
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    for unit, size in _UNITS:
        # 24h reads better than 1d: days only from two on, as a key's TTL or a retention is written.
        if seconds % size == 0 and (unit != "d" or seconds >= 2 * size):
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def when(iso: str | None) -> str:
    """An ISO time from the audit as ``2025-06-01 12:00:03Z``: one zone, to the second."""
    if not iso:
        return "-"
    return datetime.fromisoformat(iso).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart; the last column is not padded. Each cell
    is shown :func:`printable` (escaped before the widths are measured, so the columns line up)."""
    cells = [list(headers), *([printable(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def effects_table(effects: list[dict[str, Any]]) -> list[str]:
    if not effects:
        return ["no effects match"]
    rows = [
        [
            str(e["id"]),
            when(e["created_at"]),
            e["state"],
            e["upstream"],
            str(e["response_status"] or "-"),
            f"{e['method']} {e['path']}",
            e["key"],
        ]
        for e in effects
    ]
    lines = table(["id", "created", "state", "upstream", "status", "request", "key"], rows)
    waiting = sum(1 for e in effects if e["state"] in ("needs_review", "in_doubt"))
    note = f"; {waiting} waiting for an operator (effect-gateway resolve ID)" if waiting else ""
    count = f"{len(effects)} effect" if len(effects) == 1 else f"{len(effects)} effects"
    return [*lines, f"{count}, newest first{note}"]


def _body(doc: dict[str, Any], kind: str) -> list[str]:
    prefix = kind + "_body"
    if doc.get(prefix + "_base64") is not None:
        return [f"  ({len(doc[prefix + '_base64']) * 3 // 4} bytes, not text: see --json)"]
    text = doc.get(prefix)
    unreadable = (doc.get("unreadable") or {}).get(kind)
    if text is None and unreadable:
        return [f"  (cannot be read back: {unreadable})"]
    if text is None:
        return ["  (purged after the retention)" if doc.get("response_purged") else "  (none)"]
    lines = ["  " + line for line in _body_lines(text[:BODY_PREVIEW])]
    if len(text) > BODY_PREVIEW:
        lines.append(f"  ... {len(text) - BODY_PREVIEW} more characters (--json shows all)")
    return lines


def _body_lines(text: str) -> list[str]:
    """Split a body at its own line breaks (LF or CRLF) and nowhere else; no empty line after the last."""
    lines = _LINE_BREAK.split(text)
    return lines[:-1] if len(lines) > 1 and not lines[-1] else lines


def effect_detail(doc: dict[str, Any]) -> list[str]:
    """One effect in full: who, what, when, how it ended, its history, the request and response bodies."""
    query = f"?{doc['query']}" if doc["query"] else ""
    fields = [
        ("tenant", doc["tenant"]),
        ("upstream", doc["upstream"]),
        ("request", f"{doc['method']} {doc['path']}{query}"),
        ("key", doc["key"]),
        ("derived key", doc.get("derived_key") or "-"),
        ("run / step", f"{doc['run_id'] or '-'} / {doc['step'] or '-'}"),
        ("created", when(doc["created_at"])),
        ("first sent", when(doc["first_sent_at"])),
        ("last sent", when(doc["last_sent_at"])),
        ("completed", when(doc["completed_at"])),
        ("response", str(doc["response_status"] or "-")),
        ("recovered by", doc["recovered_by"] or "-"),
        ("replays", str(doc["replays"])),
        ("bodies purged", "the response, after the retention" if doc["response_purged"] else "-"),
    ]
    width = max(len(name) for name, _ in fields)
    lines = [f"effect {doc['id']}: {doc['state']} (attempt {doc['attempt']})"]
    lines += [f"  {name.ljust(width)}  {value}" for name, value in fields]
    lines.append("history")
    if (doc.get("unreadable") or {}).get("history"):
        lines.append(f"  (cannot be read back in full: {doc['unreadable']['history']})")
    for event in doc.get("history") or []:
        rest = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("at", "event"))
        lines.append(f"  {when(event.get('at'))}  {event.get('event')}  {rest}".rstrip())
    lines += ["request body", *_body(doc, "request"), "response body", *_body(doc, "response")]
    return lines


# A body's own lines; any other break (a lone CR, a form feed, U+2028) is escaped with the rest.
_LINE_BREAK = re.compile(r"\r?\n")


def _probe_window(policy: UpstreamPolicy) -> str:
    """When a probe's "not found" counts: after its lag, and only for effects inside its horizon."""
    window = []
    if policy.decision.probe_lag > timedelta(0):
        window.append(f"lists an effect {duration(policy.decision.probe_lag)} after it")
    if policy.decision.probe_horizon is not None:
        window.append(f"looks back {duration(policy.decision.probe_horizon)}")
    return f" ({'; '.join(window)})" if window else ""


def protection(policy: UpstreamPolicy) -> tuple[str, list[str]]:
    """What recovers an effect in doubt on this upstream, in the order the gateway tries it; and warnings.

    With a probe, in two parts: on the routes the probe searches (probe.routes), and on any other.
    """
    native = []
    if policy.native_header and policy.native_ttl:
        native.append(f"native key {policy.native_header} for {duration(policy.native_ttl)}")
    last = "re-send (repeat_harmless)" if policy.repeat_harmless else "needs_review"
    probe: str | None
    match policy.probe:
        case HttpProbe() as http:
            probe = f"probe {http.method} {http.path}{_probe_window(policy)}"
        case PythonProbe() as py:
            probe = f"probe {py.entry_point} (Python){_probe_window(policy)}"
        case ToolProbe() as tool:
            probe = f"probe tool {tool.tool}{_probe_window(policy)}"
        case None:
            probe = None
    if probe is not None:
        # A probe always answers (found, not found, failed), and past its horizon "not found" goes to
        # review: on its routes, repeat_harmless is never reached.
        routes = ", ".join(str(route) for route in policy.decision.probe_routes)
        others = "other routes"
        if policy.decision.probe_tools:
            routes, others = ", ".join(policy.decision.probe_tools), "other tools"
        summary = (
            f"on {routes}: {', then '.join([*native, probe, 'needs_review'])}; "
            f"on {others}: {', then '.join([*native, last])}"
        )
    elif native or policy.repeat_harmless:
        summary = ", then ".join([*native, last])
    else:
        summary = "nothing: an effect in doubt goes to needs_review"
    if policy.stamp:
        summary += f"; key stamped in {policy.stamp[0]} {policy.stamp[1]}"
    if policy.protocol == "mcp":
        # Only its tool calls with side effects are effects: the rest passes through (gateway.mcp_proxy).
        summary = f"MCP tool calls with side effects; {summary}"
    return summary, _notes(policy)


def _notes(policy: UpstreamPolicy) -> list[str]:
    """Warnings: a step of recovery that can never be relied on (safe: nothing is sent on it, but useless),
    and a probe that rests on the upstream keeping its native key.

    (What would have recovery send an effect twice is refused when the settings load.)
    """
    notes = []
    rule = policy.decision
    # The key is trusted while the first send is younger than its TTL less one lease (gateway.decision).
    if rule.native_key_ttl is not None and rule.native_key_ttl <= rule.margin:
        notes.append(
            f"native_key.ttl ({duration(rule.native_key_ttl)}) is no longer than the lease "
            f"({duration(rule.lease)}): the native key is never trusted to re-send"
        )
    # "Not found" counts from probe.lag after the first send at the earliest, to probe.horizon less a lease.
    if (
        rule.has_probe
        and rule.probe_horizon is not None
        and rule.probe_horizon <= rule.probe_lag + rule.margin
    ):
        notes.append(
            f"probe.horizon ({duration(rule.probe_horizon)}) is no longer than probe.lag plus the lease "
            f'({duration(rule.probe_lag + rule.lease)}): the probe\'s "not found" is never trusted, and '
            "such an effect goes to needs_review"
        )
    if policy.probe is not None and policy.stamp is None and rule.probe_horizon is not None:
        notes.append(
            f"no stamp: the probe looks for the key sent in {policy.native_header}, which the upstream must "
            f'keep with the effect; its "not found" counts for {duration(rule.probe_horizon)} '
            "(probe.horizon, by default native_key.ttl: an upstream that forgets the key may no longer "
            "find the effect by it), then such an effect goes to needs_review"
        )
    return notes
