"""Cheap replays: completed effects kept in memory, and their replay counts written in batches.

A completed record never changes (the state table has no way out of completed, and its response is
written once), so a copy in memory can answer a retry without asking Postgres. The copy is per process,
bounded in bytes, and scoped like the store: by (tenant, upstream, key).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from datetime import datetime

from gateway.record import StoredResponse

# Per entry beyond the response's own bytes: the key, the fingerprint and the bookkeeping.
ENTRY_OVERHEAD = 400


@dataclass(frozen=True, slots=True)
class Completed:
    """What a replay needs of a completed effect."""

    id: int
    created_at: datetime
    fingerprint: str
    response: StoredResponse
    # This process's monotonic clock when the retention drops the response from the store: the copy in
    # memory goes then too (a retention also bounds how long bodies are kept at all).
    expires: float

    @property
    def size(self) -> int:
        headers = sum(len(name) + len(value) for name, value in self.response.headers)
        return len(self.response.body) + headers + ENTRY_OVERHEAD


Scope = tuple[str, str, str]  # (tenant, upstream, key)


class ReplayCache:
    """A least-recently-used map of completed effects, at most ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[Scope, Completed] = OrderedDict()
        self._bytes = 0

    def get(self, scope: Scope, now: float) -> Completed | None:
        found = self._entries.get(scope)
        if found is None:
            return None
        if found.expires <= now:
            del self._entries[scope]
            self._bytes -= found.size
            return None
        self._entries.move_to_end(scope)
        return found

    def put(self, scope: Scope, effect: Completed) -> None:
        # One response larger than a sixteenth of the cache would push out many small ones for little.
        if effect.size * 16 > self._capacity or scope in self._entries:
            return
        self._entries[scope] = effect
        self._bytes += effect.size
        while self._bytes > self._capacity:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes


class ReplayTally:
    """Replays counted in memory and handed over in batches; a crash loses only the counts not yet written."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[int, datetime]] = Counter()

    def add(self, effect_id: int, created_at: datetime) -> None:
        self._counts[(effect_id, created_at)] += 1

    def take(self) -> Counter[tuple[int, datetime]]:
        taken, self._counts = self._counts, Counter()
        return taken

    def __bool__(self) -> bool:
        return bool(self._counts)
