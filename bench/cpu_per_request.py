"""Gateway and Postgres CPU milliseconds per request, for a new effect and for a replay.

Run: `python -m bench.cpu_per_request` (`--requests 4000 --concurrency 8 --repeat 3`; under a minute),
or `python -m bench.cpu_per_request --against DIR --repeat 5` to compare this tree's gateway with the
one in DIR (another checkout, e.g. `git worktree add /tmp/base main`; `--python` its own venv's
interpreter, which `make bench-against REF=...` builds). `--concurrency 16,64` measures at each. The
trivial upstream (bench.upstream) and the gateway as users start it (`effect-gateway serve`, one worker,
its own embedded Postgres, or the one given) run in processes of their own; wrk (or bench.loadgen) sends
the requests from another. Each run sends about ``--requests`` new effects (a fresh key each), then as
many replays (1,000 keys completed beforehand, round and round), and reads the user + system CPU time
the gateway's processes and its Postgres's spent meanwhile from /proc, and the WAL its Postgres wrote.
Then, per gateway: a new effect's latency one at a time, against the upstream called directly in the
same turn (the p50 the gateway adds), and the WAL flushes (fsyncs) per new effect at the highest
concurrency, read from Postgres's statistics once they have settled.

CPU time per request, unlike req/s, hardly moves when other work shares the machine, but it does some
(other processes evict the caches a request would find warm): the table gives the median of
``--repeat`` runs and how far the runs were apart. With ``--against`` the two gateways take turns in
every run (ABBA), and ``change`` is the median of the runs' ratios, which a busy moment moves little.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import pgstats, profiling
from bench.gateway_load import BODY, HEADERS, REPLAY_KEYS, Gateway, post, prepare, start_gateway
from bench.harness import (
    at_start,
    checkout_commit,
    conditions,
    cpu_seconds,
    machine_now,
    running,
    start_server,
    work_dir,
)
from bench.load import Load, LoadResult, LoadSpec, generator_description

# Below this a run's CPU time is a handful of the kernel's 10 ms ticks: too coarse to compare.
MIN_REQUESTS = 1000
KINDS = ("new", "replay")


# One turn of load one request at a time (seconds): a few thousand requests, enough for a steady p50.
SINGLE_SECONDS = 3.0


@dataclass(frozen=True)
class Sample:
    gateway_ms: float
    postgres_ms: float
    rate: float
    wal_bytes: float


KindAt = tuple[str, int]  # a kind of request and the concurrency it is sent at


@dataclass
class Subject:
    """A gateway under measurement: its label, loads, and what each run of them cost."""

    label: str
    gw: Gateway
    loads: dict[KindAt, LoadSpec]
    rates: dict[KindAt, float] = field(default_factory=dict)
    samples: dict[KindAt, list[Sample]] = field(default_factory=dict)
    added_p50: list[float] = field(default_factory=list)  # ms over the upstream called directly, c=1
    syncs: float | None = None  # WAL flushes per new effect


def sample(gw: Gateway, spec: LoadSpec, requests: int) -> Sample:
    """One load of about ``requests`` requests; CPU per request of the gateway and of its Postgres."""
    ours, pg = gw.pids(), gw.pg_pids()
    wal_before = pgstats.wal_position(gw.dsn)
    before_gw, before_pg = cpu_seconds(ours), cpu_seconds(pg)
    result = Load(spec).result()
    # Only the processes there at the start: a Postgres backend that ended meanwhile is not counted,
    # which the pool (connections held for the gateway's life) makes rare.
    after_gw, after_pg = cpu_seconds(ours), cpu_seconds(pg)
    wal = pgstats.wal_position(gw.dsn) - wal_before
    _check(result, spec, requests)
    n = result.requests
    return Sample(1000 * (after_gw - before_gw) / n, 1000 * (after_pg - before_pg) / n, result.rate, wal / n)


def _check(result: LoadResult, spec: LoadSpec, requests: int) -> None:
    if result.not_2xx or result.failed:
        raise RuntimeError(f"{result.not_2xx} answers not 2xx, {result.failed} failed ({spec.url})")
    if result.requests < requests / 4:
        raise RuntimeError(f"only {result.requests} of about {requests} requests were sent")


def duration_for(rate: float, requests: int) -> float:
    """Seconds of load that send about ``requests`` at ``rate`` (wrk runs for whole seconds)."""
    return float(max(1, round(requests / rate))) if rate else 2.0


def loads(gw: Gateway, concurrencies: list[int]) -> dict[KindAt, LoadSpec]:
    out = {}
    for c in concurrencies:
        common = LoadSpec(f"{gw.server.url}/shop/orders", c, 2.0, body=BODY, headers=HEADERS)
        out[("new", c)] = replace(common, mode="new", tag=f"{gw.tag}.new{c}")
        out[("replay", c)] = replace(common, mode="cycle", tag=gw.tag, keys=REPLAY_KEYS)
    return out


def measure_subject(subject: Subject, rep: int, requests: int) -> None:
    for load, spec in subject.loads.items():
        seconds = duration_for(subject.rates[load], requests)
        tag = f"{spec.tag}.{rep}" if load[0] == "new" else spec.tag
        got = sample(subject.gw, replace(spec, duration=seconds, tag=tag), requests)
        subject.samples.setdefault(load, []).append(got)
        subject.rates[load] = got.rate


def one_at_a_time(subjects: list[Subject], upstream: str, rep: int) -> None:
    """Each gateway's p50 for a new effect at c=1, less the upstream's own, called directly just before."""
    for subject in subjects if rep % 2 == 0 else subjects[::-1]:
        direct = LoadSpec(f"{upstream}/orders", 1, SINGLE_SECONDS, body=BODY, headers=HEADERS, mode="new")
        spec = replace(subject.loads[("new", min(c for _, c in subject.loads))], concurrency=1)
        base = Load(replace(direct, tag=f"direct.{subject.gw.tag}.{rep}")).result()
        got = Load(replace(spec, duration=SINGLE_SECONDS, tag=f"{spec.tag}.one.{rep}")).result()
        _check(got, spec, 100)
        subject.added_p50.append(got.p50_ms - base.p50_ms)


def flushes(subject: Subject, concurrency: int, requests: int) -> None:
    """WAL flushes per new effect at ``concurrency``, read once Postgres's statistics have settled."""
    time.sleep(pgstats.STATS_SETTLE)
    before = pgstats.wal_syncs(subject.gw.dsn)
    spec = subject.loads[("new", concurrency)]
    seconds = duration_for(subject.rates[("new", concurrency)], requests)
    result = Load(replace(spec, duration=seconds, tag=f"{spec.tag}.syncs")).result()
    _check(result, spec, requests)
    time.sleep(pgstats.STATS_SETTLE)
    subject.syncs = (pgstats.wal_syncs(subject.gw.dsn) - before) / result.requests


