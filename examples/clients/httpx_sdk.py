"""An SDK-shaped httpx client through effect-gateway, the step's key from the journal: one order.

The OpenAI and Anthropic Python SDKs are built this way: a base URL, an httpx client the caller may
pass in, and retries under one key they make up per call (`stainless-python-retry-<uuid>`). Point the
base URL at the gateway's upstream and pass an httpx client over the journal's `KeyedTransport`: it
replaces the made-up key with the step's, so the SDK's retries and the agent's re-run share one key.

With `make serve` running, in another terminal:

    .venv/bin/python examples/clients/httpx_sdk.py --crash   # orders, then dies before saving the step
    .venv/bin/python examples/clients/httpx_sdk.py           # the re-run: the gateway replays the order
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid
from typing import Any

import httpx

from journal import KeyedTransport, StepContext, open_journal

GATEWAY = os.environ.get("EFFECT_GATEWAY_URL", "http://127.0.0.1:8787")
# Where the journal keeps runs and steps; unset: an embedded Postgres in .journal.
JOURNAL = os.environ.get("JOURNAL_DATABASE_URL")
CRASHED = 3


class Shop:
    """A small SDK for the demo shop, shaped like the OpenAI and Anthropic Python SDKs."""

    RETRY = frozenset({409, 429, 500, 502, 503, 504})

    def __init__(self, *, base_url: str, http_client: httpx.AsyncClient, max_retries: int = 2) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = http_client
        self.max_retries = max_retries

    async def create_order(self, items: list[str], run_id: str) -> httpx.Response:
        # As those SDKs do: one key made up per call, kept across the SDK's own retries of it.
        headers = {"Idempotency-Key": f"shop-python-retry-{uuid.uuid4()}"}
        for attempt in range(self.max_retries + 1):
            resp = await self._http.post(
                f"{self.base_url}/orders", json={"items": items, "run_id": run_id}, headers=headers
            )
            if resp.status_code not in self.RETRY or attempt == self.max_retries:
                break
            await asyncio.sleep(float(resp.headers.get("Retry-After", "0.5")))
        return resp.raise_for_status()


async def order_groceries(shop: Shop, ctx: StepContext) -> dict[str, Any]:
    resp = await shop.create_order(["atta", "toor dal"], ctx.run_id)
    return {"order": resp.json()["order_id"], "replayed": resp.headers.get("Idempotent-Replayed") == "true"}


async def main(run_id: str, crash: bool) -> None:
    def crash_after_the_order(point: str) -> None:
        if crash and point == "after-effect:1":
            print("crashed after the order, before the step was saved", flush=True)
            os._exit(CRASHED)  # as a SIGKILL would: nothing saved, nothing cleaned up

    async with (
        open_journal(JOURNAL) as journal,
        httpx.AsyncClient(transport=KeyedTransport(), timeout=30) as http,
    ):
        shop = Shop(base_url=f"{GATEWAY}/shop", http_client=http)
        run = await journal.run(run_id, on_point=crash_after_the_order)
        finished = run.status == "completed"
        placed = await run.step("order", lambda ctx: order_groceries(shop, ctx))
        await run.complete()
    how = "new"
    if finished:
        how = "saved in the journal: nothing sent"
    elif placed["replayed"]:
        how = "replayed by the gateway: it was placed before the crash"
    print(f"order {placed['order']} ({how})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_id", nargs="?", default="order-run-1", help="the agent's run (default: %(default)s)"
    )
    parser.add_argument("--crash", action="store_true", help="die after the order, before saving the step")
    args = parser.parse_args()
    asyncio.run(main(args.run_id, args.crash))
