"""The idempotency decision: pure functions of (record, request or outcome, now, policy).

Nothing here does I/O or reads a clock. Every function that judges returns a member of one union,
:data:`Action`: :func:`decide` says what to do with a request whose key has a record,
:func:`before_sending` whether its request may leave, :func:`settle` and :func:`after_probe` what an
attempt or a probe comes to, and :func:`resolution` what an operator's verdict does. The settlements
carry the :class:`~gateway.states.Transition` that the store carries out (so a move the state table
does not list raises before any SQL runs). The driver (:mod:`gateway.service`) carries out the actions;
tests drive this module with tables (tests/test_decision.py), grouped by the rows of the state table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from gateway.outcome import Answered, Found, NoAnswer, NotFound, NotSent, Outcome, ProbeError, ProbeResult
from gateway.record import EffectRecord, KeyCarriers
from gateway.routes import Route, covered
from gateway.states import State, Transition

# Statuses that say the upstream did nothing with the request, so sending again is safe.
NOTHING_HAPPENED = frozenset({408, 425, 429})
# Redirects that keep the method and body (RFC 9110, 15.4.8 and 15.4.9): the upstream did not act, and
# asks for the same request at another URI. Nothing happened; the gateway never relays them (a client
# that follows one would send the request again, past the gateway), and the retry sends again here.
REDIRECTED = frozenset({307, 308})
# 301 and 302 let a client turn a POST into a GET, and clients do (requests, aiohttp); any other method
# they send again as it was, to the Location: for those, these too repeat the request.
REDIRECTED_BUT_POST = frozenset({301, 302})


def repeats_request(status: int, method: str) -> bool:
    """Whether a client following this redirect would send the same request again, elsewhere."""
    return status in REDIRECTED or (status in REDIRECTED_BUT_POST and method != "POST")


# Statuses after which the effect may or may not have happened.
MAYBE_HAPPENED = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class Policy:
    """What the decision needs to know about one upstream; plain values, no settings object."""

    lease: timedelta
    native_key_ttl: timedelta | None = None
    has_probe: bool = False
    # The requests whose effects the probe can find (probe.routes); it is asked about no other.
    probe_routes: tuple[Route, ...] = ()
    # An MCP server's: the tools whose effects its probe can find (probe.tools).
    probe_tools: tuple[str, ...] = ()
    # What carries the derived key in a request sent today (the native header, the stamp): what the native
    # key's dedup and the probe's search rely on. An effect sent otherwise is not recovered by them.
    key_carriers: KeyCarriers = field(default_factory=KeyCarriers)
    # How far back the upstream's search sees effects; None: as far back as the effects go.
    probe_horizon: timedelta | None = None
    # How long after an effect the upstream's search may still not list it (0: at once).
    probe_lag: timedelta = timedelta(0)
    repeat_harmless: bool = False
    # The most that may pass between taking a record (claim or take-over) and the request leaving:
    # the lease (the upstream's timeout plus a grace) only covers the request if it leaves within the
    # grace. None: not checked (tests of the decision alone).
    send_window: timedelta | None = None

    @property
    def margin(self) -> timedelta:
        # At least one lease: between judging a key fresh (or a probe's "not found" trustworthy) and
        # the re-send landing upstream, up to one lease may pass. With a smaller margin a model check
        # finds a double charge: the key is judged fresh, then the upstream forgets it before the
        # re-send arrives.
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
    """Another request with the same key holds it; it may be answered within ``retry_after``."""

    retry_after: timedelta


@dataclass(frozen=True, slots=True)
class Resend:
    """Take the record over (attempt + 1) and send; ``reason`` goes to the audit."""

    reason: SendReason


@dataclass(frozen=True, slots=True)
class Probe:
    """Take the record over and ask the upstream whether the effect exists."""


@dataclass(frozen=True, slots=True)
class Review:
    """Nothing can tell whether it happened: move the record to needs_review."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The record waits for an operator: 409 outcome-unknown."""


