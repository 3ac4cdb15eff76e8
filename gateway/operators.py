"""An operator's verdict on an effect, shared by the admin API and the CLI."""

from __future__ import annotations

from gateway.decision import Refuse, resolution, verdict_refused
from gateway.errors import BadName, NoSuchEffect, NotAwaitingOperator
from gateway.legible import flaw
from gateway.record import EffectRecord, StoredResponse
from gateway.seams import Verdicts
from gateway.states import State


def resolvable(record: EffectRecord) -> bool:
    """Whether an operator may give a verdict on the record as read (it waits for one, no lease runs)."""
    return record.read_at is not None and verdict_refused(record) is None


def _resolved_at(record: EffectRecord, attempt: int) -> bool:
    """Whether the history holds an operator's verdict on ``attempt`` (read with its history)."""
    return any(e.get("event") == "resolved" and e.get("attempt") == attempt for e in record.history)


# The name is kept in the effect's history for good, and shown on the page and on the command line:
# room for a person's name or address and a ticket number.
MAX_NAME = 200


def recorded_as(operator: str | None, typed: str | None, default: str) -> str:
    """Who a verdict is recorded as. A named operator by their name, what they typed beside it (a
    ticket: ``asha (INC-7)``); the admin, whose token automation shares, as ``admin: <what was typed>``,
    or ``default``. An operator's name has no space and is never ``admin``, so neither reads as the
    other, whatever is typed."""
    if operator is not None:
        return f"{operator} ({typed})" if typed else operator
    return f"admin: {typed}" if typed else default


def check_name(by: str | None) -> None:
    """Raise :class:`BadName` for a name the history cannot keep (see :func:`gateway.legible.flaw`), or
    one over MAX_NAME."""
    if by is None:
        return
    if len(by) > MAX_NAME:
        raise BadName(f"the operator's name is longer than {MAX_NAME} characters")
    why = flaw(by)
    if why is not None:
        raise BadName(f"the operator's name {why}")


async def resolve(
    store: Verdicts,
    effect_id: int,
    *,
    attempt: int,
    happened: bool,
    response: StoredResponse | None,
    by: str | None,
) -> EffectRecord:
    """Record that the effect happened (with the response to replay) or did not (the next retry sends).

    ``attempt`` is the attempt of the record the operator judged: a verdict holds only for what was
    looked at. A gateway that re-sent in between may have made the effect happen after all, and a stale
    "did not happen" would then let the next request send it again.

    Raises :class:`BadName` for a name the history cannot keep, :class:`NoSuchEffect`, or
    :class:`~gateway.errors.NotAwaitingOperator` when the record is not waiting for an operator or
    changed since it was judged.
    """
    check_name(by)
    record = await store.get(effect_id)
    if record is None:
        raise NoSuchEffect(f"no effect {effect_id}")
    if attempt > record.attempt:
        raise NotAwaitingOperator(
            f"it has had no attempt {attempt}: its latest is attempt {record.attempt} "
            f"({record.state}), the one to judge",
            effect_id,
        )
    if attempt < record.attempt:
        raise NotAwaitingOperator(
            f"it changed since it was judged (attempt {attempt}, now attempt "
            f"{record.attempt}, {record.state}); look at it again",
            effect_id,
        )
    if record.state is State.RETRYABLE and _resolved_at(record, attempt):
        # A verdict keeps the attempt: a second operator on the same attempt is told what changed.
        raise NotAwaitingOperator(
            "it changed since it was judged: another verdict said it did not happen "
            "(now retryable, and the next retry sends it); look at it again",
            effect_id,
        )
    move = resolution(record, record.as_of, happened=happened)
    if isinstance(move, Refuse):
        raise NotAwaitingOperator(move.reason, effect_id)
    if await store.resolve(record, move.transition, response, by) is None:
        raise NotAwaitingOperator("it changed state meanwhile; look at it again", effect_id)
    resolved = await store.get(effect_id)
    assert resolved is not None, "a resolved effect is still there"
    return resolved
