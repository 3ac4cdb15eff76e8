"""The audit's chain on a real gateway and Postgres: every settlement enters its tenant's chain, verdicts
with the operator's name; `audit export` writes it with signed heads and `audit verify` checks it
without the database, naming what was changed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from gateway import chain, locks
from gateway.chain import Signer
from gateway.decision import review
from gateway.store import opened
from tests.commands import Done, in_thread
from tests.database import runtime_url
from tests.factories import new_effect
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream

PRIVATE, PUBLIC = chain.new_key()
SIGNER = Signer(chain.signing_key(PRIVATE), timedelta(hours=1))
SETTINGS: dict[str, Any] = {
    "tenants": {"acme": {"token": "tok-acme"}, "globex": {"token": "tok-globex"}},
    "admin": {"token": "adm-1"},
    "operators": {"asha": {"token": "op-asha"}},
    # Rounds only when a test runs one: what the chain holds is then what the test did.
    "audit": {"signing_key": PRIVATE, "chain_every": "1m"},
}


@pytest.fixture
async def gw(dsn: str, upstream: Upstream) -> AsyncIterator[Gateway]:
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **SETTINGS) as gateway:
        yield gateway


async def order(http: aiohttp.ClientSession, gw: Gateway, key: str, token: str) -> int:
    headers = {"Idempotency-Key": key, "Effect-Gateway-Token": token, "Content-Type": "application/json"}
    async with http.post(f"{gw.url}/shop/orders", data=b'{"items":["atta"]}', headers=headers) as resp:
        return resp.status


async def waiting_for_review(gw: Gateway, key: str, tenant: str) -> int:
    """An effect of ``tenant`` waiting for an operator's verdict; its id."""
    record, _ = await gw.runtime.store.claim(new_effect(key, tenant=tenant), timedelta(0))
    assert record is not None
    assert await gw.runtime.store.send_to_review(record, review(record), "test") is not None
    return record.id


async def resolve(http: aiohttp.ClientSession, gw: Gateway, effect_id: int, happened: bool) -> None:
    doc: dict[str, Any] = {"happened": happened, "attempt": 1}
    if happened:
        doc["response"] = {"status": 201, "json": {"order": 77}}
    headers = {"Authorization": "Bearer op-asha", "Effect-Gateway-Operator": "INC-9"}
    async with http.post(
        f"{gw.admin_url}/_gateway/effects/{effect_id}/resolve", json=doc, headers=headers
    ) as resp:
        assert resp.status == 200, await resp.text()


