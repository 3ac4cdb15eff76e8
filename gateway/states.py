"""Everything that decides which state an effect record may move to lives here, as data.

The states are DESIGN.md's table. A transition not listed here is a bug in the gateway, and
:func:`check_transition` raises rather than write it.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    PENDING = "pending"  # claimed, lease held, the call may be under way
    COMPLETED = "completed"  # a definitive response is stored
    RETRYABLE = "retryable"  # nothing happened upstream, and no earlier attempt may have
    IN_DOUBT = "in_doubt"  # it may have happened
    NEEDS_REVIEW = "needs_review"  # recovery cannot tell; an operator must resolve it


# from-state -> the states it may move to. ``None`` is "no record yet".
TRANSITIONS: dict[State | None, frozenset[State]] = {
    None: frozenset({State.PENDING}),
    # A settled attempt, or a lease that ran out and was taken over (pending -> pending, attempt + 1).
    State.PENDING: frozenset(
        {State.COMPLETED, State.RETRYABLE, State.IN_DOUBT, State.PENDING, State.NEEDS_REVIEW}
    ),
    State.RETRYABLE: frozenset({State.PENDING}),
    # Re-sent or probed (pending), recovered by an operator (completed, retryable), or given up on.
    State.IN_DOUBT: frozenset({State.PENDING, State.COMPLETED, State.RETRYABLE, State.NEEDS_REVIEW}),
    # Only an operator moves a record out of review: it happened (completed) or it did not (retryable).
    State.NEEDS_REVIEW: frozenset({State.COMPLETED, State.RETRYABLE}),
    # A completed record whose bodies were purged is re-claimed to recover by native key or probe.
    State.COMPLETED: frozenset({State.PENDING}),
}


class IllegalTransition(RuntimeError):
    def __init__(self, source: State | None, target: State) -> None:
        super().__init__(f"an effect may not move from {source or 'nothing'} to {target}")
        self.source = source
        self.target = target


def check_transition(source: State | None, target: State) -> None:
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(source, target)
