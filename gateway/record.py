"""The effect record: one row of the ``effects`` table, as the core sees it (no I/O here)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from gateway.keys import key_digest
from gateway.states import State


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def head_bytes(headers: tuple[tuple[str, str], ...] | Mapping[str, str]) -> bytes:
    """Headers as stored: "Name: value" lines joined by CRLF, the upstream's bytes kept.

    Names and values arrive decoded 'utf-8'/'surrogateescape' (how aiohttp reads them), which this
    turns back into the exact bytes; no header may contain CR or LF, so the block splits unambiguously.
    """
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return b"\r\n".join(
        name.encode("utf-8", "surrogateescape") + b": " + value.encode("utf-8", "surrogateescape")
        for name, value in pairs
    )


def head_pairs(block: bytes) -> tuple[tuple[str, str], ...]:
    """The inverse of :func:`head_bytes`."""
    pairs = []
    for line in block.split(b"\r\n") if block else ():
        name, _, value = line.partition(b": ")
        pairs.append((name.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class KeyCarriers:
    """What carried an effect's derived key to the upstream: the native key's header and the stamp, each as
    configured when the request was sent (None: nothing there)."""

    native_header: str | None = None
    stamp: tuple[str, str] | None = None  # (kind, name): ("json_field", "client_reference")

    def carries_native(self, header: str | None) -> bool:
        """Whether the key went in the native header ``header`` (names of headers ignore case)."""
        return (
            header is not None
            and self.native_header is not None
            and header.lower() == self.native_header.lower()
        )

    def carries_stamp(self, stamp: tuple[str, str] | None) -> bool:
        """Whether the key was stamped as ``stamp`` says: the same kind, the same name."""
        if stamp is None or self.stamp is None or stamp[0] != self.stamp[0]:
            return False
        if stamp[0] == "header":
            return stamp[1].lower() == self.stamp[1].lower()
        return stamp[1] == self.stamp[1]

    def shared_with(self, other: KeyCarriers) -> KeyCarriers:
        """What carried the key both here and in ``other``."""
        return KeyCarriers(
            self.native_header if other.carries_native(self.native_header) else None,
            self.stamp if other.carries_stamp(self.stamp) else None,
        )

    def as_json(self) -> dict[str, Any]:
        """As the audit keeps it, in the configuration's words: {"native_key": H, "stamp": {KIND: NAME}}."""
        doc: dict[str, Any] = {}
        if self.native_header is not None:
            doc["native_key"] = self.native_header
        if self.stamp is not None:
            doc["stamp"] = {self.stamp[0]: self.stamp[1]}
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> KeyCarriers:
        """The inverse of :meth:`as_json`."""
        stamp: tuple[str, str] | None = None
        if doc.get("stamp"):
            ((kind, name),) = doc["stamp"].items()
            stamp = (kind, name)
        return cls(doc.get("native_key"), stamp)


# Where an effect's audit row is: its id, the time it was created (which names its month) and its scope.
RowKey = tuple[int, datetime, uuid.UUID]


@dataclass(frozen=True, slots=True)
class EffectRecord:
    id: int
    tenant: str
    upstream: str
    key: str
    derived_key: str
    method: str
    path: str
    query: str
    fingerprint: str
    state: State
    attempt: int
    # Whether any attempt settled so far may have reached the upstream (doubt is sticky).
    may_have_sent: bool
    lease_expires_at: datetime | None
    first_sent_at: datetime | None
    last_sent_at: datetime | None
    completed_at: datetime | None
    created_at: datetime
    # The response on record, when the statement that read the record fetched it (``response_read``):
    # None then means there is none, or that the retention dropped it (``response_status`` is kept).
    response: StoredResponse | None
    response_status: int | None
    response_at: datetime | None
    recovered_by: str | None
    replays: int
    run_id: str | None
    step: str | None
    request_headers: dict[str, str] = field(default_factory=dict)
    request_body: bytes | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    # The database's clock when this row was read: every time that decides anything comes from it.
    read_at: datetime | None = None
    # Sent without a key under the upstream's "audit" policy: kept for the audit, never replayed.
    keyless: bool = False
    response_read: bool = True
    # "request" or "response" -> why that stored body cannot be read back (it is then left out);
    # "history" -> why events of the history were left out.
    unreadable: dict[str, str] = field(default_factory=dict)
    # What carried the key in every attempt that may have reached the upstream, and the lease the latest
    # attempt that sent was given (its claim or take-over): recovery relies on these, never on today's
    # settings. None for rows claimed before migration 015, which recorded neither.
    key_carriers: KeyCarriers | None = None
    send_lease: timedelta | None = None
    # The MCP tool the effect called; None for an HTTP effect (and one claimed before migration 018).
    tool: str | None = None

    @property
    def scope(self) -> uuid.UUID:
        """The column every row of this effect names its scope by (tenant, upstream and key): the key's
        digest (migration 020). Each statement about the effect names it, so it concerns one shard."""
        return key_digest(self.key)

    @property
    def row_key(self) -> RowKey:
        """Where this effect's audit row is."""
        return self.id, self.created_at, self.scope

    @property
    def as_of(self) -> datetime:
        """Return the database's clock when this record was read; every record the store returns has it."""
        if self.read_at is None:
            raise ValueError("this record was not read from the store, so it has no time to judge it at")
        return self.read_at

    @property
    def replay_refused(self) -> bool:
        """Completed, with a response on record that cannot be read back: a retry is refused (500), never
        answered with garbage, and the effect is not sent again."""
        return self.state is State.COMPLETED and "response" in self.unreadable

    @property
    def purged(self) -> bool:
        """Completed with a response once on record that the retention has since dropped."""
        return (
            self.response_read
            and self.state is State.COMPLETED
            and self.response is None
            and "response" not in self.unreadable
        )


@dataclass(frozen=True, slots=True)
class NewEffect:
    """An effect as its claim first records it."""

    tenant: str
    upstream: str
    key: str
    derived_key: str
    method: str
    path: str
    query: str
    fingerprint: str
    request_headers: Mapping[str, str]
    request_body: bytes
    run_id: str | None
    step: str | None
    # Sent without a key under the upstream's "audit" policy: the key is made up and never looked up.
    keyless: bool = False
    # What carries the derived key in the request sent (nothing for a keyless one).
    key_carriers: KeyCarriers = KeyCarriers()
    # The MCP tool the effect called (gateway.mcp); None for an HTTP effect.
    tool: str | None = None
