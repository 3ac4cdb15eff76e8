"""The gateway as its effects table grows: the same figures on an empty table and at a chosen size.

Run: `make bench-growth` (ROWS=1000000 by default; `make bench-growth ROWS=10000000`), or
`python -m bench.growth --rows 1000000`. It takes about 20 minutes at 1M rows on 2 cores, most of it
the two sustained-WAL windows (one checkpoint interval each; shorten them with --wal-seconds for a
try-out, not for figures). Everything runs in processes of their own: the trivial upstream, the gateway
as users start it (`effect-gateway serve --config <generated toml>`, 4 tenants, 3 upstreams, an admin
token) on its embedded Postgres, or on an empty database given by --database-url (it is filled, so never
point it at one that matters), and the load from wrk or bench.loadgen (see bench.load).

At 0 rows, then after bench.fill has added realistic rows up to --rows (the schema is the migrations'):
the new-effect p50 at concurrency 1 and the rate at 32; the admin reads' latencies (health, metrics, the
audit page and the effects list filtered by state, upstream, run and tenant); the WAL a new effect costs
over one checkpoint interval of steady load. At the size only: `effect-gateway purge` run as users run
it, with a retention that makes a third of the rows due, its duration and WAL, and new effects at
concurrency 32 meanwhile; bytes per row before the purge, after it and after a VACUUM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg

from bench import fill
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
)
from bench.load import Load, LoadResult, LoadSpec, generator_description
from gateway.embedded import EmbeddedPostgres

T = TypeVar("T")
TENANTS = ("t1", "t2", "t3", "t4")
# Bodies as large as the filled rows' (1 KB each way), so a new effect writes what a filled row holds.
BODY = ('{"client_reference": "ref-new", "items": "' + secrets.token_hex(496) + '"}').encode()
RESPONSE_PAD = 1000
# A third of 60 days of rows are older than 40 days: the purge's share of the table.
PURGE_DAYS = 40
# Concurrency of the throughput rows, the WAL window and the load beside the purge: a busy sidecar.
BUSY = 32
# The sustained-WAL window's load: about 17 million effects a day, busy but below saturation, so
# the WAL per effect measures the write pattern and not a queue. Each connection pauses
# concurrency / rate between requests (wrk's delay), so the rate reached is a little lower, by the
# latency: many connections keep that small. The rate reached is printed.
WAL_RATE = 200.0
WAL_CONCURRENCY = 32


def _run(coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(coro())


@dataclass
class Setup:
    upstream: Server
    gateway: Server
    data_dir: Path
    config: Path
    dsn: str
    tokens: dict[str, str]
    admin: str

    def groups(self) -> dict[str, set[int]]:
        pm = postmaster_pid(self.data_dir)
        pg = tree(pm) if pm is not None else set()
        return {"gateway": tree(self.gateway.pid) - pg, "postgres": pg, "upstream": tree(self.upstream.pid)}


@dataclass
class Column:
    """One column of the printed table: a state of the table (0 rows, or the size)."""

    rows: int
    figures: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def write_config(
    path: Path, upstream: str, data_dir: Path, database_url: str | None
) -> tuple[dict[str, str], str]:
    tokens = {name: secrets.token_hex(16) for name in TENANTS}
    admin = secrets.token_hex(16)
    lines = [
        'listen = "127.0.0.1:0"',
        f'data_dir = "{data_dir}"',
        # The gateway's own hourly purge must find nothing; the benchmark runs `effect-gateway purge`.
        'retention = "400d"',
    ]
    if database_url:
        lines.append(f'database_url = "{database_url}"')
    lines += ["[admin]", f'token = "{admin}"']
    for name, token in tokens.items():
        lines += [f"[tenants.{name}]", f'token = "{token}"']
    lines += [
        "[upstreams.shop]",
        f'base_url = "{upstream}"',
        'stamp = { json_field = "client_reference" }',
        "[upstreams.mail]",
        f'base_url = "{upstream}"',
        'native_key = { header = "Idempotency-Key", ttl = "24h" }',
        "[upstreams.payments]",
        f'base_url = "{upstream}"',
        'native_key = { header = "Idempotency-Key", ttl = "24h" }',
    ]
    path.write_text("\n".join(lines) + "\n")
    return tokens, admin


def new_effects(
    setup: Setup, concurrency: int, seconds: float, tag: str, rate: float | None = None
) -> LoadSpec:
    return LoadSpec(
        f"{setup.gateway.url}/shop/orders?pad={RESPONSE_PAD}",
        concurrency,
        seconds,
        mode="new",
        tag=tag,
        body=BODY,
        headers={"Content-Type": "application/json", "Effect-Gateway-Token": setup.tokens["t1"]},
        rate=rate,
    )


def check(result: LoadResult, what: str) -> list[str]:
    if result.not_2xx or result.failed:
        return [f"(!) {what}: {result.not_2xx} answers not 2xx, {result.failed} failed"]
    return []


def cpu_note(cpu: dict[str, float]) -> str:
    return "CPU% " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items() if k != "wall")


# --- the measurements -------------------------------------------------------------------------------


def latency_and_rate(setup: Setup, col: Column, seconds: float, repeat: int) -> dict[str, float]:
    """New effects one at a time (p50) and 32 at once (req/s, p99), interleaved, medians of ``repeat``."""
    single: list[LoadResult] = []
    busy: list[LoadResult] = []
    cpus: list[dict[str, float]] = []
    for i in range(repeat):
        for c, into in ((1, single), (BUSY, busy)):
            meter = CpuMeter(setup.groups())
            result = Load(new_effects(setup, c, seconds, f"lat{col.rows}.{c}.{i}")).result()
            cpu = meter.read(extra_ours=result.cpu_s)
            cpu["load"] = 100 * result.cpu_s / cpu["wall"]
            if c == BUSY:
                cpus.append(cpu)
            into.append(result)
            col.notes += check(result, f"new effects at c={c}")
    figures = {
        "p50": statistics.median(r.p50_ms for r in single),
        "p99_1": statistics.median(r.p99_ms for r in single),
        "rate": statistics.median(r.rate for r in busy),
        "p99": statistics.median(r.p99_ms for r in busy),
    }
    col.figures["new effect p50 (c=1)"] = f"{figures['p50']:.2f} ms (p99 {figures['p99_1']:.2f})"
    col.figures[f"new effect throughput (c={BUSY})"] = (
        f"{figures['rate']:,.0f}/s (p99 {figures['p99']:.1f} ms)"
    )
    middle = {k: statistics.median(c[k] for c in cpus) for k in cpus[0]}
    col.notes.append(f"at c={BUSY}: {cpu_note(middle)} (other: the machine's busy time not ours)")
    return figures


def _get(url: str, headers: dict[str, str]) -> float:
    request = urllib.request.Request(url, headers=headers)
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        status = exc.code
    took = time.perf_counter() - start
    if status != 200:
        raise RuntimeError(f"GET {url} answered {status}")
    return took * 1000


def admin_reads(setup: Setup, col: Column, run_id: str, runs: int) -> None:
    """Each read once to warm it, then ``runs`` times; the median."""
    admin = {"Authorization": f"Bearer {setup.admin}"}
    tenant = {"Effect-Gateway-Token": setup.tokens["t2"]}
    reads = [
        ("GET /_gateway/health", "/_gateway/health", {}),
        ("GET /_gateway/metrics", "/_gateway/metrics", admin),
        ("GET /_gateway/audit", "/_gateway/audit", admin),
        ("effects?state=needs_review", "/_gateway/effects?state=needs_review", admin),
        ("effects?upstream=mail", "/_gateway/effects?upstream=mail", admin),
        ("effects?run=<one run>", f"/_gateway/effects?run={run_id}", admin),
        ("effects as tenant t2", "/_gateway/effects", tenant),
    ]
    for name, path, headers in reads:
        url = setup.gateway.url + path
        _get(url, headers)
        took = [_get(url, headers) for _ in range(runs)]
        col.figures[name] = _ms(statistics.median(took)) + f" (max {_ms(max(took))})"


def _ms(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


async def _wal_state(conn: asyncpg.Connection) -> dict[str, Any]:
    state: dict[str, Any] = dict(
        await conn.fetchrow("select pg_current_wal_lsn() as lsn, wal_records, wal_fpi from pg_stat_wal") or {}
    )
    try:
        ckpt = await conn.fetchrow("select num_timed + num_requested as n from pg_stat_checkpointer")
    except asyncpg.UndefinedTableError:  # before Postgres 17
        ckpt = await conn.fetchrow("select checkpoints_timed + checkpoints_req as n from pg_stat_bgwriter")
    state["checkpoints"] = ckpt["n"] if ckpt else 0
    return state


def wal_sustained(setup: Setup, col: Column, seconds: float) -> None:
    """WAL per new effect over one checkpoint interval of steady load, from a checkpoint on."""

    async def mark() -> dict[str, Any]:
        conn = await asyncpg.connect(setup.dsn)
        try:
            await conn.execute("checkpoint")
            return await _wal_state(conn)
        finally:
            await conn.close()

    async def since(before: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        conn = await asyncpg.connect(setup.dsn)
        try:
            after = await _wal_state(conn)
            return int(after["lsn"]) - int(before["lsn"]), after
        finally:
            await conn.close()

    before = _run(mark)
    result = Load(new_effects(setup, WAL_CONCURRENCY, seconds, f"wal{col.rows}", rate=WAL_RATE)).result()
    wal, after = _run(lambda: since(before))
    col.notes += check(result, "the sustained load")
    per = wal / max(1, result.requests)
    fpi = (after["wal_fpi"] - before["wal_fpi"]) / max(1, result.requests)
    records = (after["wal_records"] - before["wal_records"]) / max(1, result.requests)
    col.figures["WAL per new effect, sustained"] = f"{per / 1024:.1f} KB"
    col.notes.append(
        f"sustained WAL: {result.requests:,} new effects in {result.seconds:.0f} s ({result.rate:.0f}/s at "
        f"c={WAL_CONCURRENCY}), {wal / 2**20:,.0f} MB of WAL from a checkpoint on, {records:.1f} records and "
        f"{fpi:.2f} full-page images per effect, {after['checkpoints'] - before['checkpoints']} checkpoints"
        " in the window"
    )


async def _sizes(dsn: str) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            """select (select count(*) from effects) as rows,
                      pg_total_relation_size('effects') as total,
                      pg_relation_size('effects') as heap,
                      coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0) as toast,
                      pg_indexes_size('effects') as indexes
               from pg_class c where c.oid = 'effects'::regclass"""
        )
        # A row's own bytes, its bodies detoasted (what it holds, not where): a 1% sample of the pages.
        kept = await conn.fetchrow(
            """select avg(pg_column_size(e.*)) filter (where purged_at is null) as full_row,
                      avg(pg_column_size(e.*)) filter (where purged_at is not null) as purged_row
               from effects e tablesample system (1) where state = 'completed'"""
        )
        assert row is not None
        assert kept is not None
        return {**dict(row), **dict(kept)}
    finally:
        await conn.close()


def sizes(dsn: str) -> tuple[str, str]:
    s = _run(lambda: _sizes(dsn))
    per = s["total"] / max(1, s["rows"])
    detail = (
        f"{s['rows']:,} rows, {s['total'] / 2**20:,.0f} MB: heap {s['heap'] / 2**20:,.0f}, "
        f"TOAST {s['toast'] / 2**20:,.0f}, indexes {s['indexes'] / 2**20:,.0f}; a completed row holds "
        + " bytes, a purged one ".join(
            f"{s[k]:,.0f}" if s[k] is not None else "-" for k in ("full_row", "purged_row")
        )
        + " bytes (pg_column_size, 1% sample)"
    )
    return f"{per:,.0f}", detail


async def _one(dsn: str, sql: str) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def _execute(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def purge(setup: Setup, col: Column, baseline: dict[str, float]) -> None:
    """`effect-gateway purge` as users run it, with new effects at c=32 for exactly as long."""
    due = _run(
        lambda: _one(
            setup.dsn,
            f"""select count(*) from effects where state = 'completed' and purged_at is null
                and completed_at < now() - interval '{PURGE_DAYS} days'""",
        )
    )
    lsn = _run(lambda: _one(setup.dsn, "select pg_current_wal_lsn()"))  # asyncpg reads an LSN as an int
    load = Load(new_effects(setup, BUSY, 24 * 3600, f"purge{col.rows}"))
    time.sleep(1)  # the load's connections are up and busy before the purge starts
    env = {**os.environ, "EFFECT_GATEWAY_RETENTION": f"{PURGE_DAYS}d"}
    start = time.monotonic()
    done = subprocess.run(
        [*gateway_command(), "purge", "--config", str(setup.config)], env=env, capture_output=True, text=True
    )
    took = time.monotonic() - start
    load.stop()
    result = load.result()
    wal = int(_run(lambda: _one(setup.dsn, "select pg_current_wal_lsn()"))) - int(lsn)
    if done.returncode != 0:
        raise RuntimeError(f"effect-gateway purge failed ({done.returncode}): {done.stderr}")
    col.notes += check(result, "new effects during the purge")
    col.figures[f"effect-gateway purge ({due:,} rows due)"] = f"{took:.1f} s, {wal / 2**30:.2f} GB WAL"
    col.figures[f"new effect p99 / throughput while purging (c={BUSY})"] = (
        f"{result.p99_ms:.0f} ms / {result.rate:,.0f}/s ({result.p99_ms / baseline['p99']:.1f}x p99, "
        f"{result.rate / baseline['rate']:.2f}x rate; max {result.max_ms:,.0f} ms)"
    )
    col.notes.append(
        f"purge: {done.stdout.strip()}; the WAL includes the {result.requests:,} new effects sent meanwhile"
    )


async def _postgres_facts(dsn: str) -> str:
    names = (
        "server_version",
        "shared_buffers",
        "synchronous_commit",
        "full_page_writes",
        "wal_compression",
        "max_wal_size",
        "checkpoint_timeout",
        "checkpoint_completion_target",
        "autovacuum",
    )
    conn = await asyncpg.connect(dsn)
    try:
        values = [await conn.fetchval(f"show {name}") for name in names]
    finally:
        await conn.close()
    return ", ".join(f"{n} {v}" for n, v in zip(names, values, strict=True))


def _seconds(setting: str) -> float:
    value = int("".join(ch for ch in setting if ch.isdigit()))
    unit = setting.lstrip("0123456789")
    return value * {"ms": 0.001, "s": 1, "min": 60, "h": 3600, "d": 86400}.get(unit, 1)


# --- the run ----------------------------------------------------------------------------------------


def start(work: Path, database_url: str | None) -> tuple[list[Server], Setup]:
    upstream = start_server("upstream", [sys.executable, "-m", "bench.upstream"], work / "upstream.log")
    data_dir = work / "gateway"
    config = work / "gateway.toml"
    tokens, admin = write_config(config, upstream.url, data_dir, database_url)
    try:
        gateway = start_server(
            "gateway", [*gateway_command(), "serve", "--config", str(config)], work / "gateway.log"
        )
    except Exception:
        upstream.stop()
        raise
    dsn = database_url or os.environ.get("EFFECT_GATEWAY_DATABASE_URL") or EmbeddedPostgres(data_dir).start()
    return [upstream, gateway], Setup(upstream, gateway, data_dir, config, dsn, tokens, admin)


def say(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {what}; load average {load_average()}", flush=True)


def print_table(columns: list[Column]) -> None:
    names = list(dict.fromkeys(name for col in columns for name in col.figures))
    print("| | " + " | ".join(f"{col.rows:,} rows" for col in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name in names:
        print(f"| {name} | " + " | ".join(col.figures.get(name, "-") for col in columns) + " |")
    for col in columns:
        print(f"\nat {col.rows:,} rows:")
        for note in col.notes:
            print(f"- {note}")


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")  # the embedded server's wheel, attaching
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="effect-gateway-growth-"))
    work.mkdir(parents=True, exist_ok=True)
    start_line = at_start(str(work))
    servers, setup = start(work, args.database_url)
    with running(servers):
        existing = _run(lambda: _one(setup.dsn, "select count(*) from effects"))
        if existing:
            raise SystemExit(
                f"effects already holds {existing:,} rows: the growth benchmark needs an empty table"
            )
        pg = _run(lambda: _postgres_facts(setup.dsn))
        checkpoint = _run(lambda: _one(setup.dsn, "show checkpoint_timeout"))
        wal_seconds = args.wal_seconds or _seconds(str(checkpoint))
        where = "given" if (args.database_url or "EFFECT_GATEWAY_DATABASE_URL" in os.environ) else "embedded"
        print(
            conditions(
                {
                    "load": generator_description(),
                    "postgres": f"{where}; {pg}",
                    "run": f"{args.rows:,} rows; new-effect rows {args.seconds:g} s x {args.repeat} "
                    f"(medians, c=1 and c={BUSY} interleaved); admin reads {args.admin_runs} each (median); "
                    f"sustained WAL {wal_seconds:g} s at {WAL_RATE:g}/s from a checkpoint on",
                },
                start_line,
            ),
            flush=True,
        )
        empty = Column(0)
        admin_reads(setup, empty, "run-none", args.admin_runs)
        latency_and_rate(setup, empty, args.seconds, args.repeat)
        say(f"sustained WAL at 0 rows: {wal_seconds:g} s")
        wal_sustained(setup, empty, wal_seconds)
        # The table the 0-row runs left is small, but its rows are the gateway's own: their size is
        # the reference for the filled ones.
        per_row, detail = sizes(setup.dsn)
        empty.figures["bytes per row (total relation size / rows)"] = f"{per_row} (the runs' own rows)"
        empty.notes.append(f"size after these runs: {detail}")
        say("0 rows done")

        grown = _run(lambda: _one(setup.dsn, "select count(*) from effects"))
        started = time.monotonic()

        def progress(done: int, seconds: float) -> None:
            print(f"  filled {done:,} rows in {seconds:.0f} s", flush=True)

        asyncio.run(fill.fill(setup.dsn, args.rows - grown, progress=progress))
        _run(lambda: _execute(setup.dsn, "vacuum analyze effects"))
        _run(lambda: _execute(setup.dsn, "checkpoint"))
        say("filled")
        size = Column(args.rows)
        size.notes.append(
            f"filled {args.rows - grown:,} rows (plus {grown:,} left by the 0-row runs) in "
            f"{time.monotonic() - started:.0f} s, vacuum analyze and checkpoint included"
        )
        per_row, detail = sizes(setup.dsn)
        size.figures["bytes per row (total relation size / rows)"] = per_row
        size.notes.append(f"size when filled: {detail}")
        run_id = "run-" + str(_run(lambda: _one(setup.dsn, f"select md5('run' || {args.rows // 2 // 20})")))
        admin_reads(setup, size, run_id, args.admin_runs)
        baseline = latency_and_rate(setup, size, args.seconds, args.repeat)
        say(f"sustained WAL at {args.rows:,} rows: {wal_seconds:g} s")
        wal_sustained(setup, size, wal_seconds)
        say("purge")
        purge(setup, size, baseline)
        per_row, detail = sizes(setup.dsn)
        size.notes.append(f"size after the purge: {detail}")
        _run(lambda: _execute(setup.dsn, "vacuum effects"))
        vacuumed, detail = sizes(setup.dsn)
        size.notes.append(f"size after the purge and a VACUUM: {detail}")
        size.figures["bytes per row after purge; after purge + vacuum"] = f"{per_row}; {vacuumed}"
        purged = _run(
            lambda: _one(
                setup.dsn,
                "select avg(pg_column_size(e.*)) from effects e tablesample system (1)"
                " where purged_at is not null",
            )
        )
        size.figures["an audit row after purge (pg_column_size)"] = f"{purged or 0:,.0f} bytes"
        print()
        print_table([empty, size])
        print(f"\nat the end: {machine_now(str(work))}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=int(os.environ.get("ROWS", 1_000_000)))
    parser.add_argument("--seconds", type=float, default=10.0, help="per new-effect row and repeat")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--admin-runs", type=int, default=5)
    parser.add_argument(
        "--wal-seconds", type=float, help="sustained-WAL window (default: the server's checkpoint_timeout)"
    )
    parser.add_argument("--database-url", help="an empty external Postgres instead of the embedded one")
    parser.add_argument("--work-dir", help="configs, logs and the embedded Postgres (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (and the filled database)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
