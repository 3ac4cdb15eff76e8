"""The commands of ``sh`` and ``console`` blocks, each checked by the rule for its program.

A command line runs (through bash, in the world's scratch directory) when every program in it has a rule
that runs it: curl and ``effect-gateway``. The others cannot run inside the suite; their rules say why,
and check what they can without running them: that the Makefile targets, files, subcommands and flags
they name exist. A program without a rule fails the block, naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import yaml

from gateway import cli
from tests.doc_blocks import (
    ROOT,
    Command,
    NoRule,
    ShellLine,
    Unit,
    check_shown,
    output_matches,
    rebuilt,
    require_labels,
    shell_lines,
)
from tests.doc_world import BIN, World, awaiting_operator


@dataclass
class Context:
    world: World
    unit: Unit
    line: ShellLine
    made: set[str]  # files earlier commands of the block wrote


@dataclass(frozen=True)
class Run:
    """How a command runs here: its words (the addresses and paths of this world), and its exit status."""

    words: list[str]
    status: int = 0


# A rule says how to run the command, or returns None once it has checked what it cannot run.
ProgramRule = Callable[[Command, Context], "Run | None"]


def run_shell(unit: Unit, world: World) -> None:
    """Each command line by its programs' rules. One that runs must exit with the status its rule expects
    (0, but for a crash on purpose) and print what the page shows, where it shows something."""
    if unit.block.language == "sh":
        require_labels(unit, ())
    lines = shell_lines(unit.block)
    made: set[str] = set()
    _operators_world(lines, world)
    printed = []
    for line in lines:
        context = Context(world, unit, line, made)
        runs: dict[int, Run] = {}
        checked = []
        for n, command in enumerate(line.commands):
            if not command.words:
                continue
            rule = PROGRAMS.get(command.program)
            if rule is None:
                raise NoRule(f"{unit.block}: no rule for `{command.program}` in `{line.text}`")
            result = rule(command, context)
            if result is None:
                checked.append(command.program)
            else:
                runs[n] = result
            made.update(command.writes)
        if not runs:
            if line.shown is not None or unit.shown is not None:
                raise NoRule(f"{unit.block}: shows the output of `{line.text}`, which the suite cannot run")
            continue
        if checked:
            raise NoRule(f"{unit.block}: `{line.text}` mixes what runs here with {checked}: split the line")
        status = max(r.status for r in runs.values())
        if status and len(runs) > 1:
            raise NoRule(f"{unit.block}: `{line.text}` exits {status} on purpose in a pipeline: split it")
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", rebuilt(line, {n: r.words for n, r in runs.items()})],
            cwd=world.scratch,
            env=world.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == status, (
            f"{unit.block}: `{line.text}` exited {done.returncode}, not {status}:\n{done.stdout}{done.stderr}"
        )
        if line.shown is not None:
            assert output_matches(line.shown, done.stdout), (
                f"{unit.block}: `{line.text}` printed what the page does not show:\n{done.stdout}"
            )
        printed.append(done.stdout)
    check_shown(unit, "".join(printed))


def curl(command: Command, context: Context) -> Run:
    """Sent to this world's gateway (or upstream); an HTTP error fails a command whose output is not shown."""
    words = []
    for word in command.words:
        if re.match(r"https?://", word):
            base = next((b for b in context.world.addresses if word == b or word.startswith(b + "/")), None)
            if base is None:
                raise NoRule(f"{context.unit.block}: {word} is neither the gateway nor a demo upstream")
            word = context.world.addresses[base] + word[len(base) :]
        words.append(word)
    if context.line.shown is None and context.unit.shown is None:
        words.insert(1, "--fail-with-body")  # a user sees a problem+json; the exit status says it here
    return Run(words)


def effect_gateway(command: Command, context: Context) -> Run | None:
    """Parsed by the CLI's own parser, then run against this world with the example as the reader's
    configuration, whatever its path. Not run: ``serve`` (this world's gateway is that command) and
    ``demo`` (20 s, run by tests/test_demo.py)."""
    args = command.words[1:]
    parsed = _cli_args(args)
    if isinstance(parsed, str):
        raise AssertionError(f"{context.unit.block}: `{context.line.text}`: {parsed}")
    if parsed.command in ("serve", "demo"):
        return None
    for n, word in enumerate(args[:-1]):
        if word == "--config" and not (context.world.scratch / args[n + 1]).is_file():
            args[n + 1] = "gateway.toml"
    return Run([str(BIN / "effect-gateway"), *args])


