"""The gateway's log on stderr: JSON lines for a machine, or text for a person; one line per decision.

``log_format = "auto"`` (the default) writes text when stderr is a terminal and JSON lines otherwise:
a person at a terminal reads text, and a supervisor (systemd, a container runtime, Kubernetes) hands
stderr to a log pipeline that parses JSON. Every line written while a request runs carries the trace id
the agent sent. The line per decision (logger ``effect_gateway.decision``, INFO) names the effect, the
tenant, the upstream, the method, what came of it, the states before and after, the attempt, what
recovered it and how long it took; the key only as a keyed hash, no header and no query at all, so no
credential sent as a header reaches the log. The path is logged as sent: an API that puts a secret in
its paths (some webhook URLs do) should have that part in the upstream's ``base_url``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import traceback
import weakref
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from gateway import process
from gateway.legible import printable
from gateway.trail import CURRENT, Trail

LogFormat = Literal["auto", "json", "text"]
RoutineLevel = Literal["info", "debug"]
DECISIONS = logging.getLogger("effect_gateway.decision")
# The handler this module installs, found again by name when the CLI configures logging once more.
_HANDLER = "effect_gateway"
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What came of a request that went as it should: sent and answered, or its answer replayed, below 500
# (an upstream's 5xx is a failure an operator wants to see, though the gateway only relayed it). Their
# lines are logged at the level the routine_decisions setting chooses (debug leaves them out of the
# log); every other outcome's at INFO.
ROUTINE = frozenset({"sent", "replayed"})
_routine_level = logging.INFO
# Made once: json.dumps with any option builds a new encoder on every call.
_ENCODE = json.JSONEncoder(default=str).encode


class JsonLines(logging.Formatter):
    """A JSON object per line: time (UTC), level, logger, message, pid, trace id, a decision's fields,
    and the ``fields`` a record was logged with (``extra={"fields": {...}}``)."""

    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""  # the time of self._second, up to its seconds ("2026-12-07T16:22:53")

    def _time(self, created: float) -> str:
        # The date and time are spelled once a second; each line adds only its milliseconds.
        second = int(created)
        if second != self._second:
            self._second = second
            self._stamp = datetime.fromtimestamp(second, UTC).isoformat(timespec="seconds")[:19]
        return f"{self._stamp}.{int((created - second) * 1000):03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": self._time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": process.pid(),
        }
        trail = CURRENT.get()
        if trail is not None and trail.trace_id is not None:
            doc["trace_id"] = trail.trace_id
        decision = getattr(record, "decision", None)
        if decision is not None:
            doc.update(decision)
        # What a reader finds by name rather than in the message (the addresses serve listens on).
        # Never in place of the record's own (its time, level, message): a reader trusts those.
        fields = getattr(record, "fields", None)
        if fields is not None:
            doc.update({name: value for name, value in fields.items() if name not in doc})
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return _ENCODE(doc)


class Text(logging.Formatter):
    """The classic line, with the request's trace id at its end when the agent sent one.

    Written for a terminal, so every character a terminal would obey or hide is escaped, as the
    command line escapes it (:func:`gateway.legible.printable`): a line quotes request paths (aiohttp
    decodes ``%1b`` to a real ESC), errors and what upstreams and probes said. A message is one line;
    a traceback keeps its own line breaks.
    """

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return _each_line_printable(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _each_line_printable(super().formatStack(stack_info))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        trail = CURRENT.get()
        if trail is not None and trail.trace_id is not None:
            line += f" trace={printable(trail.trace_id)}"
        return line


class Lines(logging.StreamHandler):  # type: ignore[type-arg]
    """Lines to a stream, written together once per turn of the event loop that logged them.

    A request logs its line at its end; under load a turn of the loop ends dozens, and writing (and
    flushing) each line alone was a system call per request. Lines logged in a running loop wait in
    memory until the loop's current callbacks have run, no longer; anywhere else (another thread, no
    loop, the command line) a line is written at once, after any still waiting. A process killed
    (SIGKILL) loses at most the lines of the turn it was in; the audit in Postgres is the record.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._waiting: list[str] = []
        _HANDLERS.add(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            self._waiting.append(line)
            self.flush()
            return
        if not self._waiting:
            loop.call_soon(self.flush)
        self._waiting.append(line)

    def flush(self) -> None:
        self.acquire()
        try:
            lines, self._waiting = self._waiting, []
            encoding = getattr(self.stream, "encoding", None) or "utf-8"
            for chunk in _whole_lines(lines, encoding, getattr(self.stream, "errors", None) or "strict"):
                self.stream.write(chunk)
                self.stream.flush()
            if not lines:
                self.stream.flush()
        except Exception:
            # A closed or broken stream: as logging's handlers do, never raise into the caller, and say
            # so on stderr when logging is told to (logging.raiseExceptions, its default).
            self._waiting = []
            if logging.raiseExceptions:
                with contextlib.suppress(Exception):
                    traceback.print_exc(file=sys.stderr)
        finally:
            self.release()


# The most a write to a pipe may carry and still never be split by another process's write to it
# (POSIX's PIPE_BUF, 4096 on Linux): the workers of one gateway share its stderr, and a log shipper
# reading slowly would otherwise find one worker's line cut in two by another's.
PIPE_BUF = 4096


def _whole_lines(lines: list[str], encoding: str, errors: str) -> Iterator[str]:
    """``lines`` joined into pieces of at most PIPE_BUF bytes, as ``encoding`` writes them, that end
    with a line (a longer line alone)."""
    chunk: list[str] = []
    size = 0
    for line in lines:
        length = len(line) if line.isascii() else len(line.encode(encoding, errors))
        if chunk and size + length > PIPE_BUF:
            yield "".join(chunk)
            chunk, size = [], 0
        chunk.append(line)
        size += length
    if chunk:
        yield "".join(chunk)


# Every Lines handler: each writes out what waits before the process forks, or a worker would write its
# parent's lines again.
_HANDLERS: weakref.WeakSet[Lines] = weakref.WeakSet()


def _flush_before_fork() -> None:
    for handler in list(_HANDLERS):
        handler.flush()


os.register_at_fork(before=_flush_before_fork)


def _each_line_printable(text: str) -> str:
    return "\n".join(printable(line) for line in text.split("\n"))


def resolve_format(log_format: LogFormat, stream: TextIO) -> Literal["json", "text"]:
    if log_format != "auto":
        return log_format
    return "text" if stream.isatty() else "json"


def configure(
    log_format: LogFormat,
    *,
    debug: bool = False,
    stream: TextIO | None = None,
    routine_decisions: RoutineLevel = "info",
) -> None:
    """Log to stderr in ``log_format``, at INFO (DEBUG with ``debug``); warnings become log lines too.

    ``routine_decisions``: the level of the line for a request that went as it should (see ROUTINE).
    Like logging.basicConfig, leaves alone a process whose logging someone else has set up (a program
    embedding the gateway, a test runner); its own earlier set-up is replaced.
    """
    global _routine_level
    _routine_level = logging.DEBUG if routine_decisions == "debug" else logging.INFO
    root = logging.getLogger()
    ours = [handler for handler in root.handlers if handler.get_name() == _HANDLER]
    if len(ours) != len(root.handlers):
        return
    for handler in ours:
        root.removeHandler(handler)
    stream = stream or sys.stderr
    handler = Lines(stream)
    handler.set_name(_HANDLER)
    handler.setFormatter(JsonLines() if resolve_format(log_format, stream) == "json" else Text())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    logging.captureWarnings(True)
    # No line shows a thread or a process name, and the pid comes from gateway.process: looking each up
    # costs every line (getpid is a system call).
    logging.logThreads = False
    logging.logMultiprocessing = False
    logging.logProcesses = False


def decision(trail: Trail, outcome: str, seconds: float) -> None:
    """The line for one request to an upstream: what the gateway decided and what came of it."""
    routine = outcome in ROUTINE and (trail.status is None or trail.status < 500)
    level = _routine_level if routine else logging.INFO
    if not DECISIONS.isEnabledFor(level):
        return
    found = trail.found.value if trail.found else None
    left = trail.left.value if trail.left else None
    fields = {
        "effect_id": trail.effect_id,
        "tenant": trail.tenant,
        "upstream": trail.upstream or None,
        "method": trail.method,
        "path": trail.path or None,
        "outcome": outcome,
        "status": trail.status,
        "problem": trail.problem,
        "state_before": found,
        "state_after": left,
        "attempt": trail.attempt,
        "recovered_by": trail.recovered_by,
        "duration_ms": round(seconds * 1000, 3),
        "key_hash": trail.key_hash,
        "run_id": trail.run_id,
        "step": trail.step,
    }
    what = outcome if trail.problem is None else f"{outcome} ({trail.problem})"
    where = f"{trail.upstream}{trail.path}" if trail.upstream else f"{trail.path or '/'} (no upstream)"
    text = f"{trail.method} {where}: {what}, {trail.status}"
    if trail.effect_id is not None:
        text += f"; effect {trail.effect_id} {found or 'new'} -> {left}"
        if trail.attempt is not None:
            text += f", attempt {trail.attempt}"
    if trail.recovered_by is not None:
        text += f", recovered by {trail.recovered_by}"
    text += f"; {seconds * 1000:.2f} ms"
    if trail.key_hash is not None:
        text += f"; key #{trail.key_hash}"
    # Made here rather than by DECISIONS.info(), which would walk the stack for a caller nobody reads
    # (and with no file name, which the record would take apart for a module name nobody reads either).
    record = DECISIONS.makeRecord(DECISIONS.name, level, "", 0, text, (), None, extra={"decision": fields})
    DECISIONS.handle(record)
