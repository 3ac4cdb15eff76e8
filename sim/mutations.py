"""Proof that the simulator finds bugs: mutations of the real code, applied in memory for a run.

Each mutation patches the pure core (a function of gateway/decision.py, the state table,
``Policy.margin``, the table in gateway/replies.py) or a seam the driver talks through (the simulated
store's fence, the simulated prober), never a private method of the driver, for the duration of a
``with`` block; it never edits a file. The runner then explores
seeds from 0 until a run breaks an invariant on a seed that the real code passes, and shrinks that
run. Three of them put back code that the simulator found broken in main (horizon-at-take-over,
unrecorded-outage-escapes, operator-unfenced): tests/test_simulation.py replays each recorded failure
with the old code and with the fix.

    python -m sim.mutations [--seeds 5000] [--user-visible] [--traces] [NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from gateway import attempts, decision, mcp, operators, probing, problems, replies, service, states
from gateway.decision import Policy, Resend, Settlement
from gateway.endings import Ending, Unanswered, Unrecorded
from gateway.errors import ProbeFailed
from gateway.outcome import NotSent, ProbeResult
from gateway.outcome import Outcome as Sent
from gateway.policy import UpstreamPolicy
from gateway.record import EffectRecord, StoredResponse
from gateway.states import State, Transition
from sim.invariants import USER_VISIBLE, checking_only
from sim.run import Outcome, explore, report, run, shrink
from sim.store import Row, SimDatabase
from sim.upstreams import SimProber


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    patch: Callable[[], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def patched(*changes: tuple[Any, str, Any]) -> Iterator[None]:
    """Set each (owner, attribute, value) for the block, and put every one back after it."""
    saved = [
        (owner, name, owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name))
        for owner, name, _ in changes
    ]
    try:
        for owner, name, value in changes:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _doubt_not_sticky() -> contextlib.AbstractContextManager[None]:
    real = decision.settle

    def settle(outcome: Sent, *, earlier_doubt: bool, method: str = "POST") -> Settlement:
        # The state as if no earlier attempt had been in doubt; may_have_sent is still carried.
        fresh = real(outcome, earlier_doubt=False, method=method)
        return Settlement(fresh.transition, earlier_doubt or fresh.may_have_sent, fresh.ends_lease)

    return patched((decision, "settle", settle), (attempts, "settle", settle))


def _margin_zero() -> contextlib.AbstractContextManager[None]:
    return patched((Policy, "margin", property(lambda self: timedelta(0))))


def _settle_unfenced() -> contextlib.AbstractContextManager[None]:
    def holds(self: SimDatabase, row: Row | None, record: EffectRecord, source: State) -> bool:
        return row is not None  # id and created_at still match; attempt and state are not checked

    return patched((SimDatabase, "_settle_holds", holds))


def _settle_fenced_by_attempt_only() -> contextlib.AbstractContextManager[None]:
    def holds(self: SimDatabase, row: Row | None, record: EffectRecord, source: State) -> bool:
        # Sending to review and a verdict keep the attempt number: only the state fences the holder out.
        return row is not None and row.attempt == record.attempt

    return patched((SimDatabase, "_settle_holds", holds))


def _resend_purged(widen_table: bool) -> Callable[[], contextlib.AbstractContextManager[None]]:
    def patch() -> contextlib.AbstractContextManager[None]:
        real = decision.decide

        def decide(
            record: EffectRecord, request: decision.Request, now: datetime, policy: Policy
        ) -> decision.Decision:
            action = real(record, request, now, policy)
            if isinstance(action, decision.Restore | decision.Purged):
                return Resend("native_key" if policy.native_key_ttl is not None else "retryable")
            return action

        changes: list[tuple[Any, str, Any]] = [(service, "decide", decide)]
        if widen_table:
            wider = {**states.TRANSITIONS, State.COMPLETED: frozenset({State.COMPLETED, State.PENDING})}
            changes.append((states, "TRANSITIONS", wider))
        return patched(*changes)

    return patch


def _probing(
    after: Callable[[SimProber, UpstreamPolicy, str, StoredResponse | ProbeFailed | None], None],
) -> tuple[Any, str, Any]:
    """Wrap the simulated prober, a seam the driver calls: ``after`` sees each probe's answer (or failure)
    before the driver does."""
    real = SimProber.probe

    async def probe(self: SimProber, policy: UpstreamPolicy, derived_key: str) -> StoredResponse | None:
        try:
            found = await real(self, policy, derived_key)
        except ProbeFailed as exc:
            after(self, policy, derived_key, exc)
            raise
        after(self, policy, derived_key, found)
        return found

    return (SimProber, "probe", probe)


def _purged_row(prober: SimProber, derived_key: str) -> tuple[SimDatabase, EffectRecord] | None:
    """The completed record, its response purged, that a probe looked for (None: it is not one)."""
    db: SimDatabase = prober.stage.db  # type: ignore[attr-defined]  # the stage is the World
    for row in db.rows.values():
        if row.derived_key == derived_key:
            record = db.record(row, db.now(), response=True)
            return (db, record) if record.purged else None
    return None


def _failed_probe_doubts() -> contextlib.AbstractContextManager[None]:
    def after(prober: SimProber, policy: UpstreamPolicy, key: str, answer: object) -> None:
        purged = _purged_row(prober, key)
        if isinstance(answer, ProbeFailed) and purged is not None:
            # The old bug: a failed probe of a purged, completed effect put it back in doubt. (The state
            # table forbids that move, so it is built past its check.)
            db, record = purged
            move = object.__new__(Transition)
            object.__setattr__(move, "source", State.COMPLETED)
            object.__setattr__(move, "target", State.IN_DOUBT)
            db.settle(record, Settlement(move, True, True), State.COMPLETED, response=None, recovered_by=None)

    return patched(_probing(after))


def _purged_not_found_resends() -> contextlib.AbstractContextManager[None]:
    # The old code: a purged effect that the probe no longer finds is taken over and sent again (its
    # table let a completed record be taken: completed -> pending). Here decide, the pure core, sends
    # it again on the next request once a probe has found nothing for it.
    lost: set[str] = set()
    real = decision.decide

    def after(prober: SimProber, policy: UpstreamPolicy, key: str, answer: object) -> None:
        if answer is None and _purged_row(prober, key) is not None:
            lost.add(key)

    def decide(
        record: EffectRecord, request: decision.Request, now: datetime, policy: Policy
    ) -> decision.Decision:
        if record.purged and record.derived_key in lost:
            return Resend("retryable")
        return real(record, request, now, policy)

    wider = {**states.TRANSITIONS, State.COMPLETED: frozenset({State.COMPLETED, State.PENDING})}
    return patched(_probing(after), (service, "decide", decide), (states, "TRANSITIONS", wider))


@dataclass(frozen=True, slots=True)
class _Judged:
    """What after_probe judges a probe's answer by, besides the answer itself."""

    record: EffectRecord
    asked_at: datetime
    policy: Policy
    retaken_at: datetime | None


