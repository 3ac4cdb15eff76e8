"""`effect-gateway serve` with several worker processes on one socket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.support import Upstream, children, effect_rows, start_gateway_process


def _config(tmp_path: Path, dsn: str, upstream: Upstream, **extra: str) -> Path:
    config = tmp_path / "gateway.toml"
    lines = [f'database_url = "{dsn}"', 'listen = "127.0.0.1:0"', "workers = 3"]
    lines += [f"{name} = {value}" for name, value in extra.items()]
    config.write_text("\n".join(lines) + f'\n[upstreams.shop]\nbase_url = "{upstream.url}"\ntimeout = "5s"\n')
    return config


async def _order(http: aiohttp.ClientSession, url: str, key: str) -> int:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    async with http.post(f"{url}/shop/orders", data=b"{}", headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_a_worker_that_dies_is_replaced_and_the_others_go_on(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """SIGKILL one of three workers: requests keep succeeding, and a new worker takes its place."""
    gateway = start_gateway_process(_config(tmp_path, dsn, upstream))
    try:
        for _ in range(100):  # the workers start just after the address is printed
            if len(workers := children(gateway.proc.pid)) == 3:
                break
            await asyncio.sleep(0.05)
        assert len(workers) == 3
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            statuses = [await _order(http, gateway.url, f"k{n}") for n in range(30)]
        for _ in range(100):
            if len(now := children(gateway.proc.pid)) == 3 and victim not in now:
                break
            await asyncio.sleep(0.05)
        assert gateway.proc.poll() is None, "the gateway itself lives on"
    finally:
        gateway.stop()
    assert statuses == [201] * 30
    assert victim not in now
    assert len(now) == 3
    assert len(await effect_rows(dsn)) == 30


async def test_sigterm_lets_every_worker_finish_its_calls(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """SIGTERM while calls are under way: each is answered and recorded, then the gateway exits 0."""
    arrived = 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal arrived
        arrived += 1
        await asyncio.sleep(1.0)
        return web.json_response({"order": "slow"}, status=201)

    upstream.routes["/orders"] = slow
    gateway = start_gateway_process(_config(tmp_path, dsn, upstream))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            calls = [asyncio.create_task(_order(http, gateway.url, f"slow{n}")) for n in range(6)]
            for _ in range(100):
                if arrived == 6:
                    break
                await asyncio.sleep(0.02)
            gateway.proc.send_signal(signal.SIGTERM)
            statuses = await asyncio.gather(*calls)
        code = await asyncio.to_thread(gateway.proc.wait, 20)
    finally:
        gateway.stop()
    assert statuses == [201] * 6
    assert code == 0
    rows = await effect_rows(dsn)
    assert sorted(r["state"] for r in rows) == ["completed"] * 6
    assert all(json.loads(r["response_body"]) == {"order": "slow"} for r in rows)