Tree = tuple[str, dict[str, str] | None]  # a label, and the environment its gateway runs in


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    trees: list[Tree] = [("this tree", None)]
    if args.against:
        other = str(Path(args.against).resolve())
        if not Path(other, "gateway", "__init__.py").exists():
            sys.exit(f"--against {args.against}: no gateway/ package there")
        # The other tree's packages come first on its gateway's path; bench code stays this tree's.
        env = {**os.environ, "PYTHONPATH": other}
        if args.python:
            env["BENCH_GATEWAY_PYTHON"] = args.python  # its own venv, with the libraries it pinned
        trees.append((args.against, env))
    with work_dir("effect-gateway-cpu-") as work:
        measure(args, trees, work)


def measure(args: argparse.Namespace, trees: list[Tree], work: Path) -> None:
    start_line = at_start(str(work))
    subjects: list[Subject] = []
    with running([]) as started:
        upstream = start_server("upstream", [sys.executable, "-m", "bench.upstream"], work / "upstream.log")
        started.append(upstream)
        try:
            for i, (label, env) in enumerate(trees):
                gw = start_gateway(
                    1, "setting", upstream.url, work, args.database_url, env=env, name=f"gw{i}"
                )
                started.append(gw.server)
                prepare(gw)
                subjects.append(Subject(label, gw, loads(gw, args.concurrency)))
            against = ""
            if args.against:
                against = f"; against {args.against} (commit {checkout_commit(Path(args.against))}), in turns"
            print(
                conditions(
                    {
                        "load": generator_description(),
                        "run": f"about {args.requests:,} requests per kind and run, concurrency "
                        f"{', '.join(map(str, args.concurrency))}, {args.repeat} runs (medians), workers 1"
                        + against,
                    },
                    start_line,
                ),
                flush=True,
            )
            for subject in subjects:  # warm up, and learn the rates that make a run ``requests`` long
                for load, spec in subject.loads.items():
                    tag = f"{spec.tag}.warm" if load[0] == "new" else spec.tag
                    subject.rates[load] = Load(replace(spec, tag=tag)).result().rate
            for rep in range(args.repeat):
                for subject in subjects if rep % 2 == 0 else subjects[::-1]:
                    measure_subject(subject, rep, args.requests)
                one_at_a_time(subjects, upstream.url, rep)
                print(f"run {rep + 1}/{args.repeat} done", flush=True)
            for subject in subjects:
                flushes(subject, max(args.concurrency), args.requests)
            if args.profile:
                for load, spec in subjects[0].loads.items():
                    tag = f"{spec.tag}.profile" if load[0] == "new" else spec.tag
                    seconds = args.profile_seconds
                    profile(subjects[0].gw, replace(spec, duration=seconds + 2, tag=tag), Path(args.profile))
        finally:
            post(f"{upstream.url}/release", None)  # the requests prepare() holds: the gateways may stop
            for subject in subjects:
                if subject.gw.twin is not None:
                    subject.gw.twin.join(30)
    for c in args.concurrency:
        print(f"\nat concurrency {c}:\n")
        print(table(subjects, c))
    print()
    print(single_table(subjects, max(args.concurrency)))
    print(f"\nat the end: {machine_now(str(work))}")


