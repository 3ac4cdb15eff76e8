"""The gateway under load from outside its process, beside a direct upstream and a pass-through proxy.

Run: `make bench-load` (or `python -m bench.gateway_load --concurrency 1,16,64 --workers 1,N
--duration 10 --repeat 3`). Every server runs in a process of its own: the trivial upstream
(bench.upstream), a pass-through aiohttp proxy with no database (bench.passthrough), and the gateway as
users start it, `effect-gateway serve --config <generated toml>`, on its embedded Postgres (or the one
in $EFFECT_GATEWAY_DATABASE_URL / --database-url). The load comes from wrk, or bench.loadgen where wrk is
not installed (see bench.load).

Rows, at each concurrency: direct to the upstream; through the pass-through proxy; through the gateway
a new effect (a fresh key each request), a replay (1,000 keys completed beforehand, round and round)
and a 409 (the key of an effect whose first request the upstream holds unanswered). Each row gives
req/s, p50 and p99 latency and its rate as a share of the direct and the proxy rows' rates in the same
run, and who used the CPU meanwhile. Rows are interleaved (each repeat measures every row once, in a
rotated order) and each figure is the median over the repeats, so a noisy moment falls on all rows.
``--profile DIR`` then runs py-spy on the gateway during each of its loads (not counted in the table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import asyncpg

from bench import profiling
from bench.harness import (
    CpuMeter,
    Server,
    at_start,
    conditions,
    gateway_command,
    load_average,
    machine_now,
    postmaster_pid,
    running,
    start_server,
    tree,
    work_dir,
)
from bench.load import Load, LoadResult, LoadSpec, generator_description
from gateway.embedded import EmbeddedPostgres

BODY = b'{"items":["atta","toor dal","paneer","spinach"]}'
HEADERS = {"Content-Type": "application/json"}
# Enough keys that replays read rows spread over the table, few enough to create in a few seconds.
REPLAY_KEYS = 1000


@dataclass
class Gateway:
    workers: int
    server: Server
    data_dir: Path
    dsn: str
    tag: str
    twin: threading.Thread | None = None

    def pids(self) -> set[int]:
        """The gateway's processes (its workers too), without the embedded Postgres if it is a child."""
        return tree(self.server.pid) - self.pg_pids()

    def pg_pids(self) -> set[int]:
        pm = postmaster_pid(self.data_dir)
        return tree(pm) if pm is not None else set()


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # direct, proxy, new, replay, conflict
    gateway: Gateway | None = None