@dataclass(frozen=True, slots=True)
class Restore:
    """Completed, its response purged: ask the probe for the effect to answer with. Nothing is sent."""


@dataclass(frozen=True, slots=True)
class Purged:
    """Completed, the stored response is gone and nothing can supply it: 410. Nothing is sent."""


# What :func:`decide` may say; members of :data:`Action`, like every other function's answer here.
Decision = Replay | Mismatch | Busy | Resend | Probe | Review | Unknown | Restore | Purged


def decide(record: EffectRecord, request: Request, now: datetime, policy: Policy) -> Decision:
    """Say what to do with a request whose key already has a record."""
    if not record.response_read:
        raise ValueError("the decision needs the record read with its response")
    if record.replay_refused:
        # Read for an operator's view, which leaves out what cannot be read back: taken for a purge, it
        # would be restored from a probe or answered 410 instead of refused.
        raise ValueError("the decision needs a response that can be read back")
    if record.fingerprint != request.fingerprint:
        return Mismatch()
    match record.state:
        case State.COMPLETED:
            if record.response is not None:
                return Replay()
            # The response was dropped after the retention. The effect happened, so nothing is sent
            # for it again, not even under the native key: the retention outlasts any key's TTL, and a
            # re-send without a lease can land after the upstream forgot the key.
            return Restore() if _may_restore(record, policy) else Purged()
        case State.PENDING | State.IN_DOUBT:
            # An in-doubt attempt that timed out may still be running upstream until its lease ends;
            # a probe or re-send before then could miss it and duplicate it.
            if record.lease_expires_at is not None and now < record.lease_expires_at:
                return Busy(retry_after=record.lease_expires_at - now)
            return _recover(record, now, policy)
        case State.RETRYABLE:
            return Resend("retryable")
        case State.NEEDS_REVIEW:
            return Unknown()
    raise AssertionError(f"unhandled state {record.state}")  # pragma: no cover


def _recover(record: EffectRecord, now: datetime, policy: Policy) -> Decision:
    """The recovery order for a record in doubt (or a pending one whose lease ran out)."""
    # A pending record whose lease ran out belongs to a gateway that died or stalled after its claim:
    # the claim is the intent to send, so that attempt may have reached the upstream.
    if not (record.may_have_sent or record.state is State.PENDING):
        return Resend("never_sent")
    if _native_key_fresh(record, now, policy):
        return Resend("native_key")
    if probe_covers(record, policy):
        return Probe()
    if policy.repeat_harmless:
        return Resend("harmless")
    return Review()


def _native_key_fresh(record: EffectRecord, now: datetime, policy: Policy) -> bool:
    """Whether a re-send under the native key is deduplicated upstream: every attempt that may have acted
    carried the key in the header the upstream honours today, and the first send is young enough.

    A header added or renamed since the first send would carry a key the upstream never saw, and it would
    act on the re-send as on a new request.
    """
    return (
        policy.native_key_ttl is not None
        and record.key_carriers is not None
        and record.key_carriers.carries_native(policy.key_carriers.native_header)
        and _younger_than(record, now, policy.native_key_ttl, policy)
    )


def _searches_route(record: EffectRecord, policy: Policy) -> bool:
    """Whether the upstream has a probe written for the record's route (probe.routes).

    A probe searches one kind of effect: asked about a refund where it searches orders it finds nothing,
    and that "not found" would send the refund again. An MCP tool call's kind is its tool (probe.tools).
    """
    if record.tool is not None:
        return policy.has_probe and record.tool in policy.probe_tools
    return policy.has_probe and covered(policy.probe_routes, record.method, record.path)


def _looks_where_sent(carriers: KeyCarriers, policy: Policy) -> bool:
    """Whether the probe looks for the key where ``carriers`` put it: by the stamp it searches today, or,
    with no stamp, by the native header. A stamp moved to another field since would send the probe
    looking where the effect was never stamped."""
    today = policy.key_carriers
    if today.stamp is not None:
        return carriers.carries_stamp(today.stamp)
    return carriers.carries_native(today.native_header)


