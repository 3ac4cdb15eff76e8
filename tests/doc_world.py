"""What the documentation's blocks run against: ``make serve``'s world, on port 0 and the test Postgres.

The demo upstreams of agent_example/upstreams, each a process of its own, and ``effect-gateway serve``
with examples/gateway.toml (unchanged: its upstreams' addresses are overridden by variables, as a user
overrides any setting) in front of them. The gateway listens where the pages say ``make serve`` does
not (port 0); :attr:`World.addresses` maps each address a page names to the one it has here.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tomllib
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import asyncpg

from agent_example.processes import Service, start_gateway, start_service
from gateway import chain
from gateway.decision import review, take_over
from gateway.store import opened
from tests.database import empty_effects, other_database
from tests.doc_blocks import ROOT, NoRule
from tests.factories import new_effect

EXAMPLE = ROOT / "examples" / "gateway.toml"
# The addresses every page names for the gateway: where `make serve` listens, for agents and operators.
DOCUMENTED_GATEWAY = "http://127.0.0.1:8787"
DOCUMENTED_ADMIN = "http://127.0.0.1:8788"
BIN = Path(sys.executable).parent  # the project's virtualenv, whose interpreter runs the tests
JOURNAL_DATABASE = "doc_blocks_journal"


@dataclass
class World:
    gateway: str
    dsn: str
    scratch: Path  # the blocks' working directory; its gateway.toml is the example configuration
    env: dict[str, str]  # what blocks run with: EFFECT_GATEWAY_URL, JOURNAL_DATABASE_URL, the database
    addresses: dict[str, str]  # an address a page names -> the one it has here
    help_texts: dict[tuple[str, ...], str] = field(default_factory=dict)  # `--help` of a script, once


@contextmanager
def started_world(dsn: str, scratch: Path) -> Iterator[World]:
    """The demo upstreams and the example gateway on an empty audit; everything stopped (by pid) after."""
    asyncio.run(empty_effects(dsn))
    asyncio.run(_documented_role(dsn))
    journal_dsn = asyncio.run(_fresh_database(dsn, JOURNAL_DATABASE))
    shutil.copy(EXAMPLE, scratch / "gateway.toml")
    private, public = chain.new_key()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECT_GATEWAY_")}
    env |= {
        "PATH": f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        "EFFECT_GATEWAY_DATABASE_URL": dsn,
        "EFFECT_GATEWAY_WORKERS": "1",  # one worker starts sooner, and the blocks need no more
        # The audit chain's signing key as operations.md sets it up, its public half "published" in
        # the file the page verifies exports with.
        "EFFECT_GATEWAY_AUDIT__SIGNING_KEY": private,
    }
    (scratch / "audit-public.key").write_text(public + "\n")
    started: list[Service] = []
    addresses = {}
    upstreams = tomllib.loads(EXAMPLE.read_text())["upstreams"]
    try:
        # At once: each spends most of its start importing aiohttp.
        with ThreadPoolExecutor(len(upstreams)) as pool:
            starts = {
                name: pool.submit(start_service, ["-m", "agent_example.upstreams", name, "--port", "0"])
                for name in upstreams
            }
            failures = []
            for start in starts.values():
                try:
                    started.append(start.result())
                except RuntimeError as exc:  # the others are stopped below all the same
                    failures.append(exc)
            if failures:
                raise failures[0]
        for service, (name, upstream) in zip(started, upstreams.items(), strict=True):
            addresses[upstream["base_url"]] = service.url
            env[f"EFFECT_GATEWAY_UPSTREAMS__{name.upper()}__BASE_URL"] = service.url
        gateway = start_gateway(
            ["-m", "gateway", "--config", str(EXAMPLE), "serve"],
            {**env, "EFFECT_GATEWAY_LISTEN": "127.0.0.1:0", "EFFECT_GATEWAY_ADMIN_LISTEN": "127.0.0.1:0"},
            timeout=60,
            cwd=str(scratch),
        )
        started.append(gateway)
        addresses[DOCUMENTED_GATEWAY] = gateway.url
        assert gateway.admin_url is not None, "the gateway announces its admin listener"
        addresses[DOCUMENTED_ADMIN] = gateway.admin_url
        env |= {"EFFECT_GATEWAY_URL": gateway.url, "JOURNAL_DATABASE_URL": journal_dsn}
        yield World(gateway.url, dsn, scratch, env, addresses)
    finally:
        for service in reversed(started):
            service.stop()
        asyncio.run(_drop_database(dsn, JOURNAL_DATABASE))


# The runtime role docs/operations.md makes with psql (a line that does not run here) before its
# `migrate --grant-to` names it.
DOCUMENTED_ROLE = "effect_gateway_runtime"


async def _documented_role(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        if not await conn.fetchval(
            "select exists (select from pg_roles where rolname = $1)", DOCUMENTED_ROLE
        ):
            await conn.execute(f"create role {DOCUMENTED_ROLE}")
    finally:
        await conn.close()


async def _fresh_database(dsn: str, name: str) -> str:
    """A database of its own for the journal's tables, so that a run id the pages use starts afresh."""
    await _drop_database(dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"create database {name}")
    finally:
        await conn.close()
    return other_database(dsn, name)


async def _drop_database(dsn: str, name: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"drop database if exists {name} with (force)")
    finally:
        await conn.close()


async def awaiting_operator(dsn: str, attempt: int, effect_id: int | None = None) -> int:
    """An effect in needs_review at ``attempt`` (with the id ``effect_id``, if given), written by the store
    as a gateway writes one: claimed, taken over as its leases ran out, then given up on."""
    if attempt < 1:
        raise NoRule(f"an effect's attempts are numbered from 1, not {attempt}")
    async with opened(dsn) as store:
        if effect_id is not None:
            if await store.get(effect_id) is not None:
                return effect_id
            await _next_id_is(dsn, effect_id)
        new = new_effect(
            f"doc-review-{uuid.uuid4().hex}",
            derived_key="doc-review",
            fingerprint="doc",
            request_headers={"content-type": "application/json"},
            request_body=b'{"items": ["atta"]}',
        )
        record, _ = await store.claim(new, timedelta(0))  # a lease of nothing: it runs out at once
        for _ in range(attempt - 1):
            assert record is not None
            record = await store.reclaim(record, take_over(record), timedelta(0), "doc", sends=True)
        assert record is not None
        reviewed = await store.send_to_review(record, review(record), "nothing could tell (a doc example)")
        assert reviewed is not None
        assert reviewed.attempt == attempt
        return reviewed.id


async def _next_id_is(dsn: str, effect_id: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        last = await conn.fetchval("select last_value from effect_ids")
        if last >= effect_id:
            raise NoRule(f"effect {effect_id} cannot be made: ids up to {last} are taken already")
        await conn.execute("select setval('effect_ids', $1)", effect_id - 1)
    finally:
        await conn.close()
