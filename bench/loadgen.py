"""The project's own load generator, for machines without wrk: one process, ``concurrency`` connections.

Run by bench.load (several at once to use every core), never inside a server's process. Each connection
is a keep-alive HTTP/1.1 stream written and parsed by hand: aiohttp's client costs several times more CPU
per request, which the server under test would lose. Prints one line, ``LOADJSON {...}``, with every
latency sample so that the parent can pool the processes' samples before taking percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench.load import STEPS_PER_RUN

# Between tries to reconnect to a server that refuses: short beside a run of seconds, long enough not
# to spin on a server that takes a while to come back. Refusals are not counted as failed requests
# (the request that met the closed connection was): their number would only measure this pause.
RECONNECT_PAUSE = 0.05


class Client:
    def __init__(self, args: argparse.Namespace, body: bytes) -> None:
        parts = urlsplit(args.url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.args = args
        self.body = body
        self.counter = 0
        self.run = ""
        self.samples: list[float] = []
        self.not_2xx = 0
        self.failed = 0
        self.fixed = [f"Host: {self.host}:{self.port}", *args.header]
        # "{n}": a string unique to each request (bench.load.LoadSpec), so each has its own length.
        self.numbered = b"{n}" in body
        if body and not self.numbered:
            self.fixed.append(f"Content-Length: {len(body)}")
        # --target "path|Name:value|...": each run of STEPS_PER_RUN requests goes to the next in turn.
        self.targets = [
            (path, [f"{h.partition(':')[0]}: {h.partition(':')[2]}" for h in extra])
            for path, *extra in (t.split("|") for t in args.target)
        ]

    def request(self) -> bytes:
        self.counter += 1
        target, extra = self.target, list[str]()
        if self.targets:
            target, extra = self.targets[(self.counter - 1) // STEPS_PER_RUN % len(self.targets)]
        lines = [f"{self.args.method} {target} HTTP/1.1", *self.fixed, *extra]
        if self.args.mode == "new":
            lines.append(f"Idempotency-Key: {random.getrandbits(64):016x}-{self.args.tag}-{self.counter}")
        elif self.args.mode == "cycle":
            lines.append(f"Idempotency-Key: {self.args.tag}-{self.counter % self.args.keys}")
        elif self.args.mode == "fixed":
            lines.append(f"Idempotency-Key: {self.args.tag}")
        if self.counter % STEPS_PER_RUN == 1:
            self.run = f"run-{random.getrandbits(64):016x}"
        lines += [
            f"Effect-Gateway-Run: {self.run}",
            f"Effect-Gateway-Step: step-{self.counter % STEPS_PER_RUN}",
        ]
        body = self.body
        if self.numbered:
            body = body.replace(b"{n}", f"{self.args.tag}.{os.getpid()}.{self.counter}".encode())
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def connection(self, stop: asyncio.Event, interval: float | None, count: int | None) -> None:
        """Send on one connection until the run ends, or ``count`` requests (None: no count)."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        next_send = time.perf_counter()
        sent = 0
        try:
            while not stop.is_set() and (count is None or sent < count):
                sent += 1
                if interval is not None:
                    next_send += interval
                    await asyncio.sleep(max(0.0, next_send - time.perf_counter()))
                    # Timed from when it was due, not from when a slow answer before it let it go: a
                    # server that falls behind a fixed rate shows in the latencies, as in wrk2.
                    start = next_send
                else:
                    start = time.perf_counter()
                writer.write(self.request())
                try:
                    status = await asyncio.wait_for(_response(reader), self.args.timeout)
                except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                    self.failed += 1
                    writer.close()
                    connected = await self._reconnect(stop)
                    if connected is None:  # the run ended while the server refused
                        return
                    reader, writer = connected
                    continue
                self.samples.append((time.perf_counter() - start) * 1000)
                if not 200 <= status < 300:
                    self.not_2xx += 1
        finally:
            writer.close()

    async def _reconnect(
        self, stop: asyncio.Event
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A new connection, tried again while the server refuses one, until the run ends."""
        while not stop.is_set():
            try:
                return await asyncio.open_connection(self.host, self.port)
            except OSError:
                await asyncio.sleep(RECONNECT_PAUSE)
        return None


async def _response(reader: asyncio.StreamReader) -> int:
    status = int((await reader.readline()).split()[1])
    length, chunked = 0, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
            await reader.readexactly(size + 2)
        await reader.readline()
    elif length:
        await reader.readexactly(length)
    return status


def _shares(args: argparse.Namespace) -> list[int | None]:
    """Return each connection's share of --requests (None each: no count, the duration ends the run)."""
    if args.requests is None:
        return [None] * args.concurrency
    whole, rest = divmod(args.requests, args.concurrency)
    return [whole + (1 if i < rest else 0) for i in range(args.concurrency)]


async def main_async(args: argparse.Namespace, body: bytes) -> None:
    client = Client(args, body)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.call_later(args.duration, stop.set)
    interval = args.concurrency / args.rate if args.rate else None
    start = time.perf_counter()
    await asyncio.gather(*(client.connection(stop, interval, count) for count in _shares(args)))
    seconds = time.perf_counter() - start
    samples = sorted(client.samples)
    doc = {
        "requests": len(samples),
        "seconds": seconds,
        "not_2xx": client.not_2xx,
        "failed": client.failed,
        "samples_ms": [round(s, 4) for s in samples],
    }
    print("LOADJSON " + json.dumps(doc), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--mode", choices=("new", "cycle", "fixed", "none"), default="none")
    parser.add_argument("--tag", default="bench")
    parser.add_argument("--keys", type=int, default=1)
    parser.add_argument("--method", default="POST")
    parser.add_argument("--body-file")
    parser.add_argument("--header", action="append", default=[], help="Name:value (repeatable)")
    parser.add_argument(
        "--target", action="append", default=[], help="path|Name:value|... per run, in turn (repeatable)"
    )
    parser.add_argument("--rate", type=float, help="requests per second from this process in all")
    parser.add_argument(
        "--requests",
        type=int,
        help="stop once this process has sent this many (the duration still bounds it)",
    )
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    asyncio.run(main_async(args, Path(args.body_file).read_bytes() if args.body_file else b""))


if __name__ == "__main__":
    main()
