"""Requests that wait for another request with the same key to finish, in this process.

They are woken as soon as the record is written here; those waiting for a request another gateway
holds fall back to polling the row, starting fast (most upstream calls end in tens of milliseconds) and
backing off to spare Postgres.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

# The first poll of the row, in seconds: most upstream calls end in tens of milliseconds. Each poll
# after waits twice as long, up to MAX_POLL, so that many waiters do not crowd Postgres.
FIRST_POLL = 0.01
MAX_POLL = 0.2


@dataclass(slots=True)
class Wait:
    """One request's wait: until when, whether it has a seat among the key's waiters, and how to tell
    that its client has left (then it has nothing to wait for)."""

    deadline: float
    client_left: Callable[[], bool]
    # Read when the wait starts, not when this module loads (a test may slow the polls down).
    poll: float = field(default_factory=lambda: FIRST_POLL)
    seated: bool = False


class WaitingRoom:
    """Seat the requests that wait for each effect here, wake them when it is written, and keep at most
    ``per_key`` of them per effect (None: any number; the setting max_waiters_per_key says why)."""

    def __init__(self, per_key: int | None) -> None:
        self._woken: dict[int, asyncio.Event] = {}
        self._seated: Counter[int] = Counter()
        self._per_key = per_key

    def seat(self, effect_id: int, wait: Wait) -> int | None:
        """Give ``wait`` a seat; return how many wait already when the effect has no seat left."""
        if not wait.seated:
            waiting = self._seated[effect_id]
            if self._per_key is not None and waiting >= self._per_key:
                return waiting
            self._seated[effect_id] += 1
            wait.seated = True
        return None

    def seated(self, effect_id: int) -> int:
        """How many requests wait here for the effect."""
        return self._seated[effect_id]

    def unseat(self, effect_id: int, wait: Wait) -> None:
        """Free the seat of a request that waits no more (it answers, or goes on to send or probe
        itself); the effect's wake-up goes with its last waiter here."""
        if wait.seated:
            wait.seated = False
            self._seated[effect_id] -= 1
            if not self._seated[effect_id]:
                del self._seated[effect_id]
        # A record another gateway wrote is never woken here: once nobody waits, drop the event, lest it
        # linger; while others wait, it is theirs.
        if effect_id not in self._seated and (woken := self._woken.get(effect_id)) and not woken.is_set():
            del self._woken[effect_id]

    async def nap(self, effect_id: int, wait: Wait, longest: float) -> None:
        """Sleep until the effect is written here, or for the next poll (never past ``longest``)."""
        woken = self._woken.setdefault(effect_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), min(wait.poll, longest))
        wait.poll = min(wait.poll * 2, MAX_POLL)

    def wake(self, effect_id: int) -> None:
        """Wake every request waiting here for the effect: its record was just written."""
        if (woken := self._woken.pop(effect_id, None)) is not None:
            woken.set()
