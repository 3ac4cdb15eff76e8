"""What must hold in every simulated world, checked where it can change.

Each check runs at the event that could break it: every write the database applies
(:meth:`Checks.write`), every request that reaches an upstream (:meth:`Checks.arrived`), every
effect an upstream makes (:meth:`Checks.landed`), every answer a client gets (:meth:`Checks.reply`),
once clients have stopped (:meth:`Checks.at_rest`) and once the world has healed
(:meth:`Checks.final`). After every step of the loop, :meth:`Checks.step` makes sure that no record
changed state or attempt without a write those checks saw, so what they check holds after every step.

The invariants, by the name a violation is reported under:

never-twice
    An upstream makes an effect at most once per (tenant, upstream, key), whatever its kind: with a
    native key (within its TTL), a probe (within its horizon) or neither, the gateway re-sends only
    what the key or the probe covers and sends the rest to review. The one exception is an upstream
    marked ``repeat_harmless``, where a record in doubt is re-sent on purpose: there a second effect
    is allowed only from a request that took the record over *because* repeats are harmless (the
    recovery's last resort before review), and only under the next two invariants (never two
    attempts at once, never after the record completed).
one-attempt-at-a-time
    A request reaches the upstream only once every earlier attempt at the same effect is over there
    (the lease's promise: a take-over waits for it to run out).
effect-under-lease
    An effect lands only while its record is pending or in doubt under a lease that still runs.
same-answer
    Every 2xx that any client gets for a key is byte for byte the first one (status, headers, body),
    and, except for harmless upstreams, it is the answer of the upstream's one effect; the record is
    completed when a client gets it. Every request for the key that starts after a client got that
    2xx is answered with it byte for byte (a replay), or told that its response was purged after the
    retention, that the probe to restore it failed, or that Postgres or the gateway is unreachable;
    nothing else.
completed-stays
    A completed record is never written again, except to put back a response the retention dropped.
legal-transition
    Every change of state the database applied is in ``gateway.states.TRANSITIONS`` (as it was when
    the simulator started: a mutation that widens the table does not widen this check).
retryable-means-nothing
    A record becomes retryable only while nothing happened upstream: no effect in the ledger and no
    attempt still there.
review-only-when-blind
    A record goes to needs_review only where nothing could tell whether the effect happened: the
    upstream has no probe, is not harmless, and has no native key or its first send is older than
    the key's TTL less one lease (``send_to_review``); or a probe found nothing for an effect older
    than its horizon less one lease; or Postgres refused to store the answer of that very attempt.
no-unexpected-error
    The service answers every request with a reply or one of the gateway's own problems (or a store
    outage, which the app answers 503); anything else would be the app's 500 "failed unexpectedly".
nothing-sent-is-true
    An answer that tells the client nothing was sent (502 upstream-unreachable; a store error, which
    the app answers "nothing was sent") is only given when this request sent nothing upstream.
at-rest
    Once clients stop and one more lease has run out, every record is completed, retryable, in doubt
    or in review, or pending with its lease run out: the holder died or could not write what came of
    its attempt, which every gateway reads as in doubt.
unobserved-write (every step)
    No record changed state or attempt without a write that the checks above saw.
settles (final)
    Once faults stop, clients retry and an operator has settled what waits for one, no record is left
    pending and every record is completed.
audit-is-true (final)
    A record completed with a 2xx has its effect in the upstream's ledger, and every effect in a
    ledger has its record completed with a 2xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from gateway import problems
from gateway.errors import StoreRejected, StoreUnavailable
from gateway.record import StoredResponse
from gateway.replies import Reply
from gateway.states import TRANSITIONS, State
from sim.store import SimDatabase, Write
from sim.upstreams import Call, Effect, Kind, SimUpstream

Scope = tuple[str, str, str]
Answer = tuple[int, StoredResponse, float]  # the request that got it, the answer, when it got it
# Taken when the simulator is imported, before any mutation can touch the table.
PRISTINE: dict[State | None, frozenset[State]] = {source: frozenset(t) for source, t in TRANSITIONS.items()}
LIVE = (State.PENDING, State.IN_DOUBT)
# What a user would notice; the other invariants are the rules behind these, and catch a broken rule
# at the step that breaks it (python -m sim.mutations --user-visible checks these alone).
USER_VISIBLE = frozenset(
    {"never-twice", "same-answer", "nothing-sent-is-true", "no-unexpected-error", "settles", "audit-is-true"}
)
_checked: frozenset[str] | None = None


@contextmanager
def checking_only(names: frozenset[str] | None) -> Iterator[None]:
    """Report only the invariants named (None: all of them) for runs within the block."""
    global _checked
    before, _checked = _checked, names
    try:
        yield
    finally:
        _checked = before


# The reason of the take-over by which a gateway late to send renews its own attempt (gateway.service).
RENEWED = "late to send"


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str
    at: float


class Watched(Protocol):
    """What the checks read of the world they watch (sim.world.World), and how they report to it."""

    db: SimDatabase
    upstreams: dict[str, SimUpstream]

    def now(self) -> float: ...
    def db_clock(self) -> datetime: ...
    def truth(self, scope: Scope) -> StoredResponse | None: ...
    def note(self, who: str, text: str) -> None: ...
    def page(self, effect_id: int, state: State, lease_ends: float) -> None: ...
    def violate(self, violation: Violation) -> None: ...

    @property
    def epoch(self) -> datetime: ...


class Checks:
    def __init__(self, world: Watched) -> None:
        self.world = world
        # (effect id, attempt) of writes Postgres was made to refuse: the answer could not be stored.
        self.refused: set[tuple[int, int]] = set()
        # The first 2xx of each key: the request that got it, the answer, when the client got it.
        self.answers: dict[Scope, Answer] = {}
        # Why each client request's handling last took a record (the claim: None; a take-over: its
        # reason); a request renewing its own attempt before sending keeps the reason it had.
        self.took_because: dict[int, str | None] = {}
        # Each record's (state, attempt) as the last write the checks saw left it.
        self.seen: dict[int, tuple[State, int]] = {}

    def fail(self, invariant: str, detail: str) -> None:
        if _checked is not None and invariant not in _checked:
            return
        self.world.violate(Violation(invariant, detail, self.world.now()))

    # --- the database's writes ----------------------------------------------------------------------------

    def write(self, write: Write) -> None:
        row = write.row
        label = f"{row.tenant}/{row.upstream}/{row.key}"
        self.world.note(
            write.who or "db",
            f"{write.op} {label}: {write.source or 'new'} -> {row.state} (attempt {row.attempt})"
            + (f" [{write.note}]" if write.note else ""),
        )
        self.seen[row.id] = (row.state, row.attempt)
        if write.op == "claim":
            self.took_because[write.request] = None
        elif write.op == "reclaim" and write.note != RENEWED:
            self.took_because[write.request] = write.note
        if row.state not in PRISTINE[write.source]:
            self.fail("legal-transition", f"{write.op} moved {label} from {write.source} to {row.state}")
        if write.source is State.COMPLETED and write.op != "restore":
            self.fail("completed-stays", f"{write.op} by {write.who} wrote to completed {label}")
        upstream = self.world.upstreams[row.upstream]
        if row.state in (State.PENDING, State.IN_DOUBT, State.NEEDS_REVIEW):
            lease_ends = (
                (row.lease_expires_at - self.world.epoch).total_seconds() if row.lease_expires_at else 0.0
            )
            self.world.page(row.id, row.state, lease_ends)
        if row.state is State.RETRYABLE:
            if upstream.effects(row.scope):
                self.fail(
                    "retryable-means-nothing",
                    f"{label} made retryable by {write.op}, but its effect happened",
                )
            elif upstream.in_flight(row.scope):
                self.fail(
                    "retryable-means-nothing", f"{label} made retryable while an attempt is still upstream"
                )
        if row.state is State.NEEDS_REVIEW and write.source is not State.NEEDS_REVIEW:
            why = self._review_unjustified(write, upstream)
            if why is not None:
                self.fail("review-only-when-blind", f"{label} sent to review by {write.op}, but {why}")

    def _review_unjustified(self, write: Write, upstream: SimUpstream) -> str | None:
        row = write.row
        policy = upstream.policy.decision
        lease = upstream.policy.lease  # the margin as the design sets it, whatever a mutation does
        age = write.now - (row.first_sent_at or row.created_at)
        if not (row.may_have_sent or write.source is State.PENDING):
            return "it was never sent"
        if write.op == "send_to_review":
            if policy.has_probe:
                return "the upstream has a probe"
            if policy.repeat_harmless:
                return "the upstream's duplicates are harmless"
            if policy.native_key_ttl is not None and age < policy.native_key_ttl - lease:
                return f"its native key was still fresh ({age.total_seconds():.3f}s old)"
            return None
        if write.op == "settle":
            if (row.id, row.attempt) in self.refused:
                return None  # the answer of this attempt could not be stored
            horizon = policy.probe_horizon
            if policy.has_probe and horizon is not None and age >= horizon - lease:
                return None
            return f"nothing stopped the probe from telling ({age.total_seconds():.3f}s old)"
        return f"{write.op} does not send to review"

    # --- the upstreams ------------------------------------------------------------------------------------

    def arrived(self, upstream: SimUpstream, call: Call) -> None:
        others = [c for c in upstream.in_flight(call.scope) if c is not call]
        if others:
            self.fail(
                "one-attempt-at-a-time",
                f"{call.who}'s request for {_label(call.scope)} reached {upstream.name} while "
                f"{others[0].who}'s was still there",
            )

    def landed(self, upstream: SimUpstream, effect: Effect, call: Call) -> None:
        earlier = [e for e in upstream.effects(effect.scope) if e is not effect]
        because = self.took_because.get(call.request)
        if earlier and not (upstream.kind is Kind.HARMLESS and because == "harmless"):
            self.fail(
                "never-twice",
                f"{upstream.name} ({upstream.kind.value}) made {_label(effect.scope)} twice: effect "
                f"#{earlier[0].n} at {earlier[0].at:.6f}s and #{effect.n} at {effect.at:.6f}s "
                f"(by {call.who}, " + (f"taken over for {because})" if because else "its claim)"),
            )
        known = self.world.db.keys.get(effect.scope)
        row = self.world.db.rows.get(known[0]) if known else None
        now = self.world.db_clock()
        if row is None:
            self.fail("effect-under-lease", f"effect #{effect.n} for {_label(effect.scope)} has no record")
        elif row.state not in LIVE or row.lease_expires_at is None or row.lease_expires_at < now:
            lease = (
                "no lease"
                if row.lease_expires_at is None
                else f"lease ended {now - row.lease_expires_at} ago"
            )
            self.fail(
                "effect-under-lease",
                f"effect #{effect.n} for {_label(effect.scope)} (by {call.who}) landed on a {row.state} "
                f"record ({lease})",
            )

    # --- what clients are told --------------------------------------------------------------------------

    def reply(
        self, scope: Scope, number: int, started: float, sent: bool, result: Reply | BaseException
    ) -> None:
        """Check what request ``number`` was told (``sent``: whether its gateway sent it upstream)."""
        first = self.answers.get(scope)
        if first is not None and started > first[2]:
            self._after_answer(scope, number, first, result)
        match result:
            case Reply(response=response) if 200 <= response.status < 300:
                known = self.world.db.keys.get(scope)
                row = self.world.db.rows.get(known[0]) if known else None
                if row is None or row.state is not State.COMPLETED:
                    self.fail(
                        "same-answer",
                        f"r{number} got a 2xx for {_label(scope)}, whose record is "
                        f"{row.state if row else 'missing'}",
                    )
                if first is None:
                    self.answers[scope] = (number, response, self.world.now())
                    truth = self.world.truth(scope)
                    if self.world.upstreams[scope[1]].kind is not Kind.HARMLESS and response != truth:
                        self.fail(
                            "same-answer",
                            f"r{number} got a 2xx for {_label(scope)} that is not its effect's answer",
                        )
                elif response != first[1]:
                    self.fail(
                        "same-answer",
                        f"r{number} got {response.status} {response.body!r} for {_label(scope)}; r{first[0]} "
                        f"got {first[1].status} {first[1].body!r}",
                    )
            case Reply():
                pass
            case problems.UpstreamUnreachable() if sent:
                self.fail(
                    "nothing-sent-is-true", f"r{number} was told nothing was sent, but its request left"
                )
            case problems.Problem():
                pass
            case StoreUnavailable() | StoreRejected() if sent:
                self.fail(
                    "nothing-sent-is-true",
                    f"r{number}'s {type(result).__name__} ({result}) is answered 'nothing was sent', but "
                    "its request left",
                )
            case StoreUnavailable() | StoreRejected() | ConnectionError():
                pass
            case _:
                self.fail(
                    "no-unexpected-error",
                    f"r{number} for {_label(scope)} raised {type(result).__name__}: {result}",
                )

    def _after_answer(self, scope: Scope, number: int, first: Answer, result: Reply | BaseException) -> None:
        """A request that started after a client got the key's 2xx: that 2xx again, or why not."""
        match result:
            case Reply(response=response) if response == first[1]:
                return
            case Reply(response=response):
                told = f"{response.status} {response.body[:60]!r}"
            case problems.ResponsePurged() | problems.ProbeUnavailable():
                return
            case StoreUnavailable() | StoreRejected() | ConnectionError():
                return
            case _:
                told = type(result).__name__
        self.fail(
            "same-answer",
            f"r{number} for {_label(scope)} started after r{first[0]} got {first[1].status} and was "
            f"answered {told}",
        )

    # --- every step, once clients stop, once the world has healed -----------------------------------------

    def step(self) -> None:
        for row in self.world.db.rows.values():
            if self.seen.get(row.id) != (row.state, row.attempt):
                self.fail(
                    "unobserved-write",
                    f"{row.tenant}/{row.upstream}/{row.key} is {row.state} at attempt {row.attempt}, but "
                    f"the last write seen left it {self.seen.get(row.id)}",
                )
                return

    def at_rest(self) -> None:
        now = self.world.db_clock()
        for row in self.world.db.rows.values():
            if row.state is State.PENDING and (row.lease_expires_at is None or row.lease_expires_at > now):
                self.fail(
                    "at-rest",
                    f"{row.tenant}/{row.upstream}/{row.key} is pending under a running lease (until "
                    f"{row.lease_expires_at}) after clients stopped",
                )
                return

    def final(self) -> None:
        for row in self.world.db.rows.values():
            label = f"{row.tenant}/{row.upstream}/{row.key}"
            if row.state is not State.COMPLETED:
                self.fail(
                    "settles", f"{label} is {row.state} after healing, retries and an operator's verdict"
                )
                return
            effects = self.world.upstreams[row.upstream].effects(row.scope)
            ok = row.response_status is not None and 200 <= row.response_status < 300
            if ok and not effects:
                self.fail(
                    "audit-is-true", f"{label} completed {row.response_status} but nothing happened upstream"
                )
                return
            if effects and not ok:
                self.fail(
                    "audit-is-true", f"{label} happened upstream but is completed {row.response_status}"
                )
                return


def _label(scope: Scope) -> str:
    return f"{scope[0]}/{scope[1]}/{scope[2]}"
