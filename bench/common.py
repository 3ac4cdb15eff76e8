"""What the benchmarks share: a Postgres to run on, and the figures they print."""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Awaitable, Callable

from bench.harness import conditions, work_dir
from gateway.embedded import EmbeddedPostgres


def on_postgres(bench: Callable[[str], Awaitable[None]]) -> None:
    """Run ``bench(dsn)`` on $TEST_DATABASE_URL, or on an embedded Postgres that is stopped afterwards.

    The conditions come first (cores, load, versions), so that figures from a busy machine show as such.
    """
    print(conditions({"postgres": where()}), flush=True)
    dsn = os.environ.get("TEST_DATABASE_URL")
    if dsn:
        asyncio.run(bench(dsn))
        return
    with work_dir("effect-gateway-bench-") as tmp:
        embedded = EmbeddedPostgres(tmp)
        try:
            asyncio.run(bench(embedded.start()))
        finally:
            embedded.stop()


def where() -> str:
    return "given" if "TEST_DATABASE_URL" in os.environ else "embedded"


def p50_p99(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), statistics.quantiles(samples, n=100)[98]
