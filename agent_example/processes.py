"""Child processes that announce ``... listening on URL``: the gateway and the demo upstreams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO


class Stderr:
    """A child's stderr, read line by line as it comes.

    A pipe nobody reads fills up (64 KiB), and the child then blocks on its next log line: a gateway
    logs a line per request, so one serving a few hundred requests would stall.
    """

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)

    def whole(self, timeout: float = 10) -> list[str]:
        """Every line, once the child has closed its stderr (it exited)."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise RuntimeError("the child still writes to its stderr")
        return self.lines


@dataclass
class Service:
    proc: subprocess.Popen[str]
    url: str
    # What the child writes to its stderr; None when it writes to this process's own.
    stderr: Stderr | None = None
    # A gateway's admin listener (the audit, the effects API, the metrics), as it announced it.
    admin_url: str | None = None

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
    stderr = None if proc.stderr is None else Stderr(proc.stderr)
    deadline = time.monotonic() + timeout
    admin_url = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("effect-gateway admin "):
            admin_url = line.rsplit(" ", 1)[1].strip()
        if " listening on " in line:
            return Service(proc, line.rsplit(" ", 1)[1].strip(), stderr, admin_url)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    proc.wait(5)
    err = "".join(stderr.whole()) if stderr is not None else ""
    raise RuntimeError(f"{' '.join(args)} did not start: {(err or 'see above').strip()[-2000:]}")
