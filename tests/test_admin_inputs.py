"""The admin surface's inputs and access: bounds on ids and filters, strict JSON, health for anyone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway import problems
from gateway.effects_json import parse_resolution
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream

ADMIN = {"Authorization": "Bearer adm-1"}


@pytest.fixture
async def gateway(dsn: str, upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv("TOKEN_A", "tok-a")
    monkeypatch.setenv("ADMIN", "adm-1")
    async with gateway_server(
        dsn,
        upstreams={"shop": {"base_url": upstream.url}},
        tenants={"a": {"token": "env:TOKEN_A"}},
        admin={"token": "env:ADMIN"},
    ) as gw:
        yield gw


async def get(http: aiohttp.ClientSession, url: str, headers: dict[str, str] = ADMIN) -> tuple[int, Any]:
    async with http.get(url, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize(
    "target",
    [
        "/_gateway/effects/%C2%B2",  # '²' passes str.isdigit()
        f"/_gateway/effects/{2**63}",
        "/_gateway/effects/" + "9" * 5000,
        "/_gateway/effects?limit=%C2%B2",
        "/_gateway/effects?limit=" + "9" * 5000,
        f"/_gateway/effects?before={2**63}",
        "/_gateway/effects?since=99999999999d",
        "/_gateway/effects?since=" + "9" * 400 + "s",
        # past year 9999 once in UTC, and before year 1: Postgres was asked and the answer was a 500
        "/_gateway/effects?until=9999-12-31T23:59:59-14:00",
        "/_gateway/effects?since=0001-01-01T00:00:00%2B14:00",
        # a NUL cannot be in a Postgres text value: it was sent to the query, and came back a 500
        "/_gateway/effects?run=a%00b",
        "/_gateway/effects?key=%00",
        "/_gateway/effects?upstream=shop%00",
    ],
)
async def test_ids_and_filters_out_of_range_are_a_400(
    gateway: Gateway, http: aiohttp.ClientSession, target: str
) -> None:
    """Ids past int64, non-ASCII digits, huge limits and durations: 400 problem+json, never a 500."""
    async with http.get(gateway.admin_url + target, headers=ADMIN) as resp:
        assert resp.status == 400
        assert resp.content_type == "application/problem+json"


@pytest.mark.parametrize("since", ["9999-12-31T00:00:00Z", "2020-01-01T00:00:00", "2020-01-01"])
async def test_since_takes_far_future_and_zoneless_times(
    gateway: Gateway, http: aiohttp.ClientSession, since: str
) -> None:
    """A time without a zone is read as UTC; one far in the future simply finds nothing."""
    await _order(http, gateway, "s1")
    status, page = await get(http, f"{gateway.admin_url}/_gateway/effects?since={since}")
    assert status == 200
    assert len(page["effects"]) == (0 if since.startswith("9999") else 1)


async def _order(http: aiohttp.ClientSession, gw: Gateway, key: str) -> None:
    async with http.post(
        f"{gw.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": key, "Effect-Gateway-Token": "tok-a"}
    ) as resp:
        assert resp.status == 201


async def test_a_resolution_nested_10000_deep_is_a_400(gateway: Gateway, http: aiohttp.ClientSession) -> None:
    """The resolve body is read strictly: 10,000 levels of nesting are refused, not a RecursionError."""
    await _order(http, gateway, "deep")
    deep = b'{"happened":' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    async with http.post(f"{gateway.admin_url}/_gateway/effects/1/resolve", data=deep, headers=ADMIN) as resp:
        assert resp.status == 400
        assert resp.content_type == "application/problem+json"


async def test_health_says_up_to_anyone_and_counts_only_to_who_may_read_them(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    """Without a valid token, health is {"status":"ok"}; the admin sees all counts, a tenant its own."""
    await _order(http, gateway, "h")
    for headers in ({}, {"Authorization": "adm-1"}, {"Effect-Gateway-Token": "wrong"}):
        assert await get(http, f"{gateway.admin_url}/_gateway/health", headers) == (200, {"status": "ok"})
    status, admin = await get(http, f"{gateway.admin_url}/_gateway/health")
    assert (status, admin["effects"]["completed"]) == (200, 1)
    status, tenant = await get(
        http, f"{gateway.admin_url}/_gateway/health", {"Effect-Gateway-Token": "tok-a"}
    )
    # a tenant's counts are its open effects (counting its completed ones would read the whole table)
    assert (status, tenant["needs_review"], "completed" in tenant["effects"]) == (200, 0, False)


async def test_the_admin_token_counts_only_as_a_bearer_token(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    """`Authorization: Bearer <token>` opens the audit; the bare token does not."""
    assert (await get(http, f"{gateway.admin_url}/_gateway/effects", {"Authorization": "adm-1"}))[0] == 401
    assert (await get(http, f"{gateway.admin_url}/_gateway/effects", {"Authorization": "bearer adm-1"}))[
        0
    ] == 200
    assert (await get(http, f"{gateway.admin_url}/_gateway/effects"))[0] == 200


async def test_the_resolve_route_takes_only_json(gateway: Gateway, http: aiohttp.ClientSession) -> None:
    """A text/plain post (what a page on another site may send without asking) resolves nothing."""
    async with http.post(
        f"{gateway.admin_url}/_gateway/effects/1/resolve",
        data='{"happened": false}',
        headers={"Content-Type": "text/plain", "Authorization": "Bearer adm-1"},
    ) as resp:
        assert resp.status == 400
        assert "application/json" in (await resp.json())["detail"]


@pytest.mark.parametrize(
    "target",
    [
        "/_gateway/audit/%C2%B2",
        "/_gateway/audit/%D9%A1",
        "/_gateway/audit?run=%00",
        "/_gateway/audit?key=%00",
        "/_gateway/audit?since=1h&before=999999",
    ],
)
async def test_odd_ids_and_filters_on_the_audit_page_are_a_page_not_a_500(
    gateway: Gateway, http: aiohttp.ClientSession, target: str
) -> None:
    """A non-ASCII digit as an effect id, a NUL in a filter, or a page after an effect the span does not
    hold, is a 404 or 400 page (the first were a 500; the last was nearly answered in JSON)."""
    await _order(http, gateway, "p")
    async with http.get(gateway.admin_url + target, headers=ADMIN) as resp:
        assert resp.status in (400, 404), await resp.text()
        assert resp.content_type == "text/html"


async def test_metrics_show_a_tenant_only_its_own_effects(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    """A tenant's token reads its own counts from /_gateway/metrics; it read every tenant's."""
    await _order(http, gateway, "m")
    async with http.get(
        f"{gateway.admin_url}/_gateway/metrics", headers={"Effect-Gateway-Token": "tok-a"}
    ) as resp:
        tenant = await resp.text()
    async with http.get(f"{gateway.admin_url}/_gateway/metrics", headers=ADMIN) as resp:
        admin = await resp.text()
    assert 'effect_gateway_effects{state="completed"} 1' in admin
    assert 'state="completed"' not in tenant
    assert 'effect_gateway_effects{state="needs_review"} 0' in tenant


@pytest.mark.parametrize("status", [100, 101, 103, 199])
def test_an_operator_cannot_give_an_informational_status_as_the_answer(status: int) -> None:
    """A 1xx is no final answer: replayed, it left the agent waiting for one (100) or a dead connection."""
    with pytest.raises(problems.BadRequest):
        parse_resolution({"happened": True, "response": {"status": status, "body": ""}})


def test_an_operator_cannot_give_a_body_that_is_not_text() -> None:
    """A lone surrogate in a resolution's body is a 400; it was a 500."""
    with pytest.raises(problems.BadRequest):
        parse_resolution({"happened": True, "response": {"status": 200, "body": "\ud800"}})


