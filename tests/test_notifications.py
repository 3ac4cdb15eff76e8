"""Which waits are told, what a notification says, and when a failed delivery is tried again: no I/O."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from gateway.notifications import (
    LONGEST_WAIT,
    GiveUp,
    Notice,
    Retry,
    after_failure,
    body,
    delivered,
    document,
    slack_message,
    waits_told,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
REVIEW = Notice(
    id="6f1c0b4e-0000-4000-8000-000000000001",
    event="needs_review",
    effect_id=42,
    attempt=2,
    state="needs_review",
    tenant="grocer",
    upstream="shop",
    method="POST",
    path="/orders/<b>&",
    created_at=NOW - timedelta(hours=3),
    run_id="run-7",
    step="4",
    waiting_since=NOW - timedelta(minutes=5),
    noticed_at=NOW - timedelta(minutes=4),
    tries=1,
)
SECOND = timedelta(seconds=1)


def test_review_is_told_at_once_and_doubt_only_after_in_doubt_after() -> None:
    """An effect waiting for review is told as soon as it is seen; one in doubt, or pending with its
    lease run out, only once it has waited in_doubt_after; a retryable one never."""
    assert waits_told(timedelta(hours=1)) == [
        ("needs_review", "needs_review", timedelta(0)),
        ("in_doubt", "in_doubt", timedelta(hours=1)),
        ("pending", "in_doubt", timedelta(hours=1)),
    ]


@pytest.mark.parametrize(
    ("tries", "now", "asked", "expected"),
    [
        (1, NOW, None, Retry(10 * SECOND)),  # the first wait
        (2, NOW, None, Retry(20 * SECOND)),  # doubled
        (5, NOW, None, Retry(160 * SECOND)),
        (9, NOW, None, Retry(LONGEST_WAIT)),  # capped at 15 minutes
        (400, NOW, None, Retry(LONGEST_WAIT)),  # however many tries
        (1, NOW, 120 * SECOND, Retry(120 * SECOND)),  # a 429's Retry-After, when longer
        (3, NOW, 5 * SECOND, Retry(40 * SECOND)),  # ...not when shorter
        (1, NOW, timedelta(days=2), Retry(LONGEST_WAIT)),  # and never past the cap
        (1, NOW + timedelta(hours=24) - 15 * SECOND, None, GiveUp()),  # the next would fall past a day
        (1, NOW + timedelta(hours=24) - 30 * SECOND, None, Retry(10 * SECOND)),  # this one does not
    ],
)
def test_a_failed_delivery_is_tried_again_later_and_later_then_given_up(
    tries: int, now: datetime, asked: timedelta | None, expected: Retry | GiveUp
) -> None:
    """Failed deliveries wait 10 s, doubling to 15 min, longer if the receiver asks, for a day at most."""
    notice = replace(REVIEW, tries=tries, noticed_at=NOW - 20 * SECOND)
    got = after_failure(notice, now, retry_after=10 * SECOND, give_up_after=timedelta(hours=24), asked=asked)
    assert got == expected


@pytest.mark.parametrize(
    ("status", "taken"), [(200, True), (204, True), (299, True), (301, False), (429, False), (500, False)]
)
def test_only_a_2xx_answer_takes_a_notification(status: int, taken: bool) -> None:
    """A redirect, a 4xx or a 5xx from the receiver is a failed delivery, tried again."""
    assert delivered(status) is taken


def test_the_json_notification_says_what_waits_and_what_to_do() -> None:
    """The generic notification names the effect, how long it waited, its audit page and the command."""
    doc = document(REVIEW, NOW, "https://ops.example:8788/")
    assert doc["id"] == REVIEW.id
    assert doc["event"] == "needs_review"
    assert doc["effect"]["id"] == 42
    assert doc["effect"]["attempt"] == 2
    assert doc["effect"]["created_at"] == "2026-12-02T09:00:00+00:00"
    assert (doc["effect"]["run_id"], doc["effect"]["step"]) == ("run-7", "4")
    assert doc["waited_seconds"] == 300
    assert doc["audit_path"] == "/_gateway/audit/42"
    assert doc["audit_url"] == "https://ops.example:8788/_gateway/audit/42"
    assert "effect-gateway resolve 42 --attempt 2 --did-not-happen" in doc["what_to_do"]
    assert document(REVIEW, NOW)["audit_url"] is None
    assert json.loads(body(REVIEW, NOW, "json")) == document(REVIEW, NOW)


def test_the_slack_message_is_one_text_with_slacks_markup_escaped() -> None:
    """Slack gets one text field; a path's &, < and > cannot turn into Slack links or mentions."""
    message = slack_message(REVIEW, NOW, "https://ops.example:8788")
    assert list(message) == ["text"]
    text = message["text"]
    assert text.startswith("*Effect 42 needs review* (attempt 2, waiting 5m)")
    assert "`POST shop/orders/&lt;b&gt;&amp;`" in text
    assert "<https://ops.example:8788/_gateway/audit/42|audit page>" in text
    assert "<b>" not in text
    assert json.loads(body(REVIEW, NOW, "slack", "https://ops.example:8788")) == message
    doubt = slack_message(replace(REVIEW, event="in_doubt", state="pending"), NOW)
    assert doubt["text"].startswith("*Effect 42 is still in doubt*")
    assert "audit page `/_gateway/audit/42`" in doubt["text"]
