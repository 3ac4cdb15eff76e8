"""The gateway's Prometheus metrics, through prometheus-client.

``effect-gateway serve`` runs several worker processes, and a scrape lands on any one of them: each
worker writes its metrics to files of its own in one directory the parent made before forking them
(prometheus-client's multiprocess mode), and a scrape reads all the files, so the numbers are the whole
gateway's, and a worker that died still counts. In a single process (tests, a program embedding the
gateway) the metrics live in a registry of the application's own.

Label children are bound once, at start or at a label set's first use, and kept: binding takes a lock
and builds the label tuple, which the request path should not pay for each time. The effects by state
are read from the store at most every :data:`STATE_COUNTS_EVERY`, however often it is scraped.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

import gateway
from gateway import process
from gateway.audit_query import EXACT_OPEN_COUNT
from gateway.errors import StoreRejected, StoreUnavailable
from gateway.partitions import Ahead

log = logging.getLogger("effect_gateway")

# prometheus-client's own variable: where the workers' metric files are (set before they start).
SHARED_DIR = "PROMETHEUS_MULTIPROC_DIR"
# The workers' directory in the temporary folder, followed by the pid of the gateway that made it (for
# a person looking), and the file in it whose lock says the gateway still runs.
DIR_PREFIX = "effect-gateway-metrics-"
LOCK_FILE = "running.lock"
# Seconds a directory may take to be made and locked before a sweep takes it for a killed gateway's.
MAKING_FOR = 60
# Seconds, for every latency: a replay from memory takes a fraction of a millisecond, a statement a
# millisecond or so, a new effect a few (two commits), an upstream call up to its timeout (30 s by
# default); 60 s is the longest Prefer: wait may hold a request.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# The store's statements, by what they do (gateway/store.py, gateway/phases.py); bound at start so
# that each is there at 0.
STATEMENTS = (
    "claim",
    "reclaim",
    "settle",
    "note_fenced",
    "send_to_review",
    "add_replays",
    "restore",
    "resolve",
    "key_secret",
    "get",
    "reread",
    "find",
    "state_counts",
    "oldest_waiting",
    "partitions_ahead",
    "ping",
    "chain",
)
PROBE_RESULTS = ("found", "not_found", "failed")
# How old the effects-by-state gauge may be: scrapes come every 15 s or more, and a hundred scrapes a
# second then still cost each worker one query every few seconds.
STATE_COUNTS_EVERY = 5.0

# The store's state_counts: every effect's (None) or one tenant's.
StateReader = Callable[[str | None], Awaitable[dict[str, int]]]


class UpstreamMetrics:
    """One upstream's label children."""

    __slots__ = ("_metrics", "_requests", "name", "probe_seconds", "probes", "send_seconds", "taken_over")

    def __init__(self, metrics: Metrics, name: str) -> None:
        self._metrics = metrics
        self.name = name
        self.send_seconds = metrics.upstream_seconds.labels(name, "send")
        self.probe_seconds = metrics.upstream_seconds.labels(name, "probe")
        self.probes = {result: metrics.probes.labels(name, result) for result in PROBE_RESULTS}
        self.taken_over = metrics.leases_taken_over.labels(name)
        self._requests: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        for outcome in ("sent", "replayed"):  # there at 0 from the start: rate() works from the first
            self.request(outcome, "")

    def request(self, outcome: str, problem: str) -> tuple[Counter, Histogram]:
        """The request counter and latency histogram of one outcome (and problem type, or "")."""
        bound = self._requests.get((outcome, problem))
        if bound is None:
            bound = self._requests[outcome, problem] = (
                self._metrics.requests.labels(self.name, outcome, problem),
                self._metrics.request_seconds.labels(self.name, outcome),
            )
        return bound


