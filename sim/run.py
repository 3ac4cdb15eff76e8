"""Running worlds: one seed (or a given list of choices), many fresh seeds, and shrinking a failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sim.choices import Choices, Made, encode, size
from sim.invariants import Violation
from sim.loop import Runaway, Stalled, new_loop
from sim.world import World, service_log_silenced

# Enough for the largest worlds drawn (4 clients, days of virtual time); a run past it never settles.
MAX_STEPS = 400_000


@dataclass
class Outcome:
    seed: int
    made: Made
    violation: Violation | None
    trace: list[tuple[float, str, str]]
    setup: list[str]
    steps: int
    virtual: float
    requests: int
    effects: int
    crashes: int

    @property
    def failed(self) -> bool:
        return self.violation is not None


def run(seed: int = 0, given: Made | None = None) -> Outcome:
    """One world, from a seed or from a record of choices (a replay); deterministic either way."""
    choices = Choices(seed, given)
    loop = new_loop(choices["sched"].below, max_steps=MAX_STEPS)
    world = World(choices, loop)
    try:
        with service_log_silenced():
            loop.run_until_complete(world.main())
    except Stalled as exc:
        world.violate(Violation("stalled", str(exc), loop.time()))
    except Runaway as exc:
        world.violate(Violation("runaway", str(exc), loop.time()))
    for error in loop.errors:
        if "exception" in error:
            world.violate(
                Violation("loop-error", f"{error.get('message')}: {error['exception']!r}", loop.time())
            )
            break
    loop.close()
    return Outcome(
        seed=seed,
        made=choices.made,
        violation=world.violation,
        trace=world.trace,
        setup=world.setup.describe(),
        steps=loop.steps,
        virtual=loop.time(),
        requests=world.tally.requests,
        effects=world.tally.effects,
        crashes=world.tally.crashes,
    )


@dataclass
class Exploration:
    first_seed: int
    runs: int = 0
    steps: int = 0
    seconds: float = 0.0
    failure: Outcome | None = None
    failures: list[int] = field(default_factory=list)
    requests: int = 0
    effects: int = 0
    crashes: int = 0
    virtual: float = 0.0


def explore(
    first_seed: int,
    *,
    seconds: float | None = None,
    seeds: int | None = None,
    stop_at_first: bool = True,
    progress: Callable[[Exploration], None] | None = None,
) -> Exploration:
    """Run seeds first_seed, first_seed + 1, ... until the time or the count is up (or one fails)."""
    found = Exploration(first_seed)
    start = time.monotonic()
    seed = first_seed
    while (seconds is None or time.monotonic() - start < seconds) and (seeds is None or found.runs < seeds):
        outcome = run(seed)
        found.runs += 1
        found.steps += outcome.steps
        found.requests += outcome.requests
        found.effects += outcome.effects
        found.crashes += outcome.crashes
        found.virtual += outcome.virtual
        if outcome.failed:
            found.failures.append(seed)
            if found.failure is None:
                found.failure = outcome
            if stop_at_first:
                break
        seed += 1
        if progress is not None and found.runs % 200 == 0:
            found.seconds = time.monotonic() - start
            progress(found)
    found.seconds = time.monotonic() - start
    return found


def shrink(failure: Outcome, *, runs: int = 600, seconds: float = 60.0) -> Outcome:
    """The smallest schedule that still breaks the same invariant: choices set to 0 while it fails.

    Delta debugging over the run's choices, stream by stream: a whole stream to 0 (no faults, FIFO
    scheduling, the shortest delays, the fewest clients), then its shortest prefix, then ever smaller
    chunks of the choices that are not 0 yet, then smaller values for those left. A candidate counts
    only if it breaks the same invariant.
    """
    assert failure.violation is not None
    invariant = failure.violation.invariant
    best = failure
    tried = 0
    deadline = time.monotonic() + seconds

    def spent() -> bool:
        return tried >= runs or time.monotonic() > deadline

    def attempt(name: str, values: list[int]) -> bool:
        nonlocal best, tried
        if spent() or values == best.made.get(name):
            return False
        tried += 1
        outcome = run(failure.seed, {**best.made, name: values})
        if outcome.violation is not None and outcome.violation.invariant == invariant:
            if size(outcome.made) <= size(best.made):
                best = outcome
            return True
        return False

    progressed = True
    while progressed and not spent():
        progressed = False
        for name in sorted(best.made, key=lambda n: -len(best.made[n])):
            if any(best.made.get(name, ())):
                progressed |= attempt(name, [])
        for name in sorted(best.made, key=lambda n: -len(best.made[n])):
            values = best.made.get(name, [])
            # the shortest prefix (a binary search: failing is not monotone, so it is a good guess)
            low, high = 0, len(values)
            while low < high and not spent():
                mid = (low + high) // 2
                if attempt(name, values[:mid]):
                    progressed = True
                    values = best.made.get(name, [])
                    high = min(mid, len(values))
                else:
                    low = mid + 1
            # chunks of the choices not 0 yet, halving down to single ones
            live = [i for i, v in enumerate(best.made.get(name, [])) if v]
            chunk = max(1, len(live) // 2)
            while chunk >= 1 and not spent():
                live = [i for i, v in enumerate(best.made.get(name, [])) if v]
                changed = False
                for start in range(0, len(live), chunk):
                    values = list(best.made.get(name, []))
                    for i in live[start : start + chunk]:
                        if i < len(values):
                            values[i] = 0
                    if attempt(name, values):
                        changed = progressed = True
                if not changed:
                    chunk //= 2
            # smaller values for what is left (a shorter delay, an earlier callback)
            for i, value in enumerate(list(best.made.get(name, []))):
                current = best.made.get(name, [])
                if value > 1 and i < len(current) and current[i] == value:
                    values = list(current)
                    values[i] = value // 2
                    progressed |= attempt(name, values)
    return best


def clock(at: float) -> str:
    days, rest = divmod(at, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{int(days)}d{int(hours):02d}:{int(minutes):02d}:{seconds:09.6f}"


def report(outcome: Outcome, *, title: str) -> str:
    """A failing run as a person reads it: the world, each event in order, and what broke."""
    lines = [title, *(f"  {line}" for line in outcome.setup)]
    lines.append(
        f"  {outcome.requests} requests, {outcome.effects} effects, {outcome.crashes} crashes, "
        f"{outcome.steps} steps, {clock(outcome.virtual)} of virtual time"
    )
    lines.extend(f"  {clock(at)}  {who:<10} {text}" for at, who, text in outcome.trace)
    if outcome.violation is not None:
        lines.append(f"  VIOLATED {outcome.violation.invariant}: {outcome.violation.detail}")
    lines.append(f"  replay: python -m sim replay {outcome.seed} --choices '{encode(outcome.made)}'")
    return "\n".join(lines)
