"""``effect-gateway audit``: export the audit's chain, verify an export, make a signing key.

``export`` reads the database (it first links what has settled into the chain, and signs the heads it
ends at when the signing key is at hand); ``verify`` reads only the file, so an auditor runs it anywhere
(gateway.chain says what a verified export proves).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import asyncpg

from gateway import chain, problems
from gateway.chain import Round, Signer
from gateway.chaining import Exported, chain_round, export, signer_of
from gateway.effects_json import parse_moment
from gateway.errors import UsageError
from gateway.schema import ready
from gateway.settings import Settings

# How long an export waits for a round another gateway is running: rounds take tens of milliseconds.
BUSY_TRIES = 50
BUSY_WAIT = 0.1


def add_commands(sub: Any) -> None:
    """The ``audit`` command and its three, on the CLI's parser of commands."""
    audit = sub.add_parser("audit", help="export the audit's chain, or verify an export")
    what = audit.add_subparsers(dest="audit_command", required=True)
    out = what.add_parser("export", help="write the chain of a period as JSON Lines, with its signed heads")
    out.add_argument("--tenant", help="this tenant's chain only (default: every tenant's)")
    out.add_argument("--since", help="entries settled from this time: ISO, or a duration such as 7d")
    out.add_argument("--until", help="entries settled before this time: ISO, or a duration such as 1d")
    out.add_argument("--output", "-o", help="the file to write (default: standard output)")
    check = what.add_parser("verify", help="check an export, without the database")
    check.add_argument("file", help="the export (- for standard input)")
    check.add_argument(
        "--public-key",
        action="append",
        default=[],
        help="a key its heads may be signed with (hex, base64, or a file holding one); again for each key "
        "used since the key last changed. Given, every tenant's part must end at a head it signed",
    )
    what.add_parser("new-key", help="print a new signing key (for [audit] signing_key) and its public key")
    for command in what.choices.values():
        command.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def cmd_audit(settings: Settings, args: argparse.Namespace) -> int:
    match args.audit_command:
        case "export":
            return _export(settings, args)
        case "verify":
            return _verify(args)
        case _:
            private, public = chain.new_key()
            print(f"signing_key = {private}\npublic key  = {public}", flush=True)
            return 0


def _moment(value: str | None, name: str) -> datetime | None:
    try:
        return parse_moment(value, name) if value is not None else None
    except problems.Problem as exc:
        raise UsageError(exc.detail) from None


def _export(settings: Settings, args: argparse.Namespace) -> int:
    from gateway.cli import database

    since, until = _moment(args.since, "--since"), _moment(args.until, "--until")
    if since is not None and until is not None and since >= until:
        raise UsageError(f"--since ({since.isoformat()}) must come before --until ({until.isoformat()})")
    signing = signer_of(settings)  # None: no key at hand, and the export says it signed nothing

    async def run(dsn: str, output: IO[bytes]) -> list[Exported]:
        await ready(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            await _caught_up(conn, signing)
            return await export(conn, output.write, tenant=args.tenant, since=since, until=until)
        finally:
            await conn.close()

    with database(settings, create=False) as dsn, _output(args.output) as output:
        done = asyncio.run(run(dsn, output))
    # What was written, for the person who ran it: beside the export on standard output when it went to
    # a file, else on standard error, out of the export's way.
    said = sys.stdout if args.output not in (None, "-") else sys.stderr
    for part in done:
        line = f"tenant {part.tenant}: entries {part.first} to {part.last}, {part.heads} signed head(s)"
        print(line, file=said)
    if not done:
        print("no entries settled in that period", file=said)
    if signing is None:
        print(
            "the signing key is not at hand ([audit] signing_key): entries after the last signed head "
            "go out unsigned",
            file=sys.stderr,
        )
    return 0


async def _caught_up(conn: asyncpg.Connection, signing: Signer | None) -> None:
    """Link everything settled so far into the chain, and sign the heads: the export ends at them."""
    for _ in range(BUSY_TRIES):
        done: Round = await chain_round(conn, signing, sign_now=True)
        if done.busy:
            await asyncio.sleep(BUSY_WAIT)
        elif not done.chained:
            return
    raise UsageError("another gateway kept the audit's chain busy for 5 s; try the export again")


@contextlib.contextmanager
def _output(path: str | None) -> Iterator[IO[bytes]]:
    if path is None or path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    try:
        file = open(path, "wb")  # noqa: SIM115  (closed below; open's failure is the user's to fix)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    with file:
        yield file


def _verify(args: argparse.Namespace) -> int:
    keys = []
    for given in args.public_key:
        path = Path(given)
        try:
            keys.append(chain.public_key(path.read_text() if path.is_file() else given))
        except ValueError as exc:  # UnicodeDecodeError too: a binary (DER) file
            raise UsageError(f"--public-key {given}: {exc}") from None
    try:
        with _input(args.file) as lines:
            verified = chain.verify(lines, keys)
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None
    except chain.Mismatch as exc:
        print(f"NOT VERIFIED: {args.file}, {exc}", flush=True)
        return 1
    for line in verified.report():
        print(line)
    print(f"verified: {args.file}", flush=True)
    return 0


@contextlib.contextmanager
def _input(path: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdin.buffer
        return
    with open(path, "rb") as file:
        yield file
