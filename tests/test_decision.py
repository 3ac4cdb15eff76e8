"""Table tests of the pure decision, grouped by the rows of DESIGN.md's state table."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from gateway.decision import (
    Busy,
    Late,
    Mismatch,
    Policy,
    Probe,
    Purged,
    Refuse,
    Replay,
    Request,
    Resend,
    Resolve,
    Restore,
    Review,
    Send,
    SendReason,
    Settlement,
    TakeOver,
    TooSoon,
    Unknown,
    after_probe,
    before_sending,
    carried_by,
    decide,
    resolution,
    restore,
    review,
    settle,
    take_over,
    unrecorded,
)
from gateway.outcome import Answered, Found, NoAnswer, NotFound, NotSent, ProbeError, ProbeResult
from gateway.record import EffectRecord, KeyCarriers
from gateway.routes import Route
from gateway.states import TRANSITIONS, IllegalTransition, State, Transition, check_transition
from tests.factories import CARRIED, LEASE, NOW, OK, SAME, record

# The probe's routes: the records below are POST /orders unless a row says otherwise.
ORDERS = (Route.parse("POST /orders"),)
# What carries the key, today and in the records below unless a row says otherwise.
STAMP = ("json_field", "client_reference")
PLAIN = Policy(lease=LEASE, key_carriers=CARRIED)
NATIVE = Policy(lease=LEASE, native_key_ttl=timedelta(hours=24), key_carriers=CARRIED)
PROBED = Policy(lease=LEASE, has_probe=True, probe_routes=ORDERS, key_carriers=CARRIED)
NATIVE_PROBED = replace(PROBED, native_key_ttl=timedelta(hours=24))
HARMLESS = Policy(lease=LEASE, repeat_harmless=True, key_carriers=CARRIED)
HORIZON = replace(PROBED, probe_horizon=timedelta(days=30))


OLD = NOW - timedelta(days=40)


@pytest.mark.parametrize(
    ("rec", "policy", "expected"),
    [
        # completed: a definitive response is stored -> replayed, whatever the policy
        (record(State.COMPLETED), PLAIN, Replay()),
        (record(State.COMPLETED), NATIVE_PROBED, Replay()),
        # completed, response purged after the retention: the probe may supply it, else 410; the effect
        # happened, so nothing is ever sent again, not even under a fresh native key
        (record(State.COMPLETED, response=None), NATIVE, Purged()),
        (record(State.COMPLETED, response=None), PROBED, Restore()),
        (record(State.COMPLETED, response=None), NATIVE_PROBED, Restore()),
        (record(State.COMPLETED, response=None), HARMLESS, Purged()),
        (record(State.COMPLETED, response=None), PLAIN, Purged()),
    ],
)
def test_completed(rec: EffectRecord, policy: Policy, expected: object) -> None:
    """A completed record replays; a purged one may ask its probe for the answer, and never sends."""
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


REFUND = {"method": "POST", "path": "/orders/ord_1/refund"}
HARMLESS_PROBED = replace(PROBED, repeat_harmless=True)
REFUNDS_TOO = replace(PROBED, probe_routes=(*ORDERS, Route.parse("POST /orders/*/refund")))
# An MCP server's probe finds the effects of place_order (and its routes are irrelevant to a tool call).
TOOL_PROBED = replace(PROBED, probe_tools=("place_order",))


@pytest.mark.parametrize(
    ("rec", "policy", "expected"),
    [
        # a refund, where the probe searches orders: its "not found" would say nothing about the refund
        (record(State.IN_DOUBT, **REFUND), PROBED, Review()),
        (record(State.PENDING, **REFUND), PROBED, Review()),
        (record(State.IN_DOUBT, **REFUND), HARMLESS_PROBED, Resend("harmless")),
        # ... the native key still recovers it, as any request of the upstream
        (record(State.IN_DOUBT, **REFUND), NATIVE_PROBED, Resend("native_key")),
        (record(State.IN_DOUBT, first_sent_at=OLD, **REFUND), NATIVE_PROBED, Review()),
        # ... and a refund sent by nobody is still sent
        (record(State.IN_DOUBT, may_have_sent=False, **REFUND), PROBED, Resend("never_sent")),
        # a probe that names the refunds' route (* for the order's id) is asked about them
        (record(State.IN_DOUBT, **REFUND), REFUNDS_TOO, Probe()),
        (record(State.IN_DOUBT, method="POST", path="/orders/ord_1/refund/x"), REFUNDS_TOO, Review()),
        (record(State.IN_DOUBT, method="POST", path="/orders//refund"), REFUNDS_TOO, Review()),
        # the same path by another method, or spelt another way, is another route
        (record(State.IN_DOUBT, method="PUT", path="/orders"), PROBED, Review()),
        (record(State.IN_DOUBT, method="POST", path="/orders/"), PROBED, Review()),
        (record(State.IN_DOUBT, method="POST", path="/Orders"), PROBED, Review()),
        # completed, its response purged: the probe is asked for it only on its routes, else 410
        (record(State.COMPLETED, response=None, **REFUND), PROBED, Purged()),
        (record(State.COMPLETED, response=None, **REFUND), REFUNDS_TOO, Restore()),
        # an MCP tool call: the probe names the tools whose effects it finds, whatever the route
        (record(State.IN_DOUBT, method="POST", path="/mcp", tool="place_order"), TOOL_PROBED, Probe()),
        (record(State.IN_DOUBT, method="POST", path="/mcp", tool="send_email"), TOOL_PROBED, Review()),
        (record(State.IN_DOUBT, method="POST", path="/orders", tool="send_email"), TOOL_PROBED, Review()),
    ],
)
def test_a_probe_is_asked_only_about_its_routes(rec: EffectRecord, policy: Policy, expected: object) -> None:
    """A probe searches the routes it names; an effect of any other recovers by the native key, then goes
    to review (or is re-sent where harmless), and its purged answer is 410."""
    assert decide(rec, SAME, NOW, policy) == expected


STAMP_ONLY = KeyCarriers(None, STAMP)
NATIVE_ONLY = KeyCarriers("Idempotency-Key", None)
# The probe of an upstream with no stamp, which looks for the key the native header carried.
NATIVE_SEARCH = replace(NATIVE_PROBED, key_carriers=NATIVE_ONLY)


@pytest.mark.parametrize(
    ("rec", "policy", "expected"),
    [
        # native_key added after the first send, which carried the stamp alone: a re-send under a header
        # the upstream never saw with it would be a new request; the stamp still lets the probe tell
        (record(State.IN_DOUBT, key_carriers=STAMP_ONLY), NATIVE_PROBED, Probe()),
        (record(State.IN_DOUBT, key_carriers=KeyCarriers()), NATIVE, Review()),
        # the native header renamed since; another case of the same name is the same header
        (record(State.IN_DOUBT, key_carriers=KeyCarriers("X-Key", STAMP)), NATIVE, Review()),
        (
            record(State.IN_DOUBT, key_carriers=KeyCarriers("idempotency-key", None)),
            NATIVE,
            Resend("native_key"),
        ),
        # the stamp moved to another field, or to another kind: the probe would look where it never was
        (record(State.IN_DOUBT, key_carriers=KeyCarriers(None, ("json_field", "ref"))), PROBED, Review()),
        (record(State.IN_DOUBT, key_carriers=KeyCarriers(None, ("query_param", STAMP[1]))), PROBED, Review()),
        (record(State.IN_DOUBT, key_carriers=NATIVE_ONLY), PROBED, Review()),
        # ... where repeats are harmless, it is sent again
        (
            record(State.IN_DOUBT, key_carriers=NATIVE_ONLY),
            replace(PROBED, repeat_harmless=True),
            Resend("harmless"),
        ),
        # a probe with no stamp searches the native key: only for effects sent with that header
        (record(State.IN_DOUBT, key_carriers=NATIVE_ONLY, first_sent_at=OLD), NATIVE_SEARCH, Probe()),
        (record(State.IN_DOUBT, key_carriers=STAMP_ONLY), NATIVE_SEARCH, Review()),
        # a row from before migration 015 recorded nothing: neither the key nor the probe is trusted
        (record(State.IN_DOUBT, key_carriers=None), NATIVE_PROBED, Review()),
        (record(State.PENDING, key_carriers=None), NATIVE_PROBED, Review()),
        (record(State.IN_DOUBT, key_carriers=None), HARMLESS, Resend("harmless")),
        (record(State.IN_DOUBT, key_carriers=None, may_have_sent=False), NATIVE_PROBED, Resend("never_sent")),
        # ... and a purged response is still asked of the probe (a restore never sends), unless the stamp
        # is known to have moved
        (record(State.COMPLETED, response=None, key_carriers=None), PROBED, Restore()),
        (record(State.COMPLETED, response=None, key_carriers=NATIVE_ONLY), PROBED, Purged()),
    ],
)
def test_recovery_relies_on_what_the_effect_was_sent_with(
    rec: EffectRecord, policy: Policy, expected: object
) -> None:
    """The native key and the probe recover an effect only when its requests carried the key where they
    look today; an effect whose carriers are unknown goes to review."""
    assert decide(rec, SAME, NOW, policy) == expected


@pytest.mark.parametrize(
    ("rec", "policy", "reason", "expected"),
    [
        # nothing may have acted: the take-over's request is the only one that counts
        (record(State.RETRYABLE, key_carriers=None), PROBED, "retryable", CARRIED),
        (record(State.IN_DOUBT, key_carriers=STAMP_ONLY, may_have_sent=False), PROBED, "never_sent", CARRIED),
        # an earlier attempt may have acted: only what both carried
        (record(State.IN_DOUBT, key_carriers=STAMP_ONLY), NATIVE, "harmless", STAMP_ONLY),
        (
            record(State.IN_DOUBT, key_carriers=CARRIED),
            replace(NATIVE, key_carriers=NATIVE_ONLY),
            "native_key",
            NATIVE_ONLY,
        ),
        (record(State.PENDING, key_carriers=CARRIED), PROBED, None, CARRIED),
        (record(State.IN_DOUBT, key_carriers=None), HARMLESS, "harmless", None),
    ],
)
def test_a_take_over_that_sends_records_what_carries_the_key_in_every_attempt(
    rec: EffectRecord, policy: Policy, reason: SendReason | None, expected: KeyCarriers | None
) -> None:
    """A take-over that sends records today's carriers when no earlier attempt may have acted, else only
    what today's share with the earlier attempts'."""
    assert carried_by(rec, policy, reason) == expected


def test_needs_review_waits_for_an_operator() -> None:
    """needs_review answers outcome-unknown until resolved, even with a probe configured."""
    assert decide(record(State.NEEDS_REVIEW), SAME, NOW, NATIVE_PROBED) == Unknown()


def test_a_completed_record_whose_response_cannot_be_read_is_never_decided_on() -> None:
    """Without its unreadable response, a completed record looks purged, and would be restored from a
    probe or answered 410: the decision refuses it instead (only an operator's view reads it so)."""
    unreadable = record(State.COMPLETED, response=None, unreadable={"response": "its stored response ..."})
    with pytest.raises(ValueError, match="can be read back"):
        decide(unreadable, SAME, NOW, NATIVE_PROBED)
    request_only = record(State.COMPLETED, unreadable={"request": "its stored request ..."})
    assert decide(request_only, SAME, NOW, NATIVE_PROBED) == Replay()


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
        # a redirect that keeps the method: not acted on, asked for elsewhere (never relayed)
        (Answered(307, (), b""), False, State.RETRYABLE, False),
        (Answered(308, (), b""), False, State.RETRYABLE, False),
        # a redirect to see the result (303, and the 301 and 302 that clients follow with a GET)
        (Answered(303, (), b""), False, State.COMPLETED, True),
        (Answered(302, (), b""), False, State.COMPLETED, True),
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
        (Answered(307, (), b""), True, State.IN_DOUBT, True),
        (Answered(201, (), b""), True, State.COMPLETED, True),
        # an MCP server's answer to a tool call says itself whether the tool ran, whatever the status
        (Answered(200, (), b'{"result":{}}', ran="yes"), False, State.COMPLETED, True),
        (Answered(200, (), b'{"error":{"code":-32602}}', ran="no"), False, State.RETRYABLE, False),
        (Answered(404, (), b'{"error":{}}', ran="no"), False, State.RETRYABLE, False),
        (Answered(200, (), b'{"error":{"code":-32603}}', ran="maybe"), False, State.IN_DOUBT, True),
        (Answered(502, (), b'{"error":{}}', ran="maybe"), False, State.IN_DOUBT, True),
        # and doubt is as sticky for it: "never ran" after an attempt that may have stays in doubt
        (Answered(200, (), b'{"error":{"code":-32602}}', ran="no"), True, State.IN_DOUBT, True),
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


@pytest.mark.parametrize(
    ("rec", "happened", "expected"),
    [
        (record(State.NEEDS_REVIEW), True, State.COMPLETED),
        (record(State.NEEDS_REVIEW), False, State.RETRYABLE),
        (record(State.IN_DOUBT), False, State.RETRYABLE),
        (record(State.IN_DOUBT), True, State.COMPLETED),
        # a gateway died holding the record and its lease ran out: an operator may settle it
        (record(State.PENDING), True, State.COMPLETED),
        (record(State.PENDING), False, State.RETRYABLE),
    ],
)
def test_operator_resolution(rec: EffectRecord, happened: bool, expected: State) -> None:
    """Records in review, in doubt, or pending past their lease take an operator's verdict."""
    assert resolution(rec, NOW, happened=happened) == Resolve(Transition(rec.state, expected))


@pytest.mark.parametrize(
    ("rec", "why"),
    [
        (record(State.COMPLETED), "never resolved"),
        (record(State.COMPLETED, response=None), "never resolved"),
        (record(State.RETRYABLE), "nothing happened"),
        (record(State.PENDING, lease_expires_at=NOW + timedelta(seconds=1)), "under way"),
        (record(State.IN_DOUBT, lease_expires_at=NOW + timedelta(seconds=1)), "under way"),
    ],
)
def test_operator_resolution_refused(rec: EffectRecord, why: str) -> None:
    """A completed effect is never resolved, and nothing is resolved while a lease still runs."""
    for happened in (True, False):
        judged = resolution(rec, NOW, happened=happened)
        assert isinstance(judged, Refuse)
        assert why in judged.reason


FOUND = Found(OK)


@pytest.mark.parametrize(
    ("rec", "result", "policy", "expected"),
    [
        # found: the effect exists; the record completes from the probe's answer
        (record(State.PENDING), FOUND, PROBED, State.COMPLETED),
        (record(State.PENDING, first_sent_at=OLD), FOUND, HORIZON, State.COMPLETED),
        # not found within the probe's horizon (or with none): it never happened, send it
        (record(State.PENDING), NotFound(), PROBED, Send()),
        (record(State.PENDING, first_sent_at=OLD), NotFound(), PROBED, Send()),
        (record(State.PENDING, first_sent_at=NOW - timedelta(days=29)), NotFound(), HORIZON, Send()),
        # ... past the horizon (less the margin of one lease) "not found" proves nothing: review
        (record(State.PENDING, first_sent_at=OLD), NotFound(), HORIZON, State.NEEDS_REVIEW),
        (
            record(State.PENDING, first_sent_at=NOW - (timedelta(days=30) - LEASE)),
            NotFound(),
            HORIZON,
            State.NEEDS_REVIEW,
        ),
        # "not found" from a probe asked about a route it does not search proves nothing: review
        (record(State.PENDING, **REFUND), NotFound(), PROBED, State.NEEDS_REVIEW),
        # ... nor from one that looks where the effect was not stamped, or not known to be
        (record(State.PENDING, key_carriers=NATIVE_ONLY), NotFound(), PROBED, State.NEEDS_REVIEW),
        (record(State.PENDING, key_carriers=None), NotFound(), PROBED, State.NEEDS_REVIEW),
        # failed: the record goes back to in doubt, whatever its age
        (record(State.PENDING), ProbeError("timeout"), PROBED, State.IN_DOUBT),
        (record(State.PENDING, first_sent_at=OLD), ProbeError("timeout"), HORIZON, State.IN_DOUBT),
    ],
)
def test_after_probe_when_retaken(
    rec: EffectRecord, result: ProbeResult, policy: Policy, expected: object
) -> None:
    """A probe completes, sends, gives up to review or leaves the record in doubt, as its horizon allows."""
    verdict = after_probe(rec, result, NOW, policy, retaken_at=NOW)
    if isinstance(expected, Send):
        assert verdict == expected
    else:
        assert isinstance(verdict, Settlement)
        assert (verdict.transition, verdict.may_have_sent) == (Transition(State.PENDING, expected), True)


LAGGED = replace(PROBED, probe_lag=timedelta(minutes=1))
S = timedelta(seconds=1)


@pytest.mark.parametrize(
    ("rec", "policy", "expected"),
    [
        # a search that lists an effect as it happens: "not found" is trusted at once
        (record(State.PENDING, last_sent_at=NOW - S, response_at=NOW - S / 2), PROBED, None),
        # the latest attempt was answered (a 5xx) 10s ago: it acted before that, and is listed a lag later
        (record(State.PENDING, last_sent_at=NOW - 11 * S, response_at=NOW - 10 * S), LAGGED, 50 * S),
        (record(State.PENDING, last_sent_at=NOW - 61 * S, response_at=NOW - 60 * S), LAGGED, None),
        # no answer recorded (a timeout, a crash): it may have acted until its lease ran out
        (record(State.PENDING, last_sent_at=NOW - 40 * S, response_at=None), LAGGED, 55 * S),
        (record(State.PENDING, last_sent_at=NOW - LEASE - 60 * S, response_at=None), LAGGED, None),
        # ... within the lease that attempt was given, however long today's lease is
        (record(State.PENDING, last_sent_at=NOW - 40 * S, send_lease=4 * LEASE), LAGGED, 4 * LEASE + 20 * S),
        (record(State.PENDING, last_sent_at=NOW - 40 * S, send_lease=S), LAGGED, 21 * S),
        # ... an answer recorded before the latest claim is an earlier attempt's, and does not count
        (record(State.PENDING, last_sent_at=NOW - 40 * S, response_at=NOW - 100 * S), LAGGED, 55 * S),
    ],
)
def test_after_probe_when_not_found(rec: EffectRecord, policy: Policy, expected: timedelta | None) -> None:
    """ "Not found" is trusted only once the search has had its lag since the latest attempt could act."""
    early = after_probe(rec, NotFound(), NOW, policy)
    if expected is None:
        assert early == TakeOver()
    else:
        assert isinstance(early, TooSoon)
        assert early.retry_after == expected
        back = early.settlement
        assert (back.transition, back.may_have_sent, back.ends_lease) == (
            Transition(State.PENDING, State.IN_DOUBT),
            True,
            True,
        )


def test_a_write_fences_on_the_state_its_move_starts_from_and_no_other() -> None:
    """A move is written fenced on the record's state as read; asked of a record in another state it is
    refused before anything is written."""
    move = Transition(State.PENDING, State.IN_DOUBT)
    assert move.fenced_on(State.PENDING) is State.PENDING
    with pytest.raises(ValueError, match="was asked of a record in") as refused:
        move.fenced_on(State.RETRYABLE)
    assert str(State.PENDING) in str(refused.value)
    assert str(State.RETRYABLE) in str(refused.value)


def test_a_completed_record_is_never_taken_over() -> None:
    """No attempt (send or probe) can be started on a completed record: the table has no such move."""
    with pytest.raises(IllegalTransition):
        take_over(record(State.COMPLETED))
    with pytest.raises(IllegalTransition):
        review(record(State.COMPLETED))
    assert restore(record(State.COMPLETED, response=None)) == Transition(State.COMPLETED, State.COMPLETED)
    for state in (State.PENDING, State.IN_DOUBT, State.RETRYABLE):
        assert take_over(record(state)).target is State.PENDING


def test_an_outcome_that_cannot_be_recorded_goes_to_review() -> None:
    """An answer Postgres refuses never leaves the record pending (a re-send loop); it goes to review."""
    for outcome in (Answered(201, (), b""), Answered(500, (), b""), NoAnswer("reset")):
        assert unrecorded(settle(outcome, earlier_doubt=False)).state is State.NEEDS_REVIEW
    # nothing left: still safe to send
    assert unrecorded(settle(NotSent("refused"), earlier_doubt=False)).state is State.RETRYABLE


def test_transitions_not_in_the_table_raise() -> None:
    """The state machine is data: a transition it does not list is refused."""
    check_transition(None, State.PENDING)
    with pytest.raises(IllegalTransition):
        check_transition(None, State.COMPLETED)
    with pytest.raises(IllegalTransition):
        check_transition(State.NEEDS_REVIEW, State.PENDING)
    with pytest.raises(IllegalTransition):
        check_transition(State.RETRYABLE, State.COMPLETED)
    for target in State:
        if target is not State.COMPLETED:
            with pytest.raises(IllegalTransition):
                Transition(State.COMPLETED, target)
    assert set(TRANSITIONS) == {None, *State}


WINDOW = replace(NATIVE, send_window=timedelta(seconds=5))


@pytest.mark.parametrize(
    ("rec", "waited", "reason", "expected"),
    [
        # sent promptly after the claim or take-over
        (record(State.PENDING), timedelta(milliseconds=3), None, Send()),
        (record(State.PENDING), timedelta(seconds=5), "native_key", Send()),
        # stalled between taking the record and sending: the lease no longer covers the request, so the
        # record must be taken again first
        (record(State.PENDING), timedelta(seconds=5.1), None, Late(timedelta(seconds=5.1))),
        (record(State.PENDING), timedelta(minutes=10), "retryable", Late(timedelta(minutes=10))),
        # a native key judged fresh before the take-over, but too old by the time of it
        (
            record(State.PENDING, first_sent_at=NOW - (timedelta(hours=24) - LEASE)),
            timedelta(0),
            "native_key",
            Refuse("not sent: the native key grew too old to trust while the record was being taken over"),
        ),
        # a native key that the effect's requests did not carry: nothing to deduplicate the re-send by
        (
            record(State.PENDING, key_carriers=STAMP_ONLY),
            timedelta(0),
            "native_key",
            Refuse("not sent: the native key grew too old to trust while the record was being taken over"),
        ),
        # ... which does not matter when the send is not relying on the key
        (record(State.PENDING, first_sent_at=NOW - timedelta(days=2)), timedelta(0), "never_sent", Send()),
    ],
)
def test_before_sending(
    rec: EffectRecord, waited: timedelta, reason: SendReason | None, expected: Send | Late | Refuse
) -> None:
    """A request leaves only within the lease's grace of its take-over, and only under a key still trusted."""
    assert before_sending(rec, NOW, waited, WINDOW, reason) == expected
