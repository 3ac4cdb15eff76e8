"""What the gateway costs an agent: the same POST sent straight to an upstream and through the gateway.

Run: `make bench` (or `python -m bench.gateway_overhead --requests 500`). Everything runs on loopback:
an aiohttp upstream, the gateway on the embedded Postgres (or $TEST_DATABASE_URL), and a client that
sends one request at a time so each figure is a latency, not a throughput. Prints median and p99 in ms
and the ratio to the direct baseline, measured side by side in one run. The gateway's metrics are
counted in an in-process registry (`serve`'s workers write prometheus-client's multiprocess files,
which cost a little more per update: bench/gateway_load.py measures serve itself); its log is not
written unless `--log-format json|text` asks for it (to /dev/null, as serve writes its line per
request to stderr), to show what the log costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from bench.common import on_postgres, p50_p99, where
from gateway import logs
from gateway.app import runners
from gateway.schema import migrate
from gateway.settings import load_settings

BODY = b'{"items":["atta","toor dal","paneer","spinach"]}'
HEADERS = {"Content-Type": "application/json"}


async def _upstream() -> tuple[web.AppRunner, str]:
    async def create(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"order": "O-1", "status": "placed"}, status=201)

    app = web.Application()
    app.router.add_post("/orders", create)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@contextlib.asynccontextmanager
async def _gateway(dsn: str, upstream: str) -> AsyncIterator[str]:
    settings = load_settings(
        None,
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        database_url=dsn,
        upstreams={"shop": {"base_url": upstream, "stamp": {"json_field": "client_reference"}}},
    )
    async with runners(settings, dsn) as both:
        await web.TCPSite(both.proxy, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{both.proxy.addresses[0][1]}"


async def _interleaved(n: int, calls: list[Callable[[int], Awaitable[int]]]) -> list[list[float]]:
    """Time the calls round-robin, so a slow moment of the disk or CPU falls on all of them alike."""
    for i in range(min(50, n)):  # warm the connection pools and Postgres's caches
        for call in calls:
            await call(-i - 1)
    samples: list[list[float]] = [[] for _ in calls]
    for i in range(n):
        for call, out in zip(calls, samples, strict=True):
            start = time.perf_counter()
            status = await call(i)
            out.append((time.perf_counter() - start) * 1000)
            assert status in (200, 201), status
    return samples


# As many agents at once as a busy sidecar serves; enough to keep both cores and Postgres busy.
CONCURRENCY = 16


def concurrent_effect(http: aiohttp.ClientSession, gateway: str, tag: str) -> Callable[[int], Awaitable[int]]:
    async def call(i: int) -> int:
        headers = {**HEADERS, "Idempotency-Key": f"{tag}:concurrent:{i}"}
        async with http.post(f"{gateway}/shop/orders", data=BODY, headers=headers) as resp:
            await resp.read()
            return resp.status

    return call


async def _throughput(n: int, clients: int, call: Callable[[int], Awaitable[int]]) -> float:
    """Requests per second with ``clients`` sending at once, ``n`` in all."""
    todo = iter(range(n))

    async def client() -> None:
        for i in todo:
            assert await call(i) in (200, 201)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return n / (time.perf_counter() - start)


def _row(name: str, samples: list[float], base: list[float] | None) -> str:
    median, p99 = p50_p99(samples)
    ratio = "" if base is None else f"{median / statistics.median(base):>8.2f}x"
    return f"| {name:<38} | {median:>8.3f} | {p99:>8.3f} | {ratio:>9} |"


async def run(n: int, dsn: str, log_format: str | None = None) -> None:
    await migrate(dsn)
    up_runner, upstream = await _upstream()
    run_tag = str(time.time_ns())
    try:
        async with _gateway(dsn, upstream) as gateway, aiohttp.ClientSession() as http:

            async def direct(i: int) -> int:
                async with http.post(f"{upstream}/orders", data=BODY, headers=HEADERS) as resp:
                    await resp.read()
                    return resp.status

            async def new_effect(i: int) -> int:
                headers = {**HEADERS, "Idempotency-Key": f"{run_tag}:new:{i}"}
                async with http.post(f"{gateway}/shop/orders", data=BODY, headers=headers) as resp:
                    await resp.read()
                    return resp.status

            async def replay(i: int) -> int:
                headers = {**HEADERS, "Idempotency-Key": f"{run_tag}:new:{i}"}  # sent just before
                async with http.post(f"{gateway}/shop/orders", data=BODY, headers=headers) as resp:
                    await resp.read()
                    return resp.status

            base, fresh, replays = await _interleaved(n, [direct, new_effect, replay])
            concurrent = [
                (name, await _throughput(n, CONCURRENCY, call))
                for name, call in (
                    ("direct", direct),
                    ("gateway, new keys", concurrent_effect(http, gateway, run_tag)),
                )
            ]
    finally:
        await up_runner.cleanup()
    print(f"\n{n} sequential POSTs each, loopback, Postgres {where()}, log {log_format or 'not written'}")
    print(f"| {'path':<38} | {'p50 ms':>8} | {'p99 ms':>8} | {'vs direct':>9} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 10}|{'-' * 11}|")
    print(_row("direct to the upstream (baseline)", base, None))
    print(_row("through the gateway, new key", fresh, base))
    print(_row("through the gateway, replay", replays, base))
    extra = statistics.median(fresh) - statistics.median(base)
    print(f"\nthe gateway adds {extra:.3f} ms at the median to a new effect (claim + settle in Postgres)")
    print(f"\n{n} POSTs from {CONCURRENCY} concurrent clients, distinct keys")
    print(f"| {'path':<38} | {'req/s':>8} | {'vs direct':>9} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 11}|")
    direct_rate = concurrent[0][1]
    for name, rate in concurrent:
        ratio = "" if name == "direct" else f"{rate / direct_rate:.2f}x"
        print(f"| {name:<38} | {rate:>8.0f} | {ratio:>9} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--log-format", choices=["json", "text"], help="write the gateway's log to /dev/null")
    args = parser.parse_args()
    if args.log_format:
        logs.configure(args.log_format, stream=open(os.devnull, "w"))  # noqa: SIM115 - open for the run
    on_postgres(lambda dsn: run(args.requests, dsn, args.log_format))


if __name__ == "__main__":
    main()
