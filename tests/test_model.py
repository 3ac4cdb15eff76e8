"""The exhaustive model of the effect state machine (model/): it holds, and it still catches every mutation.

Runs ``model/check.py``'s short form: the designed model over every upstream kind, then each mutation of a
design rule and each finding in the code, which must all be caught. spin and a C compiler must be on the
PATH (``make test`` installs them where it can); without them these tests fail, they never skip.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.states import TRANSITIONS, State

ROOT = Path(__file__).resolve().parent.parent


def _load_checker() -> ModuleType:
    # model/ is no package: the checker runs on a bare Python in CI, before any virtualenv exists.
    spec = importlib.util.spec_from_file_location("model_check", ROOT / "model" / "check.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


check = _load_checker()
BROKEN = [*check.MUTATIONS, *check.FINDINGS]


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    missing = check.tools_missing()
    if missing:
        pytest.fail(
            f"the model check cannot run: {missing}. `make test` installs spin and gcc with apt-get when it "
            "runs as root; otherwise install them and run again.",
            pytrace=False,
        )
    planned = check.plan(short=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda run: check.execute(run, None), planned))
    return {run.name: run for run in planned}


def _explain(run: Any) -> str:
    lines = [f"{run.name}: {run.problem or run.violated or 'no error found'}", *run.trail]
    return "\n".join(lines)


def test_the_designed_model_keeps_every_invariant(runs: dict[str, Any]) -> None:
    """Every interleaving of two clients, crashes, the clock, the upstream and an operator keeps the rules."""
    designed = [run for run in runs.values() if not run.expect_error]
    assert designed
    for run in designed:
        assert run.ok, _explain(run)
        assert run.complete, _explain(run)
        assert run.states > 100_000, f"{run.name}: the search looks vacuous ({run.states} states)"


@pytest.mark.parametrize("name", BROKEN)
def test_each_broken_rule_is_caught(runs: dict[str, Any], name: str) -> None:
    """A design rule broken on purpose (or the code's hole it stands for) makes the model fail."""
    run = runs[name]
    assert not run.problem, _explain(run)
    assert run.errors, f"{name} ({run.what}) was not caught: the model no longer checks what it says"
    assert "VIOLATED" in "\n".join(run.trail), _explain(run)


def test_the_model_has_the_code_transition_table() -> None:
    """The model's transition table is gateway.states.TRANSITIONS, listed once in each."""
    text = (ROOT / "model" / "effects.pml").read_text()
    body = text[text.index("inline transition_table()") :]
    body = body[: body.index("\n}")]
    names = {"nothing": None, **{state.value: state for state in State}}
    model = {(names[a], names[b]) for a, b in re.findall(r"allow\((\w+), (\w+)\)", body)}
    code = {(source, target) for source, targets in TRANSITIONS.items() for target in targets}
    assert model == code
