"""How a request with a key ends when it has no answer of the upstream's to give, as plain values.

The driver (:mod:`gateway.service`) returns one of these instead of a reply; it knows nothing of HTTP.
:func:`gateway.replies.problem` turns each into the problem the agent gets (status, ``Retry-After``,
the words), in one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from gateway.outcome import NoAnswer, NotSent


@dataclass(frozen=True, slots=True)
class KeyReused:
    """The key was first used with a different method, path, query or body."""

    effect_id: int


@dataclass(frozen=True, slots=True)
class KeyMissing:
    """A request that may have an effect came without a key, and its upstream refuses those."""

    method: str
    upstream: str


@dataclass(frozen=True, slots=True)
class InFlight:
    """Another request with the same key holds it, and this one stopped waiting: its wait was over, its
    client left, or the key had as many waiters here as it may (``waiting`` of them)."""

    effect_id: int
    retry_after: timedelta
    why: Literal["wait over", "client left", "no seat"]
    waiting: int = 0


# What a fenced attempt was doing when a newer one took the key over.
FencedDuring = Literal["recording", "late to send", "probing"]


@dataclass(frozen=True, slots=True)
class Fenced:
    """A newer attempt took the key over from this one, while this one was recording what the upstream
    answered (``answer``, when Postgres refused it), late to send, or probing."""

    effect_id: int
    during: FencedDuring
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class AwaitsOperator:
    """The effect may have happened and nothing can tell: an operator must judge ``attempt``.

    ``answer`` and ``error``: what the upstream answered and why Postgres refused to record it, when
    that is why (else None: nothing can tell whether it happened).
    """

    effect_id: int
    attempt: int
    answer: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseGone:
    """The effect happened and is never sent again, but its stored response is gone; ``why`` says why
    nothing supplied it."""

    effect_id: int | None
    why: str


@dataclass(frozen=True, slots=True)
class ProbeUnavailable:
    """The probe could not say whether the effect exists; the record is as it was."""

    effect_id: int
    detail: str


@dataclass(frozen=True, slots=True)
class ProbeTooSoon:
    """The probe found nothing before its search could list the latest attempt; nothing was sent."""

    effect_id: int
    detail: str
    retry_after: timedelta


@dataclass(frozen=True, slots=True)
class Unrecorded:
    """The upstream was called, but what came of it could not be written down (Postgres failed)."""

    effect_id: int
    seen: str
    error: str
    lease: timedelta


@dataclass(frozen=True, slots=True)
class Unanswered:
    """The upstream gave no answer to record: nothing left (``NotSent``), or no answer came back."""

    outcome: NotSent | NoAnswer
    effect_id: int | None


@dataclass(frozen=True, slots=True)
class Redirected:
    """The upstream answered with a redirect that repeats the request: it did not act on it."""

    effect_id: int | None
    status: int
    location: str
    upstream: str


Ending = (
    KeyReused
    | KeyMissing
    | InFlight
    | Fenced
    | AwaitsOperator
    | ResponseGone
    | ProbeUnavailable
    | ProbeTooSoon
    | Unrecorded
    | Unanswered
    | Redirected
)
