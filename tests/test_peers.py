"""Slow and stuck peers: agents that stall mid-request, upstreams that hang, probes that answer too much."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.database import effect_rows, runtime_url
from tests.gateways import Gateway, gateway_server, start_gateway_process
from tests.support import PORT_ZERO
from tests.upstreams import Upstream, upstream_server


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


HEAD_WITHOUT_BODY = (
    b"POST /shop/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: slow\r\nContent-Length: 10\r\n\r\n"
)


async def test_a_body_that_does_not_arrive_in_time_is_408_and_nothing_is_claimed(
    dsn: str, upstream: Upstream
) -> None:
    """Headers and no body: 408 request-timeout after request_body_timeout, nothing recorded or sent."""
    cfg = {"shop": {"base_url": upstream.url}}
    async with gateway_server(dsn, upstreams=cfg, request_body_timeout="300ms") as gw:
        reader, writer = await _connect(gw.url)
        writer.write(HEAD_WITHOUT_BODY + b"{}")
        raw = await asyncio.wait_for(reader.read(), 5)  # the gateway closes the connection after it
        writer.close()
    assert raw.split(b" ", 2)[1] == b"408", raw
    assert b"problems/request-timeout" in raw
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


async def test_a_head_that_does_not_arrive_in_time_closes_the_connection(
    dsn: str, upstream: Upstream
) -> None:
    """A peer that stalls mid-head is disconnected after request_head_timeout instead of holding a socket."""
    async with gateway_server(
        dsn, upstreams={"shop": {"base_url": upstream.url}}, request_head_timeout="300ms"
    ) as gw:
        reader, writer = await _connect(gw.url)
        writer.write(b"POST /shop/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-")
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    assert time.monotonic() - started < 3
    assert upstream.calls == []


async def test_a_stalled_upload_does_not_hold_a_shutdown(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """SIGTERM with an agent stuck mid-body: `serve` exits within the body timeout, not aiohttp's 60 s."""
    config = tmp_path / "gw.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}request_body_timeout = "1s"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    gateway = start_gateway_process(config)
    try:
        _, writer = await _connect(gateway.url)
        writer.write(HEAD_WITHOUT_BODY)
        await writer.drain()
        await asyncio.sleep(0.2)  # the request is in the handler, waiting for its body
        started = time.monotonic()
        gateway.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(gateway.proc.wait, 30)
        writer.close()
    finally:
        gateway.kill()
    assert code == 0
    assert time.monotonic() - started < 10
    assert upstream.calls == []


async def test_agents_that_do_not_read_their_answers_do_not_hold_a_shutdown(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """SIGTERM while agents leave large answers unread: `serve` exits in seconds, its effects recorded.

    Before, each such connection held the shutdown for aiohttp's 60 s twice over (about 120 s), past
    the 45 s that the shipped unit, compose file and pod give before SIGKILL.
    """
    big = b"x" * (8 * 1024 * 1024)

    async def large(_: web.Request) -> web.Response:
        return web.Response(body=big, status=201)

    upstream.routes["/orders"] = large
    config = tmp_path / "gw.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\ntimeout = "2s"\n'
    )
    gateway = start_gateway_process(config)
    host, port = gateway.url.removeprefix("http://").split(":")
    agents = []
    try:
        for n in range(3):
            agent = socket.socket()
            agent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
            agent.connect((host, int(port)))
            agent.sendall(b"POST /shop/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: big%d\r\n" % n)
            agent.sendall(b"Content-Length: 2\r\n\r\n{}")
            agents.append(agent)
        for _ in range(200):  # the answers are recorded, and being written to agents that do not read
            if [row["state"] for row in await effect_rows(dsn)] == ["completed"] * 3:
                break
            await asyncio.sleep(0.05)
        started = time.monotonic()
        gateway.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(gateway.proc.wait, 20)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        gateway.kill()
        for agent in agents:
            agent.close()
    assert code == 0
    assert time.monotonic() - started < 15
    assert [row["state"] for row in await effect_rows(dsn)] == ["completed"] * 3


async def test_an_upstream_that_hangs_holds_only_its_own_connections(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A hung upstream fills its own pool; a call past it is refused unsent; another upstream stays fast."""
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({}, status=201)

    upstream.routes["/orders"] = hang
    async with upstream_server() as other:
        cfg = {
            "stuck": {
                "base_url": upstream.url,
                "timeout": "10s",
                "max_connections": 2,
                "connect_timeout": "300ms",
            },
            "fast": {"base_url": other.url},
        }
        async with gateway_server(dsn, upstreams=cfg) as gw:
            hung = [asyncio.create_task(_post(http, gw, "stuck", f"h{n}")) for n in range(2)]
            for _ in range(500):  # both calls reach the hung upstream within a few ms
                if len(upstream.calls) == 2:
                    break
                await asyncio.sleep(0.01)
            status, body = await _post(http, gw, "stuck", "h-extra")
            assert (status, body["type"].rsplit("/", 1)[1]) == (502, "upstream-unreachable")
            fast = await asyncio.gather(*(_post(http, gw, "fast", f"f{n}") for n in range(20)))
            assert [status for status, _ in fast] == [201] * 20
            assert not any(task.done() for task in hung), "the first upstream is still hung"
            release.set()
            assert [status for status, _ in await asyncio.gather(*hung)] == [201, 201]
    assert len(upstream.calls) == 2  # the refused call never left
    states = {row["key"]: row["state"] for row in await effect_rows(dsn)}
    assert states["h-extra"] == "retryable"


async def _post(http: aiohttp.ClientSession, gw: Gateway, upstream: str, key: str) -> tuple[int, Any]:
    async with http.post(f"{gw.url}/{upstream}/orders", data=b"{}", headers={"Idempotency-Key": key}) as resp:
        return resp.status, json.loads(await resp.read())


@pytest.mark.parametrize("oversized", ["answer", "item"])
async def test_a_probe_answer_past_the_response_limit_is_a_failed_probe(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, oversized: str
) -> None:
    """A probe reads at most max_response_bytes and keeps no larger item: 503 probe-failed, nothing stored."""

    async def create(_: web.Request) -> web.Response:
        return web.json_response({"error": "lost"}, status=500)

    async def search(_: web.Request) -> web.Response:
        if oversized == "answer":
            return web.json_response({"items": [{"id": 1}], "padding": "x" * 50_000})
        return web.json_response({"items": [{"id": 1, "blob": "x" * 5_000}]})

    upstream.routes["/orders"] = create
    upstream.routes["/orders/search"] = search
    cfg = {
        "shop": {
            "base_url": upstream.url,
            "timeout": "300ms",
            "stamp": {"json_field": "ref"},
            "probe": {
                "path": "/orders/search?ref={key}",
                "found": "items.0",
                "status": 201,
                "routes": ["POST /orders"],
            },
        }
    }
    limit = 10_000 if oversized == "answer" else 4_000
    async with gateway_server(dsn, upstreams=cfg, lease_grace="500ms", max_response_bytes=limit) as gw:
        assert (await _post(http, gw, "shop", "p"))[0] == 500
        status, body = await _post(http, gw, "shop", "p")
    assert (status, body["type"].rsplit("/", 1)[1]) == (503, "probe-failed")
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["response_status"]) == ("in_doubt", 500)
    assert len(upstream.effects("/orders")) == 1
