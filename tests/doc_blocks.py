"""The fenced code blocks of the documentation, read out of the Markdown, and the pieces to check them.

A block's info string is its language and then labels, which GitHub does not show: ```` ```toml
fragment ````, ```` ```text output ````. tests/test_doc_blocks.py says what each kind of block must do.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Every page a user reads: the README and docs/, and the READMEs beside what they describe.
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "deploy" / "README.md",
    ROOT / "sim" / "README.md",
    ROOT / "model" / "README.md",
    ROOT / "bench" / "README.md",
]
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


class BadMarkdown(ValueError):
    """A page whose blocks cannot be read as a user's renderer reads them."""


class NoRule(AssertionError):
    """A block (or a command in one) that nothing knows how to check: it fails, it is never skipped."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, counted from 1 as an editor does
    language: str
    labels: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"

    def __str__(self) -> str:
        kind = " ".join((self.language or "(no language)", *self.labels))
        return f"{self.where} ({kind})"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order, with its indentation (inside a list item) removed."""
    lines = page.read_text().splitlines()
    found = []
    n = 0
    while n < len(lines):
        opening = _FENCE.match(lines[n])
        if opening is None:
            n += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        words = opening["info"].split()
        body: list[str] = []
        end = n + 1
        while end < len(lines):
            closing = _FENCE.match(lines[end])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            line = lines[end]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
            end += 1
        else:
            where = Block(page, n + 1, "", (), "").where
            raise BadMarkdown(f"{where}: a code block that is never closed")
        language = words[0].lower() if words else ""
        found.append(Block(page, n + 1, language, tuple(words[1:]), "\n".join(body) + "\n"))
        n = end + 1
    return found


def every_block() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


@dataclass(frozen=True)
class Unit:
    """A block, and the ``text output`` block after it that shows what it prints."""

    block: Block
    shown: Block | None = None


def units(found: list[Block]) -> list[Unit]:
    """``found`` with each ``text output`` block joined to the block before it, which must print."""
    out: list[Unit] = []
    for block in found:
        before = out[-1] if out and out[-1].block.page == block.page else None
        joins = before is not None and before.shown is None and before.block.language in ("python", "sh")
        if block.labels == ("output",) and joins:
            assert before is not None
            out[-1] = Unit(before.block, block)
        else:
            out.append(Unit(block))  # an output block alone is a unit that no rule takes: it fails
    return out


