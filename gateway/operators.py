"""An operator's verdict on an effect, shared by the admin API and the CLI."""

from __future__ import annotations

from gateway.decision import NotAwaitingOperator, resolution
from gateway.record import EffectRecord, StoredResponse
from gateway.store import Store


class NoSuchEffect(LookupError):
    """No effect has this id (or none the caller may see)."""


async def resolve(
    store: Store, effect_id: int, *, happened: bool, response: StoredResponse | None, by: str | None
) -> EffectRecord:
    """Record that the effect happened (with the response to replay) or did not (the next retry sends).

    Raises :class:`NoSuchEffect`, or :class:`~gateway.decision.NotAwaitingOperator` when the record is
    not waiting for an operator or changed while the verdict was being written.
    """
    record = await store.get(effect_id)
    if record is None:
        raise NoSuchEffect(f"no effect {effect_id}")
    assert record.read_at is not None
    move = resolution(record, record.read_at, happened=happened)
    if await store.resolve(record, move, response, by) is None:
        raise NotAwaitingOperator(f"effect {effect_id} changed state meanwhile; look at it again")
    resolved = await store.get(effect_id)
    assert resolved is not None, "a resolved effect is still there"
    return resolved
