"""``effect-gateway serve``: two listening sockets, served by N worker processes (gateway.cores: how many).

The parent binds the agents' socket (``listen``) and the operators' (``admin_listen``), checks the schema
once (migrating it when it is behind and the role may: gateway.schema.ready), and forks the workers;
each runs the two aiohttp applications on the inherited sockets (the kernel hands each new connection
to one of them). A worker
that dies is replaced; the others go on serving. SIGTERM (or SIGINT) is passed to every worker, which
stops accepting, finishes the calls under way and records them, and exits; then the parent exits.

SIGHUP reloads the configuration (gateway.reload: what may change). The parent reads it again and
judges it, so that a refusal is one line, not one per worker; when it may apply, the parent keeps it
for the workers it starts from then on and passes SIGHUP on to each worker, which reads the file again
itself and applies it. Each worker reads rather than being sent the settings, because a signal is how
the parent already speaks to its workers and carries no payload; each judges what it read against what
it runs, so a file changed again in between can never slip an unsafe change past the parent's check.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway import cores, metrics, reload, schema
from gateway.errors import CannotListen, ConfigError
from gateway.policy import upstream_policies
from gateway.runtime import RUNTIME, Runtime
from gateway.settings import Settings, listen_host, listen_port

log = logging.getLogger("effect_gateway")

# A worker that dies this soon after it started is failing at start, not crashing under load: after
# this many such deaths in a row the gateway stops instead of restarting it for ever.
EARLY_DEATH = 5.0
EARLY_DEATHS_TO_STOP = 5
# Between restarts of a worker that keeps dying: enough not to spin, short enough to serve again soon.
RESTART_BACKOFF = 0.5
# prctl's option (linux/prctl.h): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
# The kernel's queue of connections not yet accepted: a burst of agents connecting at once waits here.
BACKLOG = 1024
# At shutdown, once the calls under way have finished (gateway.app drains them first), how long an agent
# has to take its answer before its connection is closed; aiohttp waits this twice. An agent that reads
# takes even max_response_bytes from its sidecar in far less; one that does not read held the shutdown
# for aiohttp's default, 60 s twice over, past any supervisor's grace before SIGKILL.
ANSWER_GRACE = 2.0
# Reads the configuration again as serve read it at start: the same file, the same environment.
Reread = Callable[[], Settings]


@dataclass(frozen=True, slots=True)
class Sockets:
    """The two listening sockets: the agents' (``listen``) and the operators' (``admin_listen``)."""

    proxy: socket.socket
    admin: socket.socket


def bind(settings: Settings) -> Sockets:
    """Bind both listeners before anything starts, so that a port in use stops start-up in one line."""
    proxy = _bind(settings.listen, "listen")
    try:
        admin = _bind(settings.admin_listen, "admin_listen")
    except CannotListen:
        proxy.close()
        raise
    return Sockets(proxy, admin)


def _bind(address: str, setting: str) -> socket.socket:
    host, port = listen_host(address, setting), listen_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise CannotListen(f"cannot listen on {address} ({setting}): {reason}") from None
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket, address: str) -> str:
    # The real port, when the setting asks for port 0; an IPv6 address in brackets, as URLs write it.
    host = listen_host(address)
    return f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"


# The announcement's fields in the JSON log: what scripts and tests read to find the gateway.
LISTENING = "listening"


def announce(sockets: Sockets, settings: Settings, workers: cores.Workers) -> None:
    """Say where the gateway serves, once both listeners do: one record on the log, nothing on stdout.

    A supervisor hands stderr to a log pipeline, which parses every line as the log's format: a plain
    line beside the JSON ones would be the one it cannot read. The JSON record carries both addresses as
    fields; the text log's message names them in the same order (agents' first, then the admin's).
    """
    log.info("workers: %d (%s)", workers.count, workers.source)
    proxy_url, admin_url = _url(sockets.proxy, settings.listen), _url(sockets.admin, settings.admin_listen)
    log.info(
        "effect-gateway listening on %s (agents) and on %s (admin: audit, effects, metrics)",
        proxy_url,
        admin_url,
        extra={"fields": {"event": LISTENING, "proxy_url": proxy_url, "admin_url": admin_url}},
    )


async def _worker(
    settings: Settings,
    dsn: str,
    sockets: Sockets,
    metrics_dir: str | None,
    ready: Callable[[], None] | None = None,
    reread: Reread | None = None,
) -> None:
    from gateway.app import runners

    async with runners(settings, dsn, metrics_dir=metrics_dir, shutdown_timeout=ANSWER_GRACE) as both:
        await web.SockSite(both.proxy, sockets.proxy).start()
        await web.SockSite(both.admin, sockets.admin).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if reread is not None:
            loop.add_signal_handler(signal.SIGHUP, _reload, both.proxy.app[RUNTIME], reread)
        # Held back until now (run, Supervisor._fork): one that came meanwhile is taken now, and none
        # ever found SIGHUP's default action, which ends the process.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        if ready is not None:
            # Only now: a SIGTERM right after the announcement must stop it as any other does.
            ready()
        await stop.wait()
        log.info("shutting down: finishing calls under way")


def _reload(runtime: Runtime, reread: Reread) -> None:
    """Apply the configuration read again to this process's next requests, or say why not.

    The requests under way go on with what they read as they arrived (gateway.runtime.Runtime).
    """
    verdict = reload.read_again(runtime.settings, reread)
    if verdict.settings is None:
        log.error("%s", verdict.line)
        return
    runtime.reconfigure(verdict.settings, upstream_policies(verdict.settings))
    log.info("%s", verdict.line)


def loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop the workers run: uvloop when chosen (or installed, for "auto"), else asyncio's."""
    if settings.event_loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if settings.event_loop == "uvloop":
            raise ConfigError(
                "bad setting event_loop: uvloop is not installed (pip install uvloop)"
            ) from None
        return None
    return uvloop.new_event_loop


