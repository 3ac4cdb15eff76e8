"""Named operators: each signs in with a token of their own, sees one tenant's effects or every tenant's,
and every verdict they give through the admin API records their name."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from gateway.decision import review
from gateway.errors import ConfigError
from gateway.settings import load_settings
from tests.database import effect_rows
from tests.factories import new_effect
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream

SETTINGS: dict[str, Any] = {
    "tenants": {"acme": {"token": "tok-acme"}, "globex": {"token": "tok-globex"}},
    "admin": {"token": "adm-1"},
    "operators": {"asha": {"token": "op-asha"}, "bo": {"token": "op-bo", "tenant": "acme"}},
}


@pytest.fixture
async def gw(dsn: str, upstream: Upstream) -> AsyncIterator[Gateway]:
    """A gateway with two tenants, each with an effect waiting for review (acme's is 1, globex's 2)."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **SETTINGS) as gateway:
        await _two_waiting(gateway)
        yield gateway


async def _two_waiting(gateway: Gateway) -> None:
    """An effect waiting for review in each tenant: acme's is 1, globex's 2."""
    for tenant in ("acme", "globex"):
        new = new_effect(f"{tenant}:1", tenant=tenant)
        record, _ = await gateway.runtime.store.claim(new, timedelta(0))
        assert record is not None
        assert await gateway.runtime.store.send_to_review(record, review(record), "test") is not None


async def _resolve(
    http: aiohttp.ClientSession, gw: Gateway, effect_id: int, token: str | None, **headers: str
) -> int:
    sent = {"Content-Type": "application/json", **headers}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    body = json.dumps({"happened": False, "attempt": 1})
    async with http.post(
        f"{gw.admin_url}/_gateway/effects/{effect_id}/resolve", data=body, headers=sent
    ) as resp:
        return resp.status


async def _listed(http: aiohttp.ClientSession, gw: Gateway, token: str) -> list[str]:
    headers = {"Authorization": f"Bearer {token}"}
    async with http.get(f"{gw.admin_url}/_gateway/effects", headers=headers) as resp:
        assert resp.status == 200
        return sorted(e["tenant"] for e in json.loads(await resp.read())["effects"])


async def test_an_operators_verdict_records_their_name_and_the_admin_tokens_what_it_was_told(
    dsn: str, gw: Gateway, http: aiohttp.ClientSession
) -> None:
    """A verdict by an operator's token is recorded under their name, with the Effect-Gateway-Operator
    header beside it; one by the admin token, which automation shares, under what the header says."""
    assert await _resolve(http, gw, 1, "op-asha", **{"Effect-Gateway-Operator": "INC-7"}) == 200
    assert await _resolve(http, gw, 2, "adm-1", **{"Effect-Gateway-Operator": "nightly-bot"}) == 200
    by = {row["tenant"]: row["history"][-1]["by"] for row in await effect_rows(dsn)}
    assert by == {"acme": "asha (INC-7)", "globex": "admin: nightly-bot"}


async def test_an_operator_of_one_tenant_sees_and_resolves_its_effects_only(
    dsn: str, gw: Gateway, http: aiohttp.ClientSession
) -> None:
    """An operator limited to acme lists acme's effects alone and cannot resolve globex's (404, as if
    there were none); an operator of every tenant lists both; no token is a 401."""
    assert await _listed(http, gw, "op-bo") == ["acme"]
    assert await _listed(http, gw, "op-asha") == ["acme", "globex"]
    assert await _resolve(http, gw, 2, "op-bo") == 404
    assert await _resolve(http, gw, 2, None) == 401
    assert await _resolve(http, gw, 1, "op-bo") == 200
    states = {row["tenant"]: (row["state"], row["history"][-1].get("by")) for row in await effect_rows(dsn)}
    assert states == {"acme": ("retryable", "bo"), "globex": ("needs_review", None)}


def test_operators_tokens_and_tenants_are_checked_at_load() -> None:
    """An operator's token shared with anyone, or a tenant that is not configured, is a bad setting."""
    shared = {**SETTINGS, "operators": {"asha": {"token": "tok-acme"}}}
    with pytest.raises(ConfigError, match="tenant acme and operator asha have the same token"):
        load_settings(None, **shared)
    unknown = {**SETTINGS, "operators": {"asha": {"token": "op-asha", "tenant": "initech"}}}
    with pytest.raises(ConfigError, match=r"operators\.asha\.tenant: 'initech' is not a configured tenant"):
        load_settings(None, **unknown)


