"""The gateway's parts, started and stopped together, whatever serves them.

The store, the upstream client and its prober, the effect service, the periodic maintenance and the
webhook's rounds (when configured), built from the settings once per process (each worker of ``serve``
has its own) and handed to the two applications of :mod:`gateway.app` as a
:class:`gateway.runtime.Runtime`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from gateway import schema
from gateway.chain import ROUND
from gateway.chaining import signer_of
from gateway.errors import StoreUnavailable
from gateway.keys import LogHash
from gateway.metrics import CachedCounts, Metrics
from gateway.policy import upstream_policies
from gateway.probes import Prober
from gateway.runtime import Runtime
from gateway.service import EffectService
from gateway.settings import Settings, pooler_url
from gateway.store import Store, StoreLimits
from gateway.telemetry import Observed
from gateway.tracing import Tracer
from gateway.upstream import UpstreamClient
from gateway.webhooks import Webhook, WebhookPlan

log = logging.getLogger("effect_gateway")
# How long a shutdown waits for the periodic jobs to end: a round's statements take milliseconds, and
# each is bounded by the pool's own timeouts (seconds).
STOP_WAIT = 15.0


@asynccontextmanager
async def running(
    settings: Settings, dsn: str, *, metrics_dir: str | None = None, tracer_provider: Any = None
) -> AsyncIterator[Runtime]:
    """Start the gateway's parts on the Postgres at ``dsn`` (already running; the workers' connections
    go through the pooler of ``settings`` when it names one); stop them on the way out.

    ``metrics_dir``: the directory its worker processes share their metrics in (gateway.metrics), or
    None for metrics of its own. ``tracer_provider``: an OpenTelemetry TracerProvider for its spans,
    instead of the global one. On the way out the calls under way finish and record before the store
    closes (bounded by the longest lease).
    """
    await schema.ready(dsn)
    policies = upstream_policies(settings)
    telemetry = Observed(Metrics(policies, metrics_dir), Tracer(tracer_provider))
    store = await Store.connect(
        dsn,
        pooler=pooler_url(settings),
        max_size=settings.pool_size,
        limits=StoreLimits.of(settings),
        telemetry=telemetry,
    )
    client = UpstreamClient(policies.values(), settings.max_response_bytes, telemetry)
    prober = Prober(client)
    for policy in policies.values():
        prober.check(policy)
    given = settings.key_secret
    secret = given.get_secret_value().encode() if given else await store.key_secret()
    service = EffectService(
        store,
        client,
        prober,
        secret,
        retention=settings.retention,
        replay_cache_bytes=settings.replay_cache_bytes,
        waiters_per_key=settings.max_waiters_per_key,
        telemetry=telemetry,
    )
    runtime = Runtime(
        settings,
        policies,
        store,
        service,
        telemetry,
        CachedCounts(store.state_counts),
        CachedCounts(store.oldest_waiting, what="the oldest waiting effects' ages"),
        LogHash(secret),
        client,
    )
    # Without a [webhook], nothing at all: no task, no statement, no HTTP session.
    plan = WebhookPlan.of(settings)
    webhook = Webhook(plan, store, telemetry) if plan is not None else None
    signing = signer_of(settings)

    async def maintain() -> None:
        await store.maintain(settings.retention, progress=log.info)

    async def link() -> None:
        # A full round leaves more behind (a backlog after an outage): the next goes at once.
        while (await store.chain(signing)).chained == ROUND:
            pass

    stopping = asyncio.Event()
    jobs = [
        periodically(maintain, settings.purge_interval, "the retention", stopping),
        periodically(link, settings.audit.chain_every, "the audit's chain", stopping),
    ]
    if webhook is not None:
        jobs.append(periodically(webhook.round, webhook.plan.interval, "the webhook's round", stopping))
    periodic = [asyncio.create_task(job) for job in jobs]
    try:
        yield runtime
    finally:
        stopping.set()
        for task in periodic:
            task.cancel()
        # Bounded: on Python 3.11 a cancellation that meets an asyncio.timeout running out (the pool's
        # acquire) can be taken for that timeout, and lost; the job then sees ``stopping`` and ends.
        await asyncio.wait(periodic, timeout=STOP_WAIT)
        if webhook is not None:
            await webhook.close()
        await service.drain(timeout=runtime.longest_lease)
        # What settled while the calls drained goes into the chain now, not at the next start.
        with contextlib.suppress(StoreUnavailable):
            await link()
        await client.close()
        await store.close()


async def periodically(
    job: Callable[[], Awaitable[object]], every: timedelta, what: str, stopping: asyncio.Event
) -> None:
    """``job`` every ``every`` until ``stopping`` is set. It must outlive any one failure: each is
    logged, and the next round tries again."""
    while not stopping.is_set():
        try:
            await job()
        except StoreUnavailable as exc:
            log.warning("%s skipped a round: %s", what, exc)
        except Exception:
            log.exception("%s failed", what)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), every.total_seconds())
