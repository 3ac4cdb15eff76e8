"""Regression tests for the ways around "never twice" that review and attack found (issue 7).

Each of these failed on the commit before the fix (13e385c): the effect was sent twice, or a record
was left where the next retry would send it again, or a forged effect was taken for a real one.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import aiohttp
import asyncpg
from aiohttp import web

from gateway import partitions
from gateway.body import read_body
from gateway.decision import settle, take_over
from gateway.fingerprint import fingerprint
from gateway.outcome import Answered
from gateway.record import NewEffect, StoredResponse
from gateway.store import opened
from tests.database import RETAINED, backdate_bodies, effect_rows, failing_database, purge_as_owner
from tests.factories import new_effect
from tests.gateways import gateway_server
from tests.upstreams import ORDER_SEARCH, Upstream, raw_upstream

SEARCH = ORDER_SEARCH
PROBED_SHOP = {"stamp": {"json_field": "client_reference"}, "probe": SEARCH}
BODY = b'{"items":["atta"]}'


async def call(
    http: aiohttp.ClientSession, url: str, method: str = "POST", key: str | None = "k", **headers: str
) -> tuple[int, dict[str, str], Any]:
    sent = {"Content-Type": "application/json", **headers}
    if key is not None:
        sent["Idempotency-Key"] = key
    async with http.request(method, f"{url}/shop/orders", data=BODY, headers=sent) as resp:
        body = await resp.read()
        try:
            doc = json.loads(body) if body else None
        except ValueError:
            doc = body
        return resp.status, dict(resp.headers), doc


async def purged(dsn: str) -> dict[str, Any]:
    """Ten days pass, and the owner's purge drops the only record's bodies."""
    await backdate_bodies(dsn, days=10)
    await purge_as_owner(dsn)
    (row,) = await effect_rows(dsn)
    assert row["response_body"] is None, "the purge dropped the day of its bodies"
    return row


def order_in_doubt(upstream: Upstream) -> None:
    """The first order is created upstream and then answered 500, as a crashing upstream might."""

    async def create(request: web.Request) -> web.Response:
        if len(upstream.effects("/orders")) == 1:
            return web.json_response({"error": "lost"}, status=500)
        return web.json_response({"order": len(upstream.effects("/orders"))}, status=201)

    upstream.routes["/orders"] = create


# --- 1. a completed effect is never sent again ---------------------------------------------------------


async def test_a_purged_effect_that_the_probe_no_longer_finds_is_not_sent_again(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """After the retention, a probe that finds nothing (the shop archived the order) gets 410, no order."""
    upstream.serve_search()
    cfg = {"shop": {"base_url": upstream.url, **PROBED_SHOP}}
    async with gateway_server(dsn, upstreams=cfg, **RETAINED) as gw:
        assert (await call(http, gw.url))[0] == 201
        await purged(dsn)
        upstream.routes["/orders/search"] = lambda request: _json({"items": []})  # archived
        status, _, body = await call(http, gw.url)
    assert (status, body["type"].rsplit("/", 1)[1]) == (410, "response-purged")
    assert len(upstream.effects()) == 1
    (row,) = await effect_rows(dsn)
    assert row["state"] == "completed"


async def test_a_failed_probe_leaves_a_purged_effect_completed_and_beyond_an_operator(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A failing probe is a 503 that changes nothing: the record stays completed, no operator can undo it."""
    upstream.serve_search()
    cfg = {"shop": {"base_url": upstream.url, **PROBED_SHOP}}
    async with gateway_server(dsn, upstreams=cfg, **RETAINED) as gw:
        assert (await call(http, gw.url))[0] == 201
        row = await purged(dsn)
        upstream.routes["/orders/search"] = lambda request: _json({"error": "down"}, status=500)
        status, _, body = await call(http, gw.url)
        assert (status, body["type"].rsplit("/", 1)[1]) == (503, "probe-failed")
        (after,) = await effect_rows(dsn)
        assert (after["state"], after["completed_at"]) == ("completed", row["completed_at"])
        async with http.post(
            f"{gw.admin_url}/_gateway/effects/{row['id']}/resolve",
            json={"happened": False, "attempt": row["attempt"]},
        ) as resp:
            assert resp.status == 409
            assert (await resp.json())["type"].endswith("/not-resolvable")
        upstream.routes["/orders/search"] = lambda request: _json({"items": []})
        assert (await call(http, gw.url))[0] == 410
    assert len(upstream.effects()) == 1


