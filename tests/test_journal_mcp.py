"""The journal's MCP helper: a step's tool call carries the step's key, so a re-run after a crash between
the call and the step's checkpoint is answered from the gateway's record instead of running the tool
again. Through the real gateway, to the official SDK's server, with the SDK's client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

import journal.mcp
from gateway import mcp
from journal import Journal, StepContext, call_tool, tool_meta
from tests.gateways import gateway_server
from tests.mcp_shop import mcp_shop


def test_the_journal_puts_the_key_where_the_gateway_reads_it() -> None:
    """The journal names the _meta entry as the gateway does, without importing the gateway."""
    assert journal.mcp.KEY_META == mcp.KEY_META


def test_a_steps_distinct_calls_get_distinct_keys_and_a_repeat_its_own() -> None:
    """As the httpx client's: run:step, run:step:2 for a second distinct call, the same for a repeat."""
    from journal.journal import _current

    token = _current.set(StepContext("run-1", 3, "order"))
    try:
        first = tool_meta("place_order", {"item": "atta", "quantity": 2})
        other = tool_meta("place_order", {"item": "rice", "quantity": 1})
        again = tool_meta("place_order", {"quantity": 2, "item": "atta"})
    finally:
        _current.reset(token)
    assert first == again == {mcp.KEY_META: "run-1:3"}
    assert other == {mcp.KEY_META: "run-1:3:2"}
    assert tool_meta("place_order", {}) == {}  # outside a step: no key


@pytest.fixture
async def steps(postgres_dsn: str) -> AsyncIterator[Journal]:
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute("drop table if exists agent_steps, agent_runs")
    finally:
        await conn.close()
    kept = await Journal.connect(postgres_dsn)
    try:
        yield kept
    finally:
        await kept.close()


class Crash(Exception):
    """The agent dying after the tool ran and before its step was saved."""


@asynccontextmanager
async def shop_session(url: str) -> AsyncIterator[ClientSession]:
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def test_a_rerun_after_a_crash_does_not_order_twice(dsn: str, steps: Journal) -> None:
    """The step crashes after place_order ran; the re-run, in a new MCP session, gets the first call's
    result from the gateway and the shop has one order. Called directly, every call orders."""
    upstreams = {"shop": {"base_url": "", "protocol": "mcp"}}
    async with mcp_shop() as shop:
        upstreams["shop"]["base_url"] = shop.url.removesuffix("/mcp")
        async with gateway_server(dsn, upstreams=upstreams) as gw:
            results: list[Any] = []

            async def order(ctx: StepContext, crash: bool) -> Any:
                async with shop_session(f"{gw.url}/shop/mcp") as session:
                    result = await call_tool(session, "place_order", {"item": "atta", "quantity": 2})
                results.append(result.structured_content)
                if crash:
                    raise Crash
                return result.structured_content

            run = await steps.run("grocer-1")
            with pytest.raises(Crash):
                await run.step("order", lambda ctx: order(ctx, crash=True))
            rerun = await steps.run("grocer-1")
            saved = await rerun.step("order", lambda ctx: order(ctx, crash=False))
            assert len(shop.orders) == 1
            assert saved == results[0] == shop.orders[0]
        # The same two calls straight to the shop: the tool runs on each.
        for _ in range(2):
            async with shop_session(shop.url) as session:
                await call_tool(session, "place_order", {"item": "atta", "quantity": 2})
        assert len(shop.orders) == 3
