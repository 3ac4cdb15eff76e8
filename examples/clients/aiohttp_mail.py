"""Plain aiohttp through effect-gateway, the step's key from the journal: one email, sent once.

The email carries the time it was written (`sent_at`), which is new on every run of the step: the
example configuration has `fingerprint_ignore = ["sent_at"]` for mail, so the re-run is still the same
request and is replayed, not refused as a key reused with another body. The re-run's own `sent_at` is
never sent: the replay is the first run's answer.

With `make serve` running, in another terminal:

    .venv/bin/python examples/clients/aiohttp_mail.py --crash   # sends, then dies before saving the step
    .venv/bin/python examples/clients/aiohttp_mail.py           # the re-run: the gateway replays the email
"""

from __future__ import annotations

import argparse
import asyncio
import os
from datetime import UTC, datetime
from typing import Any

import aiohttp

from journal import StepContext, open_journal

GATEWAY = os.environ.get("EFFECT_GATEWAY_URL", "http://127.0.0.1:8787")
# Where the journal keeps runs and steps; unset: an embedded Postgres in .journal.
JOURNAL = os.environ.get("JOURNAL_DATABASE_URL")
CRASHED = 3


async def send_receipt(http: aiohttp.ClientSession, ctx: StepContext) -> dict[str, Any]:
    email = {
        "to": "me@example.com",
        "subject": "Your groceries are on their way",
        "run_id": ctx.run_id,
        "sent_at": datetime.now(UTC).isoformat(),
    }
    # The step's key, the same on every run of this step; the run and step go to the gateway's audit.
    headers = {
        "Idempotency-Key": ctx.key,
        "Effect-Gateway-Run": ctx.run_id,
        "Effect-Gateway-Step": str(ctx.step),
    }
    async with http.post(f"{GATEWAY}/mail/messages", json=email, headers=headers) as resp:
        resp.raise_for_status()
        sent = await resp.json()
        return {"message": sent["message_id"], "replayed": resp.headers.get("Idempotent-Replayed") == "true"}


async def main(run_id: str, crash: bool) -> None:
    def crash_after_the_email(point: str) -> None:
        if crash and point == "after-effect:1":
            print("crashed after the email, before the step was saved", flush=True)
            os._exit(CRASHED)  # as a SIGKILL would: nothing saved, nothing cleaned up

    async with open_journal(JOURNAL) as journal, aiohttp.ClientSession() as http:
        run = await journal.run(run_id, on_point=crash_after_the_email)
        finished = run.status == "completed"
        sent = await run.step("email", lambda ctx: send_receipt(http, ctx))
        await run.complete()
    how = "new"
    if finished:
        how = "saved in the journal: nothing sent"
    elif sent["replayed"]:
        how = "replayed by the gateway: it was sent before the crash"
    print(f"email {sent['message']} ({how})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_id", nargs="?", default="email-run-1", help="the agent's run (default: %(default)s)"
    )
    parser.add_argument("--crash", action="store_true", help="die after the email, before saving the step")
    args = parser.parse_args()
    asyncio.run(main(args.run_id, args.crash))
