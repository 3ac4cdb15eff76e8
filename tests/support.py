"""Real parts for tests: upstream HTTP servers on loopback (port 0) and gateways on the test Postgres."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import asyncpg
from aiohttp import web

from agent_example.processes import Service, start_service
from gateway import packing
from gateway.app import runners
from gateway.decision import review as review_move
from gateway.proxy import PROXY_ROUTE
from gateway.record import EffectRecord
from gateway.runtime import RUNTIME, Runtime
from gateway.schema import grant_to
from gateway.settings import load_settings
from gateway.store import Store, StoreLimits, opened, session_settings
from tests.factories import new_effect

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The probe of Upstream.serve_search's order search, which finds the orders (POST /orders) by their stamp.
ORDER_SEARCH = {
    "method": "GET",
    "path": "/orders/search?ref={key}",
    "found": "items.0",
    "status": 201,
    "routes": ["POST /orders"],
}
# Rows of the crash matrix, filled by tests/test_crash.py and printed at the end of the run.
CRASH_MATRIX: list[tuple[str, str, int, int, int, str, str | None]] = []
# Cases tried per operation and generation mode by tests/test_schemathesis.py, printed at the end.
FUZZ_COUNTS: list[tuple[str, str, int]] = []
# Screenshots the browser tests took (tests/test_audit_browser.py), listed at the end of the run.
SCREENSHOTS: list[Path] = []
ROOT = Path(__file__).resolve().parent.parent
# The lines that put both of a gateway's listeners on port 0: a user's `make serve` may hold the defaults,
# and so may another test's gateway.
PORT_ZERO = 'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'


@dataclass
class Call:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    # Every header as received, repeats and all (headers above keeps one value per name).
    header_list: list[tuple[str, str]] = field(default_factory=list)
    # The request target as it came, still percent-encoded (path above is decoded).
    target: str = ""


@dataclass
class Upstream:
    """An HTTP server that records every request it receives and answers as a test scripts it.

    By default it creates an "order" (201, JSON with a sequence number), so that a duplicate effect
    is visible as a second call and a second id.
    """

    calls: list[Call] = field(default_factory=list)
    routes: dict[str, Handler] = field(default_factory=dict)
    url: str = ""
    received: asyncio.Event = field(default_factory=asyncio.Event)
    # When set, behaves like an API that honours keys in this header: a repeat gets the first answer.
    key_header: str | None = None
    remembered: dict[str, web.Response] = field(default_factory=dict)

    def effects(self, path: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.method not in ("GET", "HEAD") and (path is None or c.path == path)]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.calls.append(
            Call(
                request.method,
                request.path,
                request.raw_path.partition("?")[2],
                dict(request.headers),
                body,
                list(request.headers.items()),
                request.raw_path,
            )
        )
        self.received.set()
        key = request.headers.get(self.key_header) if self.key_header else None
        if key is not None and key in self.remembered:
            first = self.remembered[key]
            assert first.body is not None
            return web.Response(status=first.status, body=first.body, content_type=first.content_type)
        handler = self.routes.get(request.path)
        if handler is not None:
            resp = await handler(request)
        else:
            resp = web.json_response(
                {"id": len(self.calls), "echo": body.decode(errors="replace")}, status=201
            )
        if key is not None and isinstance(resp, web.Response):
            self.remembered[key] = resp
        return resp

    def stamped(self, field_name: str, value: str) -> list[Any]:
        """The orders created with ``field_name == value`` in their JSON body (what a probe searches)."""
        found = []
        for call in self.effects():
            try:
                doc = json.loads(call.body)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get(field_name) == value:
                found.append({"order": call.body.decode(), "reference": value})
        return found

    def serve_search(self, path: str = "/orders/search", field_name: str = "client_reference") -> None:
        """Answer ``GET path?ref=KEY`` with ``{"items": [...]}``, as a shop's order search would."""

        async def search(request: web.Request) -> web.Response:
            return web.json_response({"items": self.stamped(field_name, request.query.get("ref", ""))})

        self.routes[path] = search

    def effects_created(self) -> int:
        """Effects that really happened: repeats of a remembered key are not new effects."""
        seen: set[str] = set()
        count = 0
        for call in self.effects():
            key = call.headers.get(self.key_header) if self.key_header else None
            if key is None or key not in seen:
                count += 1
            if key is not None:
                seen.add(key)
        return count


