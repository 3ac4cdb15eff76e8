"""Failed sign-ins to the audit page, counted per address, and how long an address waits after them.

A token is guessed by trying many: after a few failures from one address, that address may not try
again for a while, doubling with each further failure. A sign-in that works forgets nothing: with a
token of little power (a tenant's), an address could otherwise clear its count between guesses at the
admin's; only a quarter of an hour without a failure does. The wait is a refusal, not a delay of the
answer: a delayed answer would let an attacker go on guessing over many connections at once. Kept in
each worker's memory (no I/O, the clock passed in): several workers multiply the tries an address gets
by their number, and a restart forgets.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Three mistyped tokens are a person; more in a row is a program.
FREE_FAILURES = 3
# The first wait, doubled with each failure after the free ones, up to the longest.
FIRST_WAIT = 1.0
# A minute: ten guesses an hour from one address, and a person who mistyped waits little.
LONGEST_WAIT = 60.0
# An address that has not failed for a quarter of an hour starts again from nothing.
FORGET_AFTER = 900.0
# Addresses remembered at most (the oldest failure forgotten first): a few hundred kilobytes.
REMEMBERED = 10_000


@dataclass(slots=True)
class _Failures:
    count: int
    last: float  # the clock at the last failure
    until: float  # the clock before which the address may not try again


class SignIns:
    """The failed sign-ins of one worker, by address."""

    def __init__(self) -> None:
        self._failed: OrderedDict[str, _Failures] = OrderedDict()

    def wait(self, address: str, now: float) -> float:
        """Seconds before ``address`` may try again (0: it may now)."""
        failures = self._failed.get(address)
        if failures is None:
            return 0.0
        if now - failures.last > FORGET_AFTER:
            del self._failed[address]
            return 0.0
        return max(0.0, failures.until - now)

    def failed(self, address: str, now: float) -> tuple[int, float]:
        """Count a failure of ``address``; its failures in a row, and the seconds it now waits."""
        failures = self._failed.pop(address, None)
        count = 1 if failures is None or now - failures.last > FORGET_AFTER else failures.count + 1
        waits = (
            0.0
            if count <= FREE_FAILURES
            else min(FIRST_WAIT * 2 ** (count - FREE_FAILURES - 1), LONGEST_WAIT)
        )
        self._failed[address] = _Failures(count, now, now + waits)
        while len(self._failed) > REMEMBERED:
            self._failed.popitem(last=False)
        return count, waits