def profile(gw: Gateway, spec: LoadSpec, out_dir: Path) -> None:
    """py-spy on the gateway during ``spec`` (not counted in the table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"{spec.mode}-c{spec.concurrency}.txt"
    seconds = spec.duration - 2
    load = Load(spec)
    time.sleep(1)  # past the connections' start
    spy = profiling.record(gw.server.pid, seconds, raw, subprocesses=True)
    _, err = spy.communicate()
    load.result()
    print(f"\npy-spy, {spec.mode} at c={spec.concurrency} ({raw}):")
    print(profiling.summary(raw, seconds) if raw.exists() else f"  py-spy failed: {err.decode().strip()}")


def _median_spread(values: list[float]) -> tuple[str, str]:
    mid = statistics.median(values)
    return f"{mid:.3f}", f"{100 * (max(values) - min(values)) / mid:.0f}%" if mid else "-"


def table(subjects: list[Subject], concurrency: int) -> str:
    out = [
        "| gateway | path | gateway CPU ms/req | spread | change | Postgres CPU ms/req | spread | change "
        "| WAL KB/req | req/s | rate ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = subjects[0]
    for subject in subjects:
        for kind in KINDS:
            runs = subject.samples[(kind, concurrency)]
            ours = first.samples[(kind, concurrency)]
            cpu, cpu_spread = _median_spread([s.gateway_ms for s in runs])
            pg, pg_spread = _median_spread([s.postgres_ms for s in runs])
            changes = ["", "", ""]
            if subject is not first:  # this tree's against this one, run by run
                for i, of in enumerate(("gateway_ms", "postgres_ms", "rate")):
                    ratios = [
                        getattr(a, of) / getattr(b, of)
                        for a, b in zip(ours, runs, strict=True)
                        if getattr(b, of)
                    ]
                    changes[i] = f"{statistics.median(ratios):.2f}x" if ratios else "-"
            rate = statistics.median(s.rate for s in runs)
            wal = statistics.median(s.wal_bytes for s in runs) / 1024
            path = "new effect" if kind == "new" else "replay"
            cells = (subject.label, path, cpu, cpu_spread, changes[0], pg, pg_spread, changes[1])
            out.append("| " + " | ".join((*cells, f"{wal:.2f}", f"{rate:,.0f}", changes[2])) + " |")
    out.append(
        "medians over the runs; spread: (max - min) / median; CPU: user + system, from /proc; change and "
        "rate ratio: this tree's figure over that row's, the median of the runs' ratios"
    )
    return "\n".join(out)


def single_table(subjects: list[Subject], concurrency: int) -> str:
    out = [
        f"| gateway | added p50 at c=1, ms | spread | WAL flushes per new effect at c={concurrency} |",
        "|---|---|---|---|",
    ]
    for subject in subjects:
        added, spread = _median_spread(subject.added_p50)
        syncs = f"{subject.syncs:.2f}" if subject.syncs is not None else "-"
        out.append(f"| {subject.label} | {added} | {spread} | {syncs} |")
    out.append(
        "added p50: a new effect's p50 through the gateway less the upstream's own, called directly in the "
        "same turn; flushes: Postgres's count of WAL fsyncs over one run, read after its statistics settled"
    )
    return "\n".join(out)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: numbers separated by commas, like 16,64") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="about this many per kind and run")
    parser.add_argument(
        "--concurrency", type=_counts, default=[8], help="connections held by the load (16,64: at each)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs; the table shows medians")
    parser.add_argument("--against", metavar="DIR", help="a checkout whose gateway to compare, in turns")
    parser.add_argument("--python", metavar="PATH", help="the interpreter of --against's gateway (its venv)")
    parser.add_argument("--database-url", help="an external Postgres instead of the embedded one")
    parser.add_argument("--profile", metavar="DIR", help="then py-spy this tree's gateway under each load")
    parser.add_argument("--profile-seconds", type=float, default=8.0, help="seconds per py-spy recording")
    args = parser.parse_args()
    if args.requests < MIN_REQUESTS:
        parser.error(f"--requests: at least {MIN_REQUESTS}, or the kernel's CPU ticks are too coarse")
    run(args)


if __name__ == "__main__":
    main()
