"""Every code block of the documentation does what its page says, against a real gateway: none can drift.

The blocks are read out of the pages (tests/doc_blocks.py), never copied, and checked by language, in
page order, against one world for the module (tests/doc_world.py): the demo upstreams and
``effect-gateway serve`` with examples/gateway.toml in front of them, on port 0 and the test Postgres.
That is what ``make serve`` starts on its fixed ports, so a block runs here as a user runs it there.

- ``python``: run as written, in a fresh interpreter of the project's virtualenv. A block reads the
  gateway's address from ``EFFECT_GATEWAY_URL`` (by default ``make serve``'s, ``http://127.0.0.1:8787``)
  and the journal's database from ``JOURNAL_DATABASE_URL``; here both name this world's. ``python
  PATH`` is the file at PATH, verbatim, and runs the same way.
- ``sh``, and ``console`` (``$ `` before each command, what it prints after it): each command by the rule
  for its program (tests/doc_commands.py). curl, ``effect-gateway`` and the programs of examples/ run,
  at this world's addresses; the rest (make, docker, kubectl, systemd, ...) cannot run here and are
  checked to name real targets, files, subcommands and flags, each rule saying why it does not run.
- ``toml``: a whole configuration loads as the gateway loads its file; ``toml fragment`` loads appended,
  as written, to examples/gateway.toml; ``toml PATH`` is the file at PATH, verbatim.
- ``json verdict``: an operator's verdict, accepted by the resolve route for an effect awaiting one.
- ``text output``, right after a ``python`` or ``sh`` block: what that block prints (``...``: any text).
- ``text transitions``: the state table of gateway/states.py. ``ini postgresql.conf``: the Postgres
  settings the embedded server applies, each a real one. ``sql role-defaults``: the statements that
  make the session settings a role's defaults behind a pooler (gateway.pooling).

A block in another language, or with labels its rule does not know, fails naming its page and line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from unittest import mock

import asyncpg
import pytest

from agent_example.playground import TRY
from gateway import embedded, notifications, pooling, states
from gateway.settings import load_settings
from gateway.store import StoreLimits, session_settings
from tests.doc_blocks import (
    PAGES,
    ROOT,
    BadMarkdown,
    Block,
    NoRule,
    Unit,
    blocks,
    check_shown,
    every_block,
    output_matches,
    require_labels,
    shell_lines,
    shows_a_file,
    units,
)
from tests.doc_commands import run_shell
from tests.doc_world import (
    DOCUMENTED_ADMIN,
    DOCUMENTED_GATEWAY,
    EXAMPLE,
    World,
    awaiting_operator,
    started_world,
)


@pytest.fixture(scope="module")
def world(postgres_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """One gateway and its upstreams for every block of every page, as one user runs the pages in turn."""
    with started_world(postgres_dsn, tmp_path_factory.mktemp("doc-blocks")) as started:
        yield started


def check(unit: Unit, world: World) -> None:
    """Check ``unit`` by its block's language; an unknown language fails naming the block."""
    rule = LANGUAGES.get(unit.block.language)
    if rule is None:
        raise NoRule(f"{unit.block}: no rule checks a block in this language (see {Path(__file__).name})")
    rule(unit, world)


def run_python(unit: Unit, world: World) -> None:
    """As written, in a fresh interpreter: exit 0, and the output the page shows. ``python PATH`` is
    the file at PATH, verbatim, run as a program."""
    if not shows_a_file(unit):
        require_labels(unit, ())
    script = world.scratch / f"{unit.block.page.stem}_{unit.block.line}.py"
    script.write_text(unit.block.text)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=world.scratch,
        env=world.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{unit.block} exited {done.returncode}:\n{done.stderr[-4000:]}"
    check_shown(unit, done.stdout)


def load_toml(unit: Unit, world: World) -> None:
    """A configuration loads as ``serve`` would load it (secrets left unresolved: the reader sets them)."""
    labels = unit.block.labels
    # A fragment is appended to examples/gateway.toml as written, as the page tells the reader to: a
    # table the file has already would be a second definition, which TOML refuses.
    text = EXAMPLE.read_text() + "\n" + unit.block.text if labels == ("fragment",) else unit.block.text
    data = tomllib.loads(text)
    if labels != ("fragment",) and not shows_a_file(unit):
        require_labels(unit, ())
    ours = {k: v for k, v in os.environ.items() if not k.startswith("EFFECT_GATEWAY_")}
    with mock.patch.dict(os.environ, ours, clear=True):  # the block alone, no variable of the suite's
        load_settings(None, need_secrets=False, **data)


