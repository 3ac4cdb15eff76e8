"""The idempotency decision: a pure function of (record, request, now, policy) -> action.

Nothing here does I/O or reads a clock. The handler (:mod:`gateway.service`) carries out the action;
tests drive this module with tables (tests/test_decision.py), grouped by the rows of DESIGN.md's state
table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from gateway.outcome import Answered, NoAnswer, NotSent, Outcome
from gateway.record import EffectRecord
from gateway.states import State, check_transition

# Statuses that say the upstream did nothing with the request, so sending again is safe.
NOTHING_HAPPENED = frozenset({408, 425, 429})
# Statuses after which the effect may or may not have happened.
MAYBE_HAPPENED = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Policy:
    """What the decision needs to know about one upstream; plain values, no settings object."""

    lease: timedelta
    native_key_ttl: timedelta | None = None
    has_probe: bool = False
    repeat_harmless: bool = False

    @property
    def key_margin(self) -> timedelta:
        # At least one lease: the margin must outlast the time between judging the key fresh and the
        # re-send landing upstream. A model check with a smaller margin finds a double charge.
        return self.lease


@dataclass(frozen=True, slots=True)
class Request:
    fingerprint: str


# --- actions -----------------------------------------------------------------------------------------

SendReason = Literal["retryable", "never_sent", "native_key", "harmless"]


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the stored response."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key was used with a different request: 422, nothing sent."""


@dataclass(frozen=True, slots=True)
class Busy:
    """A twin holds the key; it may be answered within ``retry_after``."""

    retry_after: timedelta


@dataclass(frozen=True, slots=True)
class Resend:
    """Re-claim the record (attempt + 1) and send; ``reason`` goes to the audit."""

    reason: SendReason


@dataclass(frozen=True, slots=True)
class Probe:
    """Re-claim the record and ask the upstream whether the effect exists."""


@dataclass(frozen=True, slots=True)
class Review:
    """Nothing can tell whether it happened: move the record to needs_review."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The record waits for an operator: 409 outcome-unknown."""


@dataclass(frozen=True, slots=True)
class Purged:
    """Completed, but the stored response is gone and nothing can recover it: 410."""


Action = Replay | Mismatch | Busy | Resend | Probe | Review | Unknown | Purged


def decide(record: EffectRecord, request: Request, now: datetime, policy: Policy) -> Action:
    """What to do with a request whose key already has a record."""
    if record.fingerprint != request.fingerprint:
        return Mismatch()
    match record.state:
        case State.COMPLETED:
            if record.response is not None:
                return Replay()
            # The bodies were purged after the retention: the effect happened, so only a way that
            # returns the same answer without a second effect may be used.
            action = _recover(record, now, policy, allow_blind=False)
            return Purged() if isinstance(action, Review) else action
        case State.PENDING | State.IN_DOUBT:
            # An in-doubt attempt that timed out may still be running upstream until its lease ends;
            # a probe or re-send before then could miss it and duplicate it.
            if record.lease_expires_at is not None and now < record.lease_expires_at:
                return Busy(retry_after=record.lease_expires_at - now)
            return _recover(record, now, policy, allow_blind=True)
        case State.RETRYABLE:
            return Resend("retryable")
        case State.NEEDS_REVIEW:
            return Unknown()
    raise AssertionError(f"unhandled state {record.state}")  # pragma: no cover


def _recover(record: EffectRecord, now: datetime, policy: Policy, *, allow_blind: bool) -> Action:
    """DESIGN.md's recovery order for an in-doubt record (or a pending one whose lease ran out)."""
    # A pending record whose lease ran out belongs to a gateway that died or stalled after its claim:
    # the claim is the intent to send, so that attempt may have reached the upstream.
    doubt = record.may_have_sent or record.state is State.PENDING
    if not doubt and record.state is not State.COMPLETED:
        return Resend("never_sent")
    if policy.native_key_ttl is not None and record.first_sent_at is not None:
        age = now - record.first_sent_at
        if age < policy.native_key_ttl - policy.key_margin:
            return Resend("native_key")
    if policy.has_probe:
        return Probe()
    if allow_blind and policy.repeat_harmless:
        return Resend("harmless")
    return Review()


# --- settling an attempt -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settlement:
    state: State
    may_have_sent: bool
    # The attempt is over at the upstream (it answered), so its lease need not be waited out.
    ends_lease: bool


def settle(outcome: Outcome, *, earlier_doubt: bool) -> Settlement:
    """The state an attempt leaves the record in; ``earlier_doubt`` is the record's may_have_sent."""
    match outcome:
        case Answered(status=status) if status in NOTHING_HAPPENED:
            state, reached, ends = State.RETRYABLE, False, True
        case Answered(status=status) if status in MAYBE_HAPPENED:
            state, reached, ends = State.IN_DOUBT, True, True
        case Answered():
            state, reached, ends = State.COMPLETED, True, True
        case NotSent():
            state, reached, ends = State.RETRYABLE, False, True
        case NoAnswer():
            # Timed out or reset after sending: the upstream may still be working on it.
            state, reached, ends = State.IN_DOUBT, True, False
    # Doubt is sticky: once any attempt may have reached the upstream, a later attempt refused before
    # it left must not make the record look safe to send blindly (a model check finds the duplicate).
    if state is State.RETRYABLE and earlier_doubt:
        state = State.IN_DOUBT
    check_transition(State.PENDING, state)
    return Settlement(state=state, may_have_sent=earlier_doubt or reached, ends_lease=ends)


def resolution(state: State, *, happened: bool) -> State:
    """An operator's verdict on a record in doubt or in review."""
    if state not in (State.NEEDS_REVIEW, State.IN_DOUBT):
        raise ValueError(f"an effect in state {state} is not waiting for an operator")
    target = State.COMPLETED if happened else State.RETRYABLE
    check_transition(state, target)
    return target
