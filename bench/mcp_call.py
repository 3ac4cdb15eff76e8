"""What the gateway adds to an MCP tool call: place_order sent straight to the server and through it.

Run: `make bench-mcp` (or `python -m bench.mcp_call --concurrency 1,16 --duration 5 --repeat 3`). Every
server runs in a process of its own: the demo shop as an MCP server (the official SDK's, answering each
call as an event stream) and `effect-gateway serve` in front of it on its embedded Postgres (or
--database-url). The load comes from another process (wrk, or bench.loadgen: see bench.load), over one
MCP session opened beforehand at each, as an agent's client holds one.

Rows, at each concurrency: place_order straight to the server; through the gateway as a new effect (a
fresh key each call); as a replay (1,000 keys completed beforehand, round and round); and a `ping`
passed through unrecorded. Each gives calls a second, p50 and p99 latency, and the p50 it adds to the
direct row's in the same run. Rows are interleaved (each repeat measures every row once, in a rotated
order) and each figure is the median over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from email.message import Message
from pathlib import Path

from bench.harness import at_start, conditions, gateway_command, running, start_server, work_dir
from bench.load import LoadResult, LoadSpec, generator_description, run
from gateway.mcp import PROBE_PROTOCOL, initialize_message

REPLAY_KEYS = 1000
ORDER = {"name": "place_order", "arguments": {"items": ["atta", "toor dal"], "run_id": "bench"}}


@dataclass(frozen=True)
class Row:
    name: str
    spec: LoadSpec


def _post(url: str, message: dict[str, object], headers: dict[str, str]) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(
        url, data=json.dumps(message).encode(), headers={**headers, "Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return resp.status, resp.headers, resp.read()


def open_session(url: str) -> dict[str, str]:
    """An MCP session at ``url`` (initialize, then initialized): the headers its messages carry."""
    accept = {"Accept": "application/json, text/event-stream"}
    request = urllib.request.Request(
        url, data=initialize_message(), headers={**accept, "Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        headers = resp.headers
    session = {
        **accept,
        "Mcp-Session-Id": headers["Mcp-Session-Id"] or "",
        "MCP-Protocol-Version": PROBE_PROTOCOL,
    }
    _post(url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, session)
    return session


def _config(work: Path, shop: str, database_url: str | None) -> Path:
    config = work / "gateway.toml"
    lines = [
        'listen = "127.0.0.1:0"',
        'admin_listen = "127.0.0.1:0"',
        f'data_dir = "{work / "gateway"}"',
        "workers = 1",
        'retention = "400d"',
        *([f'database_url = "{database_url}"'] if database_url else []),
        "[upstreams.tools]",
        f'base_url = "{shop}"',
        'protocol = "mcp"',
        'timeout = "30s"',
    ]
    config.write_text("\n".join(lines) + "\n")
    return config


def _rows(shop: str, gateway: str, concurrency: int, seconds: float, seq: int) -> list[Row]:
    # Each call its own id ({n}: bench.load): an MCP session's requests in flight may not share one.
    call = json.dumps({"jsonrpc": "2.0", "id": "{n}", "method": "tools/call", "params": ORDER}).encode()
    ping = json.dumps({"jsonrpc": "2.0", "id": "{n}", "method": "ping"}).encode()
    json_type = {"Content-Type": "application/json"}
    direct = LoadSpec(
        f"{shop}/mcp", concurrency, seconds, body=call, headers={**open_session(f"{shop}/mcp"), **json_type}
    )
    through = {**open_session(f"{gateway}/tools/mcp"), **json_type}
    via = replace(direct, url=f"{gateway}/tools/mcp", headers=through)
    return [
        Row("direct to the server", direct),
        Row("gateway, new effect", replace(via, mode="new", tag=f"n{seq}.{time.time_ns():x}")),
        Row("gateway, replay", replace(via, mode="cycle", tag="replay", keys=REPLAY_KEYS)),
        Row("gateway, ping passed through", replace(via, body=ping)),
    ]


def _prepare_replays(gateway: str) -> None:
    url = f"{gateway}/tools/mcp"
    session = open_session(url)

    def one(i: int) -> None:
        message = {"jsonrpc": "2.0", "id": f"prepare.{i}", "method": "tools/call", "params": ORDER}
        _, _, body = _post(url, message, {**session, "Idempotency-Key": f"replay-{i}"})
        if b'"result"' not in body:
            raise RuntimeError(f"creating the replay keys answered {body[:200]!r}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(REPLAY_KEYS)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16", help="connections held by the load, e.g. 1,16")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per row and repeat")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--database-url", help="an external Postgres instead of the embedded one")
    parser.add_argument("--work-dir", help="keep the servers' logs and data here")
    args = parser.parse_args()
    with work_dir("effect-gateway-mcp-", args.work_dir) as work, running([]) as started:
        start_line = at_start(str(work))
        shop = start_server(
            "mcp shop", [sys.executable, "-m", "agent_example.upstreams", "mcp-shop"], work / "shop.log"
        )
        started.append(shop)
        argv = [*gateway_command(), "serve", "--config", str(_config(work, shop.url, args.database_url))]
        gateway = start_server("gateway", argv, work / "gateway.log")
        started.append(gateway)
        _prepare_replays(gateway.url)
        print(
            conditions(
                {
                    "load": generator_description(),
                    "run": f"{args.duration:g} s per row, {args.repeat} repeats (medians), rows interleaved, "
                    f"concurrency {args.concurrency}, one MCP session per row, workers 1",
                },
                start_line,
            ),
            flush=True,
        )
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            results: dict[str, list[LoadResult]] = {}
            for seq in range(args.repeat):
                rows = _rows(shop.url, gateway.url, concurrency, args.duration, seq)
                for row in rows[seq % len(rows) :] + rows[: seq % len(rows)]:
                    result = run(row.spec)
                    if result.not_2xx or result.failed:
                        raise SystemExit(
                            f"{row.name}: {result.not_2xx} answers not 2xx, {result.failed} failed"
                        )
                    results.setdefault(row.name, []).append(result)
            print(_table(concurrency, results), flush=True)


def _table(concurrency: int, results: dict[str, list[LoadResult]]) -> str:
    def median(name: str, figure: str) -> float:
        return statistics.median(getattr(r, figure) for r in results[name])

    direct = median("direct to the server", "p50_ms")
    lines = [
        f"\nat concurrency {concurrency}:",
        "| row | calls/s | p50 ms | p99 ms | p50 added to direct, ms |",
        "|---|---|---|---|---|",
    ]
    for name in results:
        p50 = median(name, "p50_ms")
        added = "" if name.startswith("direct") else f"{p50 - direct:+.2f}"
        lines.append(
            f"| {name} | {median(name, 'rate'):,.0f} | {p50:.2f} | {median(name, 'p99_ms'):.2f} | {added} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
