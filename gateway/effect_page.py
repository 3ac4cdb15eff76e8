"""One effect's page: who, what and when, the request and the response, its history as a timeline, and
the operator's resolve forms when the effect waits for a verdict.

Rendering only: :mod:`gateway.audit_routes` decides who may see and resolve, and whether the record
waits for an operator (:func:`gateway.decision.resolution` says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any

from gateway.audit_page import BASE, Chrome, badge, layout, notice, time_tag
from gateway.operators import MAX_NAME
from gateway.record import EffectRecord
from gateway.states import State

# The history's events, in a person's words; their fields follow as details.
EVENTS = {
    "claimed": "Claimed: recorded before the request was sent",
    "reclaimed": "Taken again for a new attempt",
    "settled": "Settled",
    "fenced": "A stalled attempt was fenced out (what it saw follows)",
    "needs_review": "Sent to review: an operator must decide",
    "restored": "Restored: the probe found the effect upstream",
    "resolved": "Resolved by an operator",
}

RECOVERIES = {
    "native_key": "re-sent with the same derived key, which the upstream deduplicates",
    "probe": "the probe asked the upstream and found the effect",
    "operator": "an operator's verdict",
    "harmless": "re-sent: a duplicate does no harm on this upstream",
    "never_sent": "re-sent: the earlier attempt never left the gateway",
}

# The states an operator may be asked about; the decision says whether this record is one right now.
_OPERATOR_STATES = (State.NEEDS_REVIEW, State.IN_DOUBT, State.PENDING)


@dataclass(frozen=True, slots=True)
class ResolveForm:
    """What the person typed into "it happened", kept when the page comes back with an error."""

    status: str = "200"
    headers: str = ""
    body: str = ""
    kind: str = "json"
    by: str = ""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the viewer may resolve this record, and if the record cannot be resolved, why not."""

    may_resolve: bool
    # None: the record waits for an operator; else the reason the decision gives.
    blocked: str | None
    csrf: str
    form: ResolveForm = ResolveForm()


def _facts(pairs: list[tuple[str, str]]) -> str:
    rows = "".join(f"<dt>{label}</dt><dd>{value}</dd>" for label, value in pairs)
    return f'<dl class="facts">{rows}</dl>'


def _headers(pairs: list[tuple[str, str]]) -> str:
    if not pairs:
        return '<p class="muted">No headers on record.</p>'
    rows = "".join(
        f'<tr><td>{escape(_shown(k))}</td><td class="mono">{escape(_shown(v))}</td></tr>' for k, v in pairs
    )
    return f'<table class="headers"><tbody>{rows}</tbody></table>'


def _shown(text: str) -> str:
    """A stored header as a page can show it: an upstream's byte that is not UTF-8 as ``\\xe9``.

    Stored headers keep such bytes as lone surrogates ('surrogateescape'), which no page can encode.
    """
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _body(body: bytes | None, absent: str) -> str:
    if body is None:
        return f'<p class="muted">{absent}</p>'
    if not body:
        return '<p class="muted">Empty body.</p>'
    try:
        # A line break right after <pre> is dropped by the HTML parser: a body's own first one stays.
        return f"<pre>\n{escape(body.decode('utf-8'))}</pre>"
    except UnicodeDecodeError:
        return f'<p class="muted">Binary body, {len(body)} bytes: not shown (see the JSON API).</p>'


