"""py-spy on a server while a load runs: the raw stacks kept, and where the time went printed in short.

The raw file is the "collapsed stacks" format (one line per stack and its sample count) that speedscope
and flamegraph.pl read. py-spy keeps only samples of threads that are not idle (no --idle), so the share
of samples kept, out of rate x seconds, is how often the event loop was not waiting for I/O: near 100%
is a saturated loop. Samples are taken by the wall clock: a process that waits for a core (a busy
machine) is still "not idle", and the frame on top when it was preempted gets the time. On loopback
that is often a socket write, whose system call wakes the peer (wrk, the upstream, Postgres), which
may take the core at once; so on a shared machine socket writes look dearer than they are.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# 250 a second: enough samples in 10 s to rank functions, few enough that pausing the process to read
# its stacks costs it little.
RATE = 250
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*)\)$")
# Where a leaf frame's time is charged, by the file py-spy names for it (a module path): first match wins.
# A frame's time includes the C code it calls, so a transport's write is mostly the send() system call.
AREAS = (
    ("gateway (our code)", ("gateway/",)),
    ("asyncpg", ("asyncpg/",)),
    ("aiohttp server", ("aiohttp/web", "aiohttp/http_", "aiohttp/_http", "aiohttp/base_protocol")),
    ("aiohttp client", ("aiohttp/client", "aiohttp/connector", "aiohttp/tracing")),
    ("aiohttp, other", ("aiohttp/", "aiosignal/", "multidict/", "yarl/")),
    ("socket reads and writes", ("asyncio/selector_events.py",)),
    ("asyncio event loop", ("asyncio/", "selectors.py")),
    ("json", ("json/",)),
)


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, out: Path, *, subprocesses: bool) -> subprocess.Popen[bytes]:
    """Start py-spy on ``pid`` for ``seconds``; wait for the returned process before reading ``out``."""
    exe = py_spy()
    if exe is None:
        raise RuntimeError("py-spy is not installed: .venv/bin/pip install py-spy")
    argv = [
        exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(RATE),
        "--format", "raw", "--nolineno", "--output", str(out),
    ]  # fmt: skip
    if subprocesses:
        argv.append("--subprocesses")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _area(file: str) -> str:
    for name, needles in AREAS:
        if any(file.startswith(needle) for needle in needles):
            return name
    return "other"


def summary(raw: Path, seconds: float, top: int = 12) -> str:
    """Busy share; self time by area; the functions with the most self time; our code's inclusive time."""
    stacks: list[tuple[list[str], int]] = []
    for line in raw.read_text().splitlines():
        joined, _, count = line.rpartition(" ")
        if joined and count.isdigit():
            stacks.append((joined.split(";"), int(count)))
    total = sum(n for _, n in stacks)
    if not total:
        return "  (no samples: was the process idle?)"
    areas: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    for frames, n in stacks:
        leaf = _FRAME.match(frames[-1])
        areas[_area(leaf["file"] if leaf else "")] += n
        leaves[frames[-1]] += n
        for frame in set(frames):  # inclusive: once per stack, however deep the recursion
            if "(gateway/" in frame or "(asyncpg/" in frame:
                ours[frame] += n
    busy = 100 * total / (RATE * seconds)
    lines = [f"  {total} samples, not idle {busy:.0f}% of the time (samples / ({RATE}/s x {seconds:.0f} s))"]
    lines.append(
        "  self time by area: " + ", ".join(f"{a} {100 * n / total:.0f}%" for a, n in areas.most_common())
    )
    lines.append("  most self time:")
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in leaves.most_common(top)]
    lines.append("  inclusive time in gateway/ and asyncpg functions (those under 99%: not main and such):")
    inclusive = [(name, n) for name, n in ours.most_common() if n < 0.99 * total]
    lines += [f"    {100 * n / total:5.1f}%  {name}" for name, n in inclusive[: top + 8]]
    return "\n".join(lines)
