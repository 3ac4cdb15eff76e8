"""Resident memory of each gateway worker as effects pile up: is what a worker keeps bounded?

Run: `make bench-memory` (EFFECTS=1000000 by default), or `python -m bench.worker_memory --effects
1000000 --workers 2`. The gateway runs as users start it (`effect-gateway serve`, embedded Postgres) in
a process of its own, with `replay_cache_bytes` as configured (32 MiB unless --cache-mib says
otherwise); new effects come from wrk (or bench.loadgen) at concurrency 64 in rounds, each followed by
a round over 10,000 keys of its own (new effects the first time, replays after: the replay cache is
used as well as filled). After each
round every worker's VmRSS and VmHWM (its peak) are read from /proc and printed as a table row.

A worker whose memory keeps climbing with the effect count after the cache is full holds something per
effect that it should not; a flat line after the first rounds is what a bounded worker looks like.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

from bench.gateway_load import BODY, HEADERS, parse_workers, start_gateway, workers_support
from bench.harness import at_start, conditions, running, start_server, work_dir
from bench.load import Load, LoadSpec, generator_description

CONCURRENCY = 64
# Keys replayed after each round of new effects (created by the first such round).
REPLAY_KEYS = 10_000


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def run(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    if workers_support() != "setting":
        sys.exit("this build has no workers setting")
    with work_dir("effect-gateway-memory-") as work:
        measure(args, work)


def measure(args: argparse.Namespace, work: Path) -> None:
    start_line = at_start(str(work))
    (workers,) = parse_workers(args.workers)
    with running([]) as started:
        upstream = start_server("upstream", [sys.executable, "-m", "bench.upstream"], work / "upstream.log")
        started.append(upstream)
        extra = (f"replay_cache_bytes = {args.cache_mib * 1024 * 1024}",)
        gw = start_gateway(workers, "setting", upstream.url, work, None, extra=extra)
        started.append(gw.server)
        time.sleep(1)
        pids = sorted(gw.pids() - {gw.server.pid})
        print(
            conditions(
                {
                    "load": generator_description(),
                    "run": f"{args.effects:,} new effects at c={CONCURRENCY} in rounds of {args.round:g} s, "
                    f"a {args.round / 4:g} s round over {REPLAY_KEYS:,} keys after each; workers "
                    f"{workers} (pids {', '.join(map(str, pids))}); replay_cache_bytes {args.cache_mib} MiB",
                },
                start_line,
            ),
            flush=True,
        )
        workers_cells = " | ".join(f"worker {i + 1} RSS / peak MB" for i in range(len(pids)))
        print(f"\n| new effects | req/s new | req/s {REPLAY_KEYS:,} keys | {workers_cells} |")
        print("|---|---|---|" + "---|" * len(pids))
        row(0, None, None, pids)
        done = 0
        seq = 0
        while done < args.effects:
            seq += 1
            tag = f"{gw.tag}.{seq}"
            url = f"{gw.server.url}/shop/orders"
            spec = LoadSpec(url, CONCURRENCY, args.round, mode="new", tag=tag, body=BODY, headers=HEADERS)
            new = Load(spec).result()
            done += new.requests
            if new.not_2xx or new.failed:
                print(f"(!) round {seq}: {new.not_2xx} answers not 2xx, {new.failed} failed", flush=True)
            # The same REPLAY_KEYS keys round and round: new effects in the first round, replays after.
            replay_spec = replace(
                spec, duration=args.round / 4, mode="cycle", tag=f"{gw.tag}.replay", keys=REPLAY_KEYS
            )
            replay = Load(replay_spec).result()
            row(done, new.rate, replay.rate, pids)


def row(done: int, new: float | None, replay: float | None, pids: list[int]) -> None:
    cells = []
    for pid in pids:
        rss, peak = memory_kib(pid)
        cells.append(f"{rss / 1024:.0f} / {peak / 1024:.0f}")
    rates = [f"{r:,.0f}" if r is not None else "-" for r in (new, replay)]
    print(f"| {done:,} | {rates[0]} | {rates[1]} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--effects", type=int, default=1_000_000, help="new effects in all")
    parser.add_argument("--workers", default="N", help="a number, or N for the cores (default)")
    parser.add_argument("--cache-mib", type=int, default=32, help="replay_cache_bytes, in MiB")
    parser.add_argument("--round", type=float, default=60.0, help="seconds of new effects per row")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
