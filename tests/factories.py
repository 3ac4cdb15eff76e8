"""Effects for tests to claim, and records for the decision's tables: one place to build them.

Each takes keyword arguments for what a test cares about; the rest is a plain POST /orders to the
upstream "shop" (of tenant "default" for a new effect, "t" for a record), sent with nothing out of
the ordinary.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway.decision import Request
from gateway.record import EffectRecord, KeyCarriers, NewEffect, StoredResponse
from gateway.states import State

# The database's clock in the records below, and the lease their last attempt was given.
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=35)
OK = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id": 1}')
# A request the records below were made by (the same fingerprint).
SAME = Request(fingerprint="fp")
# What carries the key unless a test says otherwise: the native header and a stamp in the JSON body.
CARRIED = KeyCarriers("Idempotency-Key", ("json_field", "client_reference"))


def new_effect(key: str = "k", **changes: Any) -> NewEffect:
    """Return an effect as its claim records it, under ``key``, with ``changes`` made."""
    base = NewEffect(
        tenant="default",
        upstream="shop",
        key=key,
        derived_key=f"eg_{key}",
        method="POST",
        path="/orders",
        query="",
        fingerprint="fp",
        request_headers={},
        request_body=b"{}",
        run_id=None,
        step=None,
    )
    return replace(base, **changes)


def record(state: State, **changes: Any) -> EffectRecord:
    """Return a record in ``state`` as the store reads it at NOW, its lease just run out, with
    ``changes`` made. A completed one holds OK; any other may have sent unless it is retryable."""
    base = EffectRecord(
        id=1,
        tenant="t",
        upstream="shop",
        key="k",
        derived_key="eg_x",
        method="POST",
        path="/orders",
        query="",
        fingerprint="fp",
        state=state,
        attempt=1,
        may_have_sent=state is not State.RETRYABLE,
        lease_expires_at=NOW - timedelta(seconds=1),
        first_sent_at=NOW - timedelta(minutes=1),
        last_sent_at=NOW - timedelta(minutes=1),
        completed_at=None,
        created_at=NOW - timedelta(minutes=1),
        response=OK if state is State.COMPLETED else None,
        response_status=OK.status if state is State.COMPLETED else None,
        response_at=None,
        recovered_by=None,
        replays=0,
        run_id=None,
        step=None,
        read_at=NOW,
        key_carriers=CARRIED,
        send_lease=LEASE,
    )
    return replace(base, **changes)
