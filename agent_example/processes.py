"""Child processes that announce where they listen: the gateway and the demo upstreams.

The gateway announces itself in its log, on stderr, like everything else it says: a JSON record with the
addresses as fields (``proxy_url``, ``admin_url``), or a text line naming them when its log is text. The
demo upstreams stand in for third-party APIs, have no log of their own, and print one plain
``NAME listening on URL`` line on stdout; they stay so, as the bench's servers do.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, NoReturn, TextIO

from gateway.serve import LISTENING

# The text log's message of the announcement (gateway.serve.announce): the agents' address, then the
# admin's.
_ANNOUNCED_AS_TEXT = re.compile(
    r"effect-gateway listening on (http://\S+) \(agents\) and on (http://\S+) \(admin"
)


@dataclass(frozen=True)
class Announcement:
    """Where a gateway listens: the agents' listener and the operators'."""

    url: str
    admin_url: str


def announcement(line: str) -> Announcement | None:
    """The addresses in a line of the gateway's log if it is the announcement, in either format."""
    if line.startswith("{"):
        try:
            doc = json.loads(line)
        except ValueError:
            return None
        if isinstance(doc, dict) and doc.get("event") == LISTENING:
            return Announcement(doc["proxy_url"], doc["admin_url"])
        return None
    found = _ANNOUNCED_AS_TEXT.search(line)
    return Announcement(found[1], found[2]) if found else None


class Output:
    """A child's stdout or stderr, read line by line as it comes (and copied to ``echo``, if given).

    A pipe nobody reads fills up (64 KiB), and the child then blocks on its next log line: a gateway
    logs a line per request, so one serving a few hundred requests would stall.
    """

    def __init__(self, stream: IO[str], echo: TextIO | None = None) -> None:
        self.lines: list[str] = []
        self._echo = echo
        self._announced: Announcement | None = None
        self._seen = threading.Event()  # the announcement came, or the stream ended
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line)
            if self._echo is not None:
                self._echo.write(line)
                self._echo.flush()
            if self._announced is None and (found := announcement(line)) is not None:
                self._announced = found
                self._seen.set()
        self._seen.set()

    def announced(self, timeout: float) -> Announcement | None:
        """The gateway's announcement, once it comes; None if the stream ends or ``timeout`` passes first."""
        self._seen.wait(timeout)
        return self._announced

    def whole(self, timeout: float = 10) -> list[str]:
        """Every line, once the child has closed the stream (it exited)."""
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise RuntimeError("the child still writes to its stream")
        return self.lines


@dataclass
class Service:
    proc: subprocess.Popen[str]
    url: str
    # What the child writes to its stderr (a gateway's log); None when it writes to this process's own.
    stderr: Output | None = None
    # A gateway's admin listener (the audit, the effects API, the metrics), as it announced it.
    admin_url: str | None = None
    # What a gateway writes to its stdout: nothing, when it serves (its log is on stderr).
    stdout: Output | None = None

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
    """``python ARGS``, a demo upstream, in a child process; returns once it prints ``... listening on URL``.

    ``own_stderr`` leaves the child's stderr on this process's (its logs on the terminal, never a pipe
    nobody reads, which a long-running child would fill).
    """
    proc = _popen(args, env, cwd, stderr=None if own_stderr else subprocess.PIPE)
    assert proc.stdout is not None
    stderr = None if proc.stderr is None else Output(proc.stderr)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if " listening on " in line:
            return Service(proc, line.rsplit(" ", 1)[1].strip(), stderr)
        if not line and proc.poll() is not None:
            break
    _give_up(proc, args, stderr)


def start_gateway(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    timeout: float = 30,
    cwd: str | None = None,
    *,
    echo: TextIO | None = None,
) -> Service:
    """``python ARGS``, a gateway's ``serve``, in a child process; returns once its log announces it.

    ``echo``: where to copy its log as it comes (a terminal, for a person trying it by hand).
    """
    proc = _popen(args, env, cwd, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stderr is not None
    stdout, stderr = Output(proc.stdout), Output(proc.stderr, echo)
    found = stderr.announced(timeout)
    if found is None:
        _give_up(proc, args, stderr)
    return Service(proc, found.url, stderr, found.admin_url, stdout)


def _popen(
    args: Sequence[str], env: dict[str, str] | None, cwd: str | None, *, stderr: int | None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def _give_up(proc: subprocess.Popen[str], args: Sequence[str], stderr: Output | None) -> NoReturn:
    proc.kill()
    proc.wait(5)
    err = "".join(stderr.whole()) if stderr is not None else ""
    raise RuntimeError(f"{' '.join(args)} did not start: {(err or 'see above').strip()[-2000:]}")
