"""Crash tests of MCP tool calls: the gateway is SIGKILLed at each named fault point while a tool call is
in flight, restarted, and the agent calls again under the same key in a new MCP session. The tool runs
at most once; where nothing can tell whether it ran, the gateway says so and waits for an operator."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.mcp import KEY_META
from tests.database import effect_rows, runtime_url
from tests.gateways import start_gateway_process
from tests.mcp_shop import mcp_shop, raw_session
from tests.support import PORT_ZERO

pytestmark = pytest.mark.crash

CALL = {
    "jsonrpc": "2.0",
    "method": "tools/call",
    "params": {
        "name": "place_order",
        "arguments": {"item": "atta", "quantity": 2},
        "_meta": {KEY_META: "run-3:2"},
    },
}

# point -> (runs of the tool before the retry, the retry's answer, the runs after it, the final state)
EXPECTED = {
    # The claim was written and the call may or may not have left: with no probe, an operator decides.
    "after-claim": (0, "needs_review", 0, "needs_review"),
    # The tool ran and its answer was never recorded: the retry must not run it again.
    "after-upstream": (1, "needs_review", 1, "needs_review"),
    # The answer was recorded: the retry gets it.
    "after-record": (1, "result", 1, "completed"),
}


async def _call(http: aiohttp.ClientSession, url: str, call_id: int, wait: int = 0) -> Any:
    """The call in a new session of its own; with ``wait``, ready to wait that long for a call of the key
    still under way (the dead gateway's, until its lease runs out)."""
    headers = await raw_session(http, url)
    if wait:
        headers["Prefer"] = f"wait={wait}"
    async with http.post(url, json={**CALL, "id": call_id}, headers=headers) as resp:
        return await resp.json()


@pytest.mark.parametrize("point", list(EXPECTED))
async def test_a_gateway_killed_during_a_tool_call_never_runs_it_twice(
    dsn: str, tmp_path: Path, point: str
) -> None:
    ran_before, answer, ran_after, state = EXPECTED[point]
    async with mcp_shop() as shop:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\nlease_grace = "300ms"\n'
            f'[upstreams.shop]\nbase_url = "{shop.url.removesuffix("/mcp")}"\n'
            'protocol = "mcp"\ntimeout = "1s"\n'
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
        assert retried["id"] == 2
        assert again["id"] == 3
        if answer == "result":
            assert retried["result"] == again["result"]
            assert retried["result"]["structuredContent"] == shop.orders[0]
        else:
            assert retried["error"]["data"]["type"].endswith("/outcome-unknown"), retried
            assert again["error"] == retried["error"]