def _cli_args(args: list[str]) -> argparse.Namespace | str:
    """What the CLI makes of ``args``, or what it says when it refuses them."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return cli.parser().parse_args(args)
    except SystemExit:
        return said.getvalue().strip().splitlines()[-1]


def _operators_world(lines: list[ShellLine], world: World) -> None:
    """The effects a block's ``effects ID`` and ``resolve ID --attempt N`` name, awaiting an operator."""
    wanted: dict[int, int] = {}
    for line in lines:
        for command in line.commands:
            if command.program != "effect-gateway":
                continue
            parsed = _cli_args(command.words[1:])
            if isinstance(parsed, str):
                continue  # effect_gateway() fails it, naming the block
            if parsed.command == "resolve":
                wanted[int(parsed.id)] = parsed.attempt
            elif parsed.command == "effects" and parsed.id is not None:
                wanted.setdefault(int(parsed.id), 2)
    for effect_id, attempt in sorted(wanted.items()):
        asyncio.run(awaiting_operator(world.dsn, attempt, effect_id))


def make(command: Command, context: Context) -> None:
    """Not run: ``make test`` is this suite, the others take minutes (demo, model-check, bench) or hold
    make serve's fixed ports (tests/test_playground.py runs it in a network namespace of its own)."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", text, re.MULTILINE))
    variables = set(re.findall(r"^(\w+) \??=", text, re.MULTILINE))
    for word in command.words[1:]:
        name, assigned, _ = word.partition("=")
        if assigned:
            assert name in variables, f"{context.unit.block}: the Makefile has no variable {name}"
        else:
            assert word in targets, f"{context.unit.block}: the Makefile has no target {word}"


def python(command: Command, context: Context) -> Run | None:
    """A program of examples/ runs here, as every one of them is written to run against ``make serve``;
    with ``--crash`` it must die after its effect, with the status it names ``CRASHED``. Anything else is
    not run (a server, or minutes of model checking): the module or script exists and its ``--help``
    lists every flag the page gives it."""
    args = command.words[1:]
    if args[:2] == ["-m", "venv"]:
        return None  # the standard library's, making a virtualenv on the reader's machine
    head = []
    for word in args:
        if word.startswith("--"):
            break
        head.append(word)
    if not head:
        raise NoRule(f"{context.unit.block}: `{context.line.text}` runs no module or script")
    if head[0] == "-m":
        found = len(head) > 1 and importlib.util.find_spec(head[1]) is not None
        assert found, f"{context.unit.block}: no module {head[1:2]}"
    else:
        assert (ROOT / head[0]).is_file(), f"{context.unit.block}: no script {head[0]}"
    if head[0].startswith("examples/"):
        script = ROOT / head[0]
        status = 0
        if "--crash" in args:
            crashed = re.search(r"^CRASHED = (\d+)", script.read_text(), re.MULTILINE)
            assert crashed, f"{context.unit.block}: {head[0]} has no CRASHED status to die with"
            status = int(crashed[1])
        return Run([sys.executable, str(script), *args[1:]], status)
    key = tuple(head)
    if key not in context.world.help_texts:
        done = subprocess.run(
            [sys.executable, *head, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        context.world.help_texts[key] = done.stdout
    for flag in (w.partition("=")[0] for w in args if w.startswith("--")):
        # The whole flag: argparse takes an abbreviation, but a reader would go on typing it.
        listed = re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", context.world.help_texts[key])
        assert listed, f"{context.unit.block}: `{' '.join(head)}` has no {flag}"
    return None


def pip(command: Command, context: Context) -> None:
    """Not run (it installs on the reader's machine): what it installs is this project and its extras."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = [w for w in command.words[2:] if not w.startswith("-")]
    if command.words[1:2] != ["install"] or not wanted:
        raise NoRule(f"{context.unit.block}: `{context.line.text}` installs nothing")
    for requirement in wanted:
        name, _, rest = requirement.partition("[")
        assert name in (".", "effect-gateway"), f"{context.unit.block}: installs {name}, not this project"
        for extra in filter(None, rest.rstrip("]").split(",")):
            assert extra in extras, f"{context.unit.block}: the project has no extra {extra}"


def named_files(reason: str) -> ProgramRule:
    """A rule for a program the suite cannot run (``reason``): every repository path it names exists."""

    def rule(command: Command, context: Context) -> None:
        _files_exist(command, context)

    rule.__doc__ = f"Not run: {reason}. The files it names exist."
    return rule


def _files_exist(command: Command, context: Context) -> None:
    for word in command.words[1:]:
        _exists(word.partition("=")[2] if word.startswith("-") and "=" in word else word, context)


def _exists(word: str, context: Context) -> None:
    if not re.fullmatch(r"(\./)?[\w.-]+(/[\w.-]+)+/?", word) or word in context.made:
        return  # not a relative path of the repository (an absolute one is on the reader's machine)
    found = (ROOT / word).exists() or (context.world.scratch / word).exists()
    assert found, f"{context.unit.block}: `{context.line.text}` names {word}, which does not exist"


def docker(command: Command, context: Context) -> None:
    """Not run: CI has no container engine; tests/test_deploy.py runs compose's commands as processes.
    Files named exist, compose's services are in its file, and a command run in one is checked too."""
    _files_exist(command, context)
    args = command.words[1:]
    if args[:1] == ["compose"]:
        compose = yaml.safe_load((ROOT / args[args.index("-f") + 1]).read_text())
        if "exec" in args:
            service, *inner = args[args.index("exec") + 1 :]
            assert service in compose["services"], f"{context.unit.block}: compose has no service {service}"
            inner_rule = PROGRAMS.get(Path(inner[0]).name)
            if inner_rule is None:
                raise NoRule(f"{context.unit.block}: no rule for `{inner[0]}` in `{context.line.text}`")
            if inner[0] == "effect-gateway":
                parsed = _cli_args(inner[1:])
                assert not isinstance(parsed, str), f"{context.unit.block}: `{context.line.text}`: {parsed}"
            else:
                inner_rule(Command(inner), context)
    return None


def kubectl(command: Command, context: Context) -> None:
    """Not run: CI has no cluster; tests/test_deploy.py validates the manifests against Kubernetes' schema.
    The manifests named exist and are YAML."""
    _files_exist(command, context)
    args = command.words[1:]
    if "-f" in args:
        assert list(yaml.safe_load_all((ROOT / args[args.index("-f") + 1]).read_text()))
    return None


def partitions(command: Command, context: Context) -> None:
    """Not run: it archives a month of the reader's own audit. The partitions it names are of the form
    the gateway makes (the test database has some)."""

    async def made() -> set[str]:
        conn = await asyncpg.connect(context.world.dsn)
        try:
            rows = await conn.fetch("select relname from pg_class where relname ~ '^effects_[0-9]'")
            return {re.sub(r"\d", "0", r["relname"]) for r in rows}
        finally:
            await conn.close()

    named = {re.sub(r"\d", "0", n) for n in re.findall(r"\beffects_\d\w*", " ".join(command.words))}
    assert named <= asyncio.run(made()), f"{context.unit.block}: no partition is named like {named}"
    return None


def spin(command: Command, context: Context) -> None:
    """Not run: the model check by hand takes minutes; tests/test_model.py runs model/check.py --short.
    Each ``-D`` the page gives spin is a configuration model/effects.pml knows."""
    _files_exist(command, context)
    model = (ROOT / "model" / "effects.pml").read_text()
    for word in command.words[1:]:
        if word.startswith("-D"):
            assert re.search(rf"\b{word[2:]}\b", model), (
                f"{context.unit.block}: effects.pml has no {word[2:]}"
            )
    return None


def compiler(command: Command, context: Context) -> None:
    """Not run (with spin, above): what it compiles is what spin wrote; what it writes, later lines run."""
    if "-o" in command.words:
        context.made.add(command.words[command.words.index("-o") + 1])
    return None


def made_earlier(command: Command, context: Context) -> None:
    """Not run (with spin, above): a program an earlier command of the block built."""
    assert command.words[0].removeprefix("./") in context.made, (
        f"{context.unit.block}: nothing built {command.words[0]}"
    )
    return None


PROGRAMS: dict[str, ProgramRule] = {
    "curl": curl,
    "effect-gateway": effect_gateway,
    "make": make,
    "python": python,
    "python3": python,
    "python3.11": python,
    "pip": pip,
    "docker": docker,
    "kubectl": kubectl,
    "systemctl": named_files(
        "it starts a service on the reader's machine (tests/test_deploy.py verifies the unit)"
    ),
    "install": named_files("it writes under the reader's /etc"),
    "cp": named_files("it writes under the reader's /etc"),
    "chmod": named_files("it changes the reader's files"),
    "printf": named_files("it writes the reader's secrets"),
    "pg_dump": partitions,
    "psql": partitions,
    "spin": spin,
    "cc": compiler,
    "pan": made_earlier,
}
