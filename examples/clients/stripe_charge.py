"""stripe-python through effect-gateway, the step's key from the journal: a charge is made once.

With `make serve` running, in another terminal:

    .venv/bin/python examples/clients/stripe_charge.py --crash   # charges, then dies before saving the step
    .venv/bin/python examples/clients/stripe_charge.py           # the re-run: the gateway replays the charge

stripe-python makes up a random Idempotency-Key for every POST. Its HTTP client is the hook that replaces
it with the step's key, so stripe-python's own retries and the agent's re-run share one key. The
secret key stays with the gateway (`inject_headers`); the agent's is a placeholder.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Mapping
from typing import Any

import stripe

from journal import StepContext, open_journal, step_headers

GATEWAY = os.environ.get("EFFECT_GATEWAY_URL", "http://127.0.0.1:8787")
# Where the journal keeps runs and steps; unset: an embedded Postgres in .journal.
JOURNAL = os.environ.get("JOURNAL_DATABASE_URL")
CRASHED = 3


class StepKeyedHTTPXClient(stripe.HTTPXClient):
    """stripe-python's httpx client, sending the journal step's key instead of the one stripe made up."""

    async def request_async(
        self, method: str, url: str, headers: Mapping[str, str], post_data: Any = None
    ) -> tuple[bytes, int, Mapping[str, str]]:
        body = post_data.encode() if isinstance(post_data, str) else post_data or b""
        keyed = step_headers(method, url, body)
        mine = {name.lower() for name in keyed}
        headers = {name: value for name, value in headers.items() if name.lower() not in mine} | keyed
        return await super().request_async(method, url, headers, post_data)


async def charge_groceries(client: stripe.StripeClient, ctx: StepContext) -> dict[str, Any]:
    charge = await client.v1.charges.create_async(
        {"amount": 4200, "currency": "inr", "source": "tok_visa", "metadata": {"run": ctx.run_id}}
    )
    replayed = charge.last_response is not None and charge.last_response.headers.get("Idempotent-Replayed")
    return {"charge": charge.id, "amount": charge.amount, "replayed": replayed == "true"}


async def main(run_id: str, crash: bool) -> None:
    client = stripe.StripeClient(
        "sk_test_held_by_the_gateway",
        base_addresses={"api": f"{GATEWAY}/payments"},
        http_client=StepKeyedHTTPXClient(),
    )

    def crash_after_the_charge(point: str) -> None:
        if crash and point == "after-effect:1":
            print("crashed after the charge, before the step was saved", flush=True)
            os._exit(CRASHED)  # as a SIGKILL would: nothing saved, nothing cleaned up

    async with open_journal(JOURNAL) as journal:
        run = await journal.run(run_id, on_point=crash_after_the_charge)
        finished = run.status == "completed"
        charged = await run.step("charge", lambda ctx: charge_groceries(client, ctx))
        await run.complete()
    how = "new"
    if finished:
        how = "saved in the journal: nothing sent"
    elif charged["replayed"]:
        how = "replayed by the gateway: it was made before the crash"
    print(f"charge {charged['charge']} ({how})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_id", nargs="?", default="charge-run-1", help="the agent's run (default: %(default)s)"
    )
    parser.add_argument("--crash", action="store_true", help="die after the charge, before saving the step")
    args = parser.parse_args()
    asyncio.run(main(args.run_id, args.crash))