def check_json(unit: Unit, world: World) -> None:
    """An operator's verdict, posted to the resolve route for an effect awaiting one at its attempt; or
    (``json notification``) a webhook's notification, with the fields the gateway sends and no other."""
    if unit.block.labels == ("notification",):
        shown = json.loads(unit.block.text)
        made = notifications.document(NOTICE, NOTICE.noticed_at, "https://gateway.internal:8788")
        assert sorted(shown) == sorted(made)
        assert sorted(shown["effect"]) == sorted(made["effect"])
        assert shown["event"] in {w.event for w in notifications.WAITS}
        return
    require_labels(unit, ("verdict",))
    verdict = json.loads(unit.block.text)
    effect_id = asyncio.run(awaiting_operator(world.dsn, verdict["attempt"]))
    request = urllib.request.Request(
        f"{world.addresses[DOCUMENTED_ADMIN]}/_gateway/effects/{effect_id}/resolve",
        data=unit.block.text.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        resolved = json.load(resp)
    assert resolved["state"] == ("completed" if verdict["happened"] else "retryable")


# An effect waiting for review, as the webhook's notification of it reads it.
NOTICE = notifications.Notice(
    id="0b6f3c9e-3f0a-4c7e-9a57-8d1f0f5a2b11",
    event="needs_review",
    effect_id=42,
    attempt=2,
    state="needs_review",
    tenant="default",
    upstream="shop",
    method="POST",
    path="/orders",
    created_at=datetime(2026, 12, 2, 9, tzinfo=UTC),
    run_id="run-7",
    step="4",
    waiting_since=datetime(2026, 12, 2, 11, 55, tzinfo=UTC),
    noticed_at=datetime(2026, 12, 2, 11, 55, 10, tzinfo=UTC),
)


def check_text(unit: Unit, world: World) -> None:
    """``text transitions`` is the state table the code enforces."""
    if unit.block.labels == ("output",):  # units() joined every other one to the block it shows
        raise NoRule(f"{unit.block}: shows the output of no python or sh block right before it")
    require_labels(unit, ("transitions",))
    shown: dict[str | None, set[str]] = {}
    for line in unit.block.text.splitlines():
        source, arrow, targets = re.sub(r"\(.*\)", "", line).partition("->")
        if not arrow:
            raise NoRule(f"{unit.block}: {line!r} is not 'state -> state | state'")
        name = source.strip()
        shown[None if name == "nothing" else name] = {t.strip() for t in targets.split("|")}
    table = {(s.value if s else None): {t.value for t in ts} for s, ts in states.TRANSITIONS.items()}
    assert shown == table


def check_ini(unit: Unit, world: World) -> None:
    """``ini postgresql.conf``: real Postgres settings, with the values the embedded server applies."""
    require_labels(unit, ("postgresql.conf",))
    applied = dict(re.findall(r"alter system set (\w+) = '?([^';]+)'?;", embedded.WRITE_PATTERN_SETTINGS))
    shown = dict(re.findall(r"^(\w+) = (\S+)", unit.block.text, re.MULTILINE))
    assert shown == applied

    async def known() -> set[str]:
        conn = await asyncpg.connect(world.dsn)
        try:
            return {r["name"] for r in await conn.fetch("select name from pg_settings")}
        finally:
            await conn.close()

    assert set(shown) <= asyncio.run(known())


def check_sql(unit: Unit, _world: World) -> None:
    """``sql role-defaults``: the statements gateway.pooling gives for the default settings, for the role
    gateway_runtime in the database effects (a gateway's warning shows the same)."""
    require_labels(unit, ("role-defaults",))
    wanted = pooling.role_defaults("gateway_runtime", "effects", session_settings(StoreLimits()))
    assert unit.block.text.strip() == ";\n".join(wanted) + ";"


LANGUAGES: dict[str, Callable[[Unit, World], None]] = {
    "python": run_python,
    "sh": run_shell,
    "console": run_shell,
    "toml": load_toml,
    "json": check_json,
    "text": check_text,
    "ini": check_ini,
    "sql": check_sql,
}

UNITS = units(every_block())


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: str(u.block))
def test_every_block_does_what_its_page_says(unit: Unit, world: World) -> None:
    """Each block of the docs runs (or is checked, where it cannot run here) and shows what it prints."""
    check(unit, world)


