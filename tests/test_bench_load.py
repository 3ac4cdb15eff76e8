"""The benchmarks' load runs to its end and reports what it sent, however much it has to say."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from bench.harness import running, start_server
from bench.load import Load, LoadResult, LoadSpec

# Requests asked for, and the fewest that show the fix: each of the two processes must have more than
# the 64 KiB a pipe holds to print (a latency is about 9 characters: 7,300 each).
MANY_SAMPLES = 24_000
ENOUGH = 16_000


def test_a_python_load_reports_its_latencies_when_they_are_more_than_a_pipe_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench.loadgen's processes, sending a fixed number of requests each to a loopback upstream, are
    all counted once they end, with their percentiles.

    Their output went to a pipe that Load.result read only after each process had ended: a process
    with more than 64 KiB to print waited for the reader forever (a 10M growth run stopped there).
    """
    monkeypatch.setenv("BENCH_LOADGEN", "python")
    with running([]) as servers:
        upstream = start_server("upstream", [sys.executable, "-m", "bench.upstream"], tmp_path / "up.log")
        servers.append(upstream)
        # At a fixed rate the number of requests is known: 2 connections, MANY_SAMPLES in all. The rate
        # is well below what one process sends here with the whole suite running (4,600/s).
        spec = LoadSpec(upstream.url + "/orders", concurrency=2, duration=MANY_SAMPLES / 3000, rate=3000)
        load = Load(spec)
        results: list[LoadResult] = []
        waiting = threading.Thread(target=lambda: results.append(load.result()), daemon=True)
        waiting.start()
        waiting.join(timeout=60)
        if waiting.is_alive():
            load.kill()
            pytest.fail("Load.result() still waits a minute after the load's last request")
    [result] = results
    assert result.failed == 0
    assert result.not_2xx == 0
    assert result.requests >= ENOUGH
    assert 0 < result.p50_ms <= result.p99_ms <= result.max_ms
