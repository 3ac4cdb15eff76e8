"""The grocery agent of six steps, in the five designs of the crash matrix.

plan (model), pantry, choose (model), order (shop), email (mail), summary (model). The design decides
what a step remembers and how its side effect is made safe:

- ``naive``: no journal, no keys; a re-run does everything again.
- ``journal``: the journal, no keys (the article's "journal only").
- ``journal+keys``: the journal, and orders in the agent's own ``orders`` table with a unique key
  (the article's third design); the email carries a key the mail service honours.
- ``journal+keys-http``: the same keys sent straight to the HTTP shop, which ignores them.
- ``journal+gateway``: the order and the email go through effect-gateway.
- ``mcp-naive`` and ``mcp-journal+gateway``: the same two with the shop as an MCP server, the order a
  ``place_order`` tool call (straight to the server, or through the gateway with the step's key).

``python -m agent_example.agent --design D --run-id R --dsn DSN --shop URL --mail URL --gateway URL
[--crash after-effect:4]`` runs it once; ``--crash`` SIGKILLs the process at that point.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx

from agent_example import model
from journal import Journal, StepContext, keyed_client

DESIGNS = (
    "naive",
    "journal",
    "journal+keys",
    "journal+keys-http",
    "journal+gateway",
    "mcp-naive",
    "mcp-journal+gateway",
)
LOW = ["atta", "toor dal", "paneer", "spinach"]

ORDERS = """
create table if not exists orders (
    id               bigint generated always as identity primary key,
    run_id           text not null,
    items            jsonb not null,
    idempotency_key  text unique
)
"""


@dataclass(frozen=True)
class Endpoints:
    shop: str
    mail: str
    gateway: str
    mcp_shop: str = ""


class Stopped(Exception):
    """What stops a run short of its end, said in one line (the re-run picks it up)."""


async def place_order_over_mcp(url: str, items: list[str], run_id: str, keyed: bool) -> dict[str, Any]:
    """The order as a place_order tool call in a new MCP session (a re-run opens a new one); ``keyed``:
    through the gateway, with the step's key in the call's _meta (journal.call_tool), for the gateway to
    recognise a re-run, and ready to wait for a call of the key still under way (a dead gateway's)."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared.exceptions import MCPError

    from journal import call_tool

    arguments = {"items": items, "run_id": run_id}
    headers = {"Prefer": "wait=30"} if keyed else None
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        try:
            if keyed:
                result = await call_tool(session, "place_order", arguments)
            else:
                result = await session.call_tool("place_order", arguments)
        except MCPError as exc:
            raise Stopped(f"place_order: {exc}") from None
    if result.is_error or not result.structured_content:
        raise Stopped(f"place_order answered an error: {result.content}")
    return {"orderId": result.structured_content["order_id"]}


class NaiveRun:
    """The article's naive mode: the same step() shape, with nothing saved and nothing skipped."""

    def __init__(self, run_id: str, on_point: Callable[[str], None]) -> None:
        self.id = run_id
        self._next = 1
        self._on_point = on_point

    async def step(self, name: str, fn: Callable[[StepContext], Any]) -> Any:
        n = self._next
        self._next += 1
        result = fn(StepContext(self.id, n, name))
        if inspect.isawaitable(result):
            result = await result
        self._on_point(f"after-effect:{n}")
        self._on_point(f"after-checkpoint:{n}")
        return result

    async def complete(self) -> None:
        return None


def crash_at(point: str | None) -> Callable[[str], None]:
    def on_point(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    return on_point


async def place_order_in_db(
    db: asyncpg.Pool, run_id: str, items: list[str], key: str | None
) -> dict[str, Any]:
    """The article's placeOrder: a unique key makes the insert happen at most once."""
    order_id = await db.fetchval(
        "insert into orders (run_id, items, idempotency_key) values ($1, $2::jsonb, $3) "
        "on conflict (idempotency_key) do nothing returning id",
        run_id,
        json.dumps(items),
        key,
    )
    if order_id is None:
        order_id = await db.fetchval("select id from orders where idempotency_key = $1", key)
    return {"orderId": f"db_{order_id}"}


async def run_agent(design: str, run_id: str, dsn: str, at: Endpoints, crash: str | None) -> dict[str, Any]:
    db = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    journal = await Journal.connect(dsn)
    try:
        await db.execute(ORDERS)
        await db.execute(model.SCHEMA)
        run: Any = (
            NaiveRun(run_id, crash_at(crash))
            if design in ("naive", "mcp-naive")
            else await journal.run(run_id, on_point=crash_at(crash))
        )
        keyed = design not in ("naive", "journal", "mcp-naive")
        gateway = design in ("journal+gateway", "mcp-journal+gateway")
        # The keyed client stamps {run}:{step} on every unsafe request; the plain one sends no key.
        async with keyed_client(timeout=30) as with_keys, httpx.AsyncClient(timeout=30) as without_keys:
            http = with_keys if keyed else without_keys
            shop_url = f"{at.gateway}/shop" if gateway else at.shop
            mail_url = f"{at.gateway}/mail" if gateway else at.mail
            # Through the gateway, a retry waits for an earlier request with the same key that is still
            # settling, instead of a 409.
            wait = {"Prefer": "wait=30"} if gateway else {}

            async def order(ctx: StepContext) -> dict[str, Any]:
                if design.startswith("mcp-"):
                    url = f"{at.gateway}/mcp-shop/mcp" if gateway else f"{at.mcp_shop}/mcp"
                    return await place_order_over_mcp(url, pantry["low"], run_id, keyed)
                if design in ("naive", "journal", "journal+keys"):
                    return await place_order_in_db(db, run_id, pantry["low"], ctx.key if keyed else None)
                resp = await http.post(
                    f"{shop_url}/orders", json={"items": pantry["low"], "run_id": run_id}, headers=wait
                )
                resp.raise_for_status()
                return {"orderId": resp.json()["order_id"]}

            async def email(ctx: StepContext) -> dict[str, Any]:
                body = {
                    "to": "me@example.com",
                    "subject": f"Order {placed['orderId']} placed",
                    "run_id": run_id,
                }
                resp = await http.post(f"{mail_url}/messages", json=body, headers=wait)
                resp.raise_for_status()
                return {"messageId": resp.json()["message_id"]}

            await run.step("plan", lambda ctx: model.model(db, run_id, ctx.step, "plan this week's order"))
            pantry = await run.step("pantry", lambda ctx: {"low": LOW})
            await run.step(
                "choose", lambda ctx: model.model(db, run_id, ctx.step, f"order for {pantry['low']}")
            )
            placed = await run.step("order", order)
            sent = await run.step("email", email)
            summary = await run.step(
                "summary", lambda ctx: model.model(db, run_id, ctx.step, "summarise for the user")
            )
        await run.complete()
        return {"order": placed, "email": sent, "summary": summary}
    finally:
        await journal.close()
        await db.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the grocery agent once.")
    parser.add_argument("--design", choices=DESIGNS, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--shop", required=True)
    parser.add_argument("--mail", required=True)
    parser.add_argument("--gateway", default="")
    parser.add_argument("--mcp-shop", default="", help="the shop as an MCP server (the mcp-* designs)")
    parser.add_argument("--crash", help="after-effect:N or after-checkpoint:N")
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(
            run_agent(
                args.design,
                args.run_id,
                args.dsn,
                Endpoints(args.shop, args.mail, args.gateway, args.mcp_shop),
                args.crash,
            )
        )
    except (httpx.HTTPError, OSError, Stopped) as exc:
        print(f"agent: run {args.run_id} stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
