"""Crash tests: the gateway is SIGKILLed at each named fault point while an agent's request is in flight,
restarted, and the agent retries with the same key. The upstream must end with exactly one effect, or the
record is needs_review and nothing was sent twice.

The printed table (see conftest.py) is the scenario x upstream kind matrix.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.database import effect_rows, runtime_url
from tests.gateways import start_gateway_process
from tests.support import CRASH_MATRIX, PORT_ZERO
from tests.upstreams import Upstream

pytestmark = pytest.mark.crash

# The test upstream's search lists an order as it is placed: its "not found" is trusted at once.
SEARCH = (
    'probe = { path = "/orders/search?ref={key}", found = "items.0", status = 201, lag = "0s", '
    'routes = ["POST /orders"] }\n'
)
STAMP = 'stamp = { json_field = "client_reference" }\n'

# kind -> (the upstream's own memory of keys, the gateway's policy for it)
KINDS: dict[str, tuple[str | None, str]] = {
    # honours keys and still remembers this one: a re-send with the same key is deduplicated upstream
    "native key within TTL": (
        "Idempotency-Key",
        'native_key = { header = "Idempotency-Key", ttl = "24h" }\n',
    ),
    # its TTL is shorter than one lease, so every key counts as forgotten: only the probe can tell
    "native key past TTL + probe": (
        None,
        'native_key = { header = "Idempotency-Key", ttl = "1s" }\n' + STAMP + SEARCH,
    ),
    "no native key, probe": (None, STAMP + SEARCH),
    "neither": (None, ""),
}

# (kind, point) -> (status the agent's retry gets, upstream effects, final state)
EXPECTED: dict[tuple[str, str], tuple[int, int, str]] = {
    ("native key within TTL", "after-claim"): (201, 1, "completed"),
    ("native key within TTL", "after-upstream"): (201, 1, "completed"),
    ("native key within TTL", "after-record"): (201, 1, "completed"),
    ("native key past TTL + probe", "after-claim"): (201, 1, "completed"),
    ("native key past TTL + probe", "after-upstream"): (201, 1, "completed"),
    ("native key past TTL + probe", "after-record"): (201, 1, "completed"),
    ("no native key, probe", "after-claim"): (201, 1, "completed"),
    ("no native key, probe", "after-upstream"): (201, 1, "completed"),
    ("no native key, probe", "after-record"): (201, 1, "completed"),
    # nothing can tell: the gateway says so and waits for an operator, having sent at most once
    ("neither", "after-claim"): (409, 0, "needs_review"),
    ("neither", "after-upstream"): (409, 1, "needs_review"),
    ("neither", "after-record"): (201, 1, "completed"),
}


def _config(tmp_path: Path, dsn: str, upstream: Upstream, policy: str) -> Path:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\n'
        # a short lease, so the restarted gateway need not wait long for the dead one's to run out
        'lease_grace = "300ms"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\ntimeout = "1s"\n{policy}'
    )
    return config


async def _send(http: aiohttp.ClientSession, url: str, wait: int = 0) -> tuple[int, Any]:
    headers = {"Idempotency-Key": "run-1:4", "Content-Type": "application/json"}
    if wait:
        headers["Prefer"] = f"wait={wait}"
    async with http.post(f"{url}/shop/orders", data=b'{"items":["atta","paneer"]}', headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


@pytest.mark.parametrize("point", ["after-claim", "after-upstream", "after-record"])
@pytest.mark.parametrize("kind", list(KINDS))
async def test_the_gateway_killed_at_a_fault_point_never_duplicates(
    dsn: str, upstream: Upstream, tmp_path: Path, kind: str, point: str
) -> None:
    """SIGKILL at the fault point, restart, retry with the same key: one effect, or needs_review."""
    upstream.key_header, policy = KINDS[kind]
    upstream.serve_search()
    config = _config(tmp_path, dsn, upstream, policy)

    doomed = start_gateway_process(config, env={"EFFECT_GATEWAY_FAULT": f"{point}:shop"})
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            await _send(http, doomed.url)
        assert doomed.proc.wait(10) == -signal.SIGKILL, "the gateway died at the fault point, by SIGKILL"
        sent_before_retry = upstream.effects_created()
        assert sent_before_retry == (0 if point == "after-claim" else 1), "killed where the point says"

        restarted = start_gateway_process(config)
        try:
            status, body = await _send(http, restarted.url, wait=5)
            again, again_body = await _send(http, restarted.url)
        finally:
            restarted.stop()

    (row,) = await effect_rows(dsn)
    effects = upstream.effects_created()
    CRASH_MATRIX.append((point, kind, sent_before_retry, effects, status, row["state"], row["recovered_by"]))
    assert (status, effects, row["state"]) == EXPECTED[(kind, point)]
    assert again == status, "a further retry answers the same"
    if status == 201:
        assert again_body == body
    else:
        assert body["type"].endswith("/outcome-unknown")
