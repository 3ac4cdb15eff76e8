"""An operator's verdict on an effect, shared by the admin API and the CLI."""

from __future__ import annotations

from gateway.decision import NotAwaitingOperator, resolution
from gateway.record import EffectRecord, StoredResponse
from gateway.store import Store


def resolvable(record: EffectRecord) -> bool:
    """Whether an operator may give a verdict on the record as read (it waits for one, no lease runs)."""
    if record.read_at is None:
        return False
    try:
        resolution(record, record.read_at, happened=False)
    except NotAwaitingOperator:
        return False
    return True


class NoSuchEffect(LookupError):
    """No effect has this id (or none the caller may see)."""


async def resolve(
    store: Store,
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

    Raises :class:`NoSuchEffect`, or :class:`~gateway.decision.NotAwaitingOperator` when the record is
    not waiting for an operator or changed since it was judged.
    """
    record = await store.get(effect_id)
    if record is None:
        raise NoSuchEffect(f"no effect {effect_id}")
    if record.attempt != attempt:
        raise NotAwaitingOperator(
            f"effect {effect_id} changed since it was judged (attempt {attempt}, now attempt "
            f"{record.attempt}, {record.state}); look at it again"
        )
    assert record.read_at is not None
    move = resolution(record, record.read_at, happened=happened)
    if await store.resolve(record, move, response, by) is None:
        raise NotAwaitingOperator(f"effect {effect_id} changed state meanwhile; look at it again")
    resolved = await store.get(effect_id)
    assert resolved is not None, "a resolved effect is still there"
    return resolved
