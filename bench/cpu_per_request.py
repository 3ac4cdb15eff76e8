"""Gateway and Postgres CPU milliseconds per request, for a new effect and for a replay.

Run: `python -m bench.cpu_per_request` (`--requests 4000 --concurrency 8 --repeat 3`; about a minute).
The trivial upstream (bench.upstream) and the gateway as users start it (`effect-gateway serve`, one
worker, embedded Postgres or $EFFECT_GATEWAY_DATABASE_URL) run in processes of their own; wrk (or
bench.loadgen) sends the requests from another. Each run sends about ``--requests`` new effects (a fresh
key each), then as many replays (1,000 keys completed beforehand, round and round), and reads the
user + system CPU time the gateway's processes and Postgres's spent meanwhile from /proc.

CPU time per request, unlike req/s, hardly moves when other work shares the machine: the table is the
median of ``--repeat`` runs, and the spread beside it shows how far the runs were apart.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from bench import profiling
from bench.gateway_load import BODY, HEADERS, REPLAY_KEYS, Gateway, post, prepare, start_gateway
from bench.harness import at_start, conditions, cpu_seconds, machine_now, running, start_server
from bench.load import Load, LoadSpec, generator_description

# Below this a run's CPU time is a handful of the kernel's 10 ms ticks: too coarse to compare.
MIN_REQUESTS = 1000


@dataclass(frozen=True)
class Sample:
    gateway_ms: float
    postgres_ms: float
    rate: float


def sample(gw: Gateway, spec: LoadSpec, requests: int) -> Sample:
    """One load of about ``requests`` requests; CPU per request of the gateway and of Postgres."""
    ours, pg = gw.pids(), gw.pg_pids()
    # Backends come and go with the pool: read the tree again at the end, count those present at both.
    before_gw, before_pg = cpu_seconds(ours), cpu_seconds(pg)
    result = Load(spec).result()
    after_gw, after_pg = cpu_seconds(ours), cpu_seconds(pg)
    if result.not_2xx or result.failed:
        raise RuntimeError(f"{result.not_2xx} answers not 2xx, {result.failed} failed ({spec.url})")
    if result.requests < requests / 4:
        raise RuntimeError(f"only {result.requests} of about {requests} requests were sent")
    n = result.requests
    return Sample(1000 * (after_gw - before_gw) / n, 1000 * (after_pg - before_pg) / n, result.rate)


def duration_for(rate: float, requests: int) -> float:
    """Seconds of load that send about ``requests`` at ``rate`` (wrk runs for whole seconds)."""
    return float(max(1, round(requests / rate))) if rate else 2.0


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    work = Path(tempfile.mkdtemp(prefix="effect-gateway-cpu-"))
    start_line = at_start(str(work))
    url_path = "/shop/orders"
    with running([]) as started:
        upstream = start_server("upstream", [sys.executable, "-m", "bench.upstream"], work / "upstream.log")
        started.append(upstream)
        gw = start_gateway(1, "setting", upstream.url, work, args.database_url)
        started.append(gw.server)
        try:
            prepare(gw)
            print(
                conditions(
                    {
                        "load": generator_description(),
                        "run": f"about {args.requests:,} requests per kind and run, concurrency "
                        f"{args.concurrency}, {args.repeat} runs (medians), workers 1",
                    },
                    start_line,
                ),
                flush=True,
            )
            url = f"{gw.server.url}{url_path}"
            common = LoadSpec(url, args.concurrency, 2.0, body=BODY, headers=HEADERS)
            new = replace(common, mode="new")
            replay = replace(common, mode="cycle", tag=gw.tag, keys=REPLAY_KEYS)
            # Warm up, and learn each kind's rate, so that a run lasts as long as ``requests`` takes.
            rates = {}
            for kind, spec in (("new", new), ("replay", replay)):
                tag = f"{gw.tag}.warm" if kind == "new" else gw.tag
                warm = Load(replace(spec, tag=tag)).result()
                rates[kind] = warm.rate
            samples: dict[str, list[Sample]] = {"new": [], "replay": []}
            for rep in range(args.repeat):
                for kind, spec in (("new", new), ("replay", replay)):
                    seconds = duration_for(rates[kind], args.requests)
                    tag = f"{gw.tag}.{rep}" if kind == "new" else gw.tag
                    got = sample(gw, replace(spec, duration=seconds, tag=tag), args.requests)
                    samples[kind].append(got)
                    rates[kind] = got.rate
                print(f"run {rep + 1}/{args.repeat} done", flush=True)
            if args.profile:
                for kind, spec in (("new", new), ("replay", replay)):
                    tag = f"{gw.tag}.profile" if kind == "new" else gw.tag
                    profile(gw, replace(spec, duration=args.profile_seconds + 2, tag=tag), Path(args.profile))
        finally:
            post(f"{upstream.url}/release", None)  # the request prepare() holds: the gateway may stop
            if gw.twin is not None:
                gw.twin.join(30)
    print()
    print(table(samples))
    print(f"\nat the end: {machine_now(str(work))}")
    shutil.rmtree(work, ignore_errors=True)


def profile(gw: Gateway, spec: LoadSpec, out_dir: Path) -> None:
    """py-spy on the gateway's worker during ``spec`` (not counted in the table)."""
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


def table(samples: dict[str, list[Sample]]) -> str:
    out = [
        "| path | gateway CPU ms/req | spread | Postgres CPU ms/req | spread | req/s |",
        "|---|---|---|---|---|---|",
    ]
    for kind, runs in samples.items():
        cells = []
        for values in ([s.gateway_ms for s in runs], [s.postgres_ms for s in runs]):
            mid = statistics.median(values)
            spread = f"{100 * (max(values) - min(values)) / mid:.0f}%" if mid else "-"
            cells += [f"{mid:.3f}", spread]
        rate = statistics.median(s.rate for s in runs)
        out.append(
            f"| {'new effect' if kind == 'new' else 'replay'} | " + " | ".join(cells) + f" | {rate:,.0f} |"
        )
    out.append("medians over the runs; spread: (max - min) / median; CPU: user + system, from /proc")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="about this many per kind and run")
    parser.add_argument("--concurrency", type=int, default=8, help="connections held by the load")
    parser.add_argument("--repeat", type=int, default=3, help="runs; the table shows medians")
    parser.add_argument("--database-url", help="an external Postgres instead of the embedded one")
    parser.add_argument(
        "--profile", metavar="DIR", help="then py-spy the gateway under each load; stacks here"
    )
    parser.add_argument("--profile-seconds", type=float, default=8.0, help="seconds per py-spy recording")
    args = parser.parse_args()
    if args.requests < MIN_REQUESTS:
        parser.error(f"--requests: at least {MIN_REQUESTS}, or the kernel's CPU ticks are too coarse")
    run(args)


if __name__ == "__main__":
    main()