async def test_a_next_link_of_a_span_from_now_still_pages_once_the_span_moved_on(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    """The next link of since=2s followed three seconds later, when its cursor lies before the span
    that since=2s now means, answers 200 with the rest of the span the first page read (the effect
    that aged out meanwhile too); a cursor of no effect at all is a 400."""
    for key in ("s1", "s2", "s3"):
        await _order(http, gateway, key)
    status, page = await get(http, f"{gateway.admin_url}/_gateway/effects?since=2s&limit=2")
    assert status == 200
    assert len(page["effects"]) == 2
    await asyncio.sleep(3)
    status, later = await get(http, f"{gateway.admin_url}{page['next']}")
    assert status == 200, later
    assert [e["key"] for e in later["effects"]] == ["s1"]
    async with http.get(
        f"{gateway.admin_url}/_gateway/effects?since=1h&before=999999", headers=ADMIN
    ) as resp:
        assert resp.status == 400
        assert resp.content_type == "application/problem+json"
        assert "before=999999" in (await resp.json())["detail"]


async def test_every_problem_names_the_request_it_answers(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    """A problem carries the request's path and query as its instance, whichever part of the gateway
    refused it: a malformed key, a verdict on an effect that waits for none, a cursor of no effect, a
    path nothing serves."""
    await _order(http, gateway, "i1")
    agent = {"Idempotency-Key": "a b", "Effect-Gateway-Token": "tok-a"}
    cases = [
        ("POST", gateway.url, "/shop/orders?x=1", agent, {}),
        ("POST", gateway.admin_url, "/_gateway/effects/1/resolve", ADMIN, {"happened": False, "attempt": 1}),
        ("GET", gateway.admin_url, "/_gateway/effects?since=1h&before=999999", ADMIN, None),
        ("GET", gateway.admin_url, "/_gateway/nothing?y=2", ADMIN, None),
    ]
    for method, base, target, headers, body in cases:
        async with http.request(method, base + target, headers=headers, json=body) as resp:
            doc = await resp.json(content_type=None)
        assert resp.status in (400, 404, 409), (target, doc)
        assert doc["instance"] == target, doc
