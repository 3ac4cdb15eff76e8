"""The step journal: one row per (run, step) in Postgres, as the reference article designs it.

A step that has a row returns its saved output without running; otherwise it runs and is saved. A new
step costs one round trip (``insert ... on conflict do nothing returning``); a resumed run loads its
saved steps once, so replaying a step costs none.
"""

from __future__ import annotations

import inspect
import json
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeAlias

import asyncpg

from journal.errors import NotJSON, RunFinished, StepMismatch

JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
# Called with "after-effect:N" and "after-checkpoint:N": where a crash test kills the process.
CrashPoint = Callable[[str], None]

SCHEMA = """
create table if not exists agent_runs (
    id          text primary key,
    status      text not null default 'running' check (status in ('running', 'completed', 'failed')),
    error       text,
    created_at  timestamptz not null default now(),
    updated_at  timestamptz not null default now()
);
create table if not exists agent_steps (
    run_id      text not null references agent_runs (id),
    step        integer not null,
    name        text not null,
    output      jsonb not null,
    created_at  timestamptz not null default now(),
    primary key (run_id, step)
);
"""
# Any constant will do, as long as nothing else on the database locks it for another purpose.
SCHEMA_LOCK = 0x6A6F75726E616C  # "journal"


@dataclass
class StepContext:
    """The step now running: its stable key, and a distinct deterministic key per distinct call in it."""

    run_id: str
    step: int
    name: str
    _calls: dict[bytes, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.run_id}:{self.step}"

    def key_for(self, call: bytes) -> str:
        """The first distinct call of a step gets ``run:step``, the n-th ``run:step:n``.

        A repeat of the same call (an SDK's own retry) gets the key it had, so the SDK's retries and the
        agent's re-run share one key.
        """
        if call not in self._calls:
            n = len(self._calls) + 1
            self._calls[call] = self.key if n == 1 else f"{self.key}:{n}"
        return self._calls[call]


_current: ContextVar[StepContext | None] = ContextVar("journal_step", default=None)


def current_step() -> StepContext | None:
    """The step running in this task, if any (the httpx integration reads it)."""
    return _current.get()


def check_json(value: Any, where: str = "output") -> None:
    """Only what JSON holds as it is: str-keyed objects, lists, strings, finite numbers, booleans, null."""
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}, which JSON cannot hold")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where} has a key {key!r} that is not a string")
            check_json(item, f"{where}.{key}")
        return
    raise ValueError(f"{where} is a {type(value).__name__}")


def _as_saved(step: int, name: str, output: Any) -> tuple[JSON, str]:
    try:
        check_json(output)
    except ValueError as exc:
        raise NotJSON(step, name, str(exc)) from None
    text = json.dumps(output)
    # What the first run returns is exactly what a replay will return.
    saved: JSON = json.loads(text)
    return saved, text


@dataclass(frozen=True, slots=True)
class RunInfo:
    id: str
    status: str
    steps: int
    updated_at: datetime