def _judging_probes(
    change: Callable[[_Judged], _Judged], *more: tuple[Any, str, Any]
) -> contextlib.AbstractContextManager[None]:
    """after_probe judging by what ``change`` makes of its arguments (each probe mutation says how)."""
    real = decision.after_probe

    def after_probe(
        record: EffectRecord,
        result: ProbeResult,
        asked_at: datetime,
        policy: Policy,
        retaken_at: datetime | None = None,
    ) -> decision.ProbeStep:
        judged = change(_Judged(record, asked_at, policy, retaken_at))
        return real(judged.record, result, judged.asked_at, judged.policy, retaken_at=judged.retaken_at)

    return patched((probing, "after_probe", after_probe), *more)


def _horizon_ignored() -> contextlib.AbstractContextManager[None]:
    return _judging_probes(lambda judged: replace(judged, policy=replace(judged.policy, probe_horizon=None)))


def _horizon_at_take_over() -> contextlib.AbstractContextManager[None]:
    # The old code: "not found" judged at the take-over's clock, before the probe ran (a pause in
    # between is not seen), instead of at the re-take after the probe answered.
    return _judging_probes(
        lambda judged: judged if judged.retaken_at is None else replace(judged, retaken_at=judged.asked_at)
    )


def _lag_ignored() -> contextlib.AbstractContextManager[None]:
    # "Not found" trusted at once, however lately the search lists an effect.
    return _judging_probes(
        lambda judged: replace(judged, policy=replace(judged.policy, probe_lag=timedelta(0)))
    )


# This process's clock when the probe left (for "lag-after-probe").
_PROBED_FROM: contextvars.ContextVar[float] = contextvars.ContextVar("mutation_probed_from")