def probe_covers(record: EffectRecord, policy: Policy) -> bool:
    """Whether the probe can find this effect: written for its route, it looks for the key where every
    attempt that may have acted carried it. Not for a row that recorded nothing (before migration 015):
    what its attempts carried is not known."""
    return (
        _searches_route(record, policy)
        and record.key_carriers is not None
        and _looks_where_sent(record.key_carriers, policy)
    )


def _may_restore(record: EffectRecord, policy: Policy) -> bool:
    """Whether to ask the probe for the response of a completed effect whose response was purged.

    As :func:`probe_covers`, but a row that recorded nothing is asked for as before: a restore never
    sends, and the worst a probe looking in the wrong place can do is find nothing (410).
    """
    return _searches_route(record, policy) and (
        record.key_carriers is None or _looks_where_sent(record.key_carriers, policy)
    )


def why_not_probed(record: EffectRecord, policy: Policy) -> str:
    """Why the probe is not asked about this effect, in words for the audit and the agent."""
    if not policy.has_probe:
        return "this upstream has no probe"
    if not _searches_route(record, policy):
        if record.tool is not None:
            return (
                f"this upstream's probe does not search the effects of the tool {record.tool} (probe.tools)"
            )
        return f"this upstream's probe does not search {record.method} {record.path} (probe.routes)"
    if record.key_carriers is None:
        return "what carried this effect's key was not recorded (it was sent by an earlier version)"
    return (
        "this upstream's probe looks for the key where this effect's requests did not carry it (its "
        "stamp or native key changed since)"
    )


def carried_by(record: EffectRecord, policy: Policy, reason: SendReason | None) -> KeyCarriers | None:
    """What will have carried the key in every attempt that may have acted, once a take-over of
    ``record`` sends under today's settings (None: not known, and then never relied on).

    Today's carriers when no earlier attempt may have reached the upstream (``reason`` retryable or
    never_sent); otherwise only what today's share with what the earlier attempts carried.
    """
    if reason in ("retryable", "never_sent"):
        return policy.key_carriers
    if record.key_carriers is None:
        return None
    return record.key_carriers.shared_with(policy.key_carriers)


def _younger_than(record: EffectRecord, now: datetime, memory: timedelta, policy: Policy) -> bool:
    """Whether the upstream still remembers every attempt: the first send is within memory - margin.

    ``first_sent_at`` is the first claim's time, never later than the first request could have left,
    so the age is never underestimated.
    """
    sent = record.first_sent_at or record.created_at
    return now - sent < memory - policy.margin


@dataclass(frozen=True, slots=True)
class Send:
    """Send the request under the attempt the record holds (before sending: nothing stops it; after a
    probe: it found nothing and can be trusted to have looked)."""


@dataclass(frozen=True, slots=True)
class Late:
    """Too long since the record was taken: take it again (a fresh lease) before the request leaves."""

    waited: timedelta


@dataclass(frozen=True, slots=True)
class Refuse:
    """Not done, and ``reason`` says why: before sending, the request must not leave under this attempt
    (it is settled as never sent); for an operator's verdict, the record is not waiting for one."""

    reason: str


def before_sending(
    record: EffectRecord, now: datetime, waited: timedelta, policy: Policy, reason: SendReason | None
) -> Send | Late | Refuse:
    """Whether the request may leave under the attempt ``record`` holds.

    ``now`` is the database's clock when the record was taken (the claim or take-over that returned
    ``record``) and ``waited`` how long has passed since, measured from before that statement, so never
    less. The lease only covers a request that leaves within its grace: a gateway that stalled after
    taking the record must take it again first (which fails if another gateway took it over meanwhile).
    A native key judged fresh before the take-over may have aged past trust by the time of it: then the
    upstream may have forgotten the key, and the request must not rely on it.
    """
    if policy.send_window is not None and waited > policy.send_window:
        return Late(waited)
    if reason == "native_key" and not _native_key_fresh(record, now, policy):
        return Refuse("not sent: the native key grew too old to trust while the record was being taken over")
    return Send()