async def _init(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=lambda v: v, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Skip asyncpg's reset query on release: it would double a new step's round trips.

    Safe because the journal's connections never LISTEN, lock, open cursors or SET session variables;
    asyncpg still rolls back any transaction left open before calling this.
    """


class Journal:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def connect(cls, dsn: str) -> Journal:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=5, init=_init, reset=_keep_session)
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("select pg_advisory_xact_lock($1)", SCHEMA_LOCK)
            await conn.execute(SCHEMA)
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def run(self, run_id: str | None = None, *, on_point: CrashPoint | None = None) -> Run:
        """Start a run, or resume it: its saved steps are loaded once, here."""
        run_id = run_id or uuid.uuid4().hex
        async with self._pool.acquire() as conn:
            status = await conn.fetchval(
                """
                insert into agent_runs (id) values ($1)
                on conflict (id) do update set updated_at = now(),
                    status = case when agent_runs.status = 'completed' then 'completed' else 'running' end
                returning status
                """,
                run_id,
            )
            rows = await conn.fetch("select step, name, output from agent_steps where run_id = $1", run_id)
        saved = {row["step"]: (row["name"], row["output"]) for row in rows}
        return Run(self._pool, run_id, status, saved, on_point)

    async def incomplete_runs(self) -> list[RunInfo]:
        """Runs left running or failed, oldest first: the ones to resume."""
        async with self._pool.acquire() as conn:
            rows = await conn.fetch(
                """
                select r.id, r.status, r.updated_at, count(s.step) as steps
                from agent_runs r left join agent_steps s on s.run_id = r.id
                where r.status <> 'completed'
                group by r.id order by r.updated_at
                """
            )
        return [RunInfo(r["id"], r["status"], r["steps"], r["updated_at"]) for r in rows]


class _SavedByOther(Exception):
    """Rolls a transactional step back when another process saved the same step first."""


StepFn = Callable[[StepContext], Awaitable[Any] | Any]
TxStepFn = Callable[[Any, StepContext], Awaitable[Any]]  # the connection: asyncpg's, inside a transaction


class Run:
    """One run of an agent. Steps are numbered in the order they are called."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        run_id: str,
        status: str,
        saved: dict[int, tuple[str, JSON]],
        on_point: CrashPoint | None,
    ) -> None:
        self._pool = pool
        self.id = run_id
        self.status = status
        self._saved = saved
        self._next = 1
        self._on_point = on_point or (lambda point: None)

    @property
    def key(self) -> str:
        """The key of the step that the next call to :meth:`step` will run."""
        return f"{self.id}:{self._next}"

    def _begin(self, name: str) -> tuple[int, JSON | None, bool]:
        if self.status == "completed" and self._next not in self._saved:
            raise RunFinished(f"run {self.id} is completed; it has no step {self._next}")
        n = self._next
        self._next += 1
        if n in self._saved:
            saved_name, output = self._saved[n]
            if saved_name != name:
                raise StepMismatch(self.id, n, saved_name, name)
            return n, output, True
        return n, None, False

    async def step(self, name: str, fn: StepFn) -> Any:
        """Run ``fn`` once per run: on a re-run its saved output is returned without running it."""
        n, output, done = self._begin(name)
        if done:
            return output
        ctx = StepContext(self.id, n, name)
        token = _current.set(ctx)
        try:
            result = fn(ctx)
            if inspect.isawaitable(result):
                result = await result
        finally:
            _current.reset(token)
        saved, text = _as_saved(n, name, result)
        self._on_point(f"after-effect:{n}")
        async with self._pool.acquire() as conn:
            if not await self._checkpoint(conn, n, name, text):
                # Another process ran this step meanwhile and saved first: its output is the one.
                saved = await self._saved_by_other(conn, n, name)
        self._saved[n] = (name, saved)
        self._on_point(f"after-checkpoint:{n}")
        return saved

    async def transactional_step(self, name: str, fn: TxStepFn) -> Any:
        """A step whose effect is in the journal's own database: effect and checkpoint commit together.

        The article's rule 3: a crash before the commit leaves neither, so no key is needed.
        """
        n, output, done = self._begin(name)
        if done:
            return output
        ctx = StepContext(self.id, n, name)
        async with self._pool.acquire() as conn:
            try:
                async with conn.transaction():
                    result = await fn(conn, ctx)
                    saved, text = _as_saved(n, name, result)
                    self._on_point(f"after-effect:{n}")
                    if not await self._checkpoint(conn, n, name, text):
                        raise _SavedByOther
            except _SavedByOther:
                # Another process ran the step and committed first: our effect rolled back with our
                # transaction, so the step happened once, and its output is the other process's.
                saved = await self._saved_by_other(conn, n, name)
        self._saved[n] = (name, saved)
        self._on_point(f"after-checkpoint:{n}")
        return saved

    async def _checkpoint(self, conn: Any, n: int, name: str, text: str) -> bool:
        """Save step ``n``: one round trip. False when another process saved it first."""
        inserted = await conn.fetchval(
            """
            insert into agent_steps (run_id, step, name, output) values ($1, $2, $3, $4::jsonb)
            on conflict (run_id, step) do nothing returning step
            """,
            self.id,
            n,
            name,
            text,
        )
        return inserted is not None

    async def _saved_by_other(self, conn: Any, n: int, name: str) -> JSON:
        row = await conn.fetchrow(
            "select name, output from agent_steps where run_id = $1 and step = $2", self.id, n
        )
        if row["name"] != name:
            raise StepMismatch(self.id, n, row["name"], name)
        output: JSON = row["output"]
        return output

    async def complete(self) -> None:
        await self._set_status("completed", None)

    async def fail(self, error: str) -> None:
        await self._set_status("failed", error)

    async def _set_status(self, status: str, error: str | None) -> None:
        async with self._pool.acquire() as conn:
            await conn.execute(
                "update agent_runs set status = $2, error = $3, updated_at = now() where id = $1",
                self.id,
                status,
                error,
            )
        self.status = status


@asynccontextmanager
async def open_journal(dsn: str | None = None, data_dir: Path | None = None) -> AsyncIterator[Journal]:
    """The journal on ``dsn``, or on an embedded Postgres in ``data_dir`` (stopped again afterwards)."""
    embedded = None
    if dsn is None:
        from gateway.embedded import EmbeddedPostgres

        embedded = EmbeddedPostgres(data_dir or Path(".journal"))
        dsn = embedded.start()
    journal = await Journal.connect(dsn)
    try:
        yield journal
    finally:
        await journal.close()
        if embedded is not None:
            embedded.stop()
