"""The admin surface: health, metrics, the effects audit with filters and paging, and access to it."""

from __future__ import annotations

import asyncio
import html
import re

import aiohttp
import asyncpg
import pytest

from tests.database import effect
from tests.gateways import gateway_server
from tests.upstreams import Upstream


async def _order(http: aiohttp.ClientSession, url: str, key: str, **headers: str) -> int:
    async with http.post(
        f"{url}/shop/orders",
        data=b'{"items":["atta"]}',
        headers={"Idempotency-Key": key, "Content-Type": "application/json", **headers},
    ) as resp:
        return resp.status


async def test_the_audit_lists_effects_with_filters_and_pages(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Every effect is in the audit; state, upstream and run filter it; `next` pages through it."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        for n in range(5):
            run = "run-a" if n < 3 else "run-b"
            assert (
                await _order(http, gw.url, f"k{n}", **{"Effect-Gateway-Run": run, "Effect-Gateway-Step": "4"})
                == 201
            )
        await _order(http, gw.url, "k0")  # a replay
        async with http.get(f"{gw.admin_url}/_gateway/effects?limit=2") as resp:
            page = await resp.json()
        assert [e["key"] for e in page["effects"]] == ["k4", "k3"]
        seen = [e["key"] for e in page["effects"]]
        while page["next"]:
            async with http.get(f"{gw.admin_url}{page['next']}") as resp:
                page = await resp.json()
            seen += [e["key"] for e in page["effects"]]
        assert seen == ["k4", "k3", "k2", "k1", "k0"]
        async with http.get(
            f"{gw.admin_url}/_gateway/effects?run=run-a&state=completed&upstream=shop"
        ) as resp:
            assert sorted(e["key"] for e in (await resp.json())["effects"]) == ["k0", "k1", "k2"]
        async with http.get(f"{gw.admin_url}/_gateway/effects?state=needs_review") as resp:
            assert (await resp.json())["effects"] == []
        async with http.get(f"{gw.admin_url}/_gateway/effects?since=1h") as resp:
            assert len((await resp.json())["effects"]) == 5
        async with http.get(f"{gw.admin_url}/_gateway/effects?state=bogus") as resp:
            assert resp.status == 400
            assert resp.content_type == "application/problem+json"
        async with http.get(f"{gw.admin_url}/_gateway/effects?limit=0") as resp:
            assert resp.status == 400


async def test_one_effect_in_full(dsn: str, upstream: Upstream, http: aiohttp.ClientSession) -> None:
    """The detail shows who, what, the response, replays, the run and step, and the history."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        await _order(http, gw.url, "one", **{"Effect-Gateway-Run": "r1", "Effect-Gateway-Step": "4"})
        await _order(http, gw.url, "one")
        for _ in range(60):  # replay counts are written in batches, within a second of the replay
            async with http.get(f"{gw.admin_url}/_gateway/effects/1") as resp:
                effect = await resp.json()
            if effect["replays"]:
                break
            await asyncio.sleep(0.05)
        async with http.get(f"{gw.admin_url}/_gateway/effects/999") as resp:
            assert resp.status == 404
        async with http.get(f"{gw.admin_url}/_gateway/effects/abc") as resp:
            assert resp.status == 400  # not an effect id at all
    assert effect["state"] == "completed"
    assert effect["response_status"] == 201
    assert effect["replays"] == 1
    assert (effect["run_id"], effect["step"]) == ("r1", "4")
    assert effect["request_body"] == '{"items":["atta"]}'
    assert [h["event"] for h in effect["history"]] == ["claimed", "settled"]
    assert all("at" in h for h in effect["history"])


async def test_health_and_metrics_count_effects_by_state(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Health reports the counts per state (needs_review among them); metrics in Prometheus text."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        await _order(http, gw.url, "h1")
        async with http.get(f"{gw.admin_url}/_gateway/health") as resp:
            health = await resp.json()
        async with http.get(f"{gw.admin_url}/_gateway/metrics") as resp:
            metrics = await resp.text()
    assert health["status"] == "ok"
    assert health["effects"]["completed"] == 1
    assert health["needs_review"] == 0
    assert 'effect_gateway_effects{state="completed"} 1' in metrics


async def test_with_tenants_the_audit_needs_a_token_and_shows_only_the_tenants_own(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant sees its own effects; the admin token sees all; no token sees nothing."""
    monkeypatch.setenv("TA", "tok-a")
    monkeypatch.setenv("TB", "tok-b")
    monkeypatch.setenv("ADMIN", "adm-1")
    async with gateway_server(
        dsn,
        upstreams={"shop": {"base_url": upstream.url}},
        tenants={"a": {"token": "env:TA"}, "b": {"token": "env:TB"}},
        admin={"token": "env:ADMIN"},
    ) as gw:
        await _order(http, gw.url, "x", **{"Effect-Gateway-Token": "tok-a"})
        await _order(http, gw.url, "y", **{"Effect-Gateway-Token": "tok-b"})
        async with http.get(f"{gw.admin_url}/_gateway/effects") as resp:
            assert resp.status == 401
        async with http.get(
            f"{gw.admin_url}/_gateway/effects", headers={"Effect-Gateway-Token": "tok-a"}
        ) as resp:
            assert [e["key"] for e in (await resp.json())["effects"]] == ["x"]
        async with http.get(
            f"{gw.admin_url}/_gateway/effects/2", headers={"Effect-Gateway-Token": "tok-a"}
        ) as resp:
            assert resp.status == 404  # b's effect does not exist for a
        async with http.get(
            f"{gw.admin_url}/_gateway/effects", headers={"Authorization": "Bearer adm-1"}
        ) as resp:
            assert sorted(e["key"] for e in (await resp.json())["effects"]) == ["x", "y"]
        async with http.post(
            f"{gw.admin_url}/_gateway/effects/1/resolve",
            json={"happened": False},
            headers={"Effect-Gateway-Token": "tok-a"},
        ) as resp:
            assert resp.status == 401


async def test_the_audit_pages_older_link_of_a_span_from_now_goes_on_through_that_span(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The audit page's Older link of since=2s, followed once the page's last effect is more than 2 s
    old, shows the effect before it in the span the first page read."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        for key in ("a", "b", "c"):
            assert await _order(http, gw.url, key) == 201
        async with http.get(f"{gw.admin_url}/_gateway/audit?since=2s&limit=2") as resp:
            older = re.search(r'<a rel="next" href="([^"]+)"', await resp.text())
        assert older is not None
        await asyncio.sleep(2.5)
        async with http.get(gw.admin_url + html.unescape(older[1])) as resp:
            assert resp.status == 200
            assert '<td class="key">a</td>' in await resp.text()


async def test_a_history_changed_by_hand_is_said_to_be_unreadable_and_the_effect_still_shown(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The API and the page show an effect waiting for an operator whose history is no longer a list of
    events, say so, and offer the verdict; a verdict with a name the history cannot keep is a 400, and
    nothing is written."""
    [waiting] = await effect(dsn, "k", review=True)
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("update effects set history = 'null'::jsonb")
            async with http.get(f"{gw.admin_url}/_gateway/effects/{waiting.id}") as resp:
                doc = await resp.json()
            async with http.get(f"{gw.admin_url}/_gateway/audit/{waiting.id}") as resp:
                page = (resp.status, await resp.text())
            async with http.post(
                f"{gw.admin_url}/_gateway/effects/{waiting.id}/resolve",
                json={"happened": False, "attempt": waiting.attempt},
                headers={"Effect-Gateway-Operator": "a" * 201},
            ) as resp:
                refused = (resp.status, resp.content_type, (await resp.json())["detail"])
            after = await conn.fetchrow("select state, history::text from effects")
            await conn.execute(
                """update effects set history = '[{"event": "note", "attempt": "<b>x</b>", "at": null}]'"""
            )
            async with http.get(f"{gw.admin_url}/_gateway/audit/{waiting.id}") as resp:
                marked = await resp.text()
        finally:
            await conn.close()
    assert (doc["state"], doc["history"], doc["resolvable"]) == ("needs_review", [], True)
    assert doc["unreadable"] == {"history": "not a list of events but null"}
    assert page[0] == 200
    assert "The stored history cannot be read back in full (not a list of events but null)." in page[1]
    assert "On record, but it cannot be read back (see above)." in page[1]
    assert 'aria-label="did not happen"' in page[1], "the verdict is still offered"
    assert refused == (
        400,
        "application/problem+json",
        "Effect-Gateway-Operator: the operator's name is longer than 200 characters",
    )
    assert tuple(after) == ("needs_review", "null")
    assert "attempt &lt;b&gt;x&lt;/b&gt;" in marked
    assert "<b>x</b>" not in marked
