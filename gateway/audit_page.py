"""The audit as HTML for a person: the layout every audit page shares, the list, sign-in and errors.

Server-rendered, no scripts (the routes send a Content-Security-Policy that forbids them), styles from
one stylesheet, every value escaped: a key, path or header an agent sent is data, never markup. Times
are UTC and say so (ISO 8601 with ``Z``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from urllib.parse import urlencode

from gateway.record import EffectRecord
from gateway.states import State

BASE = "/_gateway/audit"

# What each state means to the person reading the list, beside its colour.
STATE_HINTS = {
    State.PENDING: "claimed; the call may be under way",
    State.COMPLETED: "happened; its response is replayed",
    State.RETRYABLE: "did not happen; the next retry sends it",
    State.IN_DOUBT: "may have happened; the next retry recovers it",
    State.NEEDS_REVIEW: "may have happened and nothing can tell: an operator decides",
}

STYLESHEET = """
:root { --ink: #1f2328; --muted: #59636e; --line: #d1d9e0; --soft: #f6f8fa; --link: #0550ae; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: var(--ink); }
header.top { display: flex; align-items: center; gap: 1em; padding: .7em 1.5em; background: #24292f;
  color: #fff; }
header.top a { color: #fff; text-decoration: none; font-weight: 600; }
header.top .who { margin-left: auto; color: #d0d7de; }
header.top form { margin: 0; }
header.top button { background: transparent; color: #fff; border: 1px solid #8c959f; }
main { padding: 1em 1.5em 3em; max-width: 1400px; }
h1 { font-size: 1.45em; margin: .3em 0 .5em; }
h2 { font-size: 1.1em; margin: 1.6em 0 .5em; padding-bottom: .25em; border-bottom: 1px solid var(--line); }
a { color: var(--link); }
code, pre, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px; }
pre { background: var(--soft); border: 1px solid var(--line); padding: .7em; white-space: pre-wrap;
  word-break: break-all; max-height: 30em; overflow: auto; margin: .3em 0; }
.muted { color: var(--muted); }
.notice { padding: .6em .9em; border-radius: 6px; margin: .8em 0; border: 1px solid; }
.notice.review { background: #ffebe9; border-color: #cf222e; }
.notice.ok { background: #dafbe1; border-color: #1a7f37; }
.notice.error { background: #ffebe9; border-color: #cf222e; }
.notice.info { background: #ddf4ff; border-color: #54aeff; }
.counts { display: flex; flex-wrap: wrap; gap: .5em; margin: .5em 0 1em; }
.counts a { text-decoration: none; }
.badge { display: inline-block; padding: .1em .6em; border-radius: 1em; font-weight: 600; font-size: 12.5px;
  border: 1px solid transparent; white-space: nowrap; }
.counts .badge.current { outline: 2px solid var(--ink); }
.badge.all { background: var(--soft); border-color: var(--line); color: var(--ink); }
.badge.completed { background: #dafbe1; color: #116329; border-color: #4ac26b; }
.badge.pending { background: #fff8c5; color: #7d4e00; border-color: #d4a72c; }
.badge.retryable { background: #eaeef2; color: #424a53; border-color: #afb8c1; }
.badge.in_doubt { background: #fff1e5; color: #953800; border-color: #fb8f44; }
.badge.needs_review { background: #ffebe9; color: #a40e26; border-color: #ff8182; }
form.filters { display: flex; flex-wrap: wrap; gap: .6em 1em; align-items: end; padding: .8em;
  background: var(--soft); border: 1px solid var(--line); border-radius: 6px; }
form.filters div { display: flex; flex-direction: column; }
form.filters label { font-size: 12.5px; color: var(--muted); }
input, select, textarea, button { font: inherit; padding: .3em .5em; border: 1px solid var(--line);
  border-radius: 5px; color: var(--ink); background: #fff; }
textarea { width: 100%; font-family: ui-monospace, monospace; font-size: 13px; }
button { cursor: pointer; background: var(--soft); }
button.primary { background: #1f883d; color: #fff; border-color: #1a7f37; font-weight: 600; }
button.danger { background: #fff; color: #a40e26; border-color: #cf222e; font-weight: 600; }
table { border-collapse: collapse; width: 100%; margin-top: 1em; }
th, td { text-align: left; padding: .4em .6em; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--soft); font-weight: 600; white-space: nowrap; }
tbody tr:hover { background: #f6f8fa; }
tr.needs_review { background: #fff5f5; }
td.key, td.request { font-family: ui-monospace, monospace; font-size: 13px; word-break: break-all; }
td.when, td.num { white-space: nowrap; }
.num { text-align: right; }
nav.pages { display: flex; gap: 1.5em; margin-top: 1em; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .25em 1.2em; margin: 0; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; word-break: break-all; }
table.headers { width: auto; min-width: 40%; margin-top: .3em; }
table.headers td:first-child { white-space: nowrap; color: var(--muted); }
ol.timeline { list-style: none; padding: 0; margin: 0; border-left: 3px solid var(--line); }
ol.timeline li { position: relative; padding: .35em 0 .6em 1.2em; }
ol.timeline li::before { content: ""; position: absolute; left: -8px; top: .75em; width: 13px; height: 13px;
  border-radius: 50%; background: #fff; border: 3px solid #8c959f; }
ol.timeline li.completed::before, ol.timeline li.restored::before { border-color: #1a7f37; }
ol.timeline li.needs_review::before, ol.timeline li.fenced::before { border-color: #cf222e; }
ol.timeline li.in_doubt::before, ol.timeline li.reclaimed::before { border-color: #fb8f44; }
ol.timeline li.resolved::before { border-color: #0969da; }
ol.timeline .when { color: var(--muted); margin-right: .8em; }
ol.timeline .what { font-weight: 600; }
ol.timeline .details { color: var(--muted); margin-top: .1em; }
.resolve { display: grid; grid-template-columns: 1fr 2fr; gap: 1em; }
.resolve form { border: 1px solid var(--line); border-radius: 6px; padding: .8em 1em; }
.resolve h3 { margin: 0 0 .4em; font-size: 1em; }
.resolve label { display: block; margin: .5em 0 .2em; font-weight: 600; }
.resolve label.inline { display: inline; margin-left: 1em; font-weight: normal; }
.resolve input[type=number] { width: 7em; }
.signin { max-width: 28em; margin: 3em auto; border: 1px solid var(--line); border-radius: 8px;
  padding: 1.5em; }
.signin input { width: 100%; margin: .4em 0 1em; }
"""


@dataclass(frozen=True, slots=True)
class Chrome:
    """What the header of every page shows: who is looking, and the sign-out form when signed in."""

    who: str
    csrf: str
    signed_in: bool


def utc(moment: datetime | None) -> str:
    """ISO 8601 in UTC with its zone, to the second: what every page shows for a time."""
    if moment is None:
        return "-"
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def time_tag(moment: datetime | None) -> str:
    if moment is None:
        return '<span class="muted">-</span>'
    return f'<time datetime="{moment.astimezone(UTC).isoformat()}">{utc(moment)}</time>'


def badge(state: State | str) -> str:
    value = State(state).value
    return f'<span class="badge {value}" title="{escape(STATE_HINTS[State(value)])}">{value}</span>'


def href(query: Mapping[str, str], path: str = BASE) -> str:
    """A link to ``path`` with ``query``, escaped for an attribute."""
    return escape(path + ("?" + urlencode(dict(query)) if query else ""))


def layout(title: str, body: str, chrome: Chrome | None, status_line: str = "") -> str:
    """A whole page: header (with who is signed in and sign-out), title, and ``body`` (already HTML)."""
    top = f'<a href="{BASE}">effect-gateway audit</a>'
    if chrome is not None:
        top += f'<span class="who">{escape(chrome.who)}</span>'
        if chrome.signed_in:
            top += (
                f'<form method="post" action="{BASE}/sign-out">'
                f'<input type="hidden" name="csrf" value="{escape(chrome.csrf)}">'
                '<button type="submit">Sign out</button></form>'
            )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)} · effect-gateway</title>
<link rel="stylesheet" href="{BASE}/style.css">
</head>
<body>
<header class="top">{top}</header>
<main>
{status_line}
{body}
</main>
</body></html>
"""


def notice(kind: str, html: str) -> str:
    return f'<div class="notice {kind}" role="{"alert" if kind == "error" else "status"}">{html}</div>'


def sign_in(next_path: str, error: str | None = None) -> str:
    """The sign-in form: one token field; ``next_path`` is where the person was going."""
    problem = notice("error", escape(error)) if error else ""
    body = f"""<div class="signin">
<h1>Sign in</h1>
<p class="muted">Give the gateway's admin token to see every effect and resolve those that wait for an
operator, or a tenant's token (its <code>Effect-Gateway-Token</code>) to read that tenant's effects.
You stay signed in for 8 hours in this browser.</p>
{problem}
<form method="post" action="{BASE}/sign-in">
<label for="token">Token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<input type="hidden" name="next" value="{escape(next_path)}">
<button class="primary" type="submit">Sign in</button>
</form>
</div>"""
    return layout("Sign in", body, None)


def error_page(title: str, detail: str, chrome: Chrome | None) -> str:
    back = f'<p><a href="{BASE}">Back to the audit</a></p>'
    body = f"<h1>{escape(title)}</h1>{notice('error', escape(detail))}{back}"
    return layout(title, body, chrome)


@dataclass(frozen=True, slots=True)
class Listing:
    """One page of the list: the records, the filters that chose them, and where the next page starts."""

    records: list[EffectRecord]
    counts: dict[str, int]
    # The filters as given (empty fields left out, without the page cursor ``before``).
    query: dict[str, str]
    # What the next page's query changes (gateway.effects_json.next_query); None on the last page.
    older: dict[str, str] | None
    upstreams: Iterable[str]
    may_resolve: bool
    # Whether this page starts further back than the newest (a ``before`` cursor was given).
    paged: bool = False
    error: str | None = None


def _counts(counts: Mapping[str, int], current: str | None) -> str:
    chips = [f'<a href="{BASE}"><span class="badge all{" current" if not current else ""}">all</span></a>']
    for state, n in counts.items():
        mark = " current" if state == current else ""
        chips.append(
            f'<a href="{href({"state": state})}" title="{escape(STATE_HINTS[State(state)])}">'
            f'<span class="badge {state}{mark}">{state}: {n}</span></a>'
        )
    return f'<div class="counts" aria-label="effects by state">{"".join(chips)}</div>'


def _banner(counts: Mapping[str, int], current: str | None, may_resolve: bool) -> str:
    waiting = counts.get(State.NEEDS_REVIEW.value, 0)
    if not waiting or current == State.NEEDS_REVIEW.value:
        return ""
    who = "open each one and resolve it" if may_resolve else "the gateway's admin resolves them"
    doubt = counts.get(State.IN_DOUBT.value, 0)
    also = f" ({doubt} more in doubt: their next retry recovers them)" if doubt else ""
    many = waiting != 1
    return notice(
        "review",
        f"<strong>{waiting} effect{'s wait' if many else ' waits'} for an operator</strong>: "
        f"{'each' if many else 'it'} may have happened and nothing can tell{also}. "
        f'<a href="{href({"state": State.NEEDS_REVIEW.value})}">Show them</a>, then {who}.',
    )


def _filters(query: Mapping[str, str], upstreams: Iterable[str]) -> str:
    def field(name: str, label: str, control: str) -> str:
        return f'<div><label for="f-{name}">{label}</label>{control}</div>'

    def text(name: str, label: str, placeholder: str, extra: str = "") -> str:
        value = escape(query.get(name, ""))
        attrs = f'id="f-{name}" name="{name}" value="{value}" placeholder="{escape(placeholder)}"{extra}'
        return field(name, label, f"<input {attrs}>")

    states = "".join(
        f'<option value="{s.value}"{" selected" if query.get("state") == s.value else ""}>{s.value}</option>'
        for s in State
    )
    known = "".join(f'<option value="{escape(u)}">' for u in upstreams)
    limit = query.get("limit")
    keep = f'<input type="hidden" name="limit" value="{escape(limit)}">' if limit else ""
    return f"""<form class="filters" method="get" action="{BASE}" aria-label="filters">
{field("state", "State", f'<select id="f-state" name="state"><option value="">any</option>{states}</select>')}
{text("upstream", "Upstream", "any", ' list="upstreams" size="10"')}
<datalist id="upstreams">{known}</datalist>
{text("run", "Run", "run id", ' size="14"')}
{text("key", "Key", "Idempotency-Key", ' size="18"')}
{text("since", "Since (UTC)", "1h or 2026-01-31T09:00Z", ' size="24"')}
{text("until", "Until (UTC)", "30m or 2026-01-31T18:00Z", ' size="24"')}
{keep}
<button class="primary" type="submit">Filter</button>
<a href="{BASE}">Clear</a>
</form>"""


def _row(record: EffectRecord) -> str:
    status = str(record.response_status) if record.response_status is not None else "-"
    target = record.path + ("?" + record.query if record.query else "")
    run = escape(record.run_id or "") + (":" + escape(record.step) if record.step else "")
    return (
        f'<tr class="{record.state.value}">'
        f'<td><a href="{BASE}/{record.id}">{record.id}</a></td>'
        f'<td class="when">{time_tag(record.created_at)}</td>'
        f"<td>{escape(record.tenant)}</td>"
        f"<td>{escape(record.upstream)}</td>"
        f'<td class="request">{escape(record.method)} {escape(target)}</td>'
        f'<td class="key">{escape(record.key)}</td>'
        f"<td>{badge(record.state)}</td>"
        f'<td class="num">{status}</td>'
        f'<td class="num">{record.attempt}</td>'
        f'<td class="num">{record.replays}</td>'
        f"<td>{escape(record.recovered_by or '')}</td>"
        f"<td>{run}</td>"
        "</tr>"
    )


def listing(page: Listing, chrome: Chrome | None) -> str:
    """The list: counts per state linking to a filter, a banner when effects wait, filters, the table."""
    current = page.query.get("state")
    title = f"Effects: {current}" if current else "Effects"
    rows = "\n".join(_row(r) for r in page.records)
    if not rows:
        rows = '<tr><td colspan="12" class="muted">No effects match these filters.</td></tr>'
    links = []
    if page.paged:
        links.append(f'<a href="{href(page.query)}">← Newest</a>')
    if page.older is not None:
        links.append(f'<a rel="next" href="{href({**page.query, **page.older})}">Older →</a>')
    body = f"""<h1>{escape(title)}</h1>
{_counts(page.counts, current)}
{_banner(page.counts, current, page.may_resolve)}
{notice("error", escape(page.error)) if page.error else ""}
{_filters(page.query, page.upstreams)}
<table>
<thead><tr><th>id</th><th>created (UTC)</th><th>tenant</th><th>upstream</th><th>request</th><th>key</th>
<th>state</th><th class="num">status</th><th class="num">attempt</th><th class="num">replays</th>
<th>recovered by</th><th>run:step</th>
</tr></thead>
<tbody>
{rows}
</tbody>
</table>
<nav class="pages">{"".join(links)}</nav>"""
    return layout(title, body, chrome)
