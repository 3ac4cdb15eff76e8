"""The simulator's short form for CI: fixed seeds hold every invariant, and every mutation is caught.

`make simulate` explores fresh seeds for minutes; this runs a fixed set in seconds, so that a change
that breaks an invariant on them, or makes the simulator blind to a mutation, fails `make test`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sim.choices import decode, encode
from sim.mutations import MUTATIONS, Mutation, hunt
from sim.run import Outcome, explore, run, shrink
from tests.support import ROOT

# Seeds the real code passes.
SEEDS = 200
# The first seed on which each mutation breaks an invariant that the real code keeps, as `python -m
# sim.mutations` finds them by exploring from seed 0 (`make simulate` explores fresh seeds for minutes).
# Each is replayed here, in a fraction of a second. A change that reshuffles the simulator's schedules
# can move them: run that command and copy its seeds here; a mutation it no longer catches is a hole.
CAUGHT_AT = {
    "doubt-not-sticky": 40,
    "margin-zero": 414,
    "settle-unfenced": 31,
    "settle-fenced-by-attempt-only": 31,
    "purged-resend": 0,
    "purged-resend-decide-only": 0,
    "purged-not-found-resends": 3,
    "failed-probe-doubts": 3,
    "horizon-ignored": 122,
    "horizon-at-take-over": 93075,
    "lag-ignored": 1210,
    "lag-after-probe": 1419,
    "lag-from-the-claim": 5274,
    "unrecorded-outage-escapes": 8,
    "late-sender": 13,
    "operator-unfenced": 5178,
    "operator-during-lease": 1,
    "operator-during-lease-decision-only": 53,
    "mcp-errors-never-ran": 37,
}


def test_every_mutation_has_its_seed() -> None:
    """Every mutation of the real code is replayed on the seed that catches it."""
    assert {m.name for m in MUTATIONS} == set(CAUGHT_AT)


def test_fixed_seeds_hold_every_invariant() -> None:
    """No run of the fixed seeds breaks an invariant."""
    found = explore(0, seeds=SEEDS, stop_at_first=False)
    assert found.failures == []
    assert found.effects > 0
    assert found.crashes > 0


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_is_caught(mutation: Mutation) -> None:
    """Each mutation of the real code breaks an invariant on its seed, which the real code passes."""
    seed = CAUGHT_AT[mutation.name]
    real = run(seed)
    assert real.violation is None, real.violation
    with mutation.patch():
        mutated = run(seed)
    assert mutated.violation is not None, f"{mutation.name} is no longer caught on seed {seed}"


def test_a_hunt_finds_the_first_seed_that_catches_a_mutation() -> None:
    """`python -m sim.mutations` explores from seed 0 and stops at the seed CAUGHT_AT records."""
    mutation = next(m for m in MUTATIONS if m.name == "failed-probe-doubts")
    caught = hunt(mutation, seeds=20, shrink_seconds=None)
    assert caught.failure is not None
    assert caught.failure.seed == CAUGHT_AT[mutation.name]


def test_a_seed_replays_exactly_and_shrinks() -> None:
    """The same seed gives the same trace (in another process too), and a failure shrinks to a shorter one."""
    first = run(7)
    again = run(7)
    assert first.trace == again.trace
    assert first.made == again.made
    replayed = run(7, first.made)
    assert replayed.trace == first.trace
    script = "from sim.run import run; print(len(run(7).trace), run(7).steps)"
    other = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert other.stdout.split() == [str(len(first.trace)), str(first.steps)]
    operator = next(m for m in MUTATIONS if m.name == "operator-during-lease")
    with operator.patch():
        failure = explore(0, seeds=CAUGHT_AT[operator.name] + 1).failure
        assert failure is not None
        small = shrink(failure, seconds=10)
    assert small.violation is not None
    assert small.violation.invariant == failure.violation.invariant  # type: ignore[union-attr]
    assert len(small.trace) <= len(failure.trace)
    assert decode(encode(small.made)) == {k: v for k, v in small.made.items() if any(v)}


# --- real bugs the simulator found in main (issue 9), fixed ------------------------------------------------
# Each replays the schedule that broke the code, shrunk, with the old code put back by its mutation
# (so the test is seen to fail without the fix) and with the code as it is (which must hold).


def _breaks_only_the_old_code(name: str, seed: int, schedule: str) -> Outcome:
    mutation = next(m for m in MUTATIONS if m.name == name)
    with mutation.patch():
        old = run(seed, decode(schedule))
    now = run(seed, decode(schedule))
    assert now.violation is None, now.violation
    return old


def test_a_probe_answered_after_a_stall_past_the_lease_is_not_trusted() -> None:
    """A gateway that stalls past its lease after a probe take-over must not trust the probe's "not found".

    Seed 1013: the record is in doubt (the first attempt acted, its answer was lost); at 58.2s, 1.8s
    short of the probe's 60s horizon (less a 1.5s lease: still trusted), g1 takes the record over to
    probe and pauses for 2.2s; the search, now past its horizon, no longer lists the effect. The old
    code judged "not found" at the take-over's clock, and the effect was sent a second time;
    now the record is taken again after the probe answers, and judged at that clock.
    """
    old = _breaks_only_the_old_code(
        "horizon-at-take-over",
        1013,
        "faults/48:8=945,10=645,11=6,29=999,30=160;setup/22:0=1,1=1,2=1,8=2;levels/11:1=1,2=2,6=3;c1/10:5=2,7=800",
    )
    assert old.violation is not None
    assert old.violation.invariant == "never-twice"


def test_an_operators_verdict_is_fenced_on_the_record_they_looked_at() -> None:
    """An operator who judged "did not happen" before a gateway re-sent must not make the record retryable.

    Seed 5178: the operator judges an earlier attempt "did not happen" and the record is made
    retryable; a gateway re-sends it at once (attempt 3), and the upstream acts but never answers, so
    the record is in doubt again. The operator's first look, taken before that attempt, still stands
    in their mind. The old operators.resolve fenced the verdict on its own re-read, not on the record
    judged, so "did not happen" made the record retryable again although the effect had happened, and
    the next request would send it a second time. The verdict now names the attempt it judged.
    """
    old = _breaks_only_the_old_code(
        "operator-unfenced",
        5178,
        "faults/106:9=455,10=4,52=981,53=262,54=499,55=3,94=745,95=8;setup/24:0=1,1=1,3=1,8=2,15=1,17=1;"
        "levels/11:1=2,6=3,8=2;c1/5:0=51;c2/15:2=1,5=1,6=290,9=1,10=273;"
        "operator/42:0=349,4=734,5=1,8=31,9=2,14=21,15=2,18=303,22=882,23=1,24=464",
    )
    assert old.violation is not None
    assert old.violation.invariant == "retryable-means-nothing"


def test_a_request_that_was_sent_is_never_answered_nothing_was_sent() -> None:
    """An answer that cannot be stored, then an outage on the review write: not told 'nothing was sent'.

    Seed 95: the old code let StoreUnavailable escape the service after the request had left, and the
    app answered it "...; nothing was sent". It is now the service's own 503 saying the outcome could
    not be recorded. (The driver now returns how a request ended as a value, so the mutation puts the
    old answer back where it is worded, in replies.problem.)
    """
    old = _breaks_only_the_old_code(
        "unrecorded-outage-escapes", 95, "faults/21:15=894,19=993;levels/9:3=2,5=2"
    )
    assert old.violation is not None
    assert old.violation.invariant == "nothing-sent-is-true"


# --- three probe mutations, replayed on the shrunk schedules that first caught them ---------------------


def test_the_lag_is_judged_before_the_probe_leaves() -> None:
    """A "not found" is judged at the take-over's clock: a pause after the search looked cannot age it.

    Seed 1373: the shop places an order at 2.70s and answers 201 while Postgres is down, so the record
    stays pending; its search lists orders 8s late. Probes at 6.3s and 7.7s are too soon (8s from the
    lease's end at 4.65s). At 10.58s a gateway takes the record over to probe, the search finds nothing
    (the order is listed from 10.70s), and the gateway pauses for 2.1s. Judged at the clock after the
    probe answered, 12.69s, the lag had passed, and the order was placed again; judged at the
    take-over's, it is too soon.
    """
    mutated = _breaks_only_the_old_code(
        "lag-after-probe",
        1373,
        "net/81:29=171;faults/118:3=989,4=167,43=991,44=562;setup/23:2=1,4=1,7=1,10=3;lag/1:0=3;"
        "levels/11:3=2,10=1;c1/9:0=899;c2/5:0=52;c2/eager/3:0=512,1=978,2=800;"
        "c3/18:0=286,2=3,5=847,8=802,13=1,14=365;c4/14:0=157,2=3,5=1,6=177,8=1,9=398;"
        "c4/eager/8:0=544,1=518,2=356,5=741,6=138;probe-pauses/5:1=983,2=286,3=747,4=211",
    )
    assert mutated.violation is not None
    assert mutated.violation.invariant == "never-twice"


def test_the_lag_is_counted_from_when_the_latest_attempt_could_have_acted() -> None:
    """A "not found" waits the lag from the latest attempt's answer (or lease's end), not from its claim.

    Seed 5274: the shop's search lists an order 0.5s after it is placed. It places one 0.86s after the
    claim and answers 500. Counted from the claim, the lag has passed for the retry's probe a moment
    later, which finds nothing yet, and the order is placed again; counted from the answer, that probe
    is too soon.
    """
    mutated = _breaks_only_the_old_code(
        "lag-from-the-claim",
        5274,
        "net/21:5=712;faults/44:9=402,10=5;setup/15:2=1,3=2;lag/1:0=1;levels/11:6=3",
    )
    assert mutated.violation is not None
    assert mutated.violation.invariant == "never-twice"
