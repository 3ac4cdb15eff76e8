"""Table tests of the pure decision, grouped by the rows of DESIGN.md's state table."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from gateway.decision import (
    Busy,
    Mismatch,
    Policy,
    Probe,
    Purged,
    Replay,
    Request,
    Resend,
    Review,
    Unknown,
    decide,
    resolution,
    settle,
)
from gateway.outcome import Answered, NoAnswer, NotSent
from gateway.record import EffectRecord, StoredResponse
from gateway.states import TRANSITIONS, IllegalTransition, State, check_transition

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=35)
OK = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id": 1}')

PLAIN = Policy(lease=LEASE)
NATIVE = Policy(lease=LEASE, native_key_ttl=timedelta(hours=24))
PROBED = Policy(lease=LEASE, has_probe=True)
NATIVE_PROBED = Policy(lease=LEASE, native_key_ttl=timedelta(hours=24), has_probe=True)
HARMLESS = Policy(lease=LEASE, repeat_harmless=True)


def record(state: State, **changes: object) -> EffectRecord:
    base = EffectRecord(
        id=1,
        tenant="t",
        upstream="shop",
        key="k",
        derived_key="eg_x",
        method="POST",
        path="/orders",
        query="",
        fingerprint="fp",
        state=state,
        attempt=1,
        may_have_sent=state is not State.RETRYABLE,
        lease_expires_at=NOW - timedelta(seconds=1),
        first_sent_at=NOW - timedelta(minutes=1),
        last_sent_at=NOW - timedelta(minutes=1),
        completed_at=None,
        created_at=NOW - timedelta(minutes=1),
        response=OK if state is State.COMPLETED else None,
        purged_at=None,
        recovered_by=None,
        replays=0,
        run_id=None,
        step=None,
        read_at=NOW,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


SAME = Request(fingerprint="fp")


@pytest.mark.parametrize(
    ("rec", "policy", "expected"),
    [
        # completed: a definitive response is stored -> replayed, whatever the policy
        (record(State.COMPLETED), PLAIN, Replay()),
        (record(State.COMPLETED), NATIVE_PROBED, Replay()),
        # completed, bodies purged after the retention -> native key (fresh), probe, else 410; never blind
        (record(State.COMPLETED, response=None, purged_at=NOW), NATIVE, Resend("native_key")),
        (record(State.COMPLETED, response=None, purged_at=NOW), PROBED, Probe()),
        (record(State.COMPLETED, response=None, purged_at=NOW), HARMLESS, Purged()),
        (record(State.COMPLETED, response=None, purged_at=NOW), PLAIN, Purged()),
        (
            record(State.COMPLETED, response=None, purged_at=NOW, first_sent_at=NOW - timedelta(days=8)),
            NATIVE,
            Purged(),
        ),
    ],
)
def test_completed(rec: EffectRecord, policy: Policy, expected: object) -> None:
    """A completed record replays; a purged one recovers only by ways that cannot duplicate."""
    assert decide(rec, SAME, NOW, policy) == expected


@pytest.mark.parametrize(
    ("rec", "policy", "expected"),
    [
        # pending, lease held -> 409 / wait for the rest of the lease
        (
            record(State.PENDING, lease_expires_at=NOW + timedelta(seconds=10)),
            PLAIN,
            Busy(timedelta(seconds=10)),
        ),
        # pending, lease ran out -> recovery; the claim counts as a possible send
        (record(State.PENDING, may_have_sent=False), PLAIN, Review()),
        (record(State.PENDING, may_have_sent=False), NATIVE, Resend("native_key")),
        (record(State.PENDING, may_have_sent=False), PROBED, Probe()),
        (record(State.PENDING, may_have_sent=False), HARMLESS, Resend("harmless")),
    ],
)
def test_pending(rec: EffectRecord, policy: Policy, expected: object) -> None:
    """A pending record is busy while its lease holds, and in doubt once it runs out."""
    assert decide(rec, SAME, NOW, policy) == expected


def test_retryable_is_sent_again() -> None:
    """Nothing happened upstream and nothing may have: the next request sends."""
    assert decide(record(State.RETRYABLE), SAME, NOW, PLAIN) == Resend("retryable")


@pytest.mark.parametrize(
    ("rec", "policy", "expected"),
    [
        # an attempt that timed out may still be running upstream until its lease ends
        (
            record(State.IN_DOUBT, lease_expires_at=NOW + timedelta(seconds=5)),
            PROBED,
            Busy(timedelta(seconds=5)),
        ),
        # rule 1: known never sent -> send
        (record(State.IN_DOUBT, may_have_sent=False), PLAIN, Resend("never_sent")),
        # rule 2: native key younger than its TTL less one lease -> send again with the same key
        (record(State.IN_DOUBT), NATIVE, Resend("native_key")),
        (record(State.IN_DOUBT, first_sent_at=NOW - timedelta(hours=23)), NATIVE, Resend("native_key")),
        # ... at TTL - lease the key is no longer trusted (the margin is at least one lease)
        (record(State.IN_DOUBT, first_sent_at=NOW - (timedelta(hours=24) - LEASE)), NATIVE, Review()),
        (record(State.IN_DOUBT, first_sent_at=NOW - timedelta(hours=25)), NATIVE, Review()),
        # rule 3: a probe is configured -> probe (native key too old)
        (record(State.IN_DOUBT, first_sent_at=NOW - timedelta(hours=25)), NATIVE_PROBED, Probe()),
        (record(State.IN_DOUBT), PROBED, Probe()),
        # rule 4: otherwise needs_review, or send where duplicates are harmless
        (record(State.IN_DOUBT), PLAIN, Review()),
        (record(State.IN_DOUBT), HARMLESS, Resend("harmless")),
    ],
)
def test_in_doubt(rec: EffectRecord, policy: Policy, expected: object) -> None:
    """DESIGN.md's recovery order, rule by rule."""
    assert decide(rec, SAME, NOW, policy) == expected


