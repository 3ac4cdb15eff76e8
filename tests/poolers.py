"""Debian's PgBouncer on loopback in front of the test Postgres, for the tests behind a pooler.

A real PgBouncer (1.18 on Debian 12) listening on a free loopback port, passing every database of the
test server on (the pytest-xdist workers' each have one). In transaction mode with few server
connections, so that the gateway's connections share them and one transaction of a client seldom runs
on the server connection of its last. Everything started is stopped by its pid. PgBouncer refuses to
run as root: as root (CI) it runs as the owner of the server's socket folder, or ``postgres``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

from gateway.settings import database_hosts
from tests.database import runtime_role
from tests.replicas import free_port

PGBOUNCER = Path("/usr/sbin/pgbouncer")
# PgBouncer listens within milliseconds; ten seconds is a machine far too busy to test on.
START_TIMEOUT = 10.0


def installed() -> str | None:
    """Why PgBouncer cannot run here, or None."""
    if not PGBOUNCER.exists():
        return "Debian's pgbouncer is not installed (make installs it as root: apt-get install pgbouncer)"
    return None


def _server(dsn: str) -> tuple[str, int]:
    """Where PgBouncer reaches the test server: a host or a socket folder, and a port (the first of a
    URL that names several)."""
    query = parse_qs(urlsplit(dsn).query)
    host, port = database_hosts(dsn)[0]
    return query.get("host", [host or "127.0.0.1"])[0], port or int(query.get("port", ["5432"])[0])


def suite_pooler_for(dsn: str) -> str | None:
    """The suite's PgBouncer (``make test-pgbouncer``: TEST_POOLER_URL, in front of TEST_POOLER_BEHIND)
    for ``dsn``'s database as the runtime role; None when there is none, or when ``dsn`` is on another
    server (a test's own Postgres, or a proxy a test puts in between)."""
    url, behind = os.environ.get("TEST_POOLER_URL"), os.environ.get("TEST_POOLER_BEHIND")
    if not url or not behind or _server(dsn) != _server(behind):
        return None
    return urlunsplit(urlsplit(url)._replace(path=urlsplit(dsn).path))


def _user(host: str) -> str | None:
    """The system user PgBouncer runs as when this process is root (it refuses root)."""
    if os.geteuid() != 0:
        return None
    if host.startswith("/"):
        return pwd.getpwuid(Path(host).stat().st_uid).pw_name
    return "postgres"


@contextlib.contextmanager
def pgbouncer(dsn: str, *, mode: str = "transaction", server_connections: int = 3) -> Iterator[str]:
    """PgBouncer in front of ``dsn``'s server in ``mode``; yields its URL for ``dsn``'s database as the
    runtime role (tests.database), which the tests' gateways use.

    ``server_connections`` for each database and role: fewer than a gateway's pool (20), so that its
    connections share them; three, so that a test's own statements beside a gateway's do not wait long.
    """
    if (missing := installed()) is not None:
        raise RuntimeError(missing)
    host, port = _server(dsn)
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    listen = free_port()
    user, password = runtime_role()
    owner = urlsplit(dsn)
    # trust: PgBouncer asks the clients for no password; the file holds the passwords it logs in with.
    (folder / "users.txt").write_text(
        f'"{user}" "{password}"\n"{unquote(owner.username or "")}" "{unquote(owner.password or "")}"\n'
    )
    (folder / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={host} port={port}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
unix_socket_dir =
auth_type = trust
auth_file = {folder}/users.txt
pool_mode = {mode}
default_pool_size = {server_connections}
; a second, not 15, before logging in again to a server that refused: the tests that take the
; database away for a moment expect it back as soon as it is
server_login_retry = 1
; every gateway of a test session at once, each with its pool (20 a worker), with room to spare
max_client_conn = 1000
; what asyncpg sends at login and PgBouncer would otherwise refuse
ignore_startup_parameters = extra_float_digits
logfile = {folder}/pgbouncer.log
"""
    )
    as_user = _user(host)
    if as_user is not None:
        shutil.chown(folder, as_user)
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(folder / name, as_user)
    argv = [str(PGBOUNCER), "-q", str(folder / "pgbouncer.ini")]
    proc = subprocess.Popen(["runuser", "-u", as_user, "--", *argv] if as_user else argv)
    try:
        _wait_listening(listen, proc, folder)
        where = f"{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{listen}"
        yield urlunsplit(("postgresql", where, owner.path, "", ""))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_listening(port: int, proc: subprocess.Popen[bytes], folder: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = (folder / "pgbouncer.log").read_text() if (folder / "pgbouncer.log").exists() else ""
            raise RuntimeError(f"pgbouncer stopped ({proc.returncode}): {log[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen on {port} within {START_TIMEOUT:g}s")
