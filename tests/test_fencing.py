"""The attempt fence: a stalled gateway can never overwrite a newer outcome."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.decision import settle, take_over
from gateway.outcome import Answered
from gateway.record import StoredResponse
from gateway.store import opened
from tests.database import effect_rows, runtime_url
from tests.factories import new_effect
from tests.gateways import start_gateway_process
from tests.support import PORT_ZERO
from tests.upstreams import Upstream

NEW = new_effect(derived_key="eg_1")


async def test_only_the_current_attempt_may_settle(dsn: str) -> None:
    """After a re-claim, the older attempt's write is refused and the newer one's stands."""
    async with opened(dsn) as store:
        first, created = await store.claim(NEW, timedelta(seconds=30))
        assert created
        second = await store.reclaim(first, take_over(first), timedelta(seconds=30), "test", sends=True)
        assert second is not None
        assert second.attempt == 2
        done = settle(Answered(201, (), b""), earlier_doubt=False)
        assert await store.settle(second, done, response=StoredResponse(201, (), b"newer"), recovered_by=None)
        stale = await store.settle(first, done, response=StoredResponse(201, (), b"stale"), recovered_by=None)
        assert stale is None
        # a second re-claim from the same stale read loses too
        assert await store.reclaim(first, take_over(first), timedelta(seconds=30), "test", sends=True) is None
        final = await store.reread(first)
    assert final.response is not None
    assert final.response.body == b"newer"


async def test_a_stalled_gateway_process_is_fenced_out(dsn: str, upstream: Upstream, tmp_path: Path) -> None:
    """Gateway A is frozen (SIGSTOP) mid-call past its lease; B takes over; A, resumed, cannot overwrite."""
    upstream.key_header = "Idempotency-Key"
    frozen: list[int] = []

    async def order(request: web.Request) -> web.Response:
        if not frozen:
            os.kill(gateway_a.proc.pid, signal.SIGSTOP)  # A stalls with the answer on its socket
            frozen.append(gateway_a.proc.pid)
        return web.json_response({"order": "O-1"}, status=201)

    upstream.routes["/orders"] = order
    config = tmp_path / "a.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\nlease_grace = "500ms"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\ntimeout = "1s"\n'
        'native_key = { header = "Idempotency-Key" }\n'
    )
    gateway_a = start_gateway_process(config)
    try:
        async with aiohttp.ClientSession() as http:
            a_call = asyncio.create_task(
                http.post(f"{gateway_a.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "stall"})
            )
            await upstream.received.wait()
            await asyncio.sleep(1.8)  # A's lease (1 s timeout + 0.5 s grace) runs out while it is frozen
            gateway_b = start_gateway_process(config)  # a second process on the same database
            try:
                resp = await http.post(
                    f"{gateway_b.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "stall"}
                )
                assert resp.status == 201
                assert json.loads(await resp.read()) == {"order": "O-1"}
            finally:
                gateway_b.stop()
            os.kill(gateway_a.proc.pid, signal.SIGCONT)
            a_resp = await asyncio.wait_for(a_call, 10)
            assert a_resp.status == 409
            assert "problems/fenced" in (await a_resp.json())["type"]
    finally:
        if gateway_a.proc.poll() is None:
            os.kill(gateway_a.proc.pid, signal.SIGCONT)
        gateway_a.stop()
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["attempt"], row["recovered_by"]) == ("completed", 2, "native_key")
    assert [e["event"] for e in row["history"]][-1] == "fenced"
    assert row["history"][-1]["attempt"] == 1
    assert upstream.effects_created() == 1


async def test_a_gateway_stalled_before_sending_does_not_send_after_its_lease(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """A stalls between its claim and the send; B takes over and sends; A, resumed, sends nothing.

    The fence guards the database, not the upstream: without the check before sending, A's late
    request would have placed the order a second time.
    """
    upstream.serve_search()
    config = tmp_path / "a.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\nlease_grace = "300ms"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\ntimeout = "700ms"\n'
        'stamp = { json_field = "client_reference" }\n'
        # the search lists an order as it is placed: its "not found" is trusted at once
        'probe = { path = "/orders/search?ref={key}", found = "items.0", status = 201, lag = "0s", '
        'routes = ["POST /orders"] }\n'
    )
    stall = {"EFFECT_GATEWAY_FAULT": "after-claim", "EFFECT_GATEWAY_FAULT_SIGNAL": "SIGSTOP"}
    gateway_a = start_gateway_process(config, env=stall)
    try:
        async with aiohttp.ClientSession() as http:
            headers = {"Idempotency-Key": "stall", "Content-Type": "application/json"}
            a_call = asyncio.create_task(
                http.post(f"{gateway_a.url}/shop/orders", data=b"{}", headers=headers)
            )
            for _ in range(200):  # A stops itself right after its claim is durable
                if _stopped(gateway_a.proc.pid):
                    break
                await asyncio.sleep(0.05)
            assert _stopped(gateway_a.proc.pid)
            await asyncio.sleep(1.2)  # A's lease (700 ms + 300 ms) runs out while it is stopped
            gateway_b = start_gateway_process(config)
            try:
                resp = await http.post(f"{gateway_b.url}/shop/orders", data=b"{}", headers=headers)
                assert resp.status == 201
            finally:
                gateway_b.stop()
            os.kill(gateway_a.proc.pid, signal.SIGCONT)
            a_resp = await asyncio.wait_for(a_call, 10)
            assert a_resp.status == 409
            assert "problems/fenced" in (await a_resp.json())["type"]
    finally:
        if gateway_a.proc.poll() is None:
            os.kill(gateway_a.proc.pid, signal.SIGCONT)
        gateway_a.stop()
    assert len(upstream.effects()) == 1
    (row,) = await effect_rows(dsn)
    assert row["state"] == "completed"
    assert "late, and another attempt took over" in row["history"][-1]["saw"]


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal (state T in /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"