async def test_a_trusted_proxy_names_the_operator_and_no_one_else_may(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """From a trusted proxy's address, the header names a configured operator, whose verdicts carry
    their name and scope; a name not configured, the header twice, or from any other address, is a 401."""
    shop = {"shop": {"base_url": upstream.url}}
    proxied = {**SETTINGS, "admin": {**SETTINGS["admin"], "operator_header": "X-Forwarded-User"}}
    trusted = {"admin": {**proxied["admin"], "trusted_proxies": ["127.0.0.0/8"]}}
    elsewhere = {"admin": {**proxied["admin"], "trusted_proxies": ["10.0.0.0/8"]}}

    async def resolve_as(gw: Gateway, effect_id: int, user: str) -> int:
        body = json.dumps({"happened": False, "attempt": 1})
        headers = {"Content-Type": "application/json", "X-Forwarded-User": user}
        async with http.post(
            f"{gw.admin_url}/_gateway/effects/{effect_id}/resolve", data=body, headers=headers
        ) as resp:
            return resp.status

    async with gateway_server(dsn, upstreams=shop, **{**proxied, **elsewhere}) as gw:
        await _two_waiting(gw)
        assert await resolve_as(gw, 1, "asha") == 401  # not from a trusted proxy: the header means nothing
    async with gateway_server(dsn, upstreams=shop, **{**proxied, **trusted}) as gw:
        with caplog.at_level(logging.WARNING, logger="effect_gateway"):
            assert await resolve_as(gw, 1, "mallory") == 401
        body = json.dumps({"happened": False, "attempt": 1})
        twice = [
            ("Content-Type", "application/json"),
            ("X-Forwarded-User", "asha"),
            ("X-Forwarded-User", "bo"),
        ]
        url = f"{gw.admin_url}/_gateway/effects/1/resolve"
        async with http.post(url, data=body, headers=CIMultiDict(twice)) as resp:
            assert resp.status == 401  # two names: which did the proxy mean? Neither.
        assert await resolve_as(gw, 2, "bo") == 404  # bo sees acme's effects only
        assert await resolve_as(gw, 1, "bo") == 200
    assert any("the proxy named 'mallory'" in r.getMessage() for r in caplog.records)
    by = {row["tenant"]: row["history"][-1].get("by") for row in await effect_rows(dsn)}
    assert by == {"acme": "bo", "globex": None}


def test_an_operator_header_without_trusted_proxies_is_a_bad_setting() -> None:
    """Believed from anyone, the header would let anyone name themselves an operator."""
    with pytest.raises(ConfigError, match="operator_header needs trusted_proxies"):
        load_settings(
            None, **{**SETTINGS, "admin": {"token": "adm-1", "operator_header": "X-Forwarded-User"}}
        )


async def test_an_operator_of_some_tenants_sees_and_resolves_theirs_alone_page_by_page(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An operator given two tenants of three lists both tenants' effects, newest first, a page at a
    time; counts theirs; and finds, and may resolve, no effect of the third (404)."""
    three = {
        "tenants": {t: {"token": f"tok-{t}"} for t in ("acme", "globex", "initech")},
        "operators": {"cy": {"token": "op-cy", "tenants": ["acme", "globex"]}},
    }
    headers = {"Authorization": "Bearer op-cy"}
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **three) as gateway:
        for n, tenant in enumerate(("acme", "initech", "globex", "acme", "initech")):
            new = new_effect(f"{tenant}:{n}", tenant=tenant)
            record, _ = await gateway.runtime.store.claim(new, timedelta(0))
            assert record is not None
            assert await gateway.runtime.store.send_to_review(record, review(record), "test") is not None
        seen, url = [], f"{gateway.admin_url}/_gateway/effects?limit=1"
        for _ in range(10):  # a page of one effect each: the three of acme and globex, then no more
            async with http.get(url, headers=headers) as resp:
                assert resp.status == 200
                page = json.loads(await resp.read())
            seen += [(e["id"], e["tenant"]) for e in page["effects"]]
            if page["next"] is None:
                break
            url = gateway.admin_url + page["next"]
        async with http.get(f"{gateway.admin_url}/_gateway/health", headers=headers) as resp:
            health = json.loads(await resp.read())
        assert await _resolve(http, gateway, 2, "op-cy") == 404  # initech's
        async with http.get(f"{gateway.admin_url}/_gateway/effects/5", headers=headers) as resp:
            assert resp.status == 404
        assert await _resolve(http, gateway, 3, "op-cy") == 200
    assert seen == [(4, "acme"), (3, "globex"), (1, "acme")]
    assert health["needs_review"] == 3
    by = {row["id"]: row["history"][-1].get("by") for row in await effect_rows(dsn)}
    assert by == {1: None, 2: None, 3: "cy", 4: None, 5: None}


def test_an_operators_tenants_are_one_way_or_the_other_and_configured() -> None:
    """tenant and tenants together, an empty list, or a tenant not configured: a bad setting each."""
    base = {**SETTINGS, "operators": {"cy": {"token": "op-cy", "tenants": ["acme", "initech"]}}}
    with pytest.raises(ConfigError, match=r"operators\.cy\.tenants: 'initech' is not a configured tenant"):
        load_settings(None, **base)
    both = {**SETTINGS, "operators": {"cy": {"token": "op-cy", "tenant": "acme", "tenants": ["acme"]}}}
    with pytest.raises(ConfigError, match=r"give tenant \(one\) or tenants \(a list\), not both"):
        load_settings(None, **both)
    empty = {**SETTINGS, "operators": {"cy": {"token": "op-cy", "tenants": []}}}
    with pytest.raises(ConfigError, match="tenants is empty"):
        load_settings(None, **empty)


async def test_a_caller_without_a_token_is_refused_before_the_query_is_read(
    gw: Gateway, http: aiohttp.ClientSession
) -> None:
    """A query the list would refuse, sent with no token: 401, saying nothing of what was wrong with it."""
    async with http.get(f"{gw.admin_url}/_gateway/effects?since=garbage&state=bogus") as resp:
        assert resp.status == 401
        assert "since" not in json.loads(await resp.read())["detail"]