# --- what each write does to the record's state -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settlement:
    """What an attempt (or a probe under it) leaves the record as."""

    transition: Transition
    may_have_sent: bool
    # The attempt is over at the upstream (it answered), so its lease need not be waited out.
    ends_lease: bool

    @property
    def state(self) -> State:
        return self.transition.target


def settle(outcome: Outcome, *, earlier_doubt: bool, method: str = "POST") -> Settlement:
    """Judge the state an attempt leaves its pending record in; ``earlier_doubt`` is its may_have_sent.

    ``method`` is the request's: a 301 or 302 to a POST is an answer, to a PUT it asks for the PUT again.
    """
    match outcome:
        case Answered(ran="yes"):
            state, reached, ends = State.COMPLETED, True, True
        case Answered(ran="no"):
            state, reached, ends = State.RETRYABLE, False, True
        case Answered(ran="maybe"):
            state, reached, ends = State.IN_DOUBT, True, True
        case Answered(status=status) if status in NOTHING_HAPPENED or repeats_request(status, method):
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
    return Settlement(
        Transition(State.PENDING, state), may_have_sent=earlier_doubt or reached, ends_lease=ends
    )


def unrecorded(settlement: Settlement) -> Settlement:
    """Say what the record becomes, instead of staying pending, when its attempt's outcome could not be
    written.

    A pending record would be taken over when its lease runs out and, having no answer, sent again
    (over and over, if the answer can never be stored). Whatever may have reached the upstream goes to
    an operator; what surely did not stays safe to send.
    """
    if not settlement.may_have_sent:
        return settlement
    return Settlement(Transition(State.PENDING, State.NEEDS_REVIEW), may_have_sent=True, ends_lease=True)


@dataclass(frozen=True, slots=True)
class TooSoon:
    """The probe found nothing, but its search may not list the latest attempt's effect yet.

    The record goes back to in doubt, as after a failed probe, and nothing is sent; a probe asked
    ``retry_after`` from now can tell.
    """

    settlement: Settlement
    retry_after: timedelta


def _too_soon(record: EffectRecord, asked_at: datetime, policy: Policy) -> TooSoon | None:
    """Whether a probe's "not found" may be the search lagging behind the latest attempt (None: it is not).

    ``record`` is the record as the take-over the probe runs under returned it, and ``asked_at`` that
    take-over's database clock, read before the probe left. The search lists an effect ``probe_lag``
    after it happened, and it looked after ``asked_at``; so this never credits it with more time than it
    had. (The clock read after the probe answered would: a gateway that stalls between the probe's
    answer and that read would trust a "not found" the search gave before it could list the effect. The
    horizon is the other way round, and judged at that later clock: there, later is the cautious side.)

    When did the latest attempt act, if it did? If its answer was recorded (``response_at`` since its
    claim, ``last_sent_at``), before that answer; else within its lease of its claim (it left within the
    grace, and the upstream acts within its timeout). Earlier attempts acted before it was claimed.
    """
    if policy.probe_lag <= timedelta(0):
        return None
    claimed = record.last_sent_at or record.created_at
    answered = record.response_at
    # The lease that attempt was given, not today's: a timeout shortened since would credit the search
    # with time it has not had. (A row from before migration 015 records none, and is never probed.)
    lease = record.send_lease if record.send_lease is not None else policy.lease
    acted_by = answered if answered is not None and answered >= claimed else claimed + lease
    listed_by = acted_by + policy.probe_lag
    if asked_at >= listed_by:
        return None
    back = Settlement(Transition(State.PENDING, State.IN_DOUBT), may_have_sent=True, ends_lease=True)
    return TooSoon(back, retry_after=listed_by - asked_at)


@dataclass(frozen=True, slots=True)
class TakeOver:
    """Take the record over again before judging the probe's "not found": a fresh lease for the send
    that may follow, and the database's clock read after the probe answered, to judge it by."""


ProbeStep = Settlement | TooSoon | TakeOver | Send