async def test_a_purged_effect_is_not_re_sent_under_its_native_key(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A completed effect is not re-sent even under a native key (the upstream may have forgotten it)."""
    cfg = {"shop": {"base_url": upstream.url, "native_key": {"header": "Idempotency-Key", "ttl": "24h"}}}
    async with gateway_server(dsn, upstreams=cfg, **RETAINED) as gw:
        assert (await call(http, gw.url))[0] == 201
        await purged(dsn)
        assert (await call(http, gw.url))[0] == 410
    assert len(upstream.effects()) == 1


async def test_past_its_horizon_a_probe_that_finds_nothing_sends_to_review(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An in-doubt effect older than the probe's horizon is not re-sent when the search does not list it."""
    order_in_doubt(upstream)
    upstream.routes["/orders/search"] = lambda request: _json({"items": []})  # only sees 30 days
    probe = {**SEARCH, "horizon": "30d", "lag": "0s"}  # the search lists an order as it is placed
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": probe}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await call(http, gw.url))[0] == 500
        await _execute(dsn, "update effects set first_sent_at = now() - interval '40 days'")
        status, _, body = await call(http, gw.url)
    assert (status, body["type"].rsplit("/", 1)[1]) == (409, "outcome-unknown")
    (row,) = await effect_rows(dsn)
    assert row["state"] == "needs_review"
    assert len(upstream.effects()) == 1


# --- 2. an outcome that cannot be stored is never re-sent ----------------------------------------------


async def test_an_answer_with_a_header_that_is_not_utf8_is_stored_and_replayed(
    dsn: str, http: aiohttp.ClientSession
) -> None:
    """`X-Bin: caf\\xe9` from the upstream: the agent gets its 201 once, the retry replays it, one order."""
    answer = (
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nX-Bin: caf\xe9\r\n"
        b'Content-Length: 12\r\n\r\n{"order": 1}'
    )
    async with (
        raw_upstream(answer) as shop,
        gateway_server(dsn, upstreams={"shop": {"base_url": shop.url}}) as gw,
    ):
        first = await call(http, gw.url)
        again = await call(http, gw.url)
    assert (first[0], first[2]) == (201, {"order": 1})
    assert (again[0], again[2], again[1]["Idempotent-Replayed"]) == (201, {"order": 1}, "true")
    assert again[1]["X-Bin"] == first[1]["X-Bin"]
    assert len(shop.requests) == 1
    (row,) = await effect_rows(dsn)
    assert row["state"] == "completed"
    assert b"X-Bin: caf\xe9" in row["response_headers"]


async def test_an_answer_postgres_refuses_goes_to_review_and_is_never_re_sent(
    postgres_dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """When Postgres refuses to store an answer, the record goes to review instead of a re-send loop."""
    async with failing_database(postgres_dsn, "refusing") as db:
        await _execute(
            db.dsn,
            """
            create function refuse_answers() returns trigger language plpgsql as $$
            begin
                if new.response_status = 201 then
                    raise exception 'this answer cannot be stored' using errcode = '22000';
                end if;
                return new;
            end $$;
            create trigger refuse_answers before update on effects
                for each row execute function refuse_answers();
            """,
        )
        cfg = {"shop": {"base_url": upstream.url, "timeout": "200ms"}}
        # A grace with room for a busy machine: the request must leave, not be late to send.
        async with gateway_server(db.dsn, upstreams=cfg, lease_grace="500ms") as gw:
            first = await call(http, gw.url)
            await asyncio.sleep(1.0)  # well past the lease a record left pending would have had (700 ms)
            again = await call(http, gw.url)
        (row,) = await effect_rows(db.dsn)
    assert (first[0], first[2]["type"].rsplit("/", 1)[1]) == (409, "outcome-unknown")
    assert "answered 201" in first[2]["detail"]
    assert (again[0], again[2]["type"].rsplit("/", 1)[1]) == (409, "outcome-unknown")
    assert row["state"] == "needs_review"
    assert "could not be recorded" in row["history"][-1]["note"]
    assert len(upstream.effects()) == 1


async def test_an_operator_can_resolve_a_pending_effect_whose_lease_ran_out(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A gateway died holding the record: once its lease ran out an operator settles it, and it replays."""
    async with opened(dsn) as store:
        record, _ = await store.claim(_effect("stuck"), timedelta(0))
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        verdict = {
            "happened": True,
            "attempt": record.attempt,
            "response": {"status": 201, "json": {"order": "by-hand"}},
        }
        async with http.post(f"{gw.admin_url}/_gateway/effects/{record.id}/resolve", json=verdict) as resp:
            assert resp.status == 200
        status, headers, body = await call(http, gw.url, key="stuck")
    assert (status, body, headers["Idempotent-Replayed"]) == (201, {"order": "by-hand"}, "true")
    assert upstream.effects() == []


async def test_an_operator_cannot_resolve_a_pending_effect_while_its_lease_runs(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """While a call may still be under way, "did not happen" is refused: the upstream may yet act on it."""
    async with opened(dsn) as store:
        record, _ = await store.claim(_effect("busy"), timedelta(minutes=5))
    async with (
        gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw,
        http.post(
            f"{gw.admin_url}/_gateway/effects/{record.id}/resolve",
            json={"happened": False, "attempt": record.attempt},
        ) as resp,
    ):
        assert resp.status == 409
        assert "under way" in (await resp.json())["detail"]
    (row,) = await effect_rows(dsn)
    assert row["state"] == "pending"


# --- 3. one tenant cannot forge another's effect -------------------------------------------------------


async def test_a_tenant_cannot_plant_an_effect_that_another_tenants_probe_accepts(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Tenant b plants an order carrying what a's derived key used to be; a's retry is not fooled by it."""
    import hashlib

    created: list[dict[str, Any]] = []  # what the shop's search lists: only orders really placed
    posts = 0

    async def create(request: web.Request) -> web.Response:
        nonlocal posts
        posts += request.method == "POST"
        if posts == 1 and request.method == "POST":
            return web.json_response({"error": "busy"}, status=503)  # overloaded: nothing created
        created.append({**await request.json(), "order": len(created) + 1, "by": request.method})
        return web.json_response(created[-1], status=201)

    async def search(request: web.Request) -> web.Response:
        ref = request.query["ref"]
        return web.json_response({"items": [o for o in created if o.get("client_reference") == ref]})

    upstream.routes["/orders"] = create
    upstream.routes["/orders/search"] = search
    tenants = {"a": {"token": "token-a"}, "b": {"token": "token-b"}}
    # The search lists an order as it is placed: its "not found" is trusted at once.
    cfg = {"shop": {"base_url": upstream.url, **PROBED_SHOP, "probe": {**SEARCH, "lag": "0s"}}}
    async with gateway_server(dsn, upstreams=cfg, tenants=tenants) as gw:
        assert (await call(http, gw.url, **{"Effect-Gateway-Token": "token-a"}))[0] == 503
        # What the upstream key of a's "k" was before: a plain hash anyone could compute.
        plain = hashlib.sha256()
        for part in ("a", "shop", "k"):
            plain.update(len(part).to_bytes(4, "big") + part.encode())
        forged = json.dumps({"items": ["atta"], "client_reference": "eg_" + plain.hexdigest()[:32]})
        async with http.put(
            f"{gw.url}/shop/orders",
            data=forged,
            headers={"Effect-Gateway-Token": "token-b", "Content-Type": "application/json"},
        ):
            pass
        status, _, body = await call(http, gw.url, **{"Effect-Gateway-Token": "token-a"})
    rows = {row["tenant"]: row for row in await effect_rows(dsn) if row["key"] == "k"}
    assert status == 201
    assert body["by"] == "POST"  # a's own order, placed by a's retry, not b's planted one
    assert rows["a"]["derived_key"] != "eg_" + plain.hexdigest()[:32]
    assert json.loads(upstream.effects("/orders")[-1].body)["client_reference"] == rows["a"]["derived_key"]


# --- 4. no side effect bypasses the audit --------------------------------------------------------------


async def test_keyless_unsafe_requests_are_audited_refused_or_forwarded_as_configured(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Keyless PUT is audited (each one a row), POST refused, a listed DELETE forwarded untracked."""
    cfg = {"shop": {"base_url": upstream.url, "keyless": {"DELETE": "forward", "PATCH": "audit"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        puts = [await call(http, gw.url, "PUT", key=None) for _ in range(2)]
        patch = await call(http, gw.url, "PATCH", key=None)
        post = await call(http, gw.url, "POST", key=None)
        delete = await call(http, gw.url, "DELETE", key=None)
        get = await call(http, gw.url, "GET", key=None)
    assert [p[0] for p in puts] == [201, 201]
    assert "Idempotent-Replayed" not in puts[1][1]
    assert (patch[0], delete[0], get[0]) == (201, 201, 201)
    assert (post[0], post[2]["type"].rsplit("/", 1)[1]) == (400, "key-missing")
    rows = await effect_rows(dsn)
    assert [(r["method"], r["state"], r["keyless"], r["response_status"]) for r in rows] == [
        ("PUT", "completed", True, 201),
        ("PUT", "completed", True, 201),
        ("PATCH", "completed", True, 201),
    ]
    assert [c.method for c in upstream.calls] == ["PUT", "PUT", "PATCH", "DELETE", "GET"]


async def test_keyless_put_and_delete_leave_an_audit_row_by_default(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """With no keyless setting at all, a keyless PUT and DELETE are each sent once and audited."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        put = await call(http, gw.url, "PUT", key=None)
        delete = await call(http, gw.url, "DELETE", key=None)
    assert (put[0], delete[0]) == (201, 201)
    rows = await effect_rows(dsn)
    assert [(r["method"], r["state"], r["response_status"]) for r in rows] == [
        ("PUT", "completed", 201),
        ("DELETE", "completed", 201),
    ]
    assert [c.method for c in upstream.calls] == ["PUT", "DELETE"]


async def test_a_keyless_method_can_be_refused(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An upstream that lists PUT as "refuse" answers a keyless PUT with 400 and sends nothing."""
    cfg = {"shop": {"base_url": upstream.url, "keyless": {"PUT": "refuse"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        status, _, body = await call(http, gw.url, "PUT", key=None)
    assert (status, body["type"].rsplit("/", 1)[1]) == (400, "key-missing")
    assert upstream.calls == []


# --- 9. every state change is checked, and fenced on the state it was read in ------------------------


async def test_a_take_over_from_a_stale_read_is_fenced_by_state(dsn: str) -> None:
    """A late holder completes the record at its own attempt; another request that read it pending cannot
    take over.

    The other request saw the lease run out and decided to re-send; the holder's answer arrived just
    after. Fenced by the attempt alone, the take-over won and the effect was sent a second time.
    """
    async with opened(dsn) as store:
        record, _ = await store.claim(_effect("late"), timedelta(0))
        done = settle(Answered(201, (), b"{}"), earlier_doubt=False)
        completed = await store.settle(
            record, done, response=StoredResponse(201, (), b"{}"), recovered_by=None
        )
        assert completed is not None
        assert completed.attempt == record.attempt
        assert await store.reclaim(record, take_over(record), timedelta(seconds=5), "t", sends=True) is None
        assert (await store.reread(record)).state == "completed"


# --- helpers -----------------------------------------------------------------------------------------------


def _effect(key: str) -> NewEffect:
    """Return the effect call() claims under ``key``, as the gateway records it."""
    # What the gateway computes for call()'s request, so that a retry is the same request.
    body = read_body(BODY, "application/json")
    fp = fingerprint("POST", "/orders", "", body, {"Content-Type": "application/json"}, ["content-type"])
    return new_effect(key, derived_key="eg_test", fingerprint=fp, request_body=BODY)


async def _json(doc: Any, status: int = 200) -> web.Response:
    return web.json_response(doc, status=status)


async def _execute(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def test_a_key_whose_month_of_the_audit_was_archived_is_never_sent_again(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The month holding a key's audit row is detached for archive: a retry of it gets 410, nothing sent.

    Whether it had completed or was still open, its row is not there to decide on; the key is.
    """
    cfg = {"shop": {"base_url": upstream.url}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await call(http, gw.url, key="done"))[0] == 201
    conn = await asyncpg.connect(dsn)
    month = await conn.fetchval("select tableoid::regclass::text from effects")
    await conn.execute(f'alter table effects detach partition "{month}"')
    try:
        async with gateway_server(dsn, upstreams=cfg) as gw:  # a fresh one: nothing of the key in memory
            status, _, body = await call(http, gw.url, key="done")
    finally:
        await conn.execute(f'drop table "{month}"')
        await partitions.ensure(conn)
        await conn.close()
    assert (status, body["type"].rsplit("/", 1)[1]) == (410, "response-purged")
    assert "archived" in body["detail"]
    assert "happened" not in body["detail"]  # it may not have: an open effect's month is archived too
    assert len(upstream.effects()) == 1
