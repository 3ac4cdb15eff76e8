"""What a checkpoint costs: the reference article's step (select, then insert) against the journal's.

Run: `make bench` (or `python -m bench.journal_step --steps 2000`). The article's step asks Postgres
whether the step has a row, then inserts it: two round trips per new step, one per replayed step. The
journal inserts with ``on conflict do nothing returning`` (one round trip per new step) and loads a
resumed run's steps once (no round trip per replayed step). Both run side by side on one Postgres
(embedded, or $TEST_DATABASE_URL), interleaved; the article measured 0.64 ms p50 (1.34 ms p99) per new
step and 0.24 ms per replay on Node 20 and Postgres 14.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import asyncpg

from bench.common import on_postgres, p50_p99, where
from journal import Journal

OUTPUT = {"low": ["atta", "toor dal", "paneer", "spinach"]}


async def article_step(conn: asyncpg.Connection, run_id: str, n: int) -> object:
    """The article's step(), verbatim in Python: a select, and on a miss an insert."""
    row = await conn.fetchrow("select output from agent_steps where run_id = $1 and step = $2", run_id, n)
    if row is not None:
        return row["output"]
    await conn.execute(
        "insert into agent_steps (run_id, step, name, output) values ($1, $2, $3, $4)",
        run_id,
        n,
        "pantry",
        json.dumps(OUTPUT),
    )
    return OUTPUT


async def run(steps: int, dsn: str) -> None:
    journal = await Journal.connect(dsn)
    conn = await asyncpg.connect(dsn)
    tag = str(time.time_ns())
    per_run = 10  # steps per run: an agent of a handful of steps, as in the article
    runs = steps // per_run
    try:
        for r in range(runs):
            await conn.execute("insert into agent_runs (id) values ($1)", f"article-{tag}-{r}")
        article_new: list[float] = []
        ours_new: list[float] = []
        for r in range(runs):
            ours = await journal.run(f"ours-{tag}-{r}")
            for n in range(1, per_run + 1):
                start = time.perf_counter()
                await article_step(conn, f"article-{tag}-{r}", n)
                article_new.append((time.perf_counter() - start) * 1000)
                start = time.perf_counter()
                await ours.step("pantry", lambda ctx: OUTPUT)
                ours_new.append((time.perf_counter() - start) * 1000)
        article_replay: list[float] = []
        ours_replay: list[float] = []
        ours_resume: list[float] = []
        for r in range(runs):
            start = time.perf_counter()
            resumed = await journal.run(f"ours-{tag}-{r}")  # loads the run's saved steps once
            ours_resume.append((time.perf_counter() - start) * 1000)
            for n in range(1, per_run + 1):
                start = time.perf_counter()
                await article_step(conn, f"article-{tag}-{r}", n)
                article_replay.append((time.perf_counter() - start) * 1000)
                start = time.perf_counter()
                await resumed.step("pantry", lambda ctx: OUTPUT)
                ours_replay.append((time.perf_counter() - start) * 1000)
    finally:
        await conn.close()
        await journal.close()

    print(f"\n{runs * per_run} steps each ({runs} runs of {per_run}), Postgres {where()}, interleaved")
    print(f"| {'operation':<44} | {'p50 ms':>8} | {'p99 ms':>8} | {'vs article':>10} |")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 10}|{'-' * 12}|")
    base_new, base_replay = statistics.median(article_new), statistics.median(article_replay)
    for name, samples, base in (
        ("new step, article (select + insert)", article_new, None),
        ("new step, journal (insert .. on conflict)", ours_new, base_new),
        ("replayed step, article (select)", article_replay, None),
        ("replayed step, journal (loaded at resume)", ours_replay, base_replay),
        ("resuming a run of 10 steps, journal", ours_resume, None),
    ):
        p50, p99 = p50_p99(samples)
        ratio = "" if base is None else f"{p50 / base:.2f}x"
        print(f"| {name:<44} | {p50:>8.3f} | {p99:>8.3f} | {ratio:>10} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    on_postgres(lambda dsn: run(args.steps, dsn))


if __name__ == "__main__":
    main()