def after_probe(
    record: EffectRecord,
    result: ProbeResult,
    asked_at: datetime,
    policy: Policy,
    *,
    retaken_at: datetime | None = None,
) -> ProbeStep:
    """What a probe run under a take-over of ``record`` (now pending) comes to, in the probe's order.

    Found: the effect happened, and the record completes from the probe's answer. Failed: back to in
    doubt (nothing left, so no lease need be waited out before the next try). Not found: too soon for
    the search to list the latest attempt (see _too_soon), else take the record over again
    (``retaken_at`` None), and then, at the clock of that take-over, send or give up to review.

    ``asked_at`` is the clock of the take-over the probe ran under, read before the probe left;
    ``retaken_at`` that of the take-over after it answered (``record`` is then the one it returned).

    A probe only proves absence for effects its upstream's search can still see: those it can find
    (probe_covers: of its routes, their key carried where it looks), and within the probe's horizon
    (less the margin, as for a native key's TTL), judged at ``retaken_at`` (a gateway may stall between
    taking the record and probing; the margin then covers the send that follows). Otherwise "not
    found" proves nothing and an operator must look.
    """
    pending = State.PENDING
    match result:
        case Found():
            return Settlement(Transition(pending, State.COMPLETED), may_have_sent=True, ends_lease=True)
        case ProbeError():
            return Settlement(Transition(pending, State.IN_DOUBT), may_have_sent=True, ends_lease=True)
        case NotFound() if retaken_at is None:
            return _too_soon(record, asked_at, policy) or TakeOver()
        case NotFound():
            horizon = policy.probe_horizon
            if probe_covers(record, policy) and (
                horizon is None or _younger_than(record, retaken_at, horizon, policy)
            ):
                return Send()
            return Settlement(Transition(pending, State.NEEDS_REVIEW), may_have_sent=True, ends_lease=True)
    raise AssertionError(f"unhandled probe result {result}")  # pragma: no cover


def take_over(record: EffectRecord) -> Transition:
    """Build the move of a new attempt on the record (to send or to probe); raises for one that completed."""
    return Transition(record.state, State.PENDING)


def review(record: EffectRecord) -> Transition:
    """Build the move that gives up on recovery: an operator must say whether the effect happened."""
    return Transition(record.state, State.NEEDS_REVIEW)


def restore(record: EffectRecord) -> Transition:
    """Build the move by which a probe supplies the purged response of a completed record."""
    return Transition(record.state, State.COMPLETED)


@dataclass(frozen=True, slots=True)
class Resolve:
    """Write down an operator's verdict: the record moves as ``transition`` says."""

    transition: Transition


def resolution(record: EffectRecord, now: datetime, *, happened: bool) -> Resolve | Refuse:
    """Judge an operator's verdict: it happened (completed, with a response) or it did not (retryable).

    Taken for records in review or in doubt, and for pending records whose lease ran out (a gateway
    died holding them). Refused while a lease runs: the upstream may still act on the request. Refused
    for a completed record: the effect happened, whatever anyone says later.
    """
    if record.state is State.COMPLETED:
        return Refuse("the effect completed; a completed effect is never resolved (its response is replayed)")
    if record.state is State.RETRYABLE:
        return Refuse("nothing happened upstream; the next retry sends it")
    if record.lease_expires_at is not None and now < record.lease_expires_at:
        return Refuse(
            f"a call may still be under way until its lease ends at {record.lease_expires_at.isoformat()}"
        )
    return Resolve(Transition(record.state, State.COMPLETED if happened else State.RETRYABLE))


def verdict_refused(record: EffectRecord) -> Refuse | None:
    """Say why an operator may not give a verdict on ``record`` as read; None when they may."""
    judged = resolution(record, record.as_of, happened=False)
    return judged if isinstance(judged, Refuse) else None


# Every answer of the judging functions above (decide, before_sending, settle, after_probe, resolution).
# take_over, review and restore build the transition a write carries out; they judge nothing.
Action = Decision | Send | Late | Refuse | Settlement | TooSoon | TakeOver | Resolve
