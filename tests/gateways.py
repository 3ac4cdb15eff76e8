"""Gateways for tests: the real gateway in this process on port 0, or in a process of its own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from agent_example.processes import Service, start_gateway
from gateway.app import runners
from gateway.runtime import RUNTIME, Runtime
from gateway.settings import load_settings
from tests.database import runtime_url
from tests.poolers import suite_pooler_for
from tests.support import ROOT


@dataclass
class Gateway:
    # The agents' listener (the upstreams) and the operators' (the audit, the effects API, metrics).
    url: str
    admin_url: str
    runtime: Runtime


@asynccontextmanager
async def gateway_server(
    dsn: str, tracer_provider: Any = None, *, pooler: str | None = None, **settings: Any
) -> AsyncIterator[Gateway]:
    """The real gateway on 127.0.0.1, both listeners on port 0, on the test Postgres as the runtime role.

    ``dsn``: the owner's URL of a migrated database, whose runtime role was granted (grant_runtime).
    ``tracer_provider``: an OpenTelemetry TracerProvider to receive its spans. ``pooler``: the URL its
    workers' connections go through (tests.poolers), by default the suite's when it runs behind one
    (``make test-pgbouncer``).
    """
    if pooler := pooler or suite_pooler_for(dsn):
        settings |= {"database_url": pooler, "database_direct_url": runtime_url(dsn)}
    configured = load_settings(None, listen="127.0.0.1:0", admin_listen="127.0.0.1:0", **settings)
    async with runners(configured, runtime_url(dsn), tracer_provider=tracer_provider) as both:
        await web.TCPSite(both.proxy, "127.0.0.1", 0).start()
        await web.TCPSite(both.admin, "127.0.0.1", 0).start()
        yield Gateway(
            f"http://127.0.0.1:{both.proxy.addresses[0][1]}",
            f"http://127.0.0.1:{both.admin.addresses[0][1]}",
            both.proxy.app[RUNTIME],
        )


def start_gateway_process(config: Path, env: dict[str, str] | None = None, timeout: float = 30) -> Service:
    """``effect-gateway serve`` in a child process; returns once its log announces where it listens.

    Its working directory is the repository's, so that the child imports this checkout's gateway.
    """
    return start_gateway(["-m", "gateway", "--config", str(config), "serve"], env, timeout, cwd=str(ROOT))


def children(pid: int) -> set[int]:
    """The pids of the processes that ``pid`` started (a gateway's workers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as listed:
        return {int(child) for child in listed.read().split()}


def decisions(lines: list[str]) -> list[dict[str, Any]]:
    """The gateway's lines per decision among the JSON lines of its log."""
    docs = [json.loads(line) for line in list(lines) if line.startswith("{")]
    return [doc for doc in docs if doc["logger"] == "effect_gateway.decision"]
