"""Crash tests of MCP tool calls: the gateway is SIGKILLed at each named fault point while a tool call is
in flight, restarted, and the agent calls again under the same key in a new MCP session. The tool runs
at most once; where nothing can tell whether it ran, the gateway says so and waits for an operator."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.database import effect_rows, runtime_url
from tests.gateways import start_gateway_process
from tests.mcp_shop import mcp_shop, order_call, raw_session
from tests.support import PORT_ZERO

pytestmark = pytest.mark.crash

# The gateway stamps its key into place_order's arguments, and find_orders lists the orders of a
# reference: the probe's "not found" is trusted at once (the shop lists an order as it places it).
PROBED = (
    'stamp = { json_field = "params.arguments.client_reference" }\n'
    'probe = { path = "/mcp", tool = "find_orders", arguments = { reference = "{key}" }, '
    'found = "structuredContent.orders.0", tools = ["place_order"], lag = "0s" }\n'
)
KINDS = {"neither": "", "stamp + probe": PROBED}

# (kind, point) -> (runs of the tool before the retry, the retry's answer, the runs after it, the state)
EXPECTED = {
    # The claim was written and the call may or may not have left: with no probe, an operator decides.
    ("neither", "after-claim"): (0, "needs_review", 0, "needs_review"),
    # The tool ran and its answer was never recorded: the retry must not run it again.
    ("neither", "after-upstream"): (1, "needs_review", 1, "needs_review"),
    # The answer was recorded: the retry gets it.
    ("neither", "after-record"): (1, "result", 1, "completed"),
    # The probe finds no order: the call never reached the tool, and is made now.
    ("stamp + probe", "after-claim"): (0, "result", 1, "completed"),
    # The probe finds the order the tool placed: it is the answer, and the tool is not called again.
    ("stamp + probe", "after-upstream"): (1, "result", 1, "completed"),
    ("stamp + probe", "after-record"): (1, "result", 1, "completed"),
}


async def _call(http: aiohttp.ClientSession, url: str, call_id: int, wait: int = 0) -> Any:
    """The call in a new session of its own; with ``wait``, ready to wait that long for a call of the key
    still under way (the dead gateway's, until its lease runs out)."""
    headers = await raw_session(http, url)
    if wait:
        headers["Prefer"] = f"wait={wait}"
    async with http.post(url, json=order_call(call_id, "run-3:2", quantity=2), headers=headers) as resp:
        return await resp.json()


@pytest.mark.parametrize("point", ["after-claim", "after-upstream", "after-record"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_gateway_killed_during_a_tool_call_never_runs_it_twice(
    dsn: str, tmp_path: Path, kind: str, point: str
) -> None:
    ran_before, answer, ran_after, state = EXPECTED[(kind, point)]
    async with mcp_shop() as shop:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\nlease_grace = "300ms"\n'
            f'[upstreams.shop]\nbase_url = "{shop.url.removesuffix("/mcp")}"\n'
            f'protocol = "mcp"\ntimeout = "1s"\n{KINDS[kind]}'
        )
        doomed = start_gateway_process(config, env={"EFFECT_GATEWAY_FAULT": f"{point}:shop"})
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                await _call(http, f"{doomed.url}/shop/mcp", 1)
            assert doomed.proc.wait(10) == -signal.SIGKILL
            assert shop.runs.get("place_order", 0) == ran_before
            restarted = start_gateway_process(config)
            try:
                retried = await _call(http, f"{restarted.url}/shop/mcp", 2, wait=5)
                again = await _call(http, f"{restarted.url}/shop/mcp", 3)
            finally:
                restarted.stop()
        assert shop.runs.get("place_order", 0) == ran_after
        (row,) = await effect_rows(dsn)
        assert row["state"] == state
        if (kind, point) == ("stamp + probe", "after-upstream"):
            assert row["recovered_by"] == "probe"
        assert retried["id"] == 2
        assert again["id"] == 3
        if answer == "result":
            assert retried["result"] == again["result"]
            assert retried["result"]["structuredContent"] == shop.orders[0]
            if kind == "stamp + probe":
                assert shop.orders[0]["reference"].startswith("eg_"), "the gateway's key stamped in"
        else:
            assert retried["error"]["data"]["type"].endswith("/outcome-unknown"), retried
            assert again["error"] == retried["error"]
