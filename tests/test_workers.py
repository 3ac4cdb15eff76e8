"""`effect-gateway serve` with several worker processes on one socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway import cores
from tests.database import effect_rows, runtime_url
from tests.gateways import children, start_gateway_process
from tests.support import PORT_ZERO
from tests.upstreams import Upstream


def _config(tmp_path: Path, dsn: str, upstream: Upstream, **extra: str) -> Path:
    config = tmp_path / "gateway.toml"
    settings = {
        "database_url": f'"{runtime_url(dsn)}"',
        "listen": '"127.0.0.1:0"',
        "admin_listen": '"127.0.0.1:0"',
        "workers": "3",
        **extra,
    }
    lines = [f"{name} = {value}" for name, value in settings.items()]
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


@contextlib.contextmanager
def on_one_core() -> Iterator[None]:
    """Processes started in the block may run on one core only, as a cpuset or taskset allows."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread's, which the children it starts inherit
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


async def test_without_workers_serve_starts_one_per_cpu_it_may_use(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """Allowed one core of the machine's, serve without `workers` starts one worker, not one per core of
    the machine, says at start how many and why, and serves."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    with on_one_core():
        gateway = start_gateway_process(config)
    try:
        for _ in range(10):  # a worker too many would be forked by now, or soon after
            if started := children(gateway.proc.pid):
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as http:
            status = await _order(http, gateway.url, "k1")
    finally:
        gateway.stop()
    assert (started, status) == (set(), 201), "one worker is the serve process itself"
    assert gateway.stderr is not None
    logged = [json.loads(line)["message"] for line in gateway.stderr.whole() if line.startswith("{")]
    # This test's own cgroup is the gateway's: its CPU quota, if any, is named the same way.
    assert f"workers: 1 ({cores.workers(1, cores.read()[1]).source})" in logged


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


# A supervisor of its own in a child process, with the race forced: the test process is never forked.
_SUPERVISED = """
import os, signal, sys, time
from pathlib import Path
from gateway.serve import Supervisor

race, marks = sys.argv[1], Path(sys.argv[2])
parent = os.getpid()
real_fork = os.fork
real_sleep = time.sleep
started = []


def work():
    if race == "backoff" and not started[1:]:
        os._exit(3)  # the first worker dies as it starts; its replacement waits out the backoff
    (marks / str(os.getpid())).touch()
    real_sleep(30)  # a worker that serves until it is stopped


def fork():
    started.append(time.monotonic())
    if race == "fork":
        os.kill(parent, signal.SIGTERM)  # arrives while the supervisor holds the signals back
    return real_fork()


def backoff(seconds):
    os.kill(parent, signal.SIGTERM)  # in the middle of the restart's backoff
    real_sleep(seconds)


os.fork = fork
if race == "backoff":
    time.sleep = backoff  # the supervisor sleeps only to back off
print(Supervisor(work, 1).run(lambda: None), len(started), flush=True)
"""


def _supervise(race: str, marks: Path) -> tuple[str, float]:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _SUPERVISED, race, str(marks)],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=Path(__file__).parent.parent,
    )
    return done.stdout.strip(), time.monotonic() - began


def test_sigterm_while_a_worker_is_forked_stops_that_worker_too(tmp_path: Path) -> None:
    """SIGTERM as a worker is being forked: the new worker is stopped with the rest and serve exits."""
    said, took = _supervise("fork", tmp_path)
    assert said == "0 1"  # exit status 0, one worker forked
    assert took < 10, "serve waited for the worker to end on its own"


def test_sigterm_during_a_restart_backoff_starts_no_replacement(tmp_path: Path) -> None:
    """SIGTERM while serve waits to replace a worker that died at start: serve exits, no new worker."""
    said, took = _supervise("backoff", tmp_path)
    assert said == "0 1"  # the replacement was never forked
    assert not list(tmp_path.iterdir())
    assert took < 10


def _running(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running: a zombie (state Z) has exited, whoever has yet to reap it."""
    running = set()
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue
        if stat.rpartition(")")[2].split()[0] != "Z":
            running.add(pid)
    return running


async def test_workers_of_a_serve_killed_outright_stop_and_free_the_port(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """SIGKILL the serve process itself: its workers stop too, and a serve started again takes the port."""
    gateway = start_gateway_process(_config(tmp_path, dsn, upstream, workers="2"))
    try:
        for _ in range(100):
            if len(workers := children(gateway.proc.pid)) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(workers) == 2
        gateway.kill()
        for _ in range(200):
            alive = _running(workers)
            if not alive:
                break
            await asyncio.sleep(0.05)
    finally:
        gateway.stop()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not alive, "workers went on serving with nobody to replace or stop them"
    port = gateway.url.rsplit(":", 1)[1]
    again = start_gateway_process(_config(tmp_path, dsn, upstream, listen=f'"127.0.0.1:{port}"'))
    try:
        async with aiohttp.ClientSession() as http:
            assert await _order(http, again.url, "after") == 201
    finally:
        again.stop()