def require_labels(unit: Unit, *allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The block's labels, if they are among those its rule knows; else it fails, naming the block."""
    if unit.block.labels not in allowed:
        raise NoRule(f"{unit.block}: labels {' '.join(unit.block.labels)!r} mean nothing to its rule")
    return unit.block.labels


def shows_a_file(unit: Unit) -> bool:
    """Whether the block is labelled with a file of the repository, which it must then be, verbatim."""
    if len(unit.block.labels) != 1 or not (ROOT / unit.block.labels[0]).is_file():
        return False
    shown = unit.block.labels[0]
    assert unit.block.text == (ROOT / shown).read_text(), f"{unit.block} is not {shown} as it is"
    return True


# --- printed output ---------------------------------------------------------------------------------


def check_shown(unit: Unit, printed: str) -> None:
    """What the unit printed is what its ``text output`` block shows, if it has one."""
    if unit.shown is not None:
        assert output_matches(unit.shown.text, printed), (
            f"{unit.block} printed what {unit.shown.where} does not show:\n{printed}"
        )


def output_matches(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what the documentation shows: line by line, as doctest's ELLIPSIS reads it.

    ``...`` within a line stands for any text; a line that is only ``...`` for any number of lines.
    A run of spaces matches any run of spaces (so that a table's columns stay aligned around a
    ``...``); trailing spaces and carriage returns (HTTP heads end their lines in CRLF) are not compared.
    """
    pattern = []
    for line in shown.rstrip("\n").splitlines():
        line = " ".join(line.split())
        if line == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(".*".join(re.escape(part) for part in line.split("...")) + r"\n")
    text = "".join(" ".join(line.split()) + "\n" for line in printed.rstrip("\n").splitlines())
    return re.fullmatch("".join(pattern), text) is not None


# --- shell ------------------------------------------------------------------------------------------

OPERATORS = frozenset({"&&", "||", ";", "|"})


def _is_redirection(token: str) -> bool:
    return bool(token) and set(token) <= set("<>&") and token not in OPERATORS


@dataclass
class Command:
    """One simple command of a shell line: its program and words, the variables set before it."""

    words: list[str]
    assignments: dict[str, str] = field(default_factory=dict)
    writes: list[str] = field(default_factory=list)  # files it redirects its output into

    @property
    def program(self) -> str:
        return Path(self.words[0]).name if self.words else ""


@dataclass
class ShellLine:
    """A command line as a user types it (continuations joined), and the output the page shows for it."""

    text: str
    tokens: list[str]
    commands: list[Command]
    roles: list[tuple[str, int]]  # per token: operator, redirection, target, assignment or word; its command
    shown: str | None = None  # None: the page shows no output for it

    def runs(self) -> list[Command]:
        return [c for c in self.commands if c.words]


def shell_lines(block: Block) -> list[ShellLine]:
    """The command lines of an ``sh`` block, or of a ``console`` block: there ``$ `` starts a command,
    and the lines after it, up to the next command, are what it prints."""
    console = block.language == "console"
    logical: list[tuple[str, list[str]]] = []
    current: str | None = None  # a command continued on the next line (a trailing backslash)
    for raw in block.text.splitlines():
        if current is not None:
            current += raw
        elif console and raw.startswith("$ "):
            current = raw[2:]
        elif console:
            if logical:
                logical[-1][1].append(raw)
            elif raw.strip():
                raise BadMarkdown(f"{block}: output before any command: {raw!r}")
            continue
        elif not raw.strip():
            continue
        else:
            current = raw
        current = _without_comment(current)
        if current.endswith("\\"):
            current = current[:-1]
            continue
        if current.strip():
            logical.append((current.strip(), []))
        current = None
    if current is not None:
        raise BadMarkdown(f"{block}: the last command is continued (a trailing backslash) into nothing")
    return [
        _parse(text, "\n".join(out).strip("\n") + "\n" if console and "".join(out).strip() else None)
        for text, out in logical
    ]


def _without_comment(text: str) -> str:
    """``text`` up to a ``#`` that starts a word outside quotes, as the shell reads a comment."""
    quote = ""
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text


def _parse(text: str, shown: str | None) -> ShellLine:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""  # comments are gone already; a # inside a word is part of it
    tokens = list(lexer)
    commands: list[Command] = [Command([])]
    roles: list[tuple[str, int]] = []  # per token: what it is, and the command it belongs to
    for n, token in enumerate(tokens):
        here = commands[-1]
        if token in OPERATORS:
            roles.append(("operator", len(commands) - 1))
            commands.append(Command([]))
        elif _is_redirection(token) or (
            token.isdigit() and n + 1 < len(tokens) and _is_redirection(tokens[n + 1])
        ):
            roles.append(("redirection", len(commands) - 1))
        elif roles and roles[-1][0] == "redirection" and _is_redirection(tokens[n - 1]):
            here.writes.append(token)
            roles.append(("target", len(commands) - 1))
        elif not here.words and re.match(r"^[A-Za-z_]\w*=", token):
            name, _, value = token.partition("=")
            here.assignments[name] = value
            roles.append(("assignment", len(commands) - 1))
        else:
            here.words.append(token)
            roles.append(("word", len(commands) - 1))
    return ShellLine(text, tokens, commands, roles, shown)


def rebuilt(line: ShellLine, words: dict[int, list[str]]) -> str:
    """``line`` again as one shell command, command ``i``'s words replaced by ``words[i]`` where given."""
    out: list[str] = []
    done: set[int] = set()
    for token, (role, index) in zip(line.tokens, line.roles, strict=True):
        if role in ("operator", "redirection"):
            out.append(token)
        elif role == "assignment":
            name, _, value = token.partition("=")
            out.append(f"{name}={shlex.quote(value)}")
        elif role == "target":
            out.append(shlex.quote(token))
        elif index not in done:
            done.add(index)
            out.extend(shlex.quote(w) for w in words.get(index, line.commands[index].words))
    return " ".join(out)
