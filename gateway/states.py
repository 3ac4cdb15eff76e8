"""Everything that decides which state an effect record may move to lives here, as data.

The states are the contract's table. Every write that changes a record's state carries a
:class:`Transition`, which can only be built for a move listed in :data:`TRANSITIONS`; the store's
SQL then fences the same move on the row (``where state = <source> and attempt = <attempt>``). A move
not listed here is a bug in the gateway, and it raises before any SQL runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    PENDING = "pending"  # claimed, lease held, the call may be under way
    COMPLETED = "completed"  # a definitive response is stored
    RETRYABLE = "retryable"  # nothing happened upstream, and no earlier attempt may have
    IN_DOUBT = "in_doubt"  # it may have happened
    NEEDS_REVIEW = "needs_review"  # recovery cannot tell; an operator must resolve it


# from-state -> the states it may move to. ``None`` is "no record yet".
TRANSITIONS: dict[State | None, frozenset[State]] = {
    # The claim: durable before the request leaves, the record of the intent to send.
    None: frozenset({State.PENDING}),
    State.PENDING: frozenset(
        {
            # The attempt settled (an answer, a refusal, a timeout), or a probe under it found the
            # effect (completed), failed (in_doubt) or found nothing past its horizon (needs_review).
            State.COMPLETED,
            State.RETRYABLE,
            State.IN_DOUBT,
            State.NEEDS_REVIEW,
            # The lease ran out and another attempt took the record over (attempt + 1).
            State.PENDING,
        }
    ),
    # Nothing happened, so the next request simply sends.
    State.RETRYABLE: frozenset({State.PENDING}),
    # Re-sent or probed (pending), given up on (needs_review), or an operator's verdict.
    State.IN_DOUBT: frozenset({State.PENDING, State.NEEDS_REVIEW, State.COMPLETED, State.RETRYABLE}),
    # Only an operator moves a record out of review: it happened (completed) or it did not (retryable).
    State.NEEDS_REVIEW: frozenset({State.COMPLETED, State.RETRYABLE}),
    # The effect happened: the record never leaves completed. A probe may put back a response that the
    # retention dropped (completed -> completed); nothing is ever sent for it again.
    State.COMPLETED: frozenset({State.COMPLETED}),
}


class IllegalTransition(RuntimeError):
    """A move the state table does not list: a bug of ours, raised before any SQL runs."""

    def __init__(self, source: State | None, target: State) -> None:
        super().__init__(f"an effect may not move from {source or 'nothing'} to {target}")
        self.source = source
        self.target = target


def check_transition(source: State | None, target: State) -> None:
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(source, target)


@dataclass(frozen=True, slots=True)
class Transition:
    """A move the table allows; building one for any other move raises :class:`IllegalTransition`."""

    source: State | None
    target: State

    def __post_init__(self) -> None:
        check_transition(self.source, self.target)

    def fenced_on(self, state: State) -> State:
        """The state a write of this move fences on: ``state``, the record's as read, which the move
        must start from (a move asked of a record in another state is a bug, not a race)."""
        if self.source is not state:
            raise ValueError(f"a move from {self.source} was asked of a record in {state}")
        return state
