"""Cheap replays: completed effects kept in memory, and their replay counts written in batches.

A completed record never changes (the state table has no way out of completed, its response is
written once, and one the retention dropped is put back once, by the first restore), so a copy in
memory of the response Postgres holds can answer a retry without asking Postgres. The copy is per process,
bounded in bytes, and scoped like the store: by (tenant, upstream, key).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gateway.errors import StoreRejected, StoreUnavailable
from gateway.record import EffectRecord, RowKey, StoredResponse

log = logging.getLogger("effect_gateway")

# Replay counts gather this long before one statement writes them: a second of counts is what a crash
# can cost, and a busy key's replays cost Postgres one write a second instead of one each.
REPLAY_FLUSH = 1.0

# What CPython spends beyond the characters and bytes themselves, measured with tracemalloc on 64-bit
# CPython 3.11 (tests/test_replay_cache.py holds the total to the measured memory): per entry, the
# Completed and StoredResponse objects, the id, time and expiry, the fingerprint string, the key's
# tuple and three strings, and the LRU map's slot; per header, its pair and two strings.
ENTRY_OVERHEAD = 800
HEADER_OVERHEAD = 170


@dataclass(frozen=True, slots=True)
class Completed:
    """What a replay needs of a completed effect."""

    id: int
    created_at: datetime
    scope: uuid.UUID
    fingerprint: str
    response: StoredResponse
    # This process's monotonic clock when the retention drops the response from the store: the copy in
    # memory goes then too (a retention also bounds how long bodies are kept at all).
    expires: float

    @property
    def row_key(self) -> RowKey:
        """Where the effect's audit row is."""
        return self.id, self.created_at, self.scope


Scope = tuple[str, str, str]  # (tenant, upstream, key)


def size(scope: Scope, effect: Completed) -> int:
    """The memory ``effect`` takes in the cache under ``scope``, in bytes (what capacity bounds)."""
    headers = sum(len(name) + len(value) + HEADER_OVERHEAD for name, value in effect.response.headers)
    key = sum(len(part) for part in scope)
    return len(effect.response.body) + headers + key + len(effect.fingerprint) + ENTRY_OVERHEAD


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
            self._bytes -= size(scope, found)
            return None
        self._entries.move_to_end(scope)
        return found

    def put(self, scope: Scope, effect: Completed, now: float) -> None:
        # One response larger than a sixteenth of the cache would push out many small ones for little;
        # one already past its expiry would take room until somebody asked for it.
        cost = size(scope, effect)
        if cost * 16 > self._capacity or effect.expires <= now or scope in self._entries:
            return
        self._entries[scope] = effect
        self._bytes += cost
        while self._bytes > self._capacity:
            evicted_scope, evicted = self._entries.popitem(last=False)
            self._bytes -= size(evicted_scope, evicted)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes


class ReplayTally:
    """Replays counted in memory and handed over in batches; a crash loses only the counts not yet written."""

    def __init__(self) -> None:
        self._counts: Counter[RowKey] = Counter()

    def add(self, row: RowKey) -> None:
        self._counts[row] += 1

    def take(self) -> Counter[RowKey]:
        taken, self._counts = self._counts, Counter()
        return taken

    def __bool__(self) -> bool:
        return bool(self._counts)


Counts = Mapping[RowKey, int]  # the effect's audit row -> replays


class Replays:
    """One worker's replays from memory: the completed effects it keeps and the counts it owes the audit.

    ``write`` adds counts to the audit (Store.add_replays); ``spawn`` runs a task the worker waits for
    when it drains, so that counts still in memory at a shutdown are written.
    """

    def __init__(
        self,
        capacity: int,
        retention: timedelta,
        write: Callable[[Counts], Awaitable[None]],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._cache = ReplayCache(capacity)
        self._tally = ReplayTally()
        self._retention = retention
        self._write = write
        self._spawn = spawn
        self._flusher: asyncio.Task[None] | None = None

    def known(self, scope: Scope, now: float) -> Completed | None:
        return self._cache.get(scope, now)

    def remember(self, record: EffectRecord, response: StoredResponse, now: float) -> None:
        """Keep a completed effect for replays from memory (a keyless one is never replayed).

        ``response`` must be the one Postgres holds for ``record``, as read with (or just after) it was
        stored, at ``response_at``: the store keeps it for the retention from then, and so does the copy.
        ``now`` is this process's monotonic clock.
        """
        if record.keyless or record.read_at is None:
            return
        stored = record.response_at or record.read_at
        left = self._retention - (record.read_at - stored)
        self._cache.put(
            (record.tenant, record.upstream, record.key),
            Completed(
                record.id,
                record.created_at,
                record.scope,
                record.fingerprint,
                response,
                now + left.total_seconds(),
            ),
            now,
        )

    def count(self, row: RowKey) -> None:
        # Off the agent's path: the counter is for the audit, and a commit of its own would be most of a
        # replay's time. Counts gather for a moment and go to Postgres in one statement.
        self._tally.add(row)
        if self._flusher is None or self._flusher.done():
            self._flusher = self._spawn(self._flush())

    async def _flush(self) -> None:
        # Until none are left: replays counted while a batch was being written go in the next, and a
        # drain at shutdown waits for this task, so they are not left behind with nobody to write them.
        while self._tally:
            await asyncio.sleep(REPLAY_FLUSH)
            counts = self._tally.take()
            try:
                await self._write(counts)
            except (StoreUnavailable, StoreRejected) as exc:
                log.warning("%d replay counts not written: %s", sum(counts.values()), exc)
