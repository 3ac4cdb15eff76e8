"""The HTML audit page: the effects table for a person, and a banner when something needs an operator.

Server-rendered, no scripts, every value escaped: a key or path an agent sent is data, never markup.
"""

from __future__ import annotations

from html import escape
from urllib.parse import urlencode

from gateway.record import EffectRecord
from gateway.states import State

STATE_COLOURS = {
    State.COMPLETED: "#1b7f3b",
    State.PENDING: "#8a6d00",
    State.RETRYABLE: "#555",
    State.IN_DOUBT: "#b45309",
    State.NEEDS_REVIEW: "#b91c1c",
}

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; margin: 0 0 .2em; }
.counts span { margin-right: 1.2em; }
.review { background: #fdecec; border: 1px solid #b91c1c; padding: .5em .8em; margin-top: 1em; }
.counts a { color: inherit; }
table { border-collapse: collapse; width: 100%; margin-top: 1em; }
th, td { text-align: left; padding: .35em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }
th { background: #f4f4f4; }
td.key, td.path { font-family: ui-monospace, monospace; word-break: break-all; }
.state { font-weight: 600; }
tr.needs_review { background: #fdecec; }
nav { margin-top: 1em; }
"""


def _when(record: EffectRecord) -> str:
    return record.created_at.strftime("%Y-%m-%d %H:%M:%S")


def _row(record: EffectRecord) -> str:
    colour = STATE_COLOURS[record.state]
    status = record.response.status if record.response else "-"
    return (
        f'<tr class="{record.state.value}">'
        f'<td><a href="/_gateway/effects/{record.id}">{record.id}</a></td>'
        f"<td>{escape(_when(record))}</td>"
        f"<td>{escape(record.tenant)}</td>"
        f"<td>{escape(record.upstream)}</td>"
        f'<td class="path">{escape(record.method)} {escape(record.path)}</td>'
        f'<td class="key">{escape(record.key)}</td>'
        f'<td class="state" style="color:{colour}">{record.state.value}</td>'
        f"<td>{status}</td>"
        f"<td>{record.attempt}</td>"
        f"<td>{record.replays}</td>"
        f"<td>{escape(record.recovered_by or '')}</td>"
        f"<td>{escape(record.run_id or '')}{':' + escape(record.step) if record.step else ''}</td>"
        "</tr>"
    )


def render(
    records: list[EffectRecord], counts: dict[str, int], query: dict[str, str], next_before: int | None
) -> str:
    """The page for one page of effects, with counts per state that link to a filter."""
    links = " ".join(
        f'<span><a href="/_gateway/audit?state={state}">{state}</a>: {n}</span>'
        for state, n in counts.items()
    )
    title = "effect-gateway audit"
    if query.get("state"):
        title += f" - {escape(query['state'])}"
    banner = ""
    if (waiting := counts.get(State.NEEDS_REVIEW.value, 0)) and not query.get("state"):
        banner = (
            f'<p class="review">{waiting} effect{"s" if waiting > 1 else ""} may have happened and '
            'nothing can tell: <a href="/_gateway/audit?state=needs_review">review</a>, then resolve with '
            "<code>effect-gateway resolve ID</code>.</p>"
        )
    rows = "\n".join(_row(r) for r in records) or '<tr><td colspan="12">No effects.</td></tr>'
    nav = ""
    if next_before is not None:
        older = escape(urlencode({**query, "before": str(next_before)}))
        nav = f'<nav><a href="/_gateway/audit?{older}">older</a></nav>'
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title><style>{STYLE}</style></head>
<body>
<h1>{title}</h1>
<div class="counts"><span><a href="/_gateway/audit">all</a></span>{links}</div>
{banner}
<table>
<thead><tr><th>id</th><th>created</th><th>tenant</th><th>upstream</th><th>request</th><th>key</th>
<th>state</th><th>status</th><th>attempt</th><th>replays</th><th>recovered by</th><th>run:step</th>
</tr></thead>
<tbody>
{rows}
</tbody>
</table>
{nav}
</body></html>
"""
