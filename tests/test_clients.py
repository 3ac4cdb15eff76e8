"""The client examples (examples/clients/), the very files, through a real gateway with the example config.

Each runs as a user runs it, in a process of its own, against the demo upstreams on port 0 and the test
Postgres (the gateway's, and the journal's): killed after its effect and before its step is saved, then
run again, then once more after the run completed.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import sys
import tomllib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp
import pytest

from agent_example.upstreams import mail, payments, shop
from tests.database import effect_rows
from tests.gateways import Gateway, gateway_server
from tests.support import ROOT
from tests.upstreams import serving

EXAMPLES = ROOT / "examples" / "clients"
# What each example does, and to which of the example configuration's upstreams.
CASES = [
    ("httpx_sdk.py", "shop", "order"),
    ("stripe_charge.py", "payments", "charge"),
    ("aiohttp_mail.py", "mail", "email"),
]


@pytest.fixture
async def demo() -> AsyncIterator[dict[str, str]]:
    """The demo shop, mail and payments services, each on a port of its own."""
    async with AsyncExitStack() as stack:
        yield {
            name: await stack.enter_async_context(serving(app.make_app()))
            for name, app in (("shop", shop), ("mail", mail), ("payments", payments))
        }


@asynccontextmanager
async def example_gateway(dsn: str, demo: dict[str, str]) -> AsyncIterator[Gateway]:
    """The gateway with examples/gateway.toml as shipped, but for the upstreams' ports and its own."""
    config = tomllib.loads((ROOT / "examples" / "gateway.toml").read_text())
    del config["listen"], config["data_dir"]
    for name, url in demo.items():
        config["upstreams"][name]["base_url"] = url
    async with gateway_server(dsn, **config) as gateway:
        yield gateway


async def run_example(name: str, run_id: str, gateway: str, dsn: str, *flags: str) -> tuple[int, str]:
    """``python examples/clients/NAME RUN_ID [FLAGS]`` with the gateway's URL and the journal's database."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / name),
        run_id,
        *flags,
        env={**os.environ, "EFFECT_GATEWAY_URL": gateway, "JOURNAL_DATABASE_URL": dsn},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode in (0, 3), err.decode()[-3000:]
    return proc.returncode, out.decode()


async def effects_upstream_made(http: aiohttp.ClientSession, upstream: str, url: str, run_id: str) -> int:
    """How many orders, emails or charges the demo service made for the run, by its own count."""
    if upstream == "payments":
        query = {"query": f"metadata['run']:'{run_id}'"}
        async with http.get(f"{url}/v1/charges/search", params=query) as resp:
            return len((await resp.json())["data"])
    async with http.get(f"{url}/_stats", params={"run_id": run_id}) as resp:
        counts = await resp.json()
    return int(counts["orders" if upstream == "shop" else "messages"])


@pytest.mark.parametrize(("example", "upstream", "effect"), CASES, ids=[case[0] for case in CASES])
async def test_an_example_killed_after_its_effect_does_it_once_on_the_re_run(
    dsn: str, demo: dict[str, str], example: str, upstream: str, effect: str
) -> None:
    """Killed after the effect, before the step was saved: the re-run gets the gateway's replay, no second."""
    run_id = f"run-{secrets.token_hex(4)}"
    async with example_gateway(dsn, demo) as gw, aiohttp.ClientSession() as http:
        crashed, first = await run_example(example, run_id, gw.url, dsn, "--crash")
        made_before_the_re_run = await effects_upstream_made(http, upstream, demo[upstream], run_id)
        _, again = await run_example(example, run_id, gw.url, dsn)
        _, finished = await run_example(example, run_id, gw.url, dsn)
        made = await effects_upstream_made(http, upstream, demo[upstream], run_id)
    assert (crashed, made_before_the_re_run) == (3, 1)
    assert f"crashed after the {effect}, before the step was saved" in first
    assert re.search(rf"^{effect} \S+ \(replayed by the gateway: it was \w+ before the crash\)$", again, re.M)
    assert "(saved in the journal: nothing sent)" in finished
    assert made == 1
    (row,) = await effect_rows(dsn)
    assert (row["upstream"], row["key"], row["run_id"], row["step"]) == (upstream, f"{run_id}:1", run_id, "1")
    assert row["state"] == "completed"
