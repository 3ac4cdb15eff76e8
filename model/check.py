#!/usr/bin/env python3
"""Run the spin model of the effect state machine (model/effects.pml) and say what came of it.

Three kinds of run, each a fresh ``spin -a`` + C compile + exhaustive search:

- the model as designed, once per upstream kind: must finish with no error;
- each mutation (a rule of the design broken on purpose) and each finding (the code as it stood when
  the model was written): must be caught, and the trail spin finds is summarised;
- each reachability witness: must be reached, so that no branch of the model is silently dead.

``--short`` (what ``make test`` runs) covers the designed model and every mutation; ``make model-check``
runs everything. Standard library only: CI runs it before any virtualenv exists. Exit status 1 when any
run does not come out as it must, 2 when spin or a C compiler is missing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "effects.pml"

KINDS = {0: "native key", 1: "probe", 2: "native key + probe", 3: "neither", 4: "harmless"}

# Each broken rule of DESIGN.md, as a compile-time switch of effects.pml.
MUTATIONS = {
    "MUTATION_DOUBT_NOT_STICKY": "a refused attempt after an earlier may-have-sent settles retryable",
    "MUTATION_MARGIN_ZERO": "the native key's margin is zero: fresh while younger than its TTL",
    "MUTATION_NO_FENCE": "settle is not fenced by the attempt",
    "MUTATION_FENCE_ATTEMPT_ONLY": "a holder's writes are fenced on the attempt alone, not on pending too",
    "MUTATION_PURGED_RESEND": "a purged completed record is sent again when the probe does not find it",
    "MUTATION_FAILED_PROBE_DOUBT": "a failed probe leaves a purged completed record in doubt",
    "MUTATION_HORIZON_IGNORED": "the probe's horizon is ignored: not found always means send",
    "MUTATION_PURGED_NATIVE_RESEND": "a purged completed record is sent again under its native key",
    "MUTATION_HORIZON_AT_CLAIM": "the probe's horizon is judged at its re-claim, not when the probe runs",
    "MUTATION_LAG_IGNORED": "the search's lag is ignored: not found is trusted at once",
    "MUTATION_LAG_AFTER_PROBE": "the lag is judged once the probe has answered, not at its re-claim",
    "MUTATION_LAG_FROM_CLAIM": "the lag is counted from the latest claim, not its answer or lease's end",
}

# The code as it stood when the model was written (gateway/store.py, gateway/service.py).
FINDINGS = {
    "FINDING_RECLAIM_FENCED_BY_ATTEMPT_ONLY": "store.reclaim is fenced by the attempt alone",
    "FINDING_JUDGE_AT_READ": "the native key's age is judged when the record is read, not by the re-claim",
    "FINDING_PROBE_SEND_SAME_LEASE": "after 'not found' the send goes out under the probe's lease",
    "FINDING_RESOLVE_DURING_LEASE": "an operator may resolve an in_doubt record while its lease runs",
}

WITNESSES = {
    1: "a replay",
    2: "the upstream deduplicates by its native key",
    3: "a re-send under the native key",
    4: "the re-claim finds the native key too old",
    5: "the probe finds the effect",
    6: "the probe finds nothing within its horizon, and the gateway sends",
    7: "the probe finds nothing past its horizon: needs_review",
    8: "the probe fails",
    9: "the probe supplies a purged response",
    10: "410 response-purged",
    11: "needs_review without a probe",
    12: "a harmless upstream performs the effect again",
    13: "an operator: it happened",
    14: "an operator: it did not happen",
    15: "a holder is fenced out",
    16: "a pending record whose lease ran out is taken over",
    17: "the re-claim finds the record changed since it was read",
    18: "a refused attempt after an earlier may-have-sent stays in doubt",
    19: "a definitive refusal (4xx) completes the record",
    20: "clients stop with the record pending (its holder crashed)",
    21: "the probe finds nothing too soon for its search to list the effect: in_doubt",
}

# ``make test``: the smaller configuration; ``make model-check``: the default sizes in effects.pml.
SHORT = ["-DTTL=3", "-DHORIZON=3"]


@dataclass
class Run:
    name: str
    defines: list[str]
    expect_error: bool
    what: str = ""
    optimise: bool = False
    # breadth-first: the shortest trail, at the price of storing every shallower state
    breadth_first: bool = False
    # filled in by the run
    errors: int | None = None
    states: int = 0
    matched: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = False
    violated: str = ""
    trail: list[str] = field(default_factory=list)
    trail_steps: int = 0
    problem: str = ""

    @property
    def ok(self) -> bool:
        if self.problem:
            return False
        if self.expect_error:
            return bool(self.errors)
        return self.errors == 0 and self.complete


def tools_missing() -> str | None:
    if shutil.which("spin") is None:
        return "spin is not installed (Debian/Ubuntu: apt-get install spin)"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return "no C compiler to build spin's verifier (Debian/Ubuntu: apt-get install gcc)"
    return None


def _number(pattern: str, text: str) -> int:
    found = re.search(pattern, text)
    return int(found.group(1)) if found else 0


def execute(run: Run, keep: Path | None) -> Run:
    workdir = Path(tempfile.mkdtemp(prefix="effects-model-", dir=keep))
    try:
        _execute(run, workdir)
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return run


def _execute(run: Run, workdir: Path) -> None:
    shutil.copy(MODEL, workdir / MODEL.name)
    if run.breadth_first:
        run.defines = [*run.defines, "-DBFS_SEARCH"]
    started = time.monotonic()
    made = subprocess.run(
        ["spin", *run.defines, "-a", MODEL.name], cwd=workdir, capture_output=True, text=True
    )
    if made.returncode != 0 or not (workdir / "pan.c").exists():
        run.problem = f"spin -a failed: {(made.stdout + made.stderr).strip()[:500]}"
        return
    # A run expected to fail stops at its first error, so compiling fast beats running fast; the designed
    # model's searches are long: optimise those.
    flags = ["-O2"] if run.optimise else ["-O0"]
    if run.breadth_first:
        flags.append("-DBFS")
    compiled = subprocess.run(
        [os.environ.get("CC", "cc"), *flags, "-DSAFETY", "-DMEMLIM=4096", "-o", "pan", "pan.c"],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    if compiled.returncode != 0:
        run.problem = f"compiling pan.c failed: {compiled.stderr.strip()[:500]}"
        return
    searched = subprocess.run(["./pan", "-m20000"], cwd=workdir, capture_output=True, text=True)
    run.seconds = time.monotonic() - started
    out = searched.stdout + searched.stderr
    found = re.search(r"depth reached (\d+), errors: (\d+)", out)
    if found is None:
        run.problem = f"no verdict from pan: {out.strip()[-500:]}"
        return
    run.depth, run.errors = int(found.group(1)), int(found.group(2))
    run.states = _number(r"(\d+) states, stored", out)
    run.matched = _number(r"(\d+) states, matched", out)
    run.transitions = _number(r"(\d+) transitions", out)
    if "max search depth too small" in out:
        run.problem = "the search depth limit was reached: the search is not exhaustive"
    elif "-DMEMLIM bound" in out or "out of memory" in out:
        run.problem = "out of memory: the search is not exhaustive"
    run.complete = not run.problem and "Search not completed" not in out
    if run.errors:
        first = re.search(r"pan:1: (.*)", out)
        run.violated = first.group(1).strip() if first else "an error"
        _summarise_trail(run, workdir)


def _summarise_trail(run: Run, workdir: Path) -> None:
    replay = subprocess.run(
        ["spin", "-T", *run.defines, "-t", MODEL.name], cwd=workdir, capture_output=True, text=True
    )
    lines = (replay.stdout + replay.stderr).splitlines()
    run.trail_steps = _number(r"trail ends after (\d+) steps", replay.stdout + replay.stderr)
    # The model prints events, and "tick" for each tick of the clock: number the events by time.
    tick = 0
    events = []
    for line in lines:
        text = line.strip()
        if text == "tick":
            tick += 1
        elif text.startswith(("record:", "VIOLATED")):
            events.append(f"        {text}")
        elif text.startswith(("gw", "upstream:", "operator:", "retention:", "client")):
            events.append(f"t{tick}  {text}")
    run.trail = events
    named = [line.strip() for line in events if line.strip().startswith("VIOLATED")]
    if named:
        run.violated = named[0].removeprefix("VIOLATED").strip(" :")
    elif "invalid end state" in run.violated:
        run.violated = "a deadlock (invalid end state)"


def plan(
    short: bool, only: Iterable[str] = (), user_visible: bool = False, kind: int | None = None
) -> list[Run]:
    size = SHORT if short else []
    if short:
        # One search over every kind, unoptimised: compiling with -O2 costs more than it saves here.
        runs = [Run("designed, every kind", size, expect_error=False)]
    else:
        runs = [
            Run(f"designed, {label}", [f"-DKIND={kind}"], expect_error=False, optimise=True)
            for kind, label in KINDS.items()
        ]
        runs += [
            Run(
                f"designed, {label}, 3 requests each",
                [f"-DKIND={kind}", "-DREQUESTS=3"],
                False,
                optimise=True,
            )
            for kind, label in KINDS.items()
        ]
    # The full check searches breadth-first for the shortest trails; the short one only needs "caught".
    broken = {**MUTATIONS, **FINDINGS}
    # With only the user-visible properties checked, a mutation shows what harm it does to users.
    visible = ["-DONLY_USER_VISIBLE"] if user_visible else []
    if kind is not None:
        visible.append(f"-DKIND={kind}")
    runs += [
        Run(name, [*size, *visible, f"-D{name}"], expect_error=True, what=what, breadth_first=not short)
        for name, what in broken.items()
    ]
    if not short:
        # The native key's margin at its edge: with a lease of 4 ticks, the longest time from judging the
        # key fresh to the re-send landing is 3 ticks (model/README.md). 3 must hold, 2 must not.
        edge = ["-DKIND=0", "-DTIMEOUT=2", "-DGRACE=2", "-DTTL=7"]
        runs += [
            Run("margin of 3 ticks, lease of 4", [*edge, "-DMARGIN_TICKS=3"], False, optimise=True),
            Run("margin of 2 ticks, lease of 4", [*edge, "-DMARGIN_TICKS=2"], True, what="half a lease"),
        ]
        runs += [
            Run(f"WITNESS={n}", [*size, f"-DWITNESS={n}"], expect_error=True, what=what)
            for n, what in WITNESSES.items()
        ]
    if only:
        runs = [run for run in runs if any(part in run.name for part in only)]
    return runs


def report(runs: list[Run], verbose: bool) -> None:
    width = max(len(run.name) for run in runs)
    print(
        f"{'run':<{width}}  {'verdict':<12} {'stored':>10} {'matched':>10} {'transitions':>12} {'depth':>6} "
        f"{'s':>6}  trail"
    )
    for run in runs:
        if run.problem:
            verdict = "PROBLEM"
        elif run.expect_error:
            verdict = "caught" if run.errors else "NOT CAUGHT"
        else:
            verdict = "no error" if run.ok else "VIOLATION"
        steps = f"{run.trail_steps} steps" if run.errors else ""
        print(
            f"{run.name:<{width}}  {verdict:<12} {run.states:>10} {run.matched:>10} {run.transitions:>12} "
            f"{run.depth:>6} {run.seconds:>6.1f}  {steps}"
        )
        if run.problem:
            print(f"    {run.problem}")
        if run.errors and (verbose or not run.ok):
            print(f"    violated: {run.violated}")
            for line in run.trail:
                print(f"      {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--short", action="store_true", help="the smaller configuration, without witnesses")
    parser.add_argument("--only", action="append", default=[], help="runs whose name contains this")
    parser.add_argument("--trails", action="store_true", help="print every trail, not only unexpected ones")
    parser.add_argument(
        "--user-visible",
        action="store_true",
        help="mutations and findings checked against the user-visible properties alone",
    )
    parser.add_argument(
        "--kind",
        type=int,
        choices=sorted(KINDS),
        help="mutations and findings against this upstream kind only",
    )
    parser.add_argument("--keep", type=Path, help="keep each run's directory (pan.c, trail) under this one")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    missing = tools_missing()
    if missing:
        print(f"model check: {missing}", file=sys.stderr)
        return 2
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    runs = plan(args.short, args.only, args.user_visible, args.kind)
    started = time.monotonic()
    # The designed runs are the long ones: start them first so the short ones fill the gaps.
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(lambda run: execute(run, args.keep), runs))
    report(runs, args.trails)
    failed = [run for run in runs if not run.ok]
    total = sum(run.states for run in runs if not run.expect_error)
    print(
        f"\n{len(runs)} runs in {time.monotonic() - started:.0f} s; the designed model: {total} states, "
        f"{'no error' if not any(not r.ok for r in runs if not r.expect_error) else 'ERRORS'}"
    )
    if failed:
        print("FAILED: " + ", ".join(run.name for run in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