def test_needs_review_waits_for_an_operator() -> None:
    """needs_review answers outcome-unknown until resolved, even with a probe configured."""
    assert decide(record(State.NEEDS_REVIEW), SAME, NOW, NATIVE_PROBED) == Unknown()


@pytest.mark.parametrize("state", list(State))
def test_another_request_with_the_key_is_refused_in_every_state(state: State) -> None:
    """The same key with a different fingerprint is a 422 whatever the record's state."""
    assert decide(record(state), Request(fingerprint="other"), NOW, NATIVE_PROBED) == Mismatch()


@pytest.mark.parametrize(
    ("outcome", "earlier_doubt", "state", "may_have_sent"),
    [
        (Answered(201, (), b""), False, State.COMPLETED, True),
        (Answered(400, (), b""), False, State.COMPLETED, True),
        (Answered(404, (), b""), False, State.COMPLETED, True),
        (Answered(501, (), b""), False, State.COMPLETED, True),
        (Answered(408, (), b""), False, State.RETRYABLE, False),
        (Answered(425, (), b""), False, State.RETRYABLE, False),
        (Answered(429, (), b""), False, State.RETRYABLE, False),
        (Answered(500, (), b""), False, State.IN_DOUBT, True),
        (Answered(502, (), b""), False, State.IN_DOUBT, True),
        (Answered(503, (), b""), False, State.IN_DOUBT, True),
        (Answered(504, (), b""), False, State.IN_DOUBT, True),
        (NotSent("refused"), False, State.RETRYABLE, False),
        (NoAnswer("timeout", timed_out=True), False, State.IN_DOUBT, True),
        (NoAnswer("reset"), False, State.IN_DOUBT, True),
        # doubt is sticky: a refused attempt after one that may have reached stays in doubt
        (NotSent("refused"), True, State.IN_DOUBT, True),
        (Answered(429, (), b""), True, State.IN_DOUBT, True),
        (Answered(201, (), b""), True, State.COMPLETED, True),
    ],
)
def test_settle_classifies_outcomes(
    outcome: Answered | NotSent | NoAnswer, earlier_doubt: bool, state: State, may_have_sent: bool
) -> None:
    """The upstream's outcome decides the record's state as DESIGN.md's table says."""
    settled = settle(outcome, earlier_doubt=earlier_doubt)
    assert (settled.state, settled.may_have_sent) == (state, may_have_sent)


def test_a_timeout_keeps_the_lease_and_an_answer_ends_it() -> None:
    """After a timeout the upstream may still work on the request; after an answer it has finished."""
    assert settle(NoAnswer("t", timed_out=True), earlier_doubt=False).ends_lease is False
    assert settle(Answered(500, (), b""), earlier_doubt=False).ends_lease is True


def test_operator_resolution() -> None:
    """Only records in doubt or in review take an operator's verdict."""
    assert resolution(State.NEEDS_REVIEW, happened=True) is State.COMPLETED
    assert resolution(State.NEEDS_REVIEW, happened=False) is State.RETRYABLE
    assert resolution(State.IN_DOUBT, happened=False) is State.RETRYABLE
    for state in (State.COMPLETED, State.PENDING, State.RETRYABLE):
        with pytest.raises(ValueError, match="not waiting for an operator"):
            resolution(state, happened=True)


def test_transitions_not_in_the_table_raise() -> None:
    """The state machine is data: a transition it does not list is refused."""
    check_transition(None, State.PENDING)
    with pytest.raises(IllegalTransition):
        check_transition(None, State.COMPLETED)
    with pytest.raises(IllegalTransition):
        check_transition(State.NEEDS_REVIEW, State.PENDING)
    with pytest.raises(IllegalTransition):
        check_transition(State.RETRYABLE, State.COMPLETED)
    assert set(TRANSITIONS) == {None, *State}
