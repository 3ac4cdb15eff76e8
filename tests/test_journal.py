"""The step journal: replay, determinism checks, JSON-only outputs, transactional steps, runs to resume."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from journal import Journal, NotJSON, StepContext, StepMismatch
from tests.support import ROOT


@pytest.fixture
async def journal(postgres_dsn: str) -> AsyncIterator[Journal]:
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute("drop table if exists agent_steps, agent_runs, journal_orders")
    finally:
        await conn.close()
    j = await Journal.connect(postgres_dsn)
    try:
        yield j
    finally:
        await j.close()


async def test_a_saved_step_returns_its_output_without_running(journal: Journal) -> None:
    """On a re-run, finished steps return what they returned the first time; their functions do not run."""
    calls: list[int] = []

    def plan(ctx: StepContext) -> dict[str, Any]:
        calls.append(ctx.step)
        return {"plan": ["atta", "paneer"], "n": 1.5, "ok": True, "none": None}

    first = await journal.run("r1")
    out1 = await first.step("plan", plan)
    again = await journal.run("r1")
    out2 = await again.step("plan", plan)
    assert out1 == out2 == {"plan": ["atta", "paneer"], "n": 1.5, "ok": True, "none": None}
    assert calls == [1]


async def test_steps_are_numbered_in_call_order_with_stable_keys(journal: Journal) -> None:
    """Each step's key is {run_id}:{step}, steps counted in the order they are called."""
    run = await journal.run("r2")
    keys = [await run.step(name, lambda ctx: ctx.key) for name in ("a", "b", "c")]
    assert keys == ["r2:1", "r2:2", "r2:3"]


async def test_a_renamed_step_raises(journal: Journal) -> None:
    """A saved step asked for under another name means the code is no longer deterministic."""
    run = await journal.run("r3")
    await run.step("plan", lambda ctx: 1)
    resumed = await journal.run("r3")
    with pytest.raises(StepMismatch, match="saved as 'plan' but is now asked for as 'pantry'"):
        await resumed.step("pantry", lambda ctx: 2)


@pytest.mark.parametrize(
    ("output", "why"),
    [
        ({1, 2}, "set"),
        ({"at": object()}, "object"),
        ({1: "a"}, "not a string"),
        (float("nan"), "nan"),
        (b"x", "bytes"),
    ],
)
async def test_output_that_is_not_json_is_refused_and_nothing_is_saved(
    journal: Journal, postgres_dsn: str, output: Any, why: str
) -> None:
    """Non-JSON outputs are refused before the checkpoint, naming the step; no row is written."""
    run = await journal.run("r4")
    with pytest.raises(NotJSON, match=rf"step 1 \('choose'\).*{why}"):
        await run.step("choose", lambda ctx: output)
    conn = await asyncpg.connect(postgres_dsn)
    try:
        assert await conn.fetchval("select count(*) from agent_steps where run_id = 'r4'") == 0
    finally:
        await conn.close()


async def test_runs_left_incomplete_are_listed_for_resuming(journal: Journal) -> None:
    """Completed runs drop off the list; running and failed ones stay, with their step counts."""
    done = await journal.run("done")
    await done.step("a", lambda ctx: 1)
    await done.complete()
    crashed = await journal.run("crashed")
    await crashed.step("a", lambda ctx: 1)
    await crashed.step("b", lambda ctx: 2)
    failed = await journal.run("failed")
    await failed.fail("model refused")
    listed = {(r.id, r.status, r.steps) for r in await journal.incomplete_runs()}
    assert listed == {("crashed", "running", 2), ("failed", "failed", 0)}


