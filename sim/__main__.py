"""``python -m sim``: explore fresh seeds, or replay one (see sim/README.md).

    python -m sim run [--seconds 180] [--seed N]
    python -m sim replay SEED [--choices TEXT] [--shrink]

``run`` exits 1 when a run breaks an invariant, after printing its seed and its shrunk schedule.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from sim.choices import decode
from sim.run import Exploration, explore, report, run, shrink


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim", description="The gateway's deterministic simulator."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    explore_cmd = sub.add_parser("run", help="explore fresh seeds for a while")
    explore_cmd.add_argument("--seconds", type=float, default=float(os.environ.get("SIM_SECONDS", 180)))
    explore_cmd.add_argument("--seed", type=int, default=None, help="the first seed (default: a fresh one)")
    replay_cmd = sub.add_parser("replay", help="run one seed again and print its trace")
    replay_cmd.add_argument("seed", type=int)
    replay_cmd.add_argument("--choices", default=None, help="a shrunk schedule, as a report prints it")
    replay_cmd.add_argument("--shrink", action="store_true", help="shrink the run if it fails")
    args = parser.parse_args(argv)
    if args.command == "replay":
        outcome = run(args.seed, decode(args.choices) if args.choices else None)
        if outcome.failed and args.shrink:
            outcome = shrink(outcome)
        print(report(outcome, title=f"seed {args.seed}" + (" (given choices)" if args.choices else "")))
        return 1 if outcome.failed else 0
    first = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    print(f"simulating from seed {first} for {args.seconds:g}s")

    def progress(found: Exploration) -> None:
        if found.runs % 2000 == 0:
            print(f"  {found.runs} schedules, {found.runs / max(found.seconds, 1e-9):.0f}/s", flush=True)

    found = explore(first, seconds=args.seconds, progress=progress)
    rate = found.runs / max(found.seconds, 1e-9)
    print(
        f"explored {found.runs} schedules in {found.seconds:.0f}s ({rate:.0f}/s; seeds {first}.."
        f"{first + found.runs - 1}): {found.requests} requests, {found.effects} effects, {found.crashes} "
        f"gateway crashes, {found.steps} steps, {found.virtual / 86400:.0f} days of virtual time"
    )
    if found.failure is None:
        print("no violation")
        return 0
    failure = found.failure
    assert failure.violation is not None
    print(f"VIOLATION in seed {failure.seed}: {failure.violation.invariant}: {failure.violation.detail}")
    started = time.monotonic()
    shrunk = shrink(failure)
    print(report(shrunk, title=f"seed {failure.seed}, shrunk in {time.monotonic() - started:.0f}s:"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
