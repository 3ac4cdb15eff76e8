"""The mail service: honours Idempotency-Key, and forgets a key after its TTL (default 24 h)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from agent_example.upstreams.keys import KeyMemory


def make_app(key_ttl: float = 24 * 3600) -> web.Application:
    sent: list[dict[str, Any]] = []
    keys = KeyMemory(key_ttl)

    async def send(request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key")
        if (known := keys.recall(key)) is not None:
            return web.json_response(known[1], status=known[0])
        doc = await request.json()
        message = {
            "message_id": f"msg_{len(sent) + 1}",
            "to": doc.get("to"),
            "subject": doc.get("subject"),
            "run_id": doc.get("run_id"),
        }
        sent.append(message)
        keys.remember(key, 202, message)
        return web.json_response(message, status=202)

    async def stats(request: web.Request) -> web.Response:
        run = request.query.get("run_id")
        return web.json_response({"messages": sum(1 for m in sent if run is None or m["run_id"] == run)})

    app = web.Application()
    app.router.add_post("/messages", send)
    app.router.add_get("/_stats", stats)
    return app
