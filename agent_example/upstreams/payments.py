"""A Stripe-like payments API: form-encoded charges, native keys with a TTL, search by metadata."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from agent_example.upstreams.keys import KeyMemory

_METADATA = re.compile(r"^metadata\[(\w+)\]$")
_QUERY = re.compile(r"^metadata\['(\w+)'\]:'([^']*)'$")


def make_app(key_ttl: float = 24 * 3600) -> web.Application:
    charges: list[dict[str, Any]] = []
    keys = KeyMemory(key_ttl)

    async def create(request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key")
        if (known := keys.recall(key)) is not None:
            return web.json_response(known[1], status=known[0], headers={"Idempotent-Replayed": "true"})
        form = await request.post()
        amount = str(form.get("amount", ""))
        if not amount.isdigit():
            error = {"error": {"type": "invalid_request_error", "message": "amount must be an integer"}}
            keys.remember(key, 400, error)
            return web.json_response(error, status=400)
        metadata = {m.group(1): str(v) for k, v in form.items() if (m := _METADATA.match(k))}
        charge = {
            "id": f"ch_{len(charges) + 1}",
            "object": "charge",
            "amount": int(amount),
            "currency": str(form.get("currency", "usd")),
            "metadata": metadata,
            "status": "succeeded",
        }
        charges.append(charge)
        keys.remember(key, 200, charge)
        return web.json_response(charge)

    async def search(request: web.Request) -> web.Response:
        match = _QUERY.match(request.query.get("query", ""))
        if match is None:
            return web.json_response({"error": {"message": "query must be metadata['k']:'v'"}}, status=400)
        name, value = match.groups()
        found = [c for c in charges if c["metadata"].get(name) == value]
        return web.json_response({"object": "search_result", "data": found})

    app = web.Application()
    app.router.add_post("/v1/charges", create)
    app.router.add_get("/v1/charges/search", search)
    return app
