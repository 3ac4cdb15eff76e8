"""Named operators: each signs in with a token of their own, sees one tenant's effects or every tenant's,
and every verdict they give through the admin API records their name."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import aiohttp
import pytest

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
        for tenant in ("acme", "globex"):
            record, _ = await gateway.runtime.store.claim(
                new_effect(f"{tenant}:1", tenant=tenant), timedelta(0)
            )
            assert record is not None
            assert await gateway.runtime.store.send_to_review(record, review(record), "test") is not None
        yield gateway


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
    with pytest.raises(ConfigError, match=r"operators\.asha\.tenant 'initech' is not a configured tenant"):
        load_settings(None, **unknown)
