"""Writes that arrive together share a statement, and each caller still hears only its own row's fate.

gateway.batches is the part of the store that decides which rows go to Postgres together; here its
statement is a coroutine that records the rows it was given and waits to be let go, so that a test
decides what arrives while a statement runs. The store's own SQL is tested against Postgres in
tests/test_store_contract.py (batched claims and settles, duplicates and fences).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from gateway.batches import MAX_BYTES, MAX_ROWS, Batches
from gateway.errors import StoreRejected, StoreUnavailable


class Statements:
    """A statement per call: records its rows, waits for ``release``, then answers each row."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started = asyncio.Event()  # the first statement is running
        self.release = asyncio.Event()
        self.refuse_batches_with: str | None = None  # a row Postgres cannot hold refuses its statement
        self.down = False

    async def many(self, rows: Sequence[str]) -> list[str | Exception]:
        self.batches.append(list(rows))
        self.started.set()
        await self.release.wait()
        if self.down:
            raise StoreUnavailable("Postgres is unavailable: ConnectionResetError")
        if self.refuse_batches_with in rows:
            raise StoreRejected("Postgres refused the write: DataError")
        return [
            StoreRejected(f"{row} is taken") if row.startswith("taken") else f"wrote {row}" for row in rows
        ]


def _batches(statements: Statements) -> Batches[str, str]:
    # A row "...!!" carries more than MAX_BYTES, a row "...!" MAX_BYTES, any other one byte; rows
    # "y#1" and "y#2" are two writes of the row y.
    return Batches(statements.many, distinct=lambda row: row.split("#")[0], size=_size)


def _size(row: str) -> int:
    if row.endswith("!!"):
        return MAX_BYTES + 1
    return MAX_BYTES if row.endswith("!") else 1


async def _while_a_statement_runs() -> tuple[Statements, Batches[str, str], asyncio.Task[str]]:
    """Batches whose first write, "a", is in a statement that waits to be released."""
    statements = Statements()
    batches = _batches(statements)
    first = asyncio.create_task(batches.write("a"))
    await statements.started.wait()
    return statements, batches, first


async def test_a_write_alone_goes_at_once_alone() -> None:
    """With nothing being written, a write goes at once in a statement of its own: it waits for nothing."""
    statements = Statements()
    statements.release.set()
    batches = _batches(statements)
    assert await batches.write("a") == "wrote a"
    assert await batches.write("b") == "wrote b"
    assert statements.batches == [["a"], ["b"]]


async def test_writes_that_arrive_during_a_statement_go_together_in_the_next() -> None:
    """Writes that arrive while a statement runs wait for it, then all go in one statement."""
    statements, batches, first = await _while_a_statement_runs()
    others = [asyncio.create_task(batches.write(row)) for row in ("b", "c", "d")]
    await asyncio.sleep(0)
    assert statements.batches == [["a"]]  # nothing else is sent while the first statement runs
    statements.release.set()
    assert await first == "wrote a"
    assert await asyncio.gather(*others) == ["wrote b", "wrote c", "wrote d"]
    assert statements.batches == [["a"], ["b", "c", "d"]]


async def test_each_caller_hears_only_its_own_rows_error() -> None:
    """A row's own error (its key taken) reaches its caller alone; the others in its batch are written."""
    statements, batches, first = await _while_a_statement_runs()
    fine = asyncio.create_task(batches.write("b"))
    taken = asyncio.create_task(batches.write("taken-c"))
    statements.release.set()
    await first
    assert await fine == "wrote b"
    with pytest.raises(StoreRejected, match="taken-c is taken"):
        await taken


async def test_a_refused_batch_is_written_again_row_by_row_and_only_the_bad_row_fails() -> None:
    """A statement Postgres refuses whole is tried again a row at a time: only the bad row is refused."""
    statements, batches, first = await _while_a_statement_runs()
    statements.refuse_batches_with = "bad"
    rows = [asyncio.create_task(batches.write(row)) for row in ("b", "bad", "c")]
    statements.release.set()
    await first
    results = await asyncio.gather(*rows, return_exceptions=True)
    assert results[0] == "wrote b"
    assert results[2] == "wrote c"
    assert isinstance(results[1], StoreRejected)
    assert statements.batches == [["a"], ["b", "bad", "c"], ["b"], ["bad"], ["c"]]


