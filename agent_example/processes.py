"""Child processes that announce ``... listening on URL``: the gateway and the demo upstreams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Service:
    proc: subprocess.Popen[str]
    url: str

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def start_service(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    timeout: float = 30,
    cwd: str | None = None,
    *,
    own_stderr: bool = False,
) -> Service:
    """``python ARGS`` in a child process; returns once it prints the address it listens on.

    ``own_stderr`` leaves the child's stderr on this process's (its logs on the terminal, never a pipe
    nobody reads, which a long-running child would fill).
    """
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=None if own_stderr else subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if " listening on " in line:
            return Service(proc, line.rsplit(" ", 1)[1].strip())
        if not line and proc.poll() is not None:
            break
    proc.kill()
    _, err = proc.communicate(timeout=5)
    raise RuntimeError(f"{' '.join(args)} did not start: {(err or 'see above').strip()[-2000:]}")
