"""The shop as an MCP server (the official SDK's): a ``place_order`` tool that places every order it is
called with, with no idempotency of its own, as the MCP servers of today have none.

``find_orders`` is read-only and lists the orders placed with a ``client_reference``; ``GET /_stats``
counts a run's orders for the crash matrix.
"""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse


def make_app() -> Starlette:
    server = MCPServer("shop")
    orders: list[dict[str, Any]] = []

    @server.tool()
    def place_order(items: list[str], run_id: str = "", client_reference: str = "") -> dict[str, Any]:
        """Place an order for ``items``; every call places one."""
        order = {
            "order_id": f"ord_{len(orders) + 1}",
            "items": items,
            "run_id": run_id,
            # Kept as sent: the gateway can stamp its key here for a search to find the order later.
            "client_reference": client_reference,
            "status": "placed",
        }
        orders.append(order)
        return order

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def find_orders(client_reference: str) -> dict[str, Any]:
        """The orders placed with ``client_reference``."""
        return {"orders": [o for o in orders if o["client_reference"] == client_reference]}

    async def stats(request: Request) -> JSONResponse:
        run = request.query_params.get("run_id")
        return JSONResponse({"orders": sum(1 for o in orders if run is None or o["run_id"] == run)})

    server.custom_route("/_stats", methods=["GET"])(stats)

    return server.streamable_http_app()