def test_the_example_configuration_is_shown_as_it_is() -> None:
    """The README and the configuration reference show examples/gateway.toml itself, not a look-alike."""
    shown = {
        b.page.name for b in every_block() if b.language == "toml" and b.labels == ("examples/gateway.toml",)
    }
    assert shown >= {"README.md", "configuration.md"}


def test_make_serve_suggests_what_the_readme_shows() -> None:
    """What ``make serve`` prints to try first are the README's own commands, in its order."""
    suggested = Block(
        ROOT / "agent_example" / "playground.py",
        1,
        "sh",
        (),
        _indented(TRY.format(url=DOCUMENTED_GATEWAY, admin=DOCUMENTED_ADMIN)),
    )
    readme = [
        " ".join(c.words)
        for b in blocks(ROOT / "README.md")
        if b.language in ("sh", "console")
        for line in shell_lines(b)
        for c in line.runs()
    ]
    commands = [" ".join(c.words) for line in shell_lines(suggested) for c in line.runs()]
    assert commands
    positions = [readme.index(c) if c in readme else -1 for c in commands]
    assert -1 not in positions, [c for c, p in zip(commands, positions, strict=True) if p < 0]
    assert positions == sorted(positions)


def _indented(text: str) -> str:
    return "".join(line[2:] + "\n" for line in text.splitlines() if line.startswith("  "))


def test_a_block_no_rule_knows_fails_naming_its_page_and_line(tmp_path: Path) -> None:
    """A block in an unknown language, with labels its rule does not know, or showing what the suite
    cannot run, fails naming its page and line: nothing is skipped."""
    page = tmp_path / "page.md"
    page.write_text(
        "```rust\nfn main() {}\n```\n"
        '```toml frgament\nretention = "7d"\n```\n'
        "```text output\nok\n```\n"
        "```console\n$ make demo\nok\n```\n"
        "```sh\nterraform apply\n```\n"
        "```sh\nmake test && curl -s http://127.0.0.1:8787/_gateway/health\n```\n"
    )
    found = [Unit(block) for block in blocks(page)]
    world = World("http://127.0.0.1:1", "", tmp_path, {}, {DOCUMENTED_GATEWAY: "http://127.0.0.1:1"})
    for unit, says in zip(
        found,
        [
            r"page.md:1 \(rust\): no rule checks a block in this language",
            r"page.md:4 \(toml frgament\): labels 'frgament' mean nothing",
            r"page.md:7 \(text output\): shows the output of no python or sh block",
            r"page.md:10 \(console\): shows the output of `make demo`, which the suite cannot run",
            r"page.md:14 \(sh\): no rule for `terraform`",
            r"page.md:17 \(sh\): `make test && curl .*` mixes what runs here with \['make'\]",
        ],
        strict=True,
    ):
        with pytest.raises(NoRule, match=says):
            check(unit, world)
    page.write_text("```sh\nmake test\n")
    with pytest.raises(BadMarkdown, match=r"page.md:1: a code block that is never closed"):
        blocks(page)


def test_shown_output_must_match_what_was_printed() -> None:
    """``...`` stands for any text in a line, or any lines on its own; anything else must be as printed."""
    assert output_matches("201 ...\n...\nreplayed: true\n", "201 ord_1\nDate: x\nServer: y\nreplayed: true\n")
    assert output_matches("a\n...\nb\n", "a\nb\n")
    assert output_matches("1   ...               done\n", "1   2026-12-03 07:10Z  done\n")
    assert not output_matches("201 ord_1\n", "201 ord_2\n")
    assert not output_matches("replayed: true\n", "replayed: true\nand more\n")
    assert not output_matches("...\nb\n", "a\nb\nc\n")


def test_every_page_is_read() -> None:
    """Every Markdown page in the repository but the changelog is one whose blocks are checked."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    pages = {ROOT / name for name in tracked.stdout.split()} - {ROOT / "CHANGELOG.md"}
    assert pages
    assert pages <= set(PAGES)
