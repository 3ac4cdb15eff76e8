"""The shop: places every order it is sent. It has no idempotency keys, like most APIs."""

from __future__ import annotations

from typing import Any

from aiohttp import web


def make_app() -> web.Application:
    orders: list[dict[str, Any]] = []

    async def place(request: web.Request) -> web.Response:
        doc = await request.json()
        if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
            return web.json_response({"error": 'send {"items": [...]}'}, status=400)
        order = {
            "order_id": f"ord_{len(orders) + 1}",
            "items": doc["items"],
            "run_id": doc.get("run_id"),
            # Kept as sent: the gateway stamps its key here so that a probe can find the order later.
            "client_reference": doc.get("client_reference"),
            "status": "placed",
        }
        orders.append(order)
        return web.json_response(order, status=201)

    async def search(request: web.Request) -> web.Response:
        found = [
            o
            for o in orders
            if all(
                o.get(name) == request.query[name]
                for name in ("client_reference", "run_id")
                if name in request.query
            )
        ]
        return web.json_response({"items": found})

    async def stats(request: web.Request) -> web.Response:
        run = request.query.get("run_id")
        return web.json_response({"orders": sum(1 for o in orders if run is None or o["run_id"] == run)})

    app = web.Application()
    app.router.add_post("/orders", place)
    app.router.add_get("/orders", search)
    app.router.add_get("/_stats", stats)
    return app
