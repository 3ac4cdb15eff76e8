"""A deterministic asyncio event loop: virtual time, and the seed's choice among the ready callbacks.

Nothing real is underneath: no selector, no sockets, no threads, no wall clock. When nothing is ready,
time jumps to the next timer. When several callbacks are ready, the run's choices pick which runs
first (choice 0 is the oldest, as asyncio would), so different seeds explore different interleavings
of the same program. Tasks, futures, ``sleep``, ``wait_for``, ``shield`` and ``Event`` are asyncio's
own and work unchanged: they only ever call ``call_soon``, ``call_at``, ``call_later``, ``time`` and
``create_future`` on their loop.

Every callback is owned by whoever scheduled it (read from the :data:`OWNER` context variable): a
gateway's incarnation, or the world (None). An owner can be frozen until a time (a process paused:
its callbacks wait, everything else goes on) or killed (a SIGKILL: its callbacks are dropped, so not
even its ``finally`` clauses run).
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Generator
from concurrent.futures import Executor
from contextvars import Context
from dataclasses import dataclass
from typing import Any, TypeVar, TypeVarTuple, Unpack

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@dataclass(eq=False)
class Owner:
    """One incarnation of a gateway process (or a client): what a crash kills and a pause freezes."""

    name: str
    dead: bool = False
    frozen_until: float = 0.0


OWNER: contextvars.ContextVar[Owner | None] = contextvars.ContextVar("sim_owner", default=None)
# The simulator's number of the client request a gateway is serving (0: none), for the trace and checks.
REQUEST: contextvars.ContextVar[int] = contextvars.ContextVar("sim_request", default=0)


def _dropped(handle: asyncio.Handle) -> None:
    """A ready callback dropped unrun: its owner was killed, or the run is over.

    When it is the first step of a task, the task's coroutine never starts (a request a gateway took
    just before its SIGKILL): it is closed here, as a killed process's memory is freed, instead of being
    reported as never awaited when it is collected.
    """
    task = getattr(handle._callback, "__self__", None)  # type: ignore[attr-defined]
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        if inspect.iscoroutine(coro) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
            coro.close()


class Stalled(RuntimeError):
    """Nothing is ready and no timer is left, but the awaited work is not done: a deadlock."""


class Runaway(RuntimeError):
    """The run took more steps than it may: something never settles (or the world is too big)."""


class SimLoop(asyncio.AbstractEventLoop):
    def __init__(self, pick: Callable[[int], int], max_steps: int = 1_000_000) -> None:
        """``pick(n)`` chooses which of n ready callbacks runs next (0: the oldest)."""
        self._max_steps = max_steps
        self._now = 0.0
        self._ready: list[tuple[asyncio.Handle, Owner | None]] = []
        self._timers: list[tuple[float, int, asyncio.TimerHandle, Owner | None]] = []
        self._order = 0
        self._pick = pick
        self._running = False
        self._closed = False
        self.steps = 0
        # Exceptions that escaped a callback or were never retrieved, but not those of a killed owner
        # (a SIGKILLed process leaves no such report): the world decides what they mean.
        self.errors: list[dict[str, Any]] = []
        # The owner of each future and task by id(): still there while one is finalized (weak references
        # are not), and an id reused by a newer future is overwritten when that one is made.
        self._owners: dict[int, Owner | None] = {}
        # The owner of the callback running now.
        self.current: Owner | None = None
        # Called after every step (the world's checks of what must hold after each one).
        self.after_step: Callable[[], None] | None = None

    # --- time and scheduling ------------------------------------------------------------------------

    def time(self) -> float:
        return self._now

    def call_soon(
        self, callback: Callable[[Unpack[Ts]], object], *args: *Ts, context: Context | None = None
    ) -> asyncio.Handle:
        ctx = context if context is not None else contextvars.copy_context()
        handle = asyncio.Handle(callback, args, self, ctx)
        self._ready.append((handle, ctx.get(OWNER)))
        return handle

    def call_later(
        self,
        delay: float,
        callback: Callable[[Unpack[Ts]], object],
        *args: *Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        return self.call_at(self._now + max(0.0, delay), callback, *args, context=context)

    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[Ts]], object],
        *args: *Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        ctx = context if context is not None else contextvars.copy_context()
        timer = asyncio.TimerHandle(when, callback, args, self, ctx)
        self._order += 1
        heapq.heappush(self._timers, (when, self._order, timer, ctx.get(OWNER)))
        return timer

    def call_soon_threadsafe(
        self, callback: Callable[[Unpack[Ts]], object], *args: *Ts, context: Context | None = None
    ) -> asyncio.Handle:
        return self.call_soon(callback, *args, context=context)

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        """Called by TimerHandle.cancel(); cancelled timers are dropped when they come due."""

    # --- futures and tasks --------------------------------------------------------------------------

    def create_future(self) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.Future(loop=self)
        self._owners[id(future)] = OWNER.get()
        return future

    def create_task(
        self,
        coro: Coroutine[Any, Any, T] | Generator[Any, None, T],
        *,
        name: str | None = None,
        context: Context | None = None,
    ) -> asyncio.Task[T]:
        task = asyncio.Task(coro, loop=self, name=name, context=context)
        self._owners[id(task)] = (context or contextvars.copy_context()).get(OWNER)
        return task

    # --- running ------------------------------------------------------------------------------------

    def run_until_complete(self, future: Generator[Any, None, T] | Awaitable[T]) -> T:
        if isinstance(future, Generator):
            raise TypeError("generator-based coroutines are not run here")
        done = asyncio.ensure_future(future, loop=self)
        asyncio.events._set_running_loop(self)
        self._running = True
        try:
            while not done.done():
                if not self.run_once():
                    raise Stalled(f"nothing left to run at {self._now:.3f}s")
        finally:
            self._running = False
            asyncio.events._set_running_loop(None)
        return done.result()

    def run_once(self) -> bool:
        """Run one callback, or move time on to the next one; False when nothing is left at all."""
        now = self._now
        while self._timers and self._timers[0][0] <= now:
            _, _, timer, owner = heapq.heappop(self._timers)
            if not timer.cancelled() and not (owner is not None and owner.dead):
                self._ready.append((timer, owner))
        eligible: list[int] = []
        thaw = float("inf")
        index = 0
        while index < len(self._ready):
            handle, owner = self._ready[index]
            if handle.cancelled() or (owner is not None and owner.dead):
                del self._ready[index]
                _dropped(handle)
                continue
            if owner is not None and owner.frozen_until > now:
                thaw = min(thaw, owner.frozen_until)
            else:
                eligible.append(index)
            index += 1
        if not eligible:
            while self._timers:
                _, _, timer, owner = self._timers[0]
                if not (timer.cancelled() or (owner is not None and owner.dead)):
                    break
                heapq.heappop(self._timers)
            after = min(thaw, self._timers[0][0] if self._timers else float("inf"))
            if after == float("inf"):
                return False
            self._now = max(now, after)
            return True
        chosen = eligible[self._pick(len(eligible))] if len(eligible) > 1 else eligible[0]
        handle, owner = self._ready.pop(chosen)
        self.current = owner
        self.steps += 1
        if self.steps > self._max_steps:
            raise Runaway(f"more than {self._max_steps} steps by {self._now:.3f}s")
        handle._run()
        self.current = None
        if self.after_step is not None:
            self.after_step()
        return True

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        for handle, _ in self._ready:
            _dropped(handle)
        self._ready.clear()
        self._timers.clear()

    def stop(self) -> None:
        raise NotImplementedError("the simulator runs until its world is done")

    def get_debug(self) -> bool:
        return False

    def set_debug(self, enabled: bool) -> None:
        pass

    # --- errors -------------------------------------------------------------------------------------

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        future = context.get("future") or context.get("task")
        owner = self._owners.get(id(future)) if future is not None else self.current
        if owner is None or not owner.dead:
            self.errors.append(context)

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.call_exception_handler(context)

    # --- nothing real -------------------------------------------------------------------------------

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[Unpack[Ts]], T], *args: *Ts
    ) -> asyncio.Future[T]:
        raise RuntimeError("the simulator has no threads")


def new_loop(pick: Callable[[int], int], max_steps: int = 1_000_000) -> SimLoop:
    """A SimLoop. typeshed marks AbstractEventLoop's I/O methods abstract; asyncio's own class only
    raises NotImplementedError from them, which is what a loop with nothing real underneath wants."""
    return SimLoop(pick, max_steps)  # type: ignore[abstract]