def _detail(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _event(entry: dict[str, Any]) -> str:
    kind = str(entry.get("event", "?"))
    at = entry.get("at")
    when = time_tag(datetime.fromisoformat(at)) if isinstance(at, str) else ""
    attempt = f"attempt {escape(_detail(entry['attempt']))} · " if "attempt" in entry else ""
    details = " · ".join(
        f"{escape(k.replace('_', ' '))}: {escape(_detail(v))}"
        for k, v in entry.items()
        if k not in ("event", "at", "attempt")
    )
    css = str(entry.get("state", kind)) if kind == "settled" else kind
    return (
        f'<li class="{escape(css)}"><span class="when">{when}</span>'
        f'<span class="what">{attempt}{escape(EVENTS.get(kind, kind))}</span>'
        + (f'<div class="details">{details}</div>' if details else "")
        + "</li>"
    )


def _timeline(record: EffectRecord) -> str:
    if not record.history:
        return (
            _CANNOT_BE_READ
            if "history" in record.unreadable
            else '<p class="muted">No history on record.</p>'
        )
    return f'<ol class="timeline">{"".join(_event(e) for e in record.history)}</ol>'


_CANNOT_BE_READ = '<p class="muted">On record, but it cannot be read back (see above).</p>'
_NO_REQUEST_BODY = "No body on record (none was sent, or the retention dropped it)."


def _unreadable(record: EffectRecord) -> str:
    notices = []
    for kind, why in sorted(record.unreadable.items()):
        after = ""
        if kind == "response" and record.replay_refused:
            after = " A retry is answered 500 and the effect is not sent again."
        if kind == "history":
            text = f"The stored history cannot be read back in full ({escape(why)})."
        else:
            text = f"The stored {kind} body cannot be read back ({escape(why)}); it is left out below.{after}"
        notices.append(notice("error", text))
    return "".join(notices)


def _response(record: EffectRecord) -> str:
    if record.response is not None:
        unsettled = (
            ""
            if record.state is State.COMPLETED
            else '<p class="muted">What the upstream answered the last attempt; it is not replayed.</p>'
        )
        return (
            unsettled
            + _facts([("status", str(record.response.status)), ("stored", time_tag(record.response_at))])
            + "<h3>Headers</h3>"
            + _headers(list(record.response.headers))
            + "<h3>Body</h3>"
            + _body(record.response.body, "No body.")
        )
    if "response" in record.unreadable:
        return _facts([("status", str(record.response_status))]) + _CANNOT_BE_READ
    if record.purged:
        return notice(
            "info",
            f"The response (status {record.response_status}) was purged after the retention; the audit "
            "row stays. A retry gets it from the upstream's probe, or 410; nothing is sent again.",
        )
    return '<p class="muted">No response on record.</p>'


def _resolve_forms(record: EffectRecord, verdict: Verdict) -> str:
    form = verdict.form
    action = f"{BASE}/{record.id}/resolve"
    csrf = (
        f'<input type="hidden" name="csrf" value="{escape(verdict.csrf)}">'
        # The verdict holds for the record as shown: if a gateway acts on it meanwhile, it is refused.
        f'<input type="hidden" name="attempt" value="{record.attempt}">'
    )
    kinds = "".join(
        f'<label class="inline"><input type="radio" name="kind" value="{k}"'
        f"{' checked' if form.kind == k else ''}> {label}</label>"
        for k, label in (("json", "JSON"), ("text", "text"))
    )
    by = (
        '<label for="by-{0}">Your name (kept in the history)</label>'
        f'<input id="by-{{0}}" name="by" value="{{1}}" maxlength="{MAX_NAME}">'
    )
    problem = notice("error", escape(form.error)) if form.error else ""
    # Each textarea's text starts after a line break: an HTML parser drops a line break right after
    # the tag, which would take a body's own first one with it when the form comes back with an error.
    return f"""{problem}<div class="resolve">
<form method="post" action="{action}" aria-label="did not happen">
<h3>It did not happen</h3>
<p class="muted">The upstream never acted on this request. The agent's next retry with this key sends it
again.</p>
{csrf}<input type="hidden" name="happened" value="no">
{by.format("no", "")}
<p><button class="danger" type="submit">Did not happen</button></p>
</form>
<form method="post" action="{action}" aria-label="happened">
<h3>It happened</h3>
<p class="muted">The upstream acted on it. Give the response it gave (look it up there): the agent's next
retry gets exactly this, and nothing is sent.</p>
{csrf}<input type="hidden" name="happened" value="yes">
<label for="status">Status</label>
<input id="status" name="status" type="number" min="200" max="599" value="{escape(form.status)}" required>
<label for="headers">Headers <span class="muted">(one "Name: value" a line; optional)</span></label>
<textarea id="headers" name="headers" rows="2">\n{escape(form.headers)}</textarea>
<label for="body">Body</label> {kinds}
<textarea id="body" name="body" rows="6">\n{escape(form.body)}</textarea>
{by.format("yes", escape(form.by))}
<p><button class="primary" type="submit">Happened: record this response</button></p>
</form>
</div>"""


def _why(record: EffectRecord) -> str:
    """Why the gateway could not tell, as the history says (the last review's reason)."""
    reasons = [e["why"] for e in record.history if e.get("event") == "needs_review" and "why" in e]
    return f"<p>Why it waits: {escape(str(reasons[-1]))}.</p>" if reasons else ""


def _operator(record: EffectRecord, verdict: Verdict) -> str:
    if record.state not in _OPERATOR_STATES:
        return ""
    if verdict.blocked is not None:
        return notice("info", f"Not for an operator now: {escape(verdict.blocked)}.")
    heading = "<h2>Resolve</h2>" + _why(record)
    if not verdict.may_resolve:
        return heading + notice(
            "review",
            "This effect waits for an operator; the gateway's admin resolves it (sign in with the "
            "admin token).",
        )
    return heading + _resolve_forms(record, verdict)


def effect(
    record: EffectRecord, chrome: Chrome | None, verdict: Verdict, message: tuple[str, str] | None = None
) -> str:
    """The whole page for one effect; ``message`` is a notice (kind, text), e.g. after a verdict."""
    target = record.path + ("?" + record.query if record.query else "")
    run_step = record.run_id is not None or record.step is not None
    recovered = (
        f"{escape(record.recovered_by)}: {RECOVERIES.get(record.recovered_by, '')}"
        if record.recovered_by
        else '<span class="muted">-</span>'
    )
    summary = _facts(
        [
            ("state", badge(record.state)),
            ("tenant", escape(record.tenant)),
            ("upstream", escape(record.upstream)),
            ("request", f'<span class="mono">{escape(record.method)} {escape(target)}</span>'),
            *([("MCP tool", f'<span class="mono">{escape(record.tool)}</span>')] if record.tool else []),
            ("key", f'<span class="mono">{escape(record.key)}</span>'),
            ("derived key", f'<span class="mono">{escape(record.derived_key)}</span>'),
            ("run : step", escape(f"{record.run_id or '-'} : {record.step or '-'}") if run_step else "-"),
            # The latest attempt: the one a verdict names (sending to review or resolving is none).
            ("attempt", str(record.attempt)),
            ("replays", str(record.replays)),
            ("recovered by", recovered),
            ("created", time_tag(record.created_at)),
            ("first sent", time_tag(record.first_sent_at)),
            ("last sent", time_tag(record.last_sent_at)),
            ("completed", time_tag(record.completed_at)),
            ("lease ends", time_tag(record.lease_expires_at)),
            ("fingerprint", f'<span class="mono">{escape(record.fingerprint)}</span>'),
        ]
    )
    request_headers = sorted(record.request_headers.items())
    request = [("method", escape(record.method)), ("path", escape(record.path))]
    request.append(("query", escape(record.query) or "-"))
    body = f"""<p><a href="{BASE}">← All effects</a></p>
<h1>Effect {record.id} {badge(record.state)}</h1>
{notice(message[0], escape(message[1])) if message else ""}
{_unreadable(record)}
{_operator(record, verdict)}
<h2>Who, what, when <span class="muted">(times in UTC)</span></h2>
{summary}
<h2>Request</h2>
{_facts(request)}
<h3>Headers <span class="muted">(credentials are never stored)</span></h3>
{_headers(request_headers)}
<h3>Body</h3>
{_CANNOT_BE_READ if "request" in record.unreadable else _body(record.request_body, _NO_REQUEST_BODY)}
<h2>Response</h2>
{_response(record)}
<h2>History</h2>
{_timeline(record)}"""
    return layout(f"Effect {record.id}", body, chrome)
