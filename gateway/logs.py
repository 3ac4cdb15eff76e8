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

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

from gateway import process
from gateway.legible import printable
from gateway.trail import CURRENT, Trail

LogFormat = Literal["auto", "json", "text"]
DECISIONS = logging.getLogger("effect_gateway.decision")
# The handler this module installs, found again by name when the CLI configures logging once more.
_HANDLER = "effect_gateway"
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Made once: json.dumps with any option builds a new encoder on every call.
_ENCODE = json.JSONEncoder(default=str).encode


class JsonLines(logging.Formatter):
    """A JSON object per line: time (UTC), level, logger, message, pid, trace id, a decision's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
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


def _each_line_printable(text: str) -> str:
    return "\n".join(printable(line) for line in text.split("\n"))


def resolve_format(log_format: LogFormat, stream: TextIO) -> Literal["json", "text"]:
    if log_format != "auto":
        return log_format
    return "text" if stream.isatty() else "json"


def configure(log_format: LogFormat, *, debug: bool = False, stream: TextIO | None = None) -> None:
    """Log to stderr in ``log_format``, at INFO (DEBUG with ``debug``); warnings become log lines too.

    Like logging.basicConfig, leaves alone a process whose logging someone else has set up (a program
    embedding the gateway, a test runner); its own earlier set-up is replaced.
    """
    root = logging.getLogger()
    ours = [handler for handler in root.handlers if handler.get_name() == _HANDLER]
    if len(ours) != len(root.handlers):
        return
    for handler in ours:
        root.removeHandler(handler)
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
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
    if not DECISIONS.isEnabledFor(logging.INFO):
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
    where = f"{trail.upstream}{trail.path}" if trail.upstream else "(no upstream)"
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
    record = DECISIONS.makeRecord(
        DECISIONS.name, logging.INFO, "", 0, text, (), None, extra={"decision": fields}
    )
    DECISIONS.handle(record)