@dataclass
class Measured:
    results: list[LoadResult] = field(default_factory=list)
    cpu: list[dict[str, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def workers_support() -> str | None:
    """How this build takes a number of workers: "setting", "flag", or None when it has none."""
    from gateway.settings import Settings

    if "workers" in Settings.model_fields:
        return "setting"
    done = subprocess.run([*gateway_command(), "serve", "--help"], capture_output=True, text=True)
    return "flag" if "--workers" in done.stdout else None


def parse_workers(text: str) -> list[int]:
    cores = os.cpu_count() or 1
    return [cores if part.strip().upper() in ("N", "CORES") else int(part) for part in text.split(",")]


def write_config(
    path: Path,
    upstream: str,
    data_dir: Path,
    database_url: str | None,
    workers: int | None,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> None:
    lines = [
        'listen = "127.0.0.1:0"',
        # Older gateways (another checkout's) refuse a setting they do not know: before there was an
        # admin listener, or workers (one process always), it is left out.
        *(['admin_listen = "127.0.0.1:0"'] if _knows_setting(env, "admin_listen") else []),
        f'data_dir = "{data_dir}"',
        # Longer than any run: the gateway's own hourly purge must find nothing to do.
        'retention = "400d"',
    ]
    if database_url:
        lines.append(f'database_url = "{database_url}"')
    if workers is not None and _knows_setting(env, "workers"):
        lines.append(f"workers = {workers}")
    lines += [
        *extra,
        "[upstreams.shop]",
        f'base_url = "{upstream}"',
        'timeout = "30s"',
        'stamp = { json_field = "client_reference" }',
        # The same upstream, for the request held unanswered: its lease must outlast the whole run.
        "[upstreams.slow]",
        f'base_url = "{upstream}"',
        'timeout = "6h"',
        'stamp = { json_field = "client_reference" }',
    ]
    path.write_text("\n".join(lines) + "\n")


def _knows_setting(env: dict[str, str] | None, name: str) -> bool:
    """Whether the gateway that runs in ``env`` (its PYTHONPATH: another checkout's) has the setting."""
    tree = Path((env or {}).get("PYTHONPATH") or Path(__file__).resolve().parent.parent)
    settings = tree / "gateway" / "settings.py"
    return not settings.exists() or f"{name}:" in settings.read_text()


def post(url: str, key: str | None, timeout: float = 30.0) -> int:
    headers = dict(HEADERS)
    if key is not None:
        headers["Idempotency-Key"] = key
    request = urllib.request.Request(url, data=BODY, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def start_gateway(
    workers: int,
    mode: str | None,
    upstream: str,
    work: Path,
    database_url: str | None,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> Gateway:
    """``extra``: top-level settings lines for its config; ``env``: its environment (default: ours);
    ``name``: of its files in ``work`` (default: by its workers)."""
    name = name or f"gateway-w{workers}"
    data_dir = work / name
    config = work / f"{name}.toml"
    write_config(config, upstream, data_dir, database_url, workers if mode == "setting" else None, extra, env)
    argv = [*gateway_command(env), "serve", "--config", str(config)]
    if mode == "flag":
        argv += ["--workers", str(workers)]
    server = start_server(f"gateway (workers {workers})", argv, work / f"{name}.log", env=env)
    dsn = database_url or os.environ.get("EFFECT_GATEWAY_DATABASE_URL") or EmbeddedPostgres(data_dir).start()
    return Gateway(workers, server, data_dir, dsn, tag=f"{time.time_ns():x}.w{workers}")


def prepare(gw: Gateway) -> None:
    """Complete the replay keys, and leave one effect in flight for the 409 row."""
    url = f"{gw.server.url}/shop/orders"
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: post(url, f"{gw.tag}-{i}"), range(REPLAY_KEYS)))
    if set(statuses) != {201}:
        raise RuntimeError(f"creating the replay keys answered {sorted(set(statuses))}, not only 201")
    hang = f"{gw.server.url}/slow/hang"
    gw.twin = threading.Thread(target=post, args=(hang, f"{gw.tag}-held", 6 * 3600.0), daemon=True)
    gw.twin.start()
    # Only once the held request's record is there may a twin be sent: sooner, the twin would claim it.
    deadline = time.monotonic() + 30
    # An older gateway (another checkout's) served the effects API on its one listener.
    admin = gw.server.admin_url or gw.server.url
    while not _pending(admin, f"{gw.tag}-held"):
        if time.monotonic() > deadline:
            raise RuntimeError("the held request left no pending record within 30 s")
        time.sleep(0.05)
    if (status := post(hang, f"{gw.tag}-held", timeout=10)) != 409:
        raise RuntimeError(f"the twin of an effect in flight answered {status}, not 409")


def _pending(gateway: str, key: str) -> bool:
    with urllib.request.urlopen(
        f"{gateway}/_gateway/effects?state=pending&upstream=slow", timeout=10
    ) as resp:
        return any(e["key"] == key for e in json.loads(resp.read())["effects"])


def spec(row: Row, servers: dict[str, Server], concurrency: int, seconds: float, seq: int) -> LoadSpec:
    """The load of ``row``; ``seq`` makes its new keys unlike any other run's."""
    common = LoadSpec("", concurrency, seconds, body=BODY, headers=HEADERS)
    if row.kind == "direct":
        return replace(common, url=f"{servers['upstream'].url}/orders", mode="new", tag=f"d{seq}")
    if row.kind == "proxy":
        return replace(common, url=f"{servers['proxy'].url}/shop/orders", mode="new", tag=f"p{seq}")
    gw = row.gateway
    assert gw is not None
    if row.kind == "new":
        return replace(common, url=f"{gw.server.url}/shop/orders", mode="new", tag=f"{gw.tag}.{seq}")
    if row.kind == "replay":
        return replace(common, url=f"{gw.server.url}/shop/orders", mode="cycle", tag=gw.tag, keys=REPLAY_KEYS)
    return replace(common, url=f"{gw.server.url}/slow/hang", mode="fixed", tag=f"{gw.tag}-held")


def cpu_groups(row: Row, servers: dict[str, Server]) -> dict[str, set[int]]:
    groups = {"upstream": tree(servers["upstream"].pid)}
    if row.kind == "direct":
        groups = {"server": groups["upstream"]}
    elif row.kind == "proxy":
        groups["server"] = tree(servers["proxy"].pid)
    elif row.gateway is not None:
        groups["server"] = row.gateway.pids()
        groups["postgres"] = row.gateway.pg_pids()
    return groups


def measure_once(row: Row, load: LoadSpec, groups: dict[str, set[int]], into: Measured) -> LoadResult:
    meter = CpuMeter(groups)
    result = Load(load).result()
    cpu = meter.read(extra_ours=result.cpu_s)
    cpu["load"] = 100 * result.cpu_s / cpu["wall"]
    into.results.append(result)
    into.cpu.append(cpu)
    expected_bad = result.requests if row.kind == "conflict" else 0
    if result.not_2xx != expected_bad or result.failed:
        into.problems.append(
            f"{result.not_2xx} answers not 2xx (expected {expected_bad}), {result.failed} failed"
        )
    return result


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def table(rows: list[Row], concurrencies: list[int], data: dict[tuple[str, int], Measured]) -> str:
    out = [
        "| c | path | req/s | spread | p50 ms | p99 ms | vs direct | vs proxy "
        "| CPU% server/upstream/pg/load/other |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_kind = {row.kind: row.name for row in rows}
    for c in concurrencies:
        direct = _med([r.rate for r in data[(by_kind["direct"], c)].results])
        proxy = _med([r.rate for r in data[(by_kind["proxy"], c)].results])
        for row in rows:
            m = data[(row.name, c)]
            rates = [r.rate for r in m.results]
            rate = _med(rates)
            spread = f"{100 * (max(rates) - min(rates)) / rate:.0f}%" if rate else "-"
            cpu = "/".join(
                f"{_med([x.get(k, 0.0) for x in m.cpu]):.0f}"
                for k in ("server", "upstream", "postgres", "load", "other")
            )
            vs_direct = f"{rate / direct:.2f}" if row.kind != "direct" and direct else ""
            vs_proxy = f"{rate / proxy:.2f}" if row.kind not in ("direct", "proxy") and proxy else ""
            flag = " (!)" if m.problems else ""
            p50 = _med([r.p50_ms for r in m.results])
            p99 = _med([r.p99_ms for r in m.results])
            out.append(
                f"| {c} | {row.name}{flag} | {rate:,.0f} | {spread} | {p50:.3f} | {p99:.3f} "
                f"| {vs_direct} | {vs_proxy} | {cpu} |"
            )
    return "\n".join(out)


def added_latency(rows: list[Row], data: dict[tuple[str, int], Measured], c: int) -> str:
    base = _med([r.p50_ms for r in data[(rows[0].name, c)].results])  # rows[0]: direct
    parts = [
        f"{row.name} +{_med([r.p50_ms for r in data[(row.name, c)].results]) - base:.3f} ms"
        for row in rows
        if row.kind not in ("direct",)
    ]
    return f"added latency at c={c} (p50 minus the direct p50 of {base:.3f} ms): " + "; ".join(parts)


async def _postgres_facts(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        names = (
            "server_version",
            "shared_buffers",
            "synchronous_commit",
            "fsync",
            "wal_compression",
            "max_wal_size",
            "checkpoint_timeout",
        )
        values = [await conn.fetchval(f"show {name}") for name in names]
    finally:
        await conn.close()
    return ", ".join(f"{n} {v}" for n, v in zip(names, values, strict=True))


def profile(rows: list[Row], servers: dict[str, Server], c: int, seconds: float, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"\npy-spy on the gateway at c={c}, {seconds:g} s per row (these loads are not in the table):")
    for row in rows:
        if row.gateway is None:
            continue
        raw = out_dir / f"{row.kind}-w{row.gateway.workers}-c{c}.txt"
        load = Load(spec(row, servers, c, seconds + 2, seq=10_000))
        time.sleep(1)  # past the connections' start
        spy = profiling.record(row.gateway.server.pid, seconds, raw, subprocesses=row.gateway.workers > 1)
        _, err = spy.communicate()
        result = load.result()
        print(f"\n{row.name}: {result.rate:,.0f} req/s, p50 {result.p50_ms:.3f} ms under py-spy ({raw})")
        if spy.returncode != 0 or not raw.exists():
            print(f"  py-spy failed ({spy.returncode}): {err.decode(errors='replace').strip()}")
            continue
        print(profiling.summary(raw, seconds))


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")  # the embedded server's wheel, attaching
    with work_dir("effect-gateway-bench-", args.work_dir) as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    start_line = at_start(str(work))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    wanted = parse_workers(args.workers)
    mode = workers_support()
    if mode is None:
        if any(w != 1 for w in wanted):
            print("workers: not supported by this build (measuring one process only)")
        wanted = [1]
    servers: dict[str, Server] = {}
    gateways: list[Gateway] = []
    with running([]) as started:
        servers["upstream"] = start_server(
            "upstream", [sys.executable, "-m", "bench.upstream"], work / "upstream.log"
        )
        started.append(servers["upstream"])
        servers["proxy"] = start_server(
            "proxy",
            [sys.executable, "-m", "bench.passthrough", "--upstream", servers["upstream"].url],
            work / "proxy.log",
        )
        started.append(servers["proxy"])
        try:
            for w in sorted(set(wanted)):
                gw = start_gateway(w if mode else 1, mode, servers["upstream"].url, work, args.database_url)
                started.append(gw.server)
                gateways.append(gw)
                prepare(gw)
            pg = asyncio.run(_postgres_facts(gateways[0].dsn))
            where = (
                "given" if (args.database_url or "EFFECT_GATEWAY_DATABASE_URL" in os.environ) else "embedded"
            )
            print(
                conditions(
                    {
                        "load": generator_description(),
                        "postgres": f"{where}; {pg}",
                        "run": f"{args.duration:g} s per row, {args.repeat} repeats (medians), rows "
                        f"interleaved, concurrency {args.concurrency}, workers "
                        + ",".join(str(g.workers) for g in gateways)
                        + ("" if mode else " (workers: not supported by this build)"),
                    },
                    start_line,
                ),
                flush=True,
            )
            rows = [Row("direct to the upstream", "direct"), Row("pass-through proxy, no database", "proxy")]
            for gw in gateways:
                label = f"gateway w={gw.workers}"
                rows += [
                    Row(f"{label} new effect", "new", gw),
                    Row(f"{label} replay", "replay", gw),
                    Row(f"{label} 409 in flight", "conflict", gw),
                ]
            for row in rows:  # warm every path: connection pools, Postgres's caches, the JIT of nothing
                Load(spec(row, servers, 16, args.warmup, seq=-1)).result()
            data = {(row.name, c): Measured() for row in rows for c in concurrencies}
            seq = 0
            for rep in range(args.repeat):
                for c in concurrencies:
                    shift = (rep + c) % len(rows)
                    for row in rows[shift:] + rows[:shift]:
                        seq += 1
                        measure_once(
                            row,
                            spec(row, servers, c, args.duration, seq),
                            cpu_groups(row, servers),
                            data[(row.name, c)],
                        )
                print(f"repeat {rep + 1}/{args.repeat} done; load average {load_average()}", flush=True)
            print()
            print(table(rows, concurrencies, data))
            print()
            print(added_latency(rows, data, min(concurrencies)))
            for (name, c), m in data.items():
                for problem in dict.fromkeys(m.problems):
                    print(f"(!) {name} at c={c}: {problem}")
            print(
                "req/s, p50, p99: medians over the repeats; spread: (max - min) / median of req/s; CPU%: of "
                "one core (server: the process under test), other: the machine's busy time not ours"
            )
            if args.profile:
                profile(
                    rows,
                    servers,
                    args.profile_concurrency or max(concurrencies),
                    args.duration,
                    Path(args.profile),
                )
            print(f"\nat the end: {machine_now(str(work))}")
        finally:
            for gw in gateways:
                post(f"{servers['upstream'].url}/release", None)
                if gw.twin is not None:
                    gw.twin.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated (default 1,16,64)")
    parser.add_argument("--workers", default="1", help="comma-separated; N is the number of cores")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per row and repeat")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every row; the table shows medians")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load on each path first")
    parser.add_argument("--database-url", help="an external Postgres instead of the embedded one")
    parser.add_argument(
        "--work-dir", help="keep configs, logs and the embedded Postgres here (default: temp)"
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy the gateway during its loads; stacks go here"
    )
    parser.add_argument(
        "--profile-concurrency", type=int, help="concurrency for --profile (default: the highest)"
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
