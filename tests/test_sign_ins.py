"""How long an address waits after failed sign-ins (gateway.sign_ins), with the clock passed in."""

from __future__ import annotations

from gateway import sign_ins
from gateway.sign_ins import SignIns


def test_the_wait_doubles_after_the_free_failures_up_to_a_minute() -> None:
    """Three failures cost nothing; the fourth waits a second, then two, four, ... never more than 60."""
    counter = SignIns()
    waits = [counter.failed("10.0.0.1", now=float(n))[1] for n in range(12)]
    assert waits == [0, 0, 0, 1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert counter.wait("10.0.0.1", now=11.0) == 60.0
    assert counter.wait("10.0.0.2", now=11.0) == 0.0  # another address is not held up


def test_a_quiet_quarter_hour_forgets_the_failures() -> None:
    """A quarter of an hour without a failure clears an address's failures."""
    counter = SignIns()
    for n in range(5):
        counter.failed("b", now=float(n))
    later = 4.0 + sign_ins.FORGET_AFTER + 1
    assert counter.wait("b", now=later) == 0.0
    assert counter.failed("b", now=later) == (1, 0.0)


def test_the_addresses_remembered_are_bounded() -> None:
    """A flood of addresses keeps at most REMEMBERED, forgetting the oldest failure first."""
    counter = SignIns()
    for n in range(sign_ins.REMEMBERED + 5):
        for _ in range(5):
            counter.failed(f"addr-{n}", now=1.0)
    assert counter.wait("addr-0", now=1.0) == 0.0
    assert counter.wait(f"addr-{sign_ins.REMEMBERED + 4}", now=1.0) == 2.0