def run_loop(settings: Settings, work: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=loop_factory(settings)) as runner:
        runner.run(work)


def run(settings: Settings, dsn: str, sockets: Sockets, reread: Reread | None = None) -> int:
    """Serve on ``sockets`` (see :func:`bind`) until SIGTERM or SIGINT; returns the exit status.

    ``reread``: how to read the configuration again on SIGHUP; None: SIGHUP is ignored.
    """
    # Until whoever handles it is ready (the worker's loop, the supervisor): SIGHUP's default action
    # would end serve while it starts.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    if reread is None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    workers = cores.to_start(settings.workers)
    if workers.count == 1:
        # One process: its metrics live in its memory. The files that let a scrape of any worker read
        # them all cost a new effect 3% of the gateway's CPU (py-spy), and buy nothing without others.
        metrics.sweep()
        ready = lambda: announce(sockets, settings, workers)  # noqa: E731
        run_loop(settings, _worker(settings, dsn, sockets, None, ready, reread))
        return 0
    # Made before any worker starts, so that every worker counts into it and a scrape of any one of
    # them reads them all (gateway.metrics); removed when the gateway stops.
    with metrics.shared_by_workers() as shared:
        asyncio.run(schema.ready(dsn))  # once, before any worker starts
        held = Configuration(settings, reread)
        supervisor = Supervisor(
            lambda: run_loop(held.settings, _worker(held.settings, dsn, sockets, shared, reread=reread)),
            workers.count,
            held.reload if reread is not None else None,
        )
        return supervisor.run(lambda: announce(sockets, settings, workers))


class Configuration:
    """The configuration a worker started now runs with: the one at start, or the last reload's."""

    def __init__(self, settings: Settings, reread: Reread | None) -> None:
        self.settings = settings
        self._reread = reread

    def reload(self) -> bool:
        """Judge the configuration read again: keep it and say True when the workers may apply it, else
        log why not (one line for the whole gateway) and say False."""
        assert self._reread is not None
        verdict = reload.read_again(self.settings, self._reread)
        if verdict.settings is None:
            log.error("%s", verdict.line)
            return False
        self.settings = verdict.settings
        return True


