"""A shop as an MCP server (the official SDK's), on loopback port 0, for the tests of MCP tool calls.

``place_order`` has side effects and no idempotency of its own: every call it runs places an order.
``fussy_order`` places its order and then raises "invalid params".
``slow_order`` places its order and then waits to answer until the test releases it.
``find_orders`` is read-only (annotated so) and lists the orders placed with a reference.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_PARAMS, ToolAnnotations

from gateway.mcp import KEY_META, PROBE_PROTOCOL, initialize_message


@dataclass
class Shop:
    url: str
    orders: list[dict[str, Any]] = field(default_factory=list)
    # Calls of each tool the server ran (a read-only one included).
    runs: dict[str, int] = field(default_factory=dict)
    # slow_order sets started once it has placed its order, and answers once release is set.
    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def _server(shop: Shop) -> MCPServer:
    server = MCPServer("shop")

    @server.tool()
    def place_order(item: str, quantity: int, client_reference: str = "") -> dict[str, Any]:
        """Place an order (a side effect, done again on every call)."""
        shop.runs["place_order"] = shop.runs.get("place_order", 0) + 1
        order = {
            "id": f"ord_{len(shop.orders) + 1}",
            "item": item,
            "quantity": quantity,
            "reference": client_reference,
        }
        shop.orders.append(order)
        return order

    @server.tool()
    async def slow_order(item: str) -> dict[str, Any]:
        """Place an order at once, and answer only once the test releases it."""
        shop.runs["slow_order"] = shop.runs.get("slow_order", 0) + 1
        order = {"id": f"ord_{len(shop.orders) + 1}", "item": item, "quantity": 1, "reference": ""}
        shop.orders.append(order)
        shop.started.set()
        await shop.release.wait()
        return order

    @server.tool()
    def fussy_order(item: str) -> dict[str, Any]:
        """Place an order, then raise "invalid params" (which the SDK passes on as the call's error)."""
        shop.runs["fussy_order"] = shop.runs.get("fussy_order", 0) + 1
        shop.orders.append(
            {"id": f"ord_{len(shop.orders) + 1}", "item": item, "quantity": 1, "reference": ""}
        )
        raise MCPError(INVALID_PARAMS, f"{item!r} is not sold by the kilo")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def find_orders(reference: str = "", client_reference: str = "") -> dict[str, Any]:
        """The orders placed with ``reference`` (``client_reference`` is another name for it)."""
        shop.runs["find_orders"] = shop.runs.get("find_orders", 0) + 1
        wanted = reference or client_reference
        return {"orders": [o for o in shop.orders if o["reference"] == wanted]}

    return server


@contextlib.asynccontextmanager
async def mcp_shop(*, json_response: bool = False) -> AsyncIterator[Shop]:
    """The shop served at http://127.0.0.1:<port>/mcp, answering in JSON or in event streams."""
    shop = Shop("")
    app = _server(shop).streamable_http_app(json_response=json_response)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        shop.url = f"http://127.0.0.1:{port}/mcp"
        yield shop
    finally:
        server.should_exit = True
        await task


async def raw_session(http: aiohttp.ClientSession, url: str) -> dict[str, str]:
    """An MCP session opened by hand at ``url`` (initialize, then initialized): the headers its later
    messages carry."""
    accept = {"Accept": "application/json, text/event-stream"}
    hello = {**accept, "Content-Type": "application/json"}
    async with http.post(url, data=initialize_message(), headers=hello) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        headers = {
            **accept,
            "Mcp-Session-Id": resp.headers["Mcp-Session-Id"],
            "MCP-Protocol-Version": PROBE_PROTOCOL,
        }
    async with http.post(
        url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=headers
    ) as resp:
        assert resp.status == 202
    return headers


def order_call(call_id: int | str, key: str, quantity: int = 1) -> dict[str, Any]:
    """A place_order tools/call as an MCP client sends it, its key in _meta."""
    return {
        "jsonrpc": "2.0",
        "id": call_id,
        "method": "tools/call",
        "params": {
            "name": "place_order",
            "arguments": {"item": "atta", "quantity": quantity},
            "_meta": {KEY_META: key},
        },
    }
