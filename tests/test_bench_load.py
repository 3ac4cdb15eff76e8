"""The benchmarks' load runs to its end and reports what it sent, however much it has to say."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.harness import running, start_server
from bench.load import Load, LoadResult, LoadSpec

# Requests sent, more than the fix needs to show: each of the two processes must have more than the
# 64 KiB a pipe holds to print (a latency is about 9 characters: 7,300 each, 16,000 in all).
MANY_SAMPLES = 24_000


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
        # A number of requests, not a time: however busy the machine (the suite's other workers), the
        # processes have as much to print. The minute only bounds a machine far too slow for the test.
        spec = LoadSpec(upstream.url + "/orders", concurrency=2, duration=60, requests=MANY_SAMPLES)
        load = Load(spec)
        results: list[LoadResult] = []
        waiting = threading.Thread(target=lambda: results.append(load.result()), daemon=True)
        waiting.start()
        waiting.join(timeout=120)
        if waiting.is_alive():
            load.kill()
            pytest.fail("Load.result() still waits a minute after the load's end")
    [result] = results
    assert result.failed == 0
    assert result.not_2xx == 0
    assert result.requests == MANY_SAMPLES
    assert 0 < result.p50_ms <= result.p99_ms <= result.max_ms


def _stalling_server(stall_at: int, stall: float) -> tuple[int, threading.Thread]:
    """An HTTP/1.1 server on loopback that answers at once, but waits ``stall`` s before request
    ``stall_at``'s answer (one connection, then it ends)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            buffered, served = b"", 0
            while chunk := conn.recv(65536):
                buffered += chunk
                while b"\r\n\r\n" in buffered:
                    _, buffered = buffered.split(b"\r\n\r\n", 1)
                    served += 1
                    if served == stall_at:
                        time.sleep(stall)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def test_at_a_fixed_rate_a_stall_shows_in_the_latencies_of_the_requests_it_held_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 20 requests a second, a server that stalls 1.2 s once holds up the two dozen requests due
    meanwhile: each is timed from when it was due, so the median is the stall's, not a quick answer's.

    They were timed from when they were sent, after the stall: only the stalled request showed it, and
    a server that fell behind a fixed rate looked as fast as one that kept it.
    """
    monkeypatch.setenv("BENCH_LOADGEN", "python")
    port, server = _stalling_server(stall_at=3, stall=1.2)
    result = Load(LoadSpec(f"http://127.0.0.1:{port}/", concurrency=1, duration=2.0, rate=20)).result()
    server.join(timeout=10)
    assert result.failed == 0
    assert result.max_ms >= 1200
    assert result.p50_ms >= 100, result