def _lag_after_probe() -> contextlib.AbstractContextManager[None]:
    real_probe = SimProber.probe

    async def probe(self: SimProber, policy: UpstreamPolicy, derived_key: str) -> StoredResponse | None:
        # Set in the driver's task, which goes on to judge the answer.
        _PROBED_FROM.set(asyncio.get_running_loop().time())
        return await real_probe(self, policy, derived_key)

    def later(judged: _Judged) -> _Judged:
        # The lag judged at the database's clock once the probe has answered, as the horizon is (the
        # simulated database's clock runs with the loop's), instead of the take-over's, before it left.
        if judged.retaken_at is not None:
            return judged
        since = timedelta(seconds=asyncio.get_running_loop().time() - _PROBED_FROM.get())
        return replace(judged, asked_at=judged.asked_at + since)

    return _judging_probes(later, (SimProber, "probe", probe))


def _lag_from_the_claim() -> contextlib.AbstractContextManager[None]:
    def from_the_claim(judged: _Judged) -> _Judged:
        # The lag counted from the latest claim, as if the upstream acted the moment it was sent: the
        # answer's time and the lease are left out.
        if judged.retaken_at is not None:
            return judged
        record = judged.record
        return replace(judged, record=replace(record, response_at=record.last_sent_at or record.created_at))

    return _judging_probes(from_the_claim)


def _unrecorded_outage_escapes() -> contextlib.AbstractContextManager[None]:
    real = replies.problem

    def problem(ending: Ending) -> problems.Problem:
        # The old code: an outage while writing down what the upstream answered (or while sending it to
        # review after Postgres refused the answer) reached the agent as "...; nothing was sent".
        if isinstance(ending, Unrecorded):
            return real(Unanswered(NotSent(f"the store is unavailable: {ending.error}"), ending.effect_id))
        return real(ending)

    return patched((replies, "problem", problem))


def _late_sender() -> contextlib.AbstractContextManager[None]:
    def before_sending(*args: Any) -> decision.Send:
        return decision.Send()

    return patched((attempts, "before_sending", before_sending))


def _operator_during_lease(store_too: bool) -> Callable[[], contextlib.AbstractContextManager[None]]:
    def patch() -> contextlib.AbstractContextManager[None]:
        real = decision.resolution

        def resolution(
            record: EffectRecord, now: datetime, *, happened: bool
        ) -> decision.Resolve | decision.Refuse:
            return real(replace(record, lease_expires_at=None), now, happened=happened)

        # The pure core's rule, whoever asks it: the operators' commands, and whether a record is shown
        # as waiting for a verdict (operators.resolvable, through decision.verdict_refused).
        changes: list[tuple[Any, str, Any]] = [
            (decision, "resolution", resolution),
            (operators, "resolution", resolution),
        ]
        if store_too:
            changes.append((SimDatabase, "_resolvable", lambda self, row, now: True))
        return patched(*changes)

    return patch


def _operator_unfenced() -> contextlib.AbstractContextManager[None]:
    real = operators.resolve

    async def resolve(store: Any, effect_id: int, *, attempt: int, **verdict: Any) -> EffectRecord:
        # The verdict is applied to the record as it is now, not as the operator judged it.
        now = await store.get(effect_id)
        return await real(store, effect_id, attempt=now.attempt if now else attempt, **verdict)

    return patched((operators, "resolve", resolve))


def _mcp_errors_never_ran() -> contextlib.AbstractContextManager[None]:
    real = mcp.answer_of

    def answer_of(status: int, content_type: str, body: bytes, id_json: str) -> mcp.ToolAnswer | None:
        # Any error status from an MCP server is taken to say the tool never ran.
        read = real(status, content_type, body, id_json)
        return mcp.ToolAnswer("no", read.stored) if read is not None and status >= 400 else read

    return patched((mcp, "answer_of", answer_of))


