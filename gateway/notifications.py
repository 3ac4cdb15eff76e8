"""Telling an operator of effects that wait for them: which waits are told, what is sent, when to retry.

No I/O here: :mod:`gateway.webhooks` finds the waits in Postgres, posts the bodies made here and records
how each went. A wait is told once: the notification's key is (effect, event, attempt), so every sweep of
every gateway that sees the same wait finds it told already, and an effect resolved and waiting again
at a later attempt is told again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from gateway.states import State

Event = Literal["needs_review", "in_doubt"]
Shape = Literal["json", "slack"]


@dataclass(frozen=True, slots=True)
class Wait:
    """An open state an effect may wait in, the event it is told as, and how long before it is told."""

    state: State
    event: Event
    # Told once it has lasted the webhook's in_doubt_after; else as soon as it is seen.
    after_in_doubt: bool


# Every wait that is told, and only these (a retryable effect waits for its agent, which sends it as
# soon as it retries; nobody else can do anything for it). A pending effect whose lease ran out long ago
# is in doubt as much as one marked so (its gateway died holding it), and waits for the same retry.
WAITS = (
    Wait(State.NEEDS_REVIEW, "needs_review", after_in_doubt=False),
    Wait(State.IN_DOUBT, "in_doubt", after_in_doubt=True),
    Wait(State.PENDING, "in_doubt", after_in_doubt=True),
)

# The longest wait between two tries of one delivery: a receiver back up hears within 15 minutes.
LONGEST_WAIT = timedelta(minutes=15)


def waits_told(in_doubt_after: timedelta) -> list[tuple[str, str, timedelta]]:
    """(open state, event, how long it must have waited) for each wait that is told."""
    return [(w.state.value, w.event, in_doubt_after if w.after_in_doubt else timedelta(0)) for w in WAITS]


@dataclass(frozen=True, slots=True)
class Notice:
    """One notification as recorded: the wait it tells of and the effect, as they were when noticed."""

    id: str
    event: Event
    effect_id: int
    attempt: int
    state: str
    tenant: str
    upstream: str
    method: str
    path: str
    created_at: datetime
    run_id: str | None
    step: str | None
    waiting_since: datetime
    noticed_at: datetime
    tries: int = 0


def audit_path(effect_id: int) -> str:
    return f"/_gateway/audit/{effect_id}"


def _what_to_do(notice: Notice) -> str:
    resolve = f"effect-gateway resolve {notice.effect_id} --attempt {notice.attempt}"
    if notice.event == "needs_review":
        return (
            "Nobody can tell whether the effect happened: look for it in the upstream, then resolve it "
            f"with `{resolve} --did-not-happen` (the next retry sends it) or `{resolve} --happened "
            "--status STATUS --body BODY` (that answer is replayed). Until then its retries get 409."
        )
    return (
        "The effect may have happened, and its agent has not retried since: a retry recovers it (a "
        "probe, the upstream's key, or review). If the agent will not retry, look for it in the "
        f"upstream and resolve it with `{resolve} --did-not-happen` or `--happened`."
    )


def document(notice: Notice, now: datetime, admin_url: str | None = None) -> dict[str, Any]:
    """The generic JSON notification: the wait, the effect, and what to do. Never a request's or a
    response's body or headers, never a key: only what the audit page's list shows."""
    path = audit_path(notice.effect_id)
    waited = max(timedelta(0), now - notice.waiting_since)
    return {
        "id": notice.id,
        "event": notice.event,
        "effect": {
            "id": notice.effect_id,
            "tenant": notice.tenant,
            "upstream": notice.upstream,
            "method": notice.method,
            "path": notice.path,
            "state": notice.state,
            "attempt": notice.attempt,
            "created_at": notice.created_at.isoformat(),
            "run_id": notice.run_id,
            "step": notice.step,
        },
        "waiting_since": notice.waiting_since.isoformat(),
        "waited_seconds": int(waited.total_seconds()),
        "noticed_at": notice.noticed_at.isoformat(),
        "audit_path": path,
        "audit_url": f"{admin_url.rstrip('/')}{path}" if admin_url else None,
        "what_to_do": _what_to_do(notice),
    }


def _slack_escaped(text: str) -> str:
    # Slack reads &, < and > as its markup (links, mentions): anything else would be taken for one.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _spoken(duration: timedelta) -> str:
    seconds = int(duration.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def slack_message(notice: Notice, now: datetime, admin_url: str | None = None) -> dict[str, Any]:
    """What Slack's incoming webhooks post as a message: one ``text`` field, in Slack's markup."""
    doc = document(notice, now, admin_url)
    headline = "needs review" if notice.event == "needs_review" else "is still in doubt"
    effect = doc["effect"]
    request = _slack_escaped(f"{effect['method']} {effect['upstream']}{effect['path']}")
    where = f"<{doc['audit_url']}|audit page>" if doc["audit_url"] else f"audit page `{doc['audit_path']}`"
    lines = [
        f"*Effect {notice.effect_id} {headline}* (attempt {notice.attempt}, waiting "
        f"{_spoken(now - notice.waiting_since)})",
        f"`{request}`, tenant {_slack_escaped(notice.tenant)}"
        + (f", run {_slack_escaped(notice.run_id)}" if notice.run_id else "")
        + (f" step {_slack_escaped(notice.step)}" if notice.step else ""),
        f"{where}. {_slack_escaped(doc['what_to_do'])}",
        f"notification {notice.id}",
    ]
    return {"text": "\n".join(lines)}


def body(notice: Notice, now: datetime, shape: Shape, admin_url: str | None = None) -> bytes:
    """The request body posted for ``notice`` in ``shape``, as UTF-8 JSON."""
    made = slack_message(notice, now, admin_url) if shape == "slack" else document(notice, now, admin_url)
    return json.dumps(made).encode()


def delivered(status: int) -> bool:
    """Whether a receiver's answer takes the notification: any 2xx (Slack answers 200 "ok")."""
    return 200 <= status < 300


@dataclass(frozen=True, slots=True)
class Retry:
    """Try the delivery again after ``wait``."""

    wait: timedelta


@dataclass(frozen=True, slots=True)
class GiveUp:
    """No more tries: the notification was noticed longer than give_up_after ago."""


def after_failure(
    notice: Notice,
    now: datetime,
    *,
    retry_after: timedelta,
    give_up_after: timedelta,
    asked: timedelta | None = None,
) -> Retry | GiveUp:
    """What follows the ``notice.tries``-th failed delivery, at ``now`` (the database's clock).

    The wait doubles from ``retry_after`` with each try, up to :data:`LONGEST_WAIT`, or is what the
    receiver ``asked`` (a 429's or 503's Retry-After, up to that cap) when that is longer. A try that
    would fall after ``give_up_after`` since the wait was noticed is not made.
    """
    doubled = retry_after * 2 ** min(max(notice.tries - 1, 0), 20)  # 2**20: far past the cap
    wait = min(doubled, LONGEST_WAIT)
    if asked is not None:
        # Within reason: a receiver asking for a day would have the notification given up at once.
        wait = max(wait, min(asked, LONGEST_WAIT))
    if now + wait > notice.noticed_at + give_up_after:
        return GiveUp()
    return Retry(wait)