@asynccontextmanager
async def upstream_server() -> AsyncIterator[Upstream]:
    upstream = Upstream()
    app = web.Application()
    app.router.add_route("*", PROXY_ROUTE, upstream.handle)  # every path, as the gateway's
    async with serving(app) as upstream.url:
        yield upstream


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` (a demo upstream, say) on 127.0.0.1, port 0; yields its URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@dataclass
class Gateway:
    # The agents' listener (the upstreams) and the operators' (the audit, the effects API, metrics).
    url: str
    admin_url: str
    runtime: Runtime


# The role the suite's gateways run with: made by tests/conftest.py (unless TEST_RUNTIME_DATABASE_URL
# names one made beforehand) and granted what docs/operations.md says serve needs, by the code behind
# `effect-gateway migrate --grant-to`, and nothing else: a statement that needs more fails in the suite.
RUNTIME_ROLE = "effect_gateway_test_runtime"
RUNTIME_PASSWORD = "runtime-of-the-tests"  # a test server's role, reachable only from this machine


def runtime_role() -> tuple[str, str]:
    """The runtime role's name and password: TEST_RUNTIME_DATABASE_URL's user, else the suite's own."""
    given = os.environ.get("TEST_RUNTIME_DATABASE_URL")
    if not given:
        return RUNTIME_ROLE, RUNTIME_PASSWORD
    parts = urlsplit(given)
    if not parts.username:
        raise RuntimeError("TEST_RUNTIME_DATABASE_URL names no user")
    return unquote(parts.username), unquote(parts.password or "")


def runtime_url(dsn: str) -> str:
    """``dsn``'s database as the runtime role reaches it: the same server and database, its own login."""
    user, password = runtime_role()
    parts = urlsplit(dsn)
    where = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{where}"))


async def worker_database(dsn: str, worker: str, *, drop: bool = False) -> str:
    """The URL of a database of its own for one pytest-xdist ``worker``, made empty beside ``dsn``'s (or
    dropped, with ``drop``)."""
    parts = urlsplit(dsn)
    name = f"{unquote(parts.path.lstrip('/')) or parts.username}_{worker}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'drop database if exists "{name}" with (force)')
        if not drop:
            await conn.execute(f'create database "{name}"')
    finally:
        await conn.close()
    return urlunsplit(parts._replace(path="/" + quote(name, safe="")))


async def grant_runtime(dsn: str) -> None:
    """The runtime role granted what serve needs in ``dsn``'s database (migrated), as its owner grants it;
    made first (login, password) unless TEST_RUNTIME_DATABASE_URL names one, which takes the right to
    make roles (superuser or CREATEROLE)."""
    user, password = runtime_role()
    if not os.environ.get("TEST_RUNTIME_DATABASE_URL"):
        conn = await asyncpg.connect(dsn)
        try:
            exists = await conn.fetchval("select exists (select from pg_roles where rolname = $1)", user)
            # The password is a literal: a role's password cannot be a statement's parameter.
            how = f"login password '{password}'"
            try:
                await conn.execute(f"{'alter' if exists else 'create'} role {user} {how}")
            except asyncpg.exceptions.DuplicateObjectError:
                # Another pytest-xdist worker made it meanwhile (roles belong to the whole server).
                await conn.execute(f"alter role {user} {how}")
        except asyncpg.exceptions.InsufficientPrivilegeError as exc:
            raise RuntimeError(
                f"the tests' database user may not make the role {user} ({exc}): give it CREATEROLE, or make "
                "a role with login and a password and name it in TEST_RUNTIME_DATABASE_URL"
            ) from None
        finally:
            await conn.close()
    await grant_to(dsn, user)


@asynccontextmanager
async def gateway_server(dsn: str, tracer_provider: Any = None, **settings: Any) -> AsyncIterator[Gateway]:
    """The real gateway on 127.0.0.1, both listeners on port 0, on the test Postgres as the runtime role.

    ``dsn``: the owner's URL of a migrated database, whose runtime role was granted (grant_runtime).
    ``tracer_provider``: an OpenTelemetry TracerProvider to receive its spans.
    """
    configured = load_settings(None, listen="127.0.0.1:0", admin_listen="127.0.0.1:0", **settings)
    async with runners(configured, runtime_url(dsn), tracer_provider=tracer_provider) as both:
        await web.TCPSite(both.proxy, "127.0.0.1", 0).start()
        await web.TCPSite(both.admin, "127.0.0.1", 0).start()
        yield Gateway(
            f"http://127.0.0.1:{both.proxy.addresses[0][1]}",
            f"http://127.0.0.1:{both.admin.addresses[0][1]}",
            both.proxy.app[RUNTIME],
        )


async def raw_exchange(url: str, head: bytes, body: bytes = b"{}") -> bytes:
    """Send ``head`` (request line and headers, each ending in CRLF) and ``body`` over a plain socket to
    ``url``; the answer's bytes exactly as they came, once the server closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def empty_effects(dsn: str) -> None:
    """No effects at all, and ids from 1 again: each test starts from an empty audit."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "truncate effects, effect_keys, effect_bodies, open_effects; alter sequence effect_ids restart"
        )
    finally:
        await conn.close()


def other_database(dsn: str, name: str) -> str:
    """The same server as ``dsn``, another database (for tests that must not touch the shared one)."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


@dataclass
class FailingDatabase:
    """A migrated database of its own on the test server, whose sessions a test can cut and restore."""

    dsn: str
    name: str
    admin: asyncpg.Connection

    async def cut(self) -> None:
        """The database goes away for its clients: their sessions are cut and new ones refused."""
        await self.admin.execute(f"alter database {self.name} allow_connections false")
        await self.admin.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity where datname = $1", self.name
        )

    async def restore(self) -> None:
        await self.admin.execute(f"alter database {self.name} allow_connections true")


@asynccontextmanager
async def failing_database(server_dsn: str, name: str) -> AsyncIterator[FailingDatabase]:
    from gateway.schema import migrate

    admin = await asyncpg.connect(server_dsn)
    await admin.execute(f"drop database if exists {name}")
    await admin.execute(f"create database {name}")
    db = FailingDatabase(other_database(server_dsn, name), name, admin)
    await migrate(db.dsn)
    await grant_runtime(db.dsn)
    try:
        yield db
    finally:
        await db.restore()
        await admin.execute(f"drop database {name} with (force)")
        await admin.close()


def _unpacked(row: dict[str, Any], *pairs: str) -> dict[str, Any]:
    """``row`` with each body of the (coding column, body column) ``pairs`` as it was sent."""
    for coding, body in zip(pairs[::2], pairs[1::2], strict=True):
        stored_as = row.pop(coding, None)
        if stored_as is not None and row[body] is not None:
            row[body] = packing.unpack(stored_as, bytes(row[body]))
    return row


async def effect_rows(dsn: str) -> list[dict[str, Any]]:
    """Every effect's audit row, with the request and the response on record (None once purged)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        rows = await conn.fetch(
            """
            select e.*, q.headers as request_headers, q.coding as request_coding, q.content as request_body,
                   r.headers as response_headers, r.coding as response_coding, r.content as response_body
            from effects e
            left join effect_bodies r
                on r.effect_id = e.id and r.kind = 'response' and r.stored_at = e.response_at
            left join lateral (select headers, coding, content from effect_bodies q
                               where q.effect_id = e.id and q.kind = 'request'
                               order by stored_at desc limit 1) q on true
            order by e.id
            """
        )
        pairs = ("request_coding", "request_body", "response_coding", "response_body")
        return [_unpacked(dict(row), *pairs) for row in rows]
    finally:
        await conn.close()


async def database_text(dsn: str) -> str:
    """Everything the effect tables hold (audit rows, keys, bodies), as one string to search for secrets."""
    conn = await asyncpg.connect(dsn)
    try:
        # Bodies as they were sent: a secret in a deflated body would not show in its stored bytes.
        rows = [
            _unpacked(dict(row), "coding", "content")
            for table in ("effects", "effect_keys", "effect_bodies", "open_effects")
            for row in await conn.fetch(f"select * from {table}")
        ]
    finally:
        await conn.close()
    return json.dumps(rows, default=lambda v: v.hex() if isinstance(v, bytes) else str(v))


# --- gateways in their own processes, for crash tests ------------------------------------------------


def start_gateway_process(config: Path, env: dict[str, str] | None = None, timeout: float = 30) -> Service:
    """``effect-gateway serve`` in a child process; returns once it prints the address it listens on."""
    return start_service(["-m", "gateway", "--config", str(config), "serve"], env, timeout, cwd=str(ROOT))


def children(pid: int) -> set[int]:
    """The pids of the processes that ``pid`` started (a gateway's workers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as listed:
        return {int(child) for child in listed.read().split()}


def decisions(lines: list[str]) -> list[dict[str, Any]]:
    """The gateway's lines per decision among the JSON lines of its log."""
    docs = [json.loads(line) for line in list(lines) if line.startswith("{")]
    return [doc for doc in docs if doc["logger"] == "effect_gateway.decision"]


@dataclass
class RawUpstream:
    """An HTTP/1.1 server that answers every request with the same raw bytes (headers any bytes at all)."""

    answer: bytes
    url: str = ""
    requests: list[bytes] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.requests.append(head + await reader.readexactly(length))
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def raw_upstream(answer: bytes) -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream(answer)
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()
        await server.wait_closed()


# The retention drops bodies a week after they are stored; tests move them ten days back and purge as
# the tables' owner (the suite's gateways run as the runtime role, which leaves the retention to the
# owner), and keep no copies in memory, which would outlive the move.
RETAINED: dict[str, Any] = {"retention": "7d", "replay_cache_bytes": 0}


async def purge_as_owner(dsn: str, retention: timedelta = timedelta(days=7)) -> None:
    """What `effect-gateway purge` run by the tables' owner does: the days of bodies past ``retention``
    dropped (``dsn``: the owner's URL)."""
    async with opened(dsn) as store:
        await store.maintain(retention, purge=True)


async def backdate_bodies(dsn: str, days: int = 10) -> None:
    """Time passes for the stored bodies: they move ``days`` back, into a day the retention will drop."""
    from gateway import partitions
    from gateway.store import MAINTENANCE_LOCK

    conn = await asyncpg.connect(dsn)
    try:
        # The day the oldest body moves to (bodies backdated before move further back).
        past = await conn.fetchval(
            "select coalesce(min(stored_at), now()) - $1 * interval '1 day' from effect_bodies", days
        )
        # A day a gateway left half detached takes no rows: finish it as the next retention would,
        # as the maintainer (a running gateway's round may be finishing the same day).
        await conn.execute("select pg_advisory_lock($1)", MAINTENANCE_LOCK)
        try:
            await partitions.finish_interrupted(conn)
        finally:
            await conn.execute("select pg_advisory_unlock($1)", MAINTENANCE_LOCK)
        latest = await conn.fetchval("select now() - $1 * interval '1 day'", days)
        async with conn.transaction():
            # No detach (of a running gateway's retention) between making the days and filling them:
            # it would drop a day made here, still empty, as past the retention.
            await conn.execute("lock table effect_bodies in share update exclusive mode")
            # Every day the bodies move into: ensure makes a day and the days ahead of it.
            while past <= latest:
                if not await partitions.ensure(conn, past):
                    raise RuntimeError("the days to backdate into could not be made")
                past += timedelta(days=partitions.BODY_DAYS_AHEAD)
            # ensure's short lock wait outlives its savepoint: the updates wait for a gateway's rows.
            await conn.execute("set local lock_timeout = '10s'")
            await conn.execute("update effect_bodies set stored_at = stored_at - $1 * interval '1 day'", days)
            # The attempt that stored an answer moves with it: the answer stays its attempt's own
            # (stored since its claim), as when time really passes.
            await conn.execute(
                """
                update effects set response_at = response_at - $1 * interval '1 day',
                    last_sent_at = case when last_sent_at <= response_at
                                        then last_sent_at - $1 * interval '1 day' else last_sent_at end
                where response_at is not null
                """,
                days,
            )
    finally:
        await conn.close()


# One upstream per place a key can go (tests/test_outbound.py, tests/test_schemathesis.py).
STAMPED: dict[str, dict[str, Any]] = {
    "plain": {},
    "native": {"native_key": {"header": "X-Idem"}},
    "header": {"stamp": {"header": "X-Ref"}},
    "query": {"stamp": {"query_param": "ref"}},
    "form": {"stamp": {"form_field": "metadata[ref]"}},
    "json": {"stamp": {"json_field": "meta.ref"}},
}


def one_insertion(before: bytes, after: bytes) -> bytes | None:
    """The bytes added, when ``after`` is ``before`` with one contiguous run inserted; else None."""
    added = len(after) - len(before)
    if added < 0:
        return None
    same = 0
    while same < len(before) and before[same] == after[same]:
        same += 1
    return after[same : same + added] if after[same + added :] == before[same:] else None


def _literal(value: Any) -> str:
    """``value`` as SQL text, for an EXECUTE of a prepared statement (Postgres coerces it to the type)."""
    if isinstance(value, list):
        return "array[" + ", ".join(_literal(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool | int):
        return str(value).lower()
    text = value.isoformat() if isinstance(value, datetime) else str(value)
    return "'" + text.replace("'", "''") + "'"


async def plan_run(dsn: str, sql: str, args: list[Any]) -> dict[str, Any]:
    """The plan of ``sql`` as the store's connections run it (their session settings, so the generic
    plan), executed with ``args``: EXPLAIN (ANALYZE, BUFFERS)'s top node."""
    conn = await asyncpg.connect(dsn, server_settings=session_settings(StoreLimits()))
    try:
        await conn.execute(f"prepare measured as {sql}")
        literals = ", ".join(_literal(arg) for arg in args)
        doc = await conn.fetchval(f"explain (analyze, buffers, format json) execute measured({literals})")
    finally:
        await conn.close()
    plan: dict[str, Any] = json.loads(doc)[0]["Plan"]
    return plan


def rows_read(plan: dict[str, Any], relation: str) -> int:
    """Rows (or index entries) the plan's scans of ``relation`` (a table or its partitions) looked at:
    those they returned and those their filters threw away."""
    read = 0
    name = plan.get("Relation Name", "")
    if "Scan" in plan["Node Type"] and (name == relation or name.startswith(relation + "_")):
        per_loop = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        read += round(per_loop * plan["Actual Loops"])
    return read + sum(rows_read(child, relation) for child in plan.get("Plans", ()))


def pages_read(plan: dict[str, Any]) -> int:
    """Pages of tables and indexes the plan read (EXPLAIN's shared buffers, found in memory or not):
    also those of index entries that the index's own conditions passed over, which no row count shows."""
    return int(plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0))


async def fill_effects(
    dsn: str,
    tenant: str,
    first_id: int,
    count: int,
    state: str = "completed",
    audit: bool = True,
    upstream: str = "shop",
) -> None:
    """``count`` effects of ``tenant`` written straight in SQL (a few seconds for 100,000s), ids from
    ``first_id``, made a millisecond apart from now; the open ones listed in open_effects too, and only
    there unless ``audit``."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            if audit:
                await conn.execute(
                    """insert into effects (id, created_at, tenant, upstream, key, derived_key, method, path,
                                            fingerprint, state)
                       select $1 + n, now() + n * interval '1 millisecond', $2, $5, 'fill-' || ($1 + n),
                              'eg_fill', 'POST', '/orders', 'fp', $4
                       from generate_series(0, $3 - 1) as n""",
                    first_id,
                    tenant,
                    count,
                    state,
                    upstream,
                )
            if state != "completed":
                await conn.execute(
                    """insert into open_effects (state, id, created_at, tenant, upstream)
                       select $4, $1 + n, now() + n * interval '1 millisecond', $2, $5
                       from generate_series(0, $3 - 1) as n""",
                    first_id,
                    tenant,
                    count,
                    state,
                    upstream,
                )
        await conn.execute("analyze effects, open_effects")
    finally:
        await conn.close()


async def effect(dsn: str, *keys: str, review: bool = False, upstream: str = "shop") -> list[EffectRecord]:
    """Real effect records, written by the store as the gateway writes them (pending, or in review)."""
    records = []
    async with opened(dsn) as store:
        for key in keys:
            records.append(await claim_effect(store, key, review, upstream))
    return records


async def claim_effect(store: Store, key: str, review: bool, upstream: str) -> EffectRecord:
    new = new_effect(
        key,
        upstream=upstream,
        derived_key=f"dk-{key}",
        request_body=b'{"items":["atta"]}',
        run_id="run-1",
        step="4",
    )
    record, _ = await store.claim(new, timedelta(seconds=0) if review else timedelta(seconds=30))
    assert record is not None
    if review:
        reviewed = await store.send_to_review(record, review_move(record), "a test put it here")
        assert reviewed is not None
        record = reviewed
    return record