MUTATIONS = [
    Mutation(
        "doubt-not-sticky",
        "decision.settle: a refused attempt after doubt leaves the record retryable",
        _doubt_not_sticky,
    ),
    Mutation(
        "margin-zero",
        "Policy.margin is 0: a native key is trusted until the very end of its TTL",
        _margin_zero,
    ),
    Mutation(
        "settle-unfenced", "the simulated store's settle checks neither attempt nor state", _settle_unfenced
    ),
    Mutation(
        "settle-fenced-by-attempt-only",
        "the simulated store's settle checks the attempt but not the state it was read in",
        _settle_fenced_by_attempt_only,
    ),
    Mutation(
        "purged-resend",
        "decide re-sends a completed record whose response was purged (and the table lets it be taken)",
        _resend_purged(widen_table=True),
    ),
    Mutation(
        "purged-resend-decide-only",
        "decide re-sends a completed record whose response was purged (the table unchanged)",
        _resend_purged(widen_table=False),
    ),
    Mutation(
        "purged-not-found-resends",
        "a completed record whose response was purged is sent again when the probe no longer finds it",
        _purged_not_found_resends,
    ),
    Mutation(
        "failed-probe-doubts",
        "a failed probe of a purged completed record puts it in doubt",
        _failed_probe_doubts,
    ),
    Mutation("horizon-ignored", "after_probe trusts 'not found' whatever the effect's age", _horizon_ignored),
    Mutation(
        "horizon-at-take-over",
        "after_probe judges 'not found' at the take-over's clock, before the probe ran (a bug found)",
        _horizon_at_take_over,
    ),
    Mutation(
        "lag-ignored", "after_probe trusts 'not found' at once, however late the search lists", _lag_ignored
    ),
    Mutation(
        "lag-after-probe",
        "after_probe judges the lag at the clock after the probe answered, not the take-over's",
        _lag_after_probe,
    ),
    Mutation(
        "lag-from-the-claim",
        "after_probe counts the lag from the latest claim, not from its answer or the end of its lease",
        _lag_from_the_claim,
    ),
    Mutation(
        "unrecorded-outage-escapes",
        "an outage on the write to review after a refused answer escapes as 'nothing was sent' (a bug found)",
        _unrecorded_outage_escapes,
    ),
    Mutation(
        "late-sender",
        "before_sending is off: a gateway that fell behind its lease sends anyway",
        _late_sender,
    ),
    Mutation(
        "operator-unfenced",
        "operators.resolve applies a verdict to the record as it is now, not as the operator judged it",
        _operator_unfenced,
    ),
    Mutation(
        "operator-during-lease",
        "resolution and the store's resolve both let an operator resolve while a lease runs",
        _operator_during_lease(store_too=True),
    ),
    Mutation(
        "mcp-errors-never-ran",
        "mcp.answer_of takes any error status from an MCP server to say the tool never ran",
        _mcp_errors_never_ran,
    ),
    Mutation(
        "operator-during-lease-decision-only",
        "resolution lets an operator resolve while a lease runs (the store's SQL still refuses)",
        _operator_during_lease(store_too=False),
    ),
]


@dataclass
class Caught:
    mutation: Mutation
    seeds: int
    seconds: float
    failure: Outcome | None
    shrunk: Outcome | None


def hunt(
    mutation: Mutation,
    *,
    seeds: int,
    shrink_seconds: float | None = 30.0,
    checked: frozenset[str] | None = None,
) -> Caught:
    """Explore seeds 0, 1, ... under the mutation until one breaks an invariant that the real code
    keeps on the same seed (a seed that fails either way shows a real bug, not the mutation); shrink it.

    ``checked``: only these invariants count (None: all of them); the real code is held to all.
    """
    started = time.monotonic()
    seed = 0
    while seed < seeds:
        with mutation.patch(), checking_only(checked):
            found = explore(seed, seeds=seeds - seed)
        if found.failure is None:
            return Caught(mutation, seeds, time.monotonic() - started, None, None)
        seed = found.failure.seed + 1
        if not run(found.failure.seed).failed:
            shrunk = None
            if shrink_seconds is not None:
                with mutation.patch(), checking_only(checked):
                    shrunk = shrink(found.failure, seconds=shrink_seconds)
            return Caught(mutation, seed, time.monotonic() - started, found.failure, shrunk)
    return Caught(mutation, seeds, time.monotonic() - started, None, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.mutations", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--seeds", type=int, default=5000, help="give up on a mutation after this many seeds")
    parser.add_argument("--traces", action="store_true", help="print each shrunk trace")
    parser.add_argument(
        "--user-visible",
        action="store_true",
        help="count only what a user would notice: " + ", ".join(sorted(USER_VISIBLE)),
    )
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"no such mutation: {', '.join(sorted(unknown))}")
    results = []
    for mutation in chosen:
        caught = hunt(mutation, seeds=args.seeds, checked=USER_VISIBLE if args.user_visible else None)
        results.append(caught)
        failure = caught.shrunk or caught.failure
        line = f"{mutation.name:<36} "
        if failure is None or failure.violation is None:
            line += f"NOT CAUGHT in {caught.seeds} seeds ({caught.seconds:.1f}s)"
        else:
            line += (
                f"caught by {failure.violation.invariant} at seed {caught.seeds - 1} ({caught.seeds} seeds, "
                f"{caught.seconds:.1f}s); shrunk trace {len(failure.trace)} events"
            )
        print(line, flush=True)
        if args.traces and failure is not None:
            print(report(failure, title=f"{mutation.name}: {mutation.what}"))
            print()
    missed = [c for c in results if c.failure is None]
    return 1 if missed else 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"{time.monotonic() - started:.0f}s")
    sys.exit(code)