async def test_an_outage_fails_the_whole_batch_and_the_next_write_starts_afresh() -> None:
    """An outage fails every row of its batch; once it is over, a write goes at once again."""
    statements, batches, first = await _while_a_statement_runs()
    rows = [asyncio.create_task(batches.write(row)) for row in ("b", "c")]
    statements.down = True
    statements.release.set()
    for task in (first, *rows):
        with pytest.raises(StoreUnavailable):
            await task
    statements.down = False
    assert await batches.write("d") == "wrote d"
    assert statements.batches[-1] == ["d"]


async def test_two_writes_of_one_row_never_share_a_statement() -> None:
    """Two writes of one row (one record settled twice) go in two statements, one after the other."""
    statements, batches, first = await _while_a_statement_runs()
    rows = [asyncio.create_task(batches.write(row)) for row in ("b#1", "b#2", "c")]
    statements.release.set()
    await first
    assert await asyncio.gather(*rows) == ["wrote b#1", "wrote b#2", "wrote c"]
    assert statements.batches == [["a"], ["b#1", "c"], ["b#2"]]


async def test_a_caller_that_gives_up_while_queued_leaves_the_batch() -> None:
    """A request cancelled while its row waits is not written; the rows beside it are."""
    statements, batches, first = await _while_a_statement_runs()
    gone = asyncio.create_task(batches.write("gone"))
    kept = asyncio.create_task(batches.write("kept"))
    await asyncio.sleep(0)
    gone.cancel()
    statements.release.set()
    await first
    assert await kept == "wrote kept"
    assert statements.batches == [["a"], ["kept"]]


async def test_a_statement_carries_at_most_max_rows() -> None:
    """A queue longer than MAX_ROWS goes in several statements, none longer than that."""
    statements, batches, first = await _while_a_statement_runs()
    rows = [asyncio.create_task(batches.write(f"r{n}")) for n in range(MAX_ROWS + 3)]
    statements.release.set()
    await first
    await asyncio.gather(*rows)
    assert [len(batch) for batch in statements.batches] == [1, MAX_ROWS, 3]


async def test_rows_queued_behind_a_caller_that_gave_up_are_still_written() -> None:
    """The request whose write was running is cancelled: the rows that queued behind it go next all the
    same, and their callers hear their own results."""
    statements, batches, first = await _while_a_statement_runs()
    rows = [asyncio.create_task(batches.write(row)) for row in ("b", "c")]
    await asyncio.sleep(0)
    first.cancel()
    statements.release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.gather(*rows) == ["wrote b", "wrote c"]
    assert statements.batches == [["a"], ["b", "c"]]


async def test_a_statement_carries_at_most_max_bytes_and_a_larger_row_goes_alone() -> None:
    """Large answers that come back together go in statements of their own, and small ones beside them
    go where they fit: one statement of many 10 MiB answers was cut off by Postgres, failing them all.
    A row larger than the bound goes alone rather than never."""
    statements, batches, first = await _while_a_statement_runs()
    rows = [asyncio.create_task(batches.write(row)) for row in ("huge!!", "big!", "c", "d")]
    await asyncio.sleep(0)
    statements.release.set()
    await first
    assert await asyncio.gather(*rows) == ["wrote huge!!", "wrote big!", "wrote c", "wrote d"]
    assert statements.batches == [["a"], ["huge!!"], ["big!"], ["c", "d"]]


async def test_writes_of_one_row_keep_their_order_when_one_is_held_back_for_its_size() -> None:
    """A write held back because it would make its statement too large keeps the later writes of the
    same row behind it: of two claims of one key, the first to arrive makes the record."""
    statements, batches, first = await _while_a_statement_runs()
    rows = [asyncio.create_task(batches.write(row)) for row in ("x", "y#1!", "y#2", "z")]
    await asyncio.sleep(0)
    statements.release.set()
    await first
    await asyncio.gather(*rows)
    # y#2 would fit beside x, but y#1 came first and must go first.
    assert statements.batches == [["a"], ["x", "z"], ["y#1!"], ["y#2"]]
