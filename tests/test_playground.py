"""`make serve`: the gateway with examples/gateway.toml in front of the demo upstreams, and what to try."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_deploy import _unshare

ROOT = Path(__file__).resolve().parent.parent

# Run inside a network namespace of its own, where the example's fixed ports (8787, 9001-9003) are free.
SCRIPT = r"""
import json, os, signal, subprocess, sys, urllib.request
from tests.compose_processes import loopback_up

loopback_up()
proc = subprocess.Popen([sys.executable, "-m", "agent_example.playground"], stdout=subprocess.PIPE, text=True)
printed = []
for line in proc.stdout:
    printed.append(line)
    if "Ctrl+C" in line:
        break
answers = []
for _ in range(2):
    request = urllib.request.Request(
        "http://127.0.0.1:8787/shop/orders", data=b'{"items": ["atta"]}', method="POST",
        headers={"Idempotency-Key": "run-1:4", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        answers.append([resp.status, resp.headers.get("Idempotent-Replayed"), resp.read().decode()])
proc.send_signal(signal.SIGINT)
code = proc.wait(60)
print(json.dumps({"printed": "".join(printed), "answers": answers, "exit": code}))
"""


def test_make_serve_starts_the_upstreams_and_says_what_to_try(tmp_path: Path) -> None:
    """The example gateway answers with the demo shop behind it, replays, and Ctrl+C stops all it started."""
    done = subprocess.run(
        [*_unshare(), sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env={"EFFECT_GATEWAY_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert "curl -s -H 'Idempotency-Key: run-1:4'" in result["printed"]
    assert "curl -s http://127.0.0.1:8788/_gateway/effects" in result["printed"]
    assert "http://127.0.0.1:8788/_gateway/audit" in result["printed"]
    (first_status, first_replayed, first), (again_status, again_replayed, again) = result["answers"]
    assert (first_status, first_replayed, json.loads(first)["status"]) == (201, None, "placed")
    assert (again_status, again_replayed, again) == (201, "true", first)
    assert result["exit"] == 0
