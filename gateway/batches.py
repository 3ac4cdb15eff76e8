"""Writes of one kind that arrive together go to Postgres together, in one transaction and one commit.

A worker sends its claims (and, apart, its outcomes) one batch at a time: a statement, or for outcomes
of effects created in different months one statement per month in one transaction. The first write of a
quiet moment goes at once, alone, in its caller's task; writes that arrive while a batch is being
written queue, and all of them go in the next. There is no timer: a batch is whatever queued meanwhile,
so a request alone waits for nothing, and under load a commit (and its flush to disk) serves as many
writes as arrived during the one before.

Each caller still learns its own row's result. A batch that Postgres refuses as a whole (a value one
row carries that it cannot hold) is written again row by row, so that only that row's caller hears
the refusal; an outage fails the whole batch, as it fails a statement of one row. A caller that gives
up (a cancelled request) while its row is queued leaves the batch; once its row is in a statement,
the statement runs on without it, as it would for a request whose gateway died.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from gateway.errors import StoreRejected

log = logging.getLogger("effect_gateway")

In = TypeVar("In")
Out = TypeVar("Out")

# Rows in one statement at most: enough that a batch never waits for a second statement under any load
# one worker can carry, few enough that one statement's arrays stay small and its locks short.
MAX_ROWS = 256
# Bytes of bodies and headers in one statement at most (a row larger than this goes alone): a hundred
# answers of 10 MiB that came back together made one statement of a gigabyte, which Postgres cut off
# (past statement_timeout, or a message too long), failing every row in it. 4 MiB is far more than a
# full batch of everyday bodies (256 of a few KB), so it splits only batches of large answers, and it
# takes Postgres milliseconds to receive and write, against a statement_timeout of seconds.
MAX_BYTES = 4 * 1024 * 1024

# What one statement returns for each of its rows, in their order: a result or the error of that row.
Many = Callable[[Sequence[In]], Awaitable[Sequence[Out | Exception]]]


def _its_own(exc: BaseException) -> BaseException:
    """A copy of ``exc`` for one caller, caused by it: raised in many tasks, one exception would collect
    every task's traceback."""
    try:
        copy = type(exc)(*exc.args)
    except Exception:
        return exc
    copy.__cause__ = exc
    return copy


class Batches(Generic[In, Out]):
    """One kind of write, sent a batch at a time, each batch carrying the rows that queued meanwhile."""

    def __init__(
        self, many: Many[In, Out], distinct: Callable[[In], Hashable], size: Callable[[In], int]
    ) -> None:
        """``distinct``: what no two rows of one statement may share (the row a write changes or makes);
        a row that shares it with one already taken waits for the statement after. ``size``: the bytes
        a row carries (bodies and headers), which MAX_BYTES bounds per statement."""
        self._many = many
        self._distinct = distinct
        self._size = size
        self._queue: list[tuple[In, asyncio.Future[Out]]] = []
        self._busy = False
        self._draining: asyncio.Task[None] | None = None  # held so that the loop does not lose it

    async def write(self, row: In) -> Out:
        """Write ``row`` in the next statement; its own result, or its own error raised."""
        if self._busy:
            future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
            self._queue.append((row, future))
            return await future
        # Nothing running: this row goes now, in this task, as a statement of one row would.
        self._busy = True
        try:
            [result] = await self._many([row])
        finally:
            self._hand_on()
        if isinstance(result, Exception):
            raise result
        return result

    def _hand_on(self) -> None:
        """After a statement: the rows that queued meanwhile go next, in a task of their own."""
        if not self._queue:
            self._busy = False
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            # This caller's coroutine was closed unrun, its process gone (the simulator's SIGKILL):
            # nothing of that process runs again, this batch included.
            return
        # In a context of its own: the task would otherwise carry the request that started it (its
        # trace id on every line logged meanwhile, and its trail kept alive for as long as it drains).
        self._draining = loop.create_task(self._drain(), context=contextvars.Context())

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._next_batch()
                if not batch:
                    continue
                try:
                    results = await self._written([row for row, _ in batch])
                except BaseException as exc:  # an outage, or this task cancelled by a shutdown
                    for _, future in batch:
                        if future.done():
                            continue
                        if isinstance(exc, asyncio.CancelledError):
                            future.cancel()
                        else:
                            future.set_exception(_its_own(exc))
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._busy = False
            self._draining = None
            for _, future in self._queue:  # left by a cancellation
                if not future.done():
                    future.cancel()
            self._queue = []

    def _next_batch(self) -> list[tuple[In, asyncio.Future[Out]]]:
        """The queued rows of the next statement, in the order they came, each distinct."""
        batch: list[tuple[In, asyncio.Future[Out]]] = []
        later: list[tuple[In, asyncio.Future[Out]]] = []
        seen: set[Hashable] = set()
        carried = 0
        for row, future in self._queue:
            if future.done():
                continue  # its caller gave up while it waited
            what, size = self._distinct(row), self._size(row)
            # The first row always goes, however large: alone, it is what a statement of one row was.
            full = len(batch) == MAX_ROWS or (batch and carried + size > MAX_BYTES)
            if what in seen or full:
                later.append((row, future))
            else:
                carried += size
                batch.append((row, future))
            # Held back or taken, a row keeps a later write of the same row behind it: writes of one
            # row go in the order they came (of two claims of a key, the first makes the record).
            seen.add(what)
        self._queue = later
        return batch

    async def _written(self, rows: list[In]) -> Sequence[Out | Exception]:
        """One statement for ``rows``; row by row if Postgres refuses it, so that each hears its own."""
        try:
            return await self._many(rows)
        except StoreRejected:
            if len(rows) == 1:
                raise
            log.debug("Postgres refused a batch of %d rows; writing them one by one", len(rows))
        results: list[Out | Exception] = []
        for row in rows:
            try:
                [result] = await self._many([row])
            except StoreRejected as exc:
                result = exc
            results.append(result)
        return results
