"""Whatever an agent POSTs to an MCP upstream, and whatever an MCP server answers, the gateway answers
clearly and never runs a tool with side effects unrecorded (hypothesis).

The readers of gateway.mcp are total: any JSON value is a tool call, a refusal or a message to pass on;
any answer is read or found to hold none; an event stream reads the same however it is cut. Through a
real gateway in front of the SDK's server, generated messages (odd ids, batches, missing or malformed
params, huge arguments, keys in odd places) never get a 5xx, every tool call gets a JSON-RPC answer under
its own id, and place_order runs only for a call that carries a key, at most once per key.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway import jsonbody, mcp
from tests.database import empty_effects
from tests.gateways import gateway_server
from tests.mcp_shop import Shop, mcp_shop

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
IDS = (
    st.integers()
    | st.text(max_size=12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.none()
    | st.booleans()
    | JSON
)
KEYS = st.none() | st.just("run-1:4") | st.text(min_size=1, max_size=30) | st.integers()
ARGUMENTS = (
    st.fixed_dictionaries({"item": st.text(max_size=10), "quantity": st.integers(-3, 3)})
    | st.just({"item": "x" * 200_000, "quantity": 1})  # a huge argument
    | JSON
)


@st.composite
def messages(draw: st.DrawFn) -> Any:
    """A JSON-RPC message as an agent (or an attacker) might POST it."""
    params: dict[str, Any] = {"name": draw(st.sampled_from(["place_order", "find_orders", "nope"]) | JSON)}
    if draw(st.booleans()):
        params["arguments"] = draw(ARGUMENTS)
    key = draw(KEYS)
    if key is not None:
        params["_meta"] = {mcp.KEY_META: key}
    message: dict[str, Any] = {
        "jsonrpc": "2.0",
        "method": draw(st.sampled_from(["tools/call", "tools/list", "ping"])),
    }
    if draw(st.integers(0, 9)) > 0:
        message["id"] = draw(IDS)
    message["params"] = params if draw(st.integers(0, 9)) > 0 else draw(JSON)
    return [message, draw(messages())] if draw(st.integers(0, 19)) == 0 else message


def as_the_gateway_reads(message: Any) -> Any:
    """``message`` as gateway.jsonbody parses the POSTed body (numbers as their text)."""
    return jsonbody.parse(json.dumps(message).encode()).value


@given(value=JSON | messages())
def test_every_json_value_is_a_call_a_refusal_or_a_message_to_pass_on(value: Any) -> None:
    read = mcp.message_of(as_the_gateway_reads(value))
    assert isinstance(read, mcp.ToolCall | mcp.Refused | mcp.PassThrough)
    if isinstance(read, mcp.ToolCall | mcp.Refused):
        json.loads(read.id_json)  # an id the answer can carry


@given(
    status=st.integers(100, 599),
    media=st.sampled_from(["application/json", "text/event-stream", "x"]),
    body=st.binary(max_size=300),
)
def test_any_answer_is_read_or_found_to_hold_none(status: int, media: str, body: bytes) -> None:
    answer = mcp.answer_of(status, media, body, "7")
    if answer is not None:
        assert answer.ran in ("yes", "no", "maybe")
        json.loads(answer.stored)


@given(events=st.lists(st.text(max_size=40), max_size=6), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_an_event_stream_reads_the_same_however_it_is_cut(events: list[str], cuts: list[int]) -> None:
    stream = "".join(f"event: message\r\ndata: {e}\r\n\r\n" for e in events).encode()
    whole = mcp.SseReader().feed(stream, final=True)
    reader, pieces, start = mcp.SseReader(), [], 0
    for cut in sorted(c for c in cuts if c <= len(stream)):
        pieces += reader.feed(stream[start:cut])
        start = cut
    pieces += reader.feed(stream[start:], final=True)
    assert pieces == whole


@dataclass
class World:
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    url: str = ""
    shop: Shop | None = None
    headers: dict[str, str] = field(default_factory=dict)
    keys_sent: set[str] = field(default_factory=set)


@pytest.fixture(scope="module")
def world(postgres_dsn: str) -> Iterator[World]:
    """The SDK's server and the gateway in a thread of their own, for hypothesis' synchronous examples."""
    w = World()
    thread = threading.Thread(target=w.loop.run_forever, daemon=True)
    thread.start()
    stack = AsyncExitStack()

    async def start() -> None:
        await empty_effects(postgres_dsn)
        w.shop = await stack.enter_async_context(mcp_shop())
        upstreams = {"shop": {"base_url": w.shop.url.removesuffix("/mcp"), "protocol": "mcp"}}
        gw = await stack.enter_async_context(gateway_server(postgres_dsn, upstreams=upstreams))
        w.url = f"{gw.url}/shop/mcp"

    asyncio.run_coroutine_threadsafe(start(), w.loop).result(60)
    accept = {"Accept": "application/json, text/event-stream"}
    opened = requests.post(
        w.url,
        data=mcp.initialize_message(),
        headers={**accept, "Content-Type": "application/json"},
        timeout=10,
    )
    w.headers = {
        **accept,
        "Mcp-Session-Id": opened.headers["Mcp-Session-Id"],
        "MCP-Protocol-Version": mcp.PROBE_PROTOCOL,
    }
    requests.post(
        w.url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=w.headers, timeout=10
    )
    try:
        yield w
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), w.loop).result(60)
        w.loop.call_soon_threadsafe(w.loop.stop)
        thread.join(10)


VALID = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "tools/call",
    "params": {
        "name": "place_order",
        "arguments": {"item": "atta", "quantity": 1},
        "_meta": {mcp.KEY_META: "k:1"},
    },
}


@settings(max_examples=max(20, settings.default.max_examples))
@example(message=VALID)
@example(message={**VALID, "id": "again"})
@given(message=messages())
def test_no_message_gets_a_server_error_or_runs_a_tool_unrecorded(world: World, message: Any) -> None:
    assert world.shop is not None
    before = world.shop.runs.get("place_order", 0)
    answered = requests.post(
        world.url,
        data=json.dumps(message),
        headers={**world.headers, "Content-Type": "application/json"},
        timeout=30,
    )
    assert answered.status_code < 500, answered.text
    ran = world.shop.runs.get("place_order", 0) - before
    call = mcp.message_of(as_the_gateway_reads(message))
    if isinstance(call, mcp.ToolCall) and call.name == "place_order":
        reply = answered.json()
        assert json.loads(json.dumps(reply["id"])) == json.loads(call.id_json)
        assert ("result" in reply) != ("error" in reply)
        if ran:
            assert call.key is not None, "a tool with side effects ran without a key"
            assert call.key not in world.keys_sent, "a key's tool ran twice"
            world.keys_sent.add(call.key)
    else:
        assert ran == 0


def test_the_examples_ran_the_tool(world: World) -> None:
    """The property above saw place_order run (its explicit example at least), so it checked something."""
    assert "k:1" in world.keys_sent