async def test_a_transactional_step_commits_effect_and_checkpoint_together(
    journal: Journal, postgres_dsn: str
) -> None:
    """Rule 3: the effect in the journal's own database and its checkpoint are one transaction."""
    conn = await asyncpg.connect(postgres_dsn)
    await conn.execute("create table journal_orders (id serial primary key, run_id text, items text)")
    await conn.close()

    async def order(db: Any, ctx: StepContext) -> dict[str, int]:
        order_id = await db.fetchval(
            "insert into journal_orders (run_id, items) values ($1, 'atta') returning id", ctx.run_id
        )
        return {"order": order_id}

    run = await journal.run("tx")
    first = await run.transactional_step("order", order)
    again = await (await journal.run("tx")).transactional_step("order", order)
    assert first == again
    conn = await asyncpg.connect(postgres_dsn)
    try:
        assert await conn.fetchval("select count(*) from journal_orders") == 1
    finally:
        await conn.close()


KILLED_IN_TRANSACTION = """
import asyncio, os, signal, sys
from journal import Journal

async def main(dsn):
    journal = await Journal.connect(dsn)

    def crash(point):
        if point == "after-effect:1":  # inside the transaction, after the effect, before the commit
            os.kill(os.getpid(), signal.SIGKILL)

    run = await journal.run("killed-tx", on_point=crash)

    async def order(db, ctx):
        await db.execute("insert into journal_orders (run_id, items) values ($1, 'atta')", ctx.run_id)
        return {"placed": True}

    await run.transactional_step("order", order)

asyncio.run(main(sys.argv[1]))
"""


async def test_a_transactional_step_killed_before_commit_leaves_neither(
    journal: Journal, postgres_dsn: str, tmp_path: Path
) -> None:
    """SIGKILL after the effect, before the commit: no order and no checkpoint; the re-run places one."""
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute("create table journal_orders (id serial primary key, run_id text, items text)")
        script = tmp_path / "agent.py"
        script.write_text(textwrap.dedent(KILLED_IN_TRANSACTION))
        proc = await asyncio.create_subprocess_exec(sys.executable, str(script), postgres_dsn, cwd=ROOT)
        assert await proc.wait() == -9
        assert await conn.fetchval("select count(*) from journal_orders") == 0
        assert await conn.fetchval("select count(*) from agent_steps where run_id = 'killed-tx'") == 0

        async def order(db: Any, ctx: StepContext) -> dict[str, bool]:
            await db.execute("insert into journal_orders (run_id, items) values ($1, 'atta')", ctx.run_id)
            return {"placed": True}

        assert await (await journal.run("killed-tx")).transactional_step("order", order) == {"placed": True}
        assert await conn.fetchval("select count(*) from journal_orders") == 1
    finally:
        await conn.close()


async def test_two_processes_racing_on_a_transactional_step_make_one_effect(
    journal: Journal, postgres_dsn: str
) -> None:
    """Two resumed copies of a run race on the same step: one effect commits, both return its output."""
    conn = await asyncpg.connect(postgres_dsn)
    await conn.execute("create table journal_orders (id serial primary key, run_id text, items text)")

    async def order(db: Any, ctx: StepContext) -> dict[str, int]:
        order_id = await db.fetchval(
            "insert into journal_orders (run_id, items) values ($1, 'x') returning id", ctx.run_id
        )
        await asyncio.sleep(0.2)  # both effects are in flight before either checkpoint commits
        return {"order": order_id}

    first, second = await journal.run("race"), await journal.run("race")
    a, b = await asyncio.gather(
        first.transactional_step("order", order), second.transactional_step("order", order)
    )
    try:
        assert a == b
        assert await conn.fetchval("select count(*) from journal_orders") == 1
        assert await conn.fetchval("select count(*) from agent_steps where run_id = 'race'") == 1
    finally:
        await conn.close()


async def test_a_completed_run_replays_and_takes_no_new_steps(journal: Journal) -> None:
    """Resuming a completed run returns its outputs; asking for a step it never had is an error."""
    from journal import RunFinished

    run = await journal.run("finished")
    await run.step("a", lambda ctx: "A")
    await run.complete()
    again = await journal.run("finished")
    assert again.status == "completed"
    assert await again.step("a", lambda ctx: "other") == "A"
    with pytest.raises(RunFinished):
        await again.step("b", lambda ctx: "B")
