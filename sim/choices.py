"""Every decision of a run, from one seed: recorded, so that a run can be replayed and shrunk.

A run asks for each decision as a number below some bound (which callback runs next, whether a fault
strikes here, how long a statement takes, how many clients there are). Decisions come in named
streams, one per concern (the world's shape, the scheduler, the network, the faults, each client),
each from its own PRNG seeded by (seed, name): so that changing the decisions of one concern does not
reshuffle the others. With a given record the numbers are read back (a replay), and past its end
they are all 0. Every decision is shaped so that 0 is its simplest outcome (the oldest callback, no
fault, the shortest delay, the fewest clients): shrinking a failing run is setting numbers to 0 while
it still fails.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")
Made = dict[str, list[int]]


class Stream:
    def __init__(self, rng: random.Random | None, given: Sequence[int] | None) -> None:
        self._rng = rng
        self._given = given
        self.made: list[int] = []

    def below(self, bound: int) -> int:
        """A number in [0, bound); 0 is the simplest outcome."""
        if bound <= 1:
            return 0
        if self._rng is not None:
            value = self._rng.randrange(bound)
        else:
            at = len(self.made)
            value = self._given[at] % bound if self._given is not None and at < len(self._given) else 0
        self.made.append(value)
        return value

    def chance(self, per_mille: int) -> bool:
        """True about ``per_mille`` times in a thousand; the simplest outcome (0) is False.

        It draws even when ``per_mille`` is 0, so that turning one fault off while shrinking does not
        shift every later decision of the stream.
        """
        drawn = self.below(1000)
        return per_mille > 0 and drawn >= 1000 - per_mille

    def pick(self, items: Sequence[T]) -> T:
        """One of ``items``; the first is the simplest."""
        return items[self.below(len(items))]

    def between(self, low: float, high: float, steps: int = 1000) -> float:
        """A value in [low, high]; the simplest is ``low``."""
        return low + (high - low) * self.below(steps + 1) / steps


class Choices:
    def __init__(self, seed: int = 0, given: Mapping[str, Sequence[int]] | None = None) -> None:
        self.seed = seed
        self._given = given
        self._streams: dict[str, Stream] = {}
        # Set when the run must settle down: faults stop being drawn (see World.heal).
        self.quiet = False

    def __getitem__(self, name: str) -> Stream:
        stream = self._streams.get(name)
        if stream is None:
            if self._given is None:
                stream = Stream(random.Random(f"{self.seed}/{name}"), None)
            else:
                stream = Stream(None, self._given.get(name, ()))
            self._streams[name] = stream
        return stream

    @property
    def made(self) -> Made:
        return {name: list(stream.made) for name, stream in self._streams.items()}


def size(made: Made) -> tuple[int, int]:
    """How big a schedule is: the decisions that are not the simplest, then all of them."""
    return (sum(1 for values in made.values() for v in values if v), sum(len(v) for v in made.values()))


def encode(made: Made) -> str:
    """A run's decisions as text: per stream its length and the positions that are not 0."""
    return ";".join(
        f"{name}/{len(values)}:" + ",".join(f"{i}={v}" for i, v in enumerate(values) if v)
        for name, values in made.items()
        if any(values)
    )


def decode(text: str) -> Made:
    made: Made = {}
    for part in filter(None, text.strip().split(";")):
        head, _, pairs = part.partition(":")
        name, _, length = head.rpartition("/")
        values = [0] * int(length)
        for pair in filter(None, pairs.split(",")):
            at, _, value = pair.partition("=")
            values[int(at)] = int(value)
        made[name] = values
    return made
