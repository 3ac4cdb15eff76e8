"""A primary and a standby of Debian's Postgres 15 on loopback, streaming, for the failover tests.

Real servers: a standby made with pg_basebackup, promoted with pg_ctl promote (a real promotion, not a
restart), the primary killed with SIGKILL. Each server listens on a free loopback port of its own and
keeps its socket in its data folder; everything started is stopped by its pid. Run as root (CI), the
servers run as the system user ``postgres``, as Postgres refuses root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path("/usr/lib/postgresql/15/bin")
START_TIMEOUT = 30.0


def installed() -> str | None:
    """Why the servers cannot run here, or None."""
    if not (BIN / "postgres").exists():
        return (
            "Debian's postgresql-15 is not installed (make installs it as root: apt-get install "
            "postgresql-15)"
        )
    return None


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def _run(argv: list[str]) -> None:
    done = subprocess.run(_as_postgres(argv), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr.strip()}")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listed:
            return [int(child) for child in listed.read().split()]
    except FileNotFoundError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    name: str
    data: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        log = open(self.data.parent / f"{self.name}.log", "ab")  # noqa: SIM115 - held by the server
        self.proc = subprocess.Popen(
            _as_postgres(
                [
                    str(BIN / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.data),
                    "-c",
                    "listen_addresses=127.0.0.1",
                ]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            ready = subprocess.run(
                [str(BIN / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"], check=False
            )
            if ready.returncode == 0:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited: {(self.data.parent / f'{self.name}.log').read_text()}"
                )
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not accept connections within {START_TIMEOUT:g}s")

    def kill(self) -> None:
        """SIGKILL every process of the server at once, as a machine that dies (the postmaster alone
        would leave its backends to notice and exit a moment later)."""
        assert self.proc is not None
        # By their own pids: run as root, self.proc is runuser, which waits for the postmaster.
        with contextlib.suppress(FileNotFoundError, ValueError):
            postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
            for pid in (*_children(postmaster), postmaster):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def _kill_postmaster(self, sig: signal.Signals) -> None:
        pid_file = self.data / "postmaster.pid"
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int(pid_file.read_text().split()[0]), sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self._kill_postmaster(signal.SIGINT)  # fast shutdown
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self._kill_postmaster(signal.SIGKILL)
            self.proc.wait(10)

    def promote(self) -> None:
        _run([str(BIN / "pg_ctl"), "promote", "-w", "-D", str(self.data)])


@dataclass
class Pair:
    """A primary streaming to a standby; ``url`` names both, for a client that wants the writable one."""

    folder: Path
    primary: Server
    standby: Server
    sync: bool

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in (self.primary, self.standby))
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def fail_over(self) -> None:
        """Kill the primary, promote the standby, and make a new standby of the old primary's place."""
        self.primary.kill()
        self.standby.promote()
        old = self.primary
        self.primary, self.standby = self.standby, Server(f"{old.name}-next", old.data, old.port)
        shutil.rmtree(old.data)
        _standby_of(self.primary, self.standby)
        self.standby.start()
        if self.sync:
            _set_sync(self.primary, True)

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            server.stop()


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")
    return path


def _base_backup(primary: Server, data: Path, *more: str) -> None:
    """``primary`` as it is now, copied to ``data`` with the WAL it needs to start."""
    where = ["-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres"]
    _run([str(BIN / "pg_basebackup"), *where, "-D", str(data), "-X", "stream", "--checkpoint=fast", *more])


def _standby_of(primary: Server, standby: Server) -> None:
    _base_backup(primary, standby.data, "-R")  # -R: a standby of it
    with open(standby.data / "postgresql.auto.conf", "a") as conf:
        conf.write(
            f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
            f"application_name={standby.name}'\n"
        )


def _set_sync(primary: Server, on: bool) -> None:
    names = "'*'" if on else "''"
    where = ["-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres"]
    change = f"alter system set synchronous_standby_names = {names}"
    _run([str(BIN / "psql"), *where, "-qAt", "-c", change, "-c", "select pg_reload_conf()"])


def backup(primary: Server, name: str) -> Server:
    """A base backup of ``primary`` as it is now, to start later as a primary of its own: a restore to
    this point."""
    server = Server(name, primary.data.parent / name)
    _base_backup(primary, server.data)
    return server


@contextlib.contextmanager
def replicated(folder: Path, *, sync: bool = True) -> Iterator[Pair]:
    """A primary and a standby streaming from it (synchronous commit to the standby when ``sync``)."""
    base = _folder(folder / "pg")
    primary = Server("a", _folder(base / "a"))
    _run([str(BIN / "initdb"), "-D", str(primary.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
    with open(primary.data / "postgresql.conf", "a") as conf:
        conf.write("wal_level = replica\nmax_wal_senders = 10\nhot_standby = on\nfsync = off\n")
    with open(primary.data / "pg_hba.conf", "a") as hba:
        hba.write("host replication postgres 127.0.0.1/32 trust\n")
    primary.start()
    standby = Server("b", base / "b")
    pair = Pair(base, primary, standby, sync)
    try:
        _standby_of(primary, standby)
        standby.start()
        if sync:
            _set_sync(primary, True)
        yield pair
    finally:
        pair.stop()