class Metrics:
    """Every metric of one gateway process; ``shared_dir`` when its workers share the numbers."""

    def __init__(self, upstreams: Iterable[str], shared_dir: str | None = None) -> None:
        # The workers' shared metrics have no *_created series; a single process's then have none
        # either, so that a scrape reads the same however the gateway runs. (A switch of the process's.)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        if shared_dir is not None:
            _count_in_files(shared_dir)
            own = None  # counted in the files, read back by the collector below
            self.registry = CollectorRegistry()
            # prometheus-client's multiprocess module has no type hints.
            MultiProcessCollector(self.registry, path=shared_dir)  # type: ignore[no-untyped-call]
        else:
            own = self.registry = CollectorRegistry()
        self.requests = Counter(
            "effect_gateway_requests",
            "Requests to upstreams, by what came of them (outcome) and the problem type of a refusal.",
            ["upstream", "outcome", "problem"],
            registry=own,
        )
        self.request_seconds = Histogram(
            "effect_gateway_request_duration_seconds",
            "Time from a request's arrival to its answer, by upstream and outcome.",
            ["upstream", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.upstream_seconds = Histogram(
            "effect_gateway_upstream_duration_seconds",
            "Time of each call to an upstream: a request sent (call=send) or a probe (call=probe).",
            ["upstream", "call"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.statement_seconds = Histogram(
            "effect_gateway_store_duration_seconds",
            "Time of each statement of the effect store, from asking for a connection to the answer.",
            ["statement"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.probes = Counter(
            "effect_gateway_probes",
            "Probes asking an upstream whether an effect exists, by result (found, not_found, failed).",
            ["upstream", "result"],
            registry=own,
        )
        self.leases_taken_over = Counter(
            "effect_gateway_leases_taken_over",
            "Pending records whose lease ran out (a gateway stopped holding them) taken over by another.",
            ["upstream"],
            registry=own,
        )
        replay_cache = Counter(
            "effect_gateway_replay_cache",
            "Keyed requests answered from the completed effects in a worker's memory (hit) or not (miss).",
            ["result"],
            registry=own,
        )
        self.verdicts = Counter(
            "effect_gateway_operator_verdicts",
            "Operators' verdicts given through the gateway (admin API, audit page), by verdict.",
            ["upstream", "verdict"],
            registry=own,
        )
        self.notifications = Counter(
            "effect_gateway_notifications",
            "Deliveries of notifications to the webhook, by event and outcome (delivered, failed, gave_up).",
            ["event", "outcome"],
            registry=own,
        )
        self.cache_hit = replay_cache.labels("hit")
        self.cache_miss = replay_cache.labels("miss")
        self.statements = {kind: self.statement_seconds.labels(kind) for kind in STATEMENTS}
        self._upstreams = {name: UpstreamMetrics(self, name) for name in upstreams}
        self._states = _states()
        self.registry.register(self._states)
        self._ahead = _AheadGauge()
        self.registry.register(self._ahead)
        self.registry.register(_BuildInfo())
        self._waiting = _waiting()
        self.registry.register(self._waiting)

    def upstream(self, name: str) -> UpstreamMetrics:
        found = self._upstreams.get(name)
        if found is None:  # an upstream known only by its record (an effect of a removed one)
            found = self._upstreams[name] = UpstreamMetrics(self, name)
        return found

    def exposition(
        self,
        counts: Mapping[str, int] | None,
        ahead: Ahead | None = None,
        waiting: Mapping[str, int] | None = None,
    ) -> bytes:
        """The Prometheus text of every metric, with ``counts`` as the effects by state, ``ahead`` as the
        partitions' days left, ``waiting`` as the oldest waiting effects' ages (None: left out)."""
        self._states.values = counts
        self._ahead.ahead = ahead
        self._waiting.values = waiting
        return generate_latest(self.registry)


class _ReadGauge:
    """A gauge of values read from the store by label (the gateway's as a whole, not counted per
    process), set before each scrape; None leaves it out of that scrape."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        self._name, self._documentation, self._label = name, documentation, label
        self.values: Mapping[str, int] | None = None

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for label, value in sorted((self.values or {}).items()):
            family.add_metric([label], value)
        yield family

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name, self._documentation, labels=[self._label])


def _states() -> _ReadGauge:
    """The effects by state."""
    return _ReadGauge(
        "effect_gateway_effects",
        f"Effect records by state: open states exact up to {EXACT_OPEN_COUNT:,} each and estimated"
        " above, completed from Postgres's estimate on large tables.",
        "state",
    )


def _waiting() -> _ReadGauge:
    """How long the oldest effect in doubt, and the oldest waiting for review, have existed: what an
    alert on effects left waiting for someone asks."""
    return _ReadGauge(
        "effect_gateway_oldest_waiting_seconds",
        "Seconds since the oldest effect in the state (in_doubt, needs_review) was claimed; 0: none.",
        "state",
    )


class _BuildInfo:
    """Which gateway answers: its version and Python's, as labels of a series that is always 1 (an
    alert or a dashboard joins on it, and sees a rollout as the labels change)."""

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        family.add_metric([gateway.__version__, platform.python_version()], 1)
        yield family

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "effect_gateway_build_info",
            "The gateway's version and Python's (always 1).",
            labels=["version", "python"],
        )


class _AheadGauge:
    """Days of partitions left for rows stored from now on, per table: read from Postgres's catalog at
    each scrape (the gateway's as a whole, like the effects by state)."""

    def __init__(self) -> None:
        self.ahead: Ahead | None = None

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        if self.ahead is not None:
            family.add_metric(["effects"], self.ahead.audit.total_seconds() / 86400)
            family.add_metric(["effect_bodies"], self.ahead.bodies.total_seconds() / 86400)
        yield family

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "effect_gateway_partition_days_left",
            "Days until rows stored from now on find no partition of the table to go into (0: none now).",
            labels=["table"],
        )


class CachedCounts:
    """The store's counts by state, read again only once they are :data:`STATE_COUNTS_EVERY` old.

    Kept for each viewer (None: the admin's, every effect; else a tenant's own). Scrapes that arrive
    while a read is under way wait for that read instead of starting their own. When the store cannot
    answer, the gauge is left out of that scrape (the counters still answer).
    """

    def __init__(
        self, read: StateReader, every: float = STATE_COUNTS_EVERY, what: str = "effects by state"
    ) -> None:
        self._read = read
        self._what = what
        self._every = every
        self._counts: dict[str | None, tuple[float, dict[str, int]]] = {}
        self._reading: dict[str | None, asyncio.Future[dict[str, int] | None]] = {}

    async def get(self, tenant: str | None = None) -> dict[str, int] | None:
        now = asyncio.get_running_loop().time()
        if (kept := self._counts.get(tenant)) is not None and now - kept[0] < self._every:
            return kept[1]
        if tenant not in self._reading:
            self._reading[tenant] = asyncio.ensure_future(self._refresh(tenant))
        return await asyncio.shield(self._reading[tenant])

    async def _refresh(self, tenant: str | None) -> dict[str, int] | None:
        try:
            counts = await self._read(tenant)
        except (StoreUnavailable, StoreRejected) as exc:
            log.warning("%s left out of the metrics: %s", self._what, exc)
            return None
        finally:
            del self._reading[tenant]
        self._counts[tenant] = (asyncio.get_running_loop().time(), counts)
        return counts


def states_exposition(counts: Mapping[str, int] | None) -> bytes:
    """The Prometheus text of the effects by state alone."""
    registry = CollectorRegistry()
    gauge = _states()
    gauge.values = counts
    registry.register(gauge)
    return generate_latest(registry)


def _count_in_files(directory: str) -> None:
    """Make this process's metrics go to its own files in ``directory`` (prometheus-client's way).

    prometheus-client picks where values go when it is first imported, from the variable; this process
    may have imported it before the parent set the variable, so the choice is made again here.
    """
    if os.environ.get(SHARED_DIR) != directory:
        raise RuntimeError(f"{SHARED_DIR} must name {directory} before the workers start")
    # Told the pid through gateway.process: by default it asks the kernel before every update.
    values.ValueClass = values.MultiProcessValue(process.pid)  # type: ignore[no-untyped-call]


def sweep_left_behind(parent: str | None = None) -> list[str]:
    """Remove the metric directories of gateways that died without removing theirs; returns them.

    A gateway SIGKILLed (or killed by the OOM killer) cannot run its ``finally``, and its directory
    stays in the temporary folder: one per kill, forever. Each gateway holds a lock on a file in its
    directory for as long as it runs (the kernel lets go of it however the gateway ends), so the next
    gateway to start removes every directory whose lock it can take: a gateway in another container
    sharing the folder holds its lock as well, which a pid, read in another pid namespace, would not show.
    """
    parent = parent or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(parent):
        if not entry.is_dir(follow_symlinks=False):
            continue
        # One still being made (see shared_by_workers) is locked within moments; a gateway killed in
        # those moments leaves it, unlocked, for good.
        making = entry.name.startswith(f".{DIR_PREFIX}")
        if not (entry.name.startswith(DIR_PREFIX) or making):
            continue
        if making and time.time() - entry.stat(follow_symlinks=False).st_mtime < MAKING_FOR:
            continue
        try:
            with open(os.path.join(entry.path, LOCK_FILE), "rb") as held:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            if not making:
                continue  # not a gateway's
        except (NotADirectoryError, BlockingIOError, PermissionError):
            continue  # a running gateway's, or another user's
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def sweep() -> None:
    """Remove the metric directories that killed gateways left behind (see sweep_left_behind), and say so."""
    gone = sweep_left_behind()
    if gone:
        log.info("removed %d metrics directories of gateways that were killed", len(gone))


@contextlib.contextmanager
def shared_by_workers() -> Iterator[str]:
    """A directory for the workers' metric files, named in the environment they inherit; removed after."""
    sweep()
    # Made under a name no sweep looks at, and given its name once locked: a sweep never sees it unlocked.
    making = tempfile.mkdtemp(prefix=f".{DIR_PREFIX}")
    # Held until this process and the workers it forks have all exited: while held, no sweep removes it.
    lock = open(os.path.join(making, LOCK_FILE), "wb")  # noqa: SIM115 - held for the whole with
    fcntl.flock(lock, fcntl.LOCK_EX)
    unique = os.path.basename(making).removeprefix(f".{DIR_PREFIX}")
    directory = os.path.join(os.path.dirname(making), f"{DIR_PREFIX}{os.getpid()}-{unique}")
    os.rename(making, directory)
    before = os.environ.get(SHARED_DIR)
    os.environ[SHARED_DIR] = directory
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        lock.close()
        if before is None:
            os.environ.pop(SHARED_DIR, None)
        else:
            os.environ[SHARED_DIR] = before