async def chain_rows(dsn: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [dict(r) for r in await conn.fetch("select * from audit_chain order by tenant, seq")]
    finally:
        await conn.close()


@pytest.fixture
async def settled(dsn: str, gw: Gateway, http: aiohttp.ClientSession) -> dict[str, int]:
    """Two orders of acme and one of globex answered; a globex effect that asha said happened, and an
    acme one she said did not; all chained and signed. Their ids by name."""
    assert [await order(http, gw, key, "tok-acme") for key in ("a-1", "a-2")] == [201, 201]
    assert await order(http, gw, "g-1", "tok-globex") == 201
    ids = {"happened": await waiting_for_review(gw, "g-2", "globex")}
    ids["did_not"] = await waiting_for_review(gw, "a-3", "acme")
    await resolve(http, gw, ids["happened"], happened=True)
    await resolve(http, gw, ids["did_not"], happened=False)
    done = await gw.runtime.store.chain(SIGNER)
    assert (done.chained, len(done.signed)) == (5, 2)
    return ids


async def test_every_settlement_enters_its_tenants_chain_in_order_with_the_operators_name(
    dsn: str, gw: Gateway, settled: dict[str, int]
) -> None:
    """Each tenant's chain numbers its settlements from 1; a verdict records who gave it and how."""
    rows = await chain_rows(dsn)
    assert [(r["tenant"], r["seq"], r["outcome"], r["by"]) for r in rows] == [
        ("acme", 1, "completed", None),
        ("acme", 2, "completed", None),
        ("acme", 3, "not_happened", "asha (INC-9)"),
        ("globex", 1, "completed", None),
        ("globex", 2, "completed", "asha (INC-9)"),
    ]
    verdict = rows[-1]
    assert (verdict["effect_id"], verdict["recovered_by"], verdict["status"]) == (
        settled["happened"],
        "operator",
        201,
    )
    # The digest of the response the agent is replayed (status, headers as stored, body), as read back.
    record = await gw.runtime.store.get(settled["happened"])
    assert record is not None
    assert record.response is not None
    assert record.response.body == b'{"order": 77}'
    assert verdict["response"].hex() == chain.response_digest(record.response)


async def test_the_runtime_role_may_add_to_the_chain_but_never_change_it(
    dsn: str, settled: dict[str, int]
) -> None:
    """A gateway's own database role cannot update or delete an entry: only the tables' owner could."""
    conn = await asyncpg.connect(runtime_url(dsn))
    try:
        for sql in (
            "update audit_chain set status = 200",
            "delete from audit_chain",
            "delete from audit_heads",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    finally:
        await conn.close()


def export(run: Callable[..., Done], config: Path, out: Path, *args: str) -> Done:
    done = run("audit", "export", "--output", str(out), *args, config=config)
    assert done.status == 0, done.err
    return done


@pytest.fixture
def config(dsn: str, tmp_path: Path) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(f'database_url = "{runtime_url(dsn)}"\n[audit]\nsigning_key = "{PRIVATE}"\n')
    return path


async def test_an_export_verifies_and_names_what_a_change_broke(
    dsn: str, settled: dict[str, int], run: Callable[..., Done], config: Path, tmp_path: Path
) -> None:
    """`audit export` then `audit verify` with the published key: verified; the same file with one
    byte changed, an entry removed, or two entries swapped: not verified, the entry named, exit 1."""
    out = tmp_path / "chain.jsonl"
    await in_thread(export, run, config, out)
    verified = await in_thread(run, "audit", "verify", str(out), "--public-key", PUBLIC)
    assert verified.status == 0, verified.out
    said = verified.out.splitlines()
    assert [said[0], said[2], said[4]] == [
        "tenant acme: entries 1 to 3 (3), each follows the one before",
        "tenant globex: entries 1 to 2 (2), each follows the one before",
        f"verified: {out}",
    ]
    assert said[1].startswith("  1 signed head(s) check out; the last signs entry 3 at ")
    assert said[1].endswith(f" with key {PUBLIC}")
    assert said[3].startswith("  1 signed head(s) check out; the last signs entry 2 at ")
    lines = out.read_bytes().splitlines(keepends=True)
    # line 1 the format, 2 acme's start, 3-5 acme's entries, 6 its head, 7 globex's start, ...
    assert [next(iter(json.loads(line))) for line in (lines[1], lines[5])] == ["chain", "head"]
    tampered = {
        "byte": [*lines[:3], lines[3].replace(b'"status":201', b'"status":202'), *lines[4:]],
        "removed": [*lines[:3], *lines[4:]],
        "swapped": [*lines[:2], lines[3], lines[2], *lines[4:]],
    }
    said = {}
    for name, changed in tampered.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(b"".join(changed))
        done = await in_thread(run, "audit", "verify", str(path))
        assert done.status == 1
        said[name] = done.out.strip().removeprefix(f"NOT VERIFIED: {path}, ")
    assert said == {
        "byte": "line 4: entry 2 of tenant acme (effect 2) does not match its hash: "
        "it was changed after it was chained",
        "removed": f"line 4: entry 2 is missing: entry 3 of tenant acme (effect {settled['did_not']}) "
        "comes next",
        "swapped": "line 3: entry 1 is missing: entry 2 of tenant acme (effect 2) comes next",
    }


async def test_an_entry_changed_in_the_database_is_caught_by_the_next_export(
    dsn: str, settled: dict[str, int], run: Callable[..., Done], config: Path, tmp_path: Path
) -> None:
    """The tables' owner changing an entry's status in place: the export carries it, and verify names it."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("update audit_chain set status = 200 where tenant = 'globex' and seq = 1")
    finally:
        await conn.close()
    out = tmp_path / "chain.jsonl"
    await in_thread(export, run, config, out)
    done = await in_thread(run, "audit", "verify", str(out))
    assert done.status == 1
    assert "entry 1 of tenant globex (effect 3) does not match its hash" in done.out


async def test_an_export_of_one_tenant_since_a_time_starts_from_the_hash_before_it(
    dsn: str,
    settled: dict[str, int],
    gw: Gateway,
    http: aiohttp.ClientSession,
    run: Callable[..., Done],
    config: Path,
    tmp_path: Path,
) -> None:
    """Entries settled after a moment, of one tenant: anchored on the entry before, ending at a head
    the export signs, and verified."""
    conn = await asyncpg.connect(dsn)
    try:
        since = await conn.fetchval("select clock_timestamp()")
    finally:
        await conn.close()
    assert await order(http, gw, "a-4", "tok-acme") == 201
    out = tmp_path / "since.jsonl"
    done = await in_thread(export, run, config, out, "--tenant", "acme", "--since", since.isoformat())
    # Two heads: the one signed at entry 3 before, which anchors the export, and the one it signed at 4.
    assert done.out.splitlines() == ["tenant acme: entries 4 to 4, 2 signed head(s)"]
    verified = chain.verify(out.read_bytes().splitlines(), [chain.public_key(PUBLIC)])
    [acme] = verified.chains
    assert (acme.first, acme.seq, [h.seq for h in acme.heads], acme.uncovered) == (4, 4, [3, 4], 0)


async def test_a_serving_gateway_chains_and_signs_on_its_own(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """With chain_every at 100 ms, an answered order is in the chain and signed within moments."""
    settings = {**SETTINGS, "audit": {"signing_key": PRIVATE, "chain_every": "100ms"}}
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **settings) as gw:
        assert await order(http, gw, "a-1", "tok-acme") == 201
        for _ in range(100):
            rows = await chain_rows(dsn)
            if rows:
                break
            await asyncio.sleep(0.05)
    assert [(r["tenant"], r["seq"]) for r in rows] == [("acme", 1)]
    conn = await asyncpg.connect(dsn)
    try:
        heads = await conn.fetch("select tenant, seq, key from audit_heads")
    finally:
        await conn.close()
    assert [tuple(h) for h in heads] == [("acme", 1, PUBLIC)]


async def test_a_webhook_sweep_under_way_does_not_hold_up_the_chain(dsn: str) -> None:
    """Each periodic job has its own lock: while a notice sweep holds its own, a chain round still runs
    (they once shared a key, and each skipped its turn whenever the other held it)."""
    assert len(set(locks.ALL)) == len(locks.ALL)
    conn = await asyncpg.connect(dsn)
    try:
        async with opened(runtime_url(dsn)) as store, conn.transaction():
            assert await conn.fetchval("select pg_try_advisory_xact_lock($1)", locks.NOTICE)
            assert not (await store.chain(SIGNER)).busy
            assert await conn.fetchval("select pg_try_advisory_xact_lock($1)", locks.CHAIN)
            assert (await store.chain(SIGNER)).busy  # and the chain's own lock does hold it
    finally:
        await conn.close()


async def test_an_export_or_a_verify_told_something_impossible_says_so_in_one_line(
    dsn: str, run: Callable[..., Done], config: Path, tmp_path: Path
) -> None:
    """A period that ends before it starts, a file that cannot be written, a key file that is not text:
    one line each, exit 2, nothing written."""
    said = [
        await in_thread(run, "audit", "export", "--since", "1s", "--until", "10d", config=config),
        await in_thread(run, "audit", "export", "-o", str(tmp_path), config=config),
        await in_thread(run, "audit", "export", "-o", str(tmp_path / "no" / "such"), config=config),
    ]
    (tmp_path / "key.der").write_bytes(b"\x30\x2a\x30\x05\x06\x03\x2b\x65\x70\x03\x21\x00\xff" + bytes(31))
    said.append(await in_thread(run, "audit", "verify", "-", "--public-key", str(tmp_path / "key.der")))
    assert [(done.status, done.err.count("\n"), "Traceback" in done.err) for done in said] == [
        (2, 1, False)
    ] * 4
    assert "must come before --until" in said[0].err
    assert f"cannot write {tmp_path}: Is a directory" in said[1].err
    assert "--public-key" in said[3].err


async def test_a_large_answers_digest_is_the_one_of_the_answer_replayed(
    dsn: str, gw: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An answer past the size hashed off the event loop (200 KiB) enters the chain with the digest of
    the very response a retry is replayed."""
    big = b"x" * (200 * 1024)

    async def large(_request: web.Request) -> web.Response:
        return web.Response(body=big, status=201, content_type="application/octet-stream")

    upstream.routes["/orders"] = large
    assert await order(http, gw, "big", "tok-acme") == 201
    await gw.runtime.store.chain(SIGNER)
    [entry] = await chain_rows(dsn)
    record = await gw.runtime.store.get(entry["effect_id"])
    assert record is not None
    assert record.response is not None
    assert record.response.body == big
    assert entry["response"].hex() == chain.response_digest(record.response)
