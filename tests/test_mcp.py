"""MCP tool calls through the gateway: a real MCP server (the official SDK's) and the SDK's own client.

A tool call with side effects runs once per key whatever the retries, across sessions (an agent's
re-run opens a new one); its answer is replayed under the retry's own JSON-RPC id, in the framing the
agent takes. Read-only tools pass through unrecorded. What the gateway refuses is a JSON-RPC error that
the SDK raises as MCPError.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from gateway.audit_query import EffectFilter
from gateway.mcp import KEY_META
from tests.gateways import Gateway, gateway_server
from tests.mcp_shop import Shop, mcp_shop, order_call, raw_session


def shop_upstream(shop: Shop, **more: Any) -> dict[str, Any]:
    return {"shop": {"base_url": shop.url.removesuffix("/mcp"), "protocol": "mcp", **more}}


@asynccontextmanager
async def session(gw: Gateway, token: str | None = None) -> AsyncIterator[ClientSession]:
    """A new MCP session with the shop through the gateway (as the tenant of ``token``), initialized,
    its tools listed."""
    headers = {"Effect-Gateway-Token": token} if token else None
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(f"{gw.url}/shop/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as mcp_session,
    ):
        await mcp_session.initialize()
        await mcp_session.list_tools()
        yield mcp_session


async def place(
    gw: Gateway, key: str | None, quantity: int = 2, *, tool: str = "place_order", token: str | None = None
) -> Any:
    """A call of ``tool`` in a session of its own; the MCPError the SDK raises is returned, not raised
    (raised, it would leave the session's task group wrapped in an ExceptionGroup)."""
    arguments: dict[str, Any] = (
        {"item": "atta"} if tool == "slow_order" else {"item": "atta", "quantity": quantity}
    )
    async with session(gw, token) as s:
        meta = {KEY_META: key} if key is not None else None
        try:
            return await s.call_tool(tool, arguments, meta=meta)
        except MCPError as exc:
            return exc


async def test_a_tool_call_sent_again_in_a_new_session_runs_once_and_is_replayed(dsn: str) -> None:
    """Three calls of place_order under one key, each in a session of its own: one order, three answers
    with the same result, and one effect in the audit holding the tool's name, arguments and result."""
    async with mcp_shop() as shop, gateway_server(dsn, upstreams=shop_upstream(shop)) as gw:
        answers = [await place(gw, "run-7:order") for _ in range(3)]
        assert shop.runs["place_order"] == 1
        assert len(shop.orders) == 1
        assert {json.dumps(a.structured_content, sort_keys=True) for a in answers} == {
            json.dumps(shop.orders[0], sort_keys=True)
        }
        [effect] = await gw.runtime.store.find(EffectFilter(upstream="shop"))
        assert effect.state.value == "completed"
        full = await gw.runtime.store.get(effect.id)
        assert full is not None
        assert full.response is not None
        assert b'"place_order"' in (full.request_body or b"")
        assert b'"quantity":2' in (full.request_body or b"")
        assert full.response.body.startswith(b'{"result":')
        assert b"ord_1" in full.response.body


async def test_a_call_without_a_key_and_a_key_reused_with_other_arguments_are_refused(dsn: str) -> None:
    """Neither reaches the tool: the SDK raises the gateway's JSON-RPC error, which says why."""
    async with mcp_shop() as shop, gateway_server(dsn, upstreams=shop_upstream(shop)) as gw:
        keyless = await place(gw, None)
        assert isinstance(keyless, MCPError)
        assert "needs a key" in str(keyless)
        assert shop.runs == {}
        await place(gw, "run-8:order", quantity=2)
        reused = await place(gw, "run-8:order", quantity=5)
        assert isinstance(reused, MCPError)
        assert "different" in str(reused)
        assert reused.error.data["type"].endswith("key-reused")
        assert shop.runs["place_order"] == 1


async def test_a_twin_sent_while_the_call_runs_is_told_it_is_in_flight_then_gets_the_result(dsn: str) -> None:
    """A second call under the key while the first is still running: a JSON-RPC error saying the call
    is in flight (the HTTP 409 as its data), nothing run; once the first answers, the twin's retry is
    the first call's result."""
    async with mcp_shop() as shop, gateway_server(dsn, upstreams=shop_upstream(shop)) as gw:
        first = asyncio.create_task(place(gw, "run-9:slow", tool="slow_order"))
        await asyncio.wait_for(shop.started.wait(), 10)
        twin = await place(gw, "run-9:slow", tool="slow_order")
        assert isinstance(twin, MCPError)
        assert twin.error.data["status"] == 409
        shop.release.set()
        answered = await first
        retried = await place(gw, "run-9:slow", tool="slow_order")
        assert retried.structured_content == answered.structured_content == shop.orders[0]
        assert shop.runs["slow_order"] == 1


async def test_tenants_keep_their_keys_apart(dsn: str) -> None:
    """Two tenants call under the same key: each call runs once for its tenant, and each tenant's retry
    is its own result, never the other's."""
    tenants = {"a": {"token": "token-a-0123456789abcdef"}, "b": {"token": "token-b-0123456789abcdef"}}
    async with mcp_shop() as shop, gateway_server(dsn, upstreams=shop_upstream(shop), tenants=tenants) as gw:
        a = await place(gw, "run-1:order", quantity=1, token=tenants["a"]["token"])
        b = await place(gw, "run-1:order", quantity=7, token=tenants["b"]["token"])
        assert a.structured_content["quantity"] == 1
        assert b.structured_content["quantity"] == 7
        assert shop.runs["place_order"] == 2
        again = await place(gw, "run-1:order", quantity=7, token=tenants["b"]["token"])
        assert again.structured_content == b.structured_content
        assert shop.runs["place_order"] == 2


async def test_a_read_only_tool_passes_through_unrecorded(dsn: str) -> None:
    """find_orders, annotated read-only by the server, runs every time and leaves no effect; a tool the
    operator names read-only does too, without any annotation."""
    async with mcp_shop() as shop, gateway_server(dsn, upstreams=shop_upstream(shop)) as gw:
        async with session(gw) as s:
            for _ in range(2):
                found = await s.call_tool("find_orders", {"reference": "r"})
                assert found.structured_content == {"orders": []}
        assert shop.runs["find_orders"] == 2
        assert await gw.runtime.store.find(EffectFilter(upstream="shop")) == []
    async with (
        mcp_shop() as shop,
        gateway_server(dsn, upstreams=shop_upstream(shop, tools={"place_order": "read_only"})) as gw,
    ):
        await place(gw, None)
        await place(gw, None)
        assert shop.runs["place_order"] == 2
        assert await gw.runtime.store.find(EffectFilter(upstream="shop")) == []


@pytest.mark.parametrize("json_response", [True, False], ids=["server-json", "server-sse"])
async def test_a_replay_carries_the_retrys_own_id_in_the_framing_it_takes(
    dsn: str, json_response: bool
) -> None:
    """The first answer under id 7 as JSON; the replay, in a new session, under id "abc" as an event
    stream when the agent takes only that: the same result bytes, whichever framing the server used."""
    async with (
        mcp_shop(json_response=json_response) as shop,
        gateway_server(dsn, upstreams=shop_upstream(shop)) as gw,
        aiohttp.ClientSession() as http,
    ):
        url = f"{gw.url}/shop/mcp"
        headers = await raw_session(http, url)
        async with http.post(url, json=order_call(7, "r:1"), headers=headers) as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            first = await resp.read()
        assert first.startswith(b'{"jsonrpc":"2.0","id":7,"result":')
        headers = await raw_session(http, url)
        headers["Accept"] = "text/event-stream"
        async with http.post(url, json=order_call("abc", "r:1"), headers=headers) as resp:
            assert resp.content_type == "text/event-stream"
            assert resp.headers["Idempotent-Replayed"] == "true"
            replayed = await resp.read()
        result = first.removeprefix(b'{"jsonrpc":"2.0","id":7,')
        assert replayed == b'event: message\ndata: {"jsonrpc":"2.0","id":"abc",' + result + b"\n\n"
        assert shop.runs["place_order"] == 1


async def test_malformed_messages_get_a_json_rpc_error_and_reach_nothing(dsn: str) -> None:
    """Broken JSON, a duplicate key, a batch with a tool call, a tool call without a name: each a
    JSON-RPC error from the gateway, nothing run."""
    async with (
        mcp_shop() as shop,
        gateway_server(dsn, upstreams=shop_upstream(shop)) as gw,
        aiohttp.ClientSession() as http,
    ):
        url = f"{gw.url}/shop/mcp"
        headers = await raw_session(http, url)
        headers["Content-Type"] = "application/json"
        call = '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"place_order","arguments":{}}}'
        for body, code in [
            ("{", -32700),
            ('{"jsonrpc":"2.0","id":1,"id":2,"method":"tools/call","params":{"name":"place_order"}}', -32700),
            (f"[{call}]", -32600),
            ('{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{}}', -32602),
            # a tools/call without an id is a notification: no answer, so never recorded
            (
                '{"jsonrpc":"2.0","method":"tools/call","params":{"name":"place_order","arguments":{}}}',
                -32600,
            ),
        ]:
            async with http.post(url, data=body, headers=headers) as resp:
                assert resp.status == 200
                answer = await resp.json()
            assert answer["error"]["code"] == code, (body, answer)
        assert shop.runs == {}


async def test_the_stamped_argument_is_the_gateways_on_effects_and_free_on_read_only_tools(dsn: str) -> None:
    """With the key stamped into place_order's client_reference: an agent's place_order that sets it is
    refused under its own id, nothing run; find_orders, read-only, may be asked about any reference."""
    stamped = {"stamp": {"json_field": "params.arguments.client_reference"}}
    async with mcp_shop() as shop, gateway_server(dsn, upstreams=shop_upstream(shop, **stamped)) as gw:
        async with session(gw) as s:
            found = await s.call_tool("find_orders", {"reference": "mine", "client_reference": "x"})
            assert found.structured_content == {"orders": []}
            try:
                await s.call_tool(
                    "place_order",
                    {"item": "atta", "quantity": 1, "client_reference": "mine"},
                    meta={KEY_META: "run-2:1"},
                )
            except MCPError as exc:
                refused = exc
        assert refused.error.data["type"].endswith("/stamp-reserved")
        assert "place_order" not in shop.runs
        placed = await place(gw, "run-2:2")
        assert placed.structured_content["reference"].startswith("eg_"), "the gateway's key, stamped"


async def test_keys_made_up_per_call_are_refused_where_the_upstream_takes_step_keys_only(dsn: str) -> None:
    """refuse_random_keys holds for tool calls as for HTTP requests: a key ending in a UUID never runs."""
    async with (
        mcp_shop() as shop,
        gateway_server(dsn, upstreams=shop_upstream(shop, refuse_random_keys=True)) as gw,
    ):
        made_up = await place(gw, "call-6f1c2a5e-8b9d-4c3e-a1f2-0d9e8c7b6a55")
        assert isinstance(made_up, MCPError)
        assert made_up.error.data["type"].endswith("/key-random")
        assert shop.runs == {}


async def test_an_error_that_may_come_after_the_tool_ran_is_never_sent_again(dsn: str) -> None:
    """fussy_order places its order and then raises "invalid params", which the SDK passes on: the call
    is left in doubt, and its retries wait for an operator (no probe) instead of ordering again."""
    async with mcp_shop() as shop, gateway_server(dsn, upstreams=shop_upstream(shop)) as gw:
        answers = []
        for _ in range(3):
            async with session(gw) as s:
                try:
                    answers.append(await s.call_tool("fussy_order", {"item": "atta"}, meta={KEY_META: "r:9"}))
                except MCPError as exc:
                    answers.append(exc)
        assert shop.runs["fussy_order"] == 1
        [effect] = await gw.runtime.store.find(EffectFilter(upstream="shop"))
        assert effect.state.value == "needs_review"
        assert all(isinstance(a, MCPError) for a in answers)


async def test_an_event_stream_an_agent_left_holds_no_connection_a_tool_call_needs(dsn: str) -> None:
    """With one connection to the server allowed, an agent's event stream (a GET the server keeps open)
    takes none of the effects' connections, and once the agent hangs up the gateway lets it go, so a new
    session (whose messages pass through on that one connection) can start."""
    async with (
        mcp_shop() as shop,
        gateway_server(dsn, upstreams=shop_upstream(shop, max_connections=1)) as gw,
    ):
        url = f"{gw.url}/shop/mcp"
        async with aiohttp.ClientSession() as http:
            headers = await raw_session(http, url)
            stream = await http.get(url, headers={**headers, "Accept": "text/event-stream"})
            assert stream.status == 200
            # While the stream is open, on the stream's one connection: a tool call has its own.
            async with http.post(url, json=order_call(1, "run-4:1"), headers=headers) as resp:
                placed = await resp.read()
            assert b'"result"' in placed
        # The agent has gone: its stream is let go within a second or two, and a new session starts.
        await asyncio.sleep(2.5)
        assert not gw.runtime.streams
        async with aiohttp.ClientSession() as http:
            headers = await raw_session(http, url)
            async with http.post(url, json=order_call(1, "run-4:2"), headers=headers) as resp:
                assert b'"result"' in await resp.read()
        assert shop.runs["place_order"] == 2


async def test_when_the_server_cannot_be_reached_requests_get_json_rpc_errors(dsn: str) -> None:
    """initialize gets a JSON-RPC error under its own id (which a client raises), not an HTTP 502; a tool
    call gets one too, and stays safe to send again."""
    upstreams = {"shop": {"base_url": "http://127.0.0.1:9", "protocol": "mcp", "connect_timeout": "1s"}}
    async with gateway_server(dsn, upstreams=upstreams) as gw, aiohttp.ClientSession() as http:
        url = f"{gw.url}/shop/mcp"
        hello = {"jsonrpc": "2.0", "id": 3, "method": "initialize", "params": {}}
        async with http.post(url, json=hello, headers={"Accept": "application/json"}) as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert answer["id"] == 3
        assert answer["error"]["data"]["type"].endswith("/upstream-unreachable")
        async with http.post(url, json=order_call(4, "r:1"), headers={"Accept": "application/json"}) as resp:
            called = await resp.json()
        assert called["id"] == 4
        [effect] = await gw.runtime.store.find(EffectFilter(upstream="shop"))
        assert effect.state.value == "retryable"
