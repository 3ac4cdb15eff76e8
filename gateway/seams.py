"""The parts the driver talks to, as types: the effect store it writes, the sender and the prober.

:class:`gateway.store.Store`, :class:`gateway.upstream.UpstreamClient` and :class:`gateway.probes.Prober`
satisfy them against Postgres and real upstreams; the simulator's store and upstreams (sim/) satisfy
them in memory. mypy checks both, so neither side can drift from what :class:`gateway.service.
EffectService` calls. The audit's reads and the operators' verdicts are apart (:class:`AuditReads`,
:class:`Verdicts`): the driver never reads a list of effects, and never resolves one. :class:`Database`
is all of them, and the upkeep besides.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Protocol

from gateway import partitions
from gateway.audit_query import EffectFilter
from gateway.chain import Round, Signer
from gateway.decision import Settlement
from gateway.outcome import Outcome
from gateway.policy import UpstreamPolicy
from gateway.record import EffectRecord, KeyCarriers, NewEffect, RowKey, StoredResponse
from gateway.states import Transition
from gateway.upstream import Outbound


class EffectStore(Protocol):
    """Write each step of an effect, fenced on the attempt and state the record was read in.

    Every record returned carries the database's clock (``read_at``) of the statement that read it.
    """

    async def claim(self, new: NewEffect, lease: timedelta) -> tuple[EffectRecord | None, bool]: ...

    async def reclaim(
        self,
        record: EffectRecord,
        move: Transition,
        lease: timedelta,
        reason: str,
        *,
        sends: bool,
        renew: bool = False,
        carriers: KeyCarriers | None = None,
    ) -> EffectRecord | None: ...

    async def reread(self, record: EffectRecord) -> EffectRecord: ...

    async def settle(
        self,
        record: EffectRecord,
        settlement: Settlement,
        *,
        response: StoredResponse | None,
        recovered_by: str | None,
        note: str | None = None,
    ) -> EffectRecord | None: ...

    async def send_to_review(
        self, record: EffectRecord, move: Transition, why: str
    ) -> EffectRecord | None: ...

    async def note_fenced(self, record: EffectRecord, saw: str) -> None: ...

    async def restore(
        self, record: EffectRecord, move: Transition, response: StoredResponse
    ) -> tuple[EffectRecord, bool]: ...

    async def add_replays(self, counts: Mapping[RowKey, int]) -> None: ...


class AuditReads(Protocol):
    """Read the audit: one effect, a page of them, and how many are in each state."""

    async def get(self, effect_id: int, tenant: str | None = None) -> EffectRecord | None: ...

    async def find(self, where: EffectFilter) -> list[EffectRecord]: ...

    async def state_counts(self, tenant: str | None = None) -> dict[str, int]: ...


class Verdicts(Protocol):
    """Read one effect and write an operator's verdict on it (the CLI, the API, the audit page)."""

    async def get(self, effect_id: int, tenant: str | None = None) -> EffectRecord | None: ...

    async def resolve(
        self, record: EffectRecord, move: Transition, response: StoredResponse | None, by: str | None
    ) -> EffectRecord | None: ...


class Database(EffectStore, AuditReads, Verdicts, Protocol):
    """Everything the gateway asks of its database: :class:`gateway.store.Store` against Postgres, and
    the simulator's store in memory. tests/test_store_contract.py holds both to one suite through this
    type, so the two cannot drift apart without mypy saying so."""

    async def key_secret(self) -> bytes: ...

    async def ping(self) -> None: ...

    async def partitions_ahead(self) -> partitions.Ahead: ...

    async def chain(self, signer: Signer | None, *, sign_now: bool = False) -> Round: ...

    async def maintain(
        self, retention: timedelta, progress: partitions.Progress = ..., *, purge: bool = False
    ) -> list[partitions.Partition]: ...

    async def close(self) -> None: ...


class Sender(Protocol):
    """Send a request upstream and say what came of it; never raises for anything the upstream did."""

    async def send(self, request: Outbound, timeout: float, leave_within: float | None = None) -> Outcome: ...


class EffectProbe(Protocol):
    """Ask an upstream whether an effect exists, by the key the gateway gave it (the probe)."""

    async def probe(self, policy: UpstreamPolicy, derived_key: str) -> StoredResponse | None: ...