class Supervisor:
    """Forks the workers, replaces one that dies, and passes SIGTERM/SIGINT on to all of them, and
    SIGHUP when the configuration read again may be applied."""

    def __init__(
        self, work: Callable[[], None], count: int, on_hangup: Callable[[], bool] | None = None
    ) -> None:
        """``on_hangup``: called on SIGHUP; says whether to pass it on to the workers."""
        self._work = work
        self._count = count
        self._on_hangup = on_hangup
        self._children: dict[int, float] = {}  # pid -> when it started
        self._stopping = False
        self._early_deaths = 0

    def run(self, ready: Callable[[], None]) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        if self._on_hangup is not None:
            signal.signal(signal.SIGHUP, self._reload)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})  # held back by run until now
        for _ in range(self._count):
            self._fork()
        ready()
        status = 0
        while self._children:
            try:
                pid, code = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries os.wait itself
                continue
            started = self._children.pop(pid, None)
            if started is None:
                continue
            if self._stopping:
                continue
            log.error("worker %d %s; starting another", pid, _death(code))
            if time.monotonic() - started < EARLY_DEATH:
                self._early_deaths += 1
                if self._early_deaths >= EARLY_DEATHS_TO_STOP:
                    log.error("workers keep dying as they start; stopping")
                    self._stop(signal.SIGTERM, None)
                    status = 1
                    continue
                time.sleep(RESTART_BACKOFF)
            else:
                self._early_deaths = 0
            self._fork()
        return status

    def _fork(self) -> None:
        # Held back across the fork: a worker that got SIGTERM before it dropped the parent's handler
        # would run that handler instead of stopping, and the parent would wait for it forever. The
        # parent records the worker before they are let through, so that a stop passes them on to it.
        # SIGHUP likewise: the parent's handler must never run in a worker, and one that comes before
        # the worker's own (in _worker) waits for it; the worker lets it through once that is in place.
        stopping = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, stopping | {signal.SIGHUP})
        pid = -1
        try:
            if self._stopping:  # asked during a restart's backoff: no replacement
                return
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:  # the worker stops on them, from now on
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                # Still held back (see above); ignored for good when nothing reloads: a hang-up sent to
                # the whole process group (a closed terminal) must not end the workers alone.
                signal.signal(
                    signal.SIGHUP, signal.SIG_DFL if self._on_hangup is not None else signal.SIG_IGN
                )
                _stop_when_orphaned(parent)
            else:
                self._children[pid] = time.monotonic()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping if pid == 0 else stopping | {signal.SIGHUP})
        if pid == 0:  # the worker
            code = 0
            try:
                self._work()
            except BaseException:
                log.exception("worker %d failed", os.getpid())
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def _reload(self, _signum: int, _frame: object) -> None:
        assert self._on_hangup is not None  # the handler is set only then
        if not self._on_hangup():
            return
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGHUP)

    def _stop(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _stop_when_orphaned(parent: int) -> None:
    """Have the kernel SIGTERM this worker when ``parent`` dies (Linux; elsewhere nothing).

    A serve killed outright (SIGKILL, the OOM killer) cannot pass a stop on: its workers would go on
    serving with nobody to replace one that dies, and hold the port against the serve restarted after
    it. Stopped like this they finish the calls under way, record them, and exit. The kernel sends it
    when the *thread* that forked the worker ends: the supervisor forks from its main thread, which
    lives as long as serve does, and must go on doing so.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM)) != 0:
        errno = ctypes.get_errno()
        log.warning("worker %d will not stop with serve: prctl failed (errno %d)", os.getpid(), errno)
        return
    if os.getppid() != parent:  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def _death(code: int) -> str:
    if os.WIFSIGNALED(code):
        return f"was killed by {signal.Signals(os.WTERMSIG(code)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(code)}"
