"""schemathesis against a real gateway, from its own OpenAPI document, with tenants and an admin token.

The gateway, a recording upstream and the Postgres fixture are real; the gateway runs on port 0 in a
thread of its own so that schemathesis' synchronous client can call it. Every case is checked for what a
user would notice: never a 5xx (the upstream is healthy, so every one would be ours); the answer as the
document says (status, content type, problem+json, headers); no record lost (a keyed request the upstream
received leaves its completed row, a refused one changes nothing, a replay is the first answer); and the
upstream receives the agent's request plus the stamp and native key, nothing else. `make test` tries a few
cases per operation, `make fuzz` a thousand; the counts are printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import asyncpg
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway import openapi, problems
from gateway.errors import KeySyntaxError
from gateway.headers import GATEWAY_REQUEST_HEADERS, connection_scoped
from gateway.keys import parse_key
from gateway.settings import SAFE_METHODS
from tests.database import empty_effects
from tests.gateways import gateway_server
from tests.support import FUZZ_COUNTS
from tests.upstreams import STAMPED, Call, Upstream, one_insertion, upstream_server

T = TypeVar("T")

ADMIN = "admin-secret-token"
TENANTS = {"acme": "acme-secret-token", "globex": "globex-secret-token"}
# Who calls: the admin, either tenant, a wrong token, nobody. Tenants most often: only they reach upstreams.
PRINCIPALS = ["acme", "acme", "globex", "admin", "stranger", "nobody"]
# One upstream per place a key can go, all served by the recording upstream; "plain" forwards keyless PUTs.
UPSTREAMS: dict[str, dict[str, Any]] = {**STAMPED, "plain": {"keyless": {"PUT": "forward"}}}
# An upstream name that is not configured: 404 unknown-upstream, nothing sent.
NOWHERE = "nowhere"
PROXY = "/{upstream}/{path}"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# A few cases per operation and mode in `make test`; HYPOTHESIS_PROFILE=fuzz (make fuzz) tries 500.
CASES = max(8, settings.default.max_examples // 10)
# Every operation with valid requests; those with inputs to break (parameters, a body) with invalid ones too.
RUNS = [
    pytest.param(f"{method.upper()} {path}", mode, id=f"{method.upper()} {path}-{mode.value}")
    for path, item in openapi.document()["paths"].items()
    for method, operation in openapi.operations(item).items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or "parameters" in operation or "requestBody" in operation
]


@dataclass
class Harness:
    """The gateway and its upstream, served by an event loop in a thread of its own."""

    url: str = ""
    admin_url: str = ""
    dsn: str = ""
    upstream: Upstream = field(default_factory=Upstream)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    db: asyncpg.Connection | None = None
    schema: Any = None
    session: requests.Session = field(default_factory=requests.Session)
    # The first answer relayed for each (tenant, upstream, key): what every replay must be.
    first: dict[tuple[str, str, str], tuple[int, bytes]] = field(default_factory=dict)

    def run(self, work: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await work

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(timeout=60)

    async def row(self, tenant: str, upstream: str, key: str) -> dict[str, Any] | None:
        assert self.db is not None
        found = await self.db.fetchrow(
            "select id, state, attempt, response_status, derived_key, keyless from effects"
            " where tenant = $1 and upstream = $2 and key = $3",
            tenant,
            upstream,
            key,
        )
        return dict(found) if found else None

    async def table(self) -> tuple[int, int, int, int]:
        """The whole table in four numbers: rows, their attempts, completed ones, the newest id."""
        assert self.db is not None
        found = await self.db.fetchrow(
            "select count(*), coalesce(sum(attempt), 0), count(*) filter (where state = 'completed'),"
            " coalesce(max(id), 0) from effects"
        )
        assert found is not None
        return (found[0], found[1], found[2], found[3])

    async def newest(self, after_id: int) -> list[dict[str, Any]]:
        assert self.db is not None
        rows = await self.db.fetch(
            "select id, tenant, upstream, key, state, response_status, keyless from effects where id > $1",
            after_id,
        )
        return [dict(r) for r in rows]


@pytest.fixture(scope="module")
def harness(postgres_dsn: str) -> Iterator[Harness]:
    """A gateway with two tenants, an admin token and six upstreams, loaded from its served document."""
    h = Harness(dsn=postgres_dsn)
    thread = threading.Thread(target=h.loop.run_forever, daemon=True)
    thread.start()
    stack = AsyncExitStack()

    async def start() -> None:
        await empty_effects(postgres_dsn)
        served = await stack.enter_async_context(upstream_server())
        h.upstream = served
        gw = await stack.enter_async_context(
            gateway_server(
                postgres_dsn,
                upstreams={name: {"base_url": served.url, **cfg} for name, cfg in UPSTREAMS.items()},
                tenants={name: {"token": token} for name, token in TENANTS.items()},
                admin={"token": ADMIN},
                # No copies in memory: a replay is read from Postgres, as after a restart.
                replay_cache_bytes=0,
            )
        )
        h.url, h.admin_url = gw.url, gw.admin_url
        h.db = await asyncpg.connect(postgres_dsn)

    async def stop() -> None:
        if h.db is not None:
            await h.db.close()
        await stack.aclose()

    h.run(start())
    try:
        served = h.session.get(h.admin_url + openapi.PATH, timeout=10)
        assert served.status_code == 200
        document = served.json()
        assert document == json.loads(json.dumps(openapi.document()))
        # This gateway's upstreams, and one it does not have: free text would almost never name one.
        proxy = document["paths"][PROXY]
        for operation in openapi.operations(proxy).values():
            for parameter in operation["parameters"]:
                if parameter["name"] == "upstream":
                    parameter["schema"] = {"enum": [*UPSTREAMS, NOWHERE]}
        h.schema = schemathesis.openapi.from_dict(document)
        yield h
    finally:
        h.run(stop())
        h.session.close()
        h.loop.call_soon_threadsafe(h.loop.stop)
        thread.join(timeout=10)


def credentials(who: str) -> dict[str, str]:
    if who == "admin":
        return {"Authorization": f"Bearer {ADMIN}"}
    if who in TENANTS:
        return {"Effect-Gateway-Token": TENANTS[who]}
    if who == "stranger":
        return {"Effect-Gateway-Token": "not-a-token", "Authorization": "Bearer not-a-token"}
    return {}


def _refused(response: schemathesis.Response) -> bool:
    """Answered by the gateway itself: a problem, or the HTTP server's plain 400 for a head it cannot parse.

    The recording upstream answers neither (its answers are 201 JSON).
    """
    content_type = response.headers.get("content-type", [""])[0]
    unparsable = response.status_code == openapi.UNPARSABLE and content_type.startswith("text/plain")
    return content_type.startswith(problems.CONTENT_TYPE) or unparsable


def check_upstream_request(
    sent: requests.PreparedRequest, call: Call, derived: str | None, upstream: str
) -> None:
    """What the upstream got is the agent's request plus the stamp and native key: nothing else."""
    target = urlsplit(sent.url or "")
    raw_path = target.path
    assert call.method == sent.method
    assert call.target.partition("?")[0] == "/" + raw_path.split("/", 2)[2], (call.target, raw_path)
    stamp = UPSTREAMS[upstream].get("stamp", {})
    native = UPSTREAMS[upstream].get("native_key", {}).get("header")
    # Query: as sent, plus the stamp's parameter.
    if derived is not None and "query_param" in stamp:
        assert call.query == (target.query + "&" if target.query else "") + f"ref={derived}"
    else:
        assert call.query == target.query
    # Headers: the agent's (repeats and order kept) less the gateway's own and hop-by-hop ones, plus ours.
    agent = list(sent.headers.items())
    dropped = connection_scoped(agent) | GATEWAY_REQUEST_HEADERS
    added = {
        name.lower()
        for name in (native, stamp.get("header"))
        if name is not None and derived is not None  # keyless requests get neither
    }
    received = [(k, v) for k, v in call.header_list if k.lower() not in ("host", "content-length")]
    assert [(k, v) for k, v in received if k.lower() not in added] == [
        (k, v) for k, v in agent if k.lower() not in dropped
    ]
    assert sorted((k.lower(), v) for k, v in received if k.lower() in added) == sorted(
        (name, derived) for name in added
    )
    # Body: the agent's bytes, plus the stamp spliced into a form or JSON body.
    body = sent.body.encode() if isinstance(sent.body, str) else (sent.body or b"")
    if derived is not None and ("form_field" in stamp or "json_field" in stamp):
        inserted = one_insertion(body, call.body)
        assert inserted is not None, (body, call.body)
        assert derived.encode() in call.body
        if "json_field" in stamp:
            assert json.loads(call.body)["meta"]["ref"] == derived
    else:
        assert call.body == body


def check_proxy(
    h: Harness,
    who: str,
    response: schemathesis.Response,
    calls: list[Call],
    before: tuple[int, int, int, int],
) -> None:
    """No record lost, nothing sent twice, and the upstream got the agent's request plus the stamp."""
    sent = response.request
    upstream = urlsplit(sent.url or "").path.split("/", 2)[1]
    tenant = who if who in TENANTS else None
    raw_key = sent.headers.get("Idempotency-Key")
    try:
        key = parse_key(raw_key) if raw_key is not None else None
    except KeySyntaxError:
        key = None
    replayed = response.headers.get("idempotent-replayed") == ["true"]
    seen = f"{sent.method} {sent.url} {dict(sent.headers)} -> {response.status_code} {response.headers}"
    assert len(calls) <= 1, f"one request, one upstream call at most: {seen}"
    after = h.run(h.table())
    if _refused(response) or replayed:
        # Refused, or answered from the record: nothing reached the upstream and no record changed.
        assert calls == [], f"a problem or a replay sends nothing: {seen}"
        assert after[:3] == before[:3], f"a refused request leaves the audit as it was: {seen}"
        if replayed:
            assert tenant is not None
            assert key is not None
            row = h.run(h.row(tenant, upstream, key))
            assert row is not None
            assert row["state"] == "completed"
            assert h.first[(tenant, upstream, key)] == (response.status_code, response.content)
        return
    # The upstream's own answer, relayed: it was sent once, as the agent sent it, and recorded if tracked.
    assert len(calls) == 1, f"a relayed answer comes from exactly one upstream call: {seen}"
    assert tenant is not None, seen
    assert upstream in UPSTREAMS, seen
    assert response.status_code == 201, seen  # what the recording upstream answers
    if key is not None:
        row = h.run(h.row(tenant, upstream, key))
        assert row is not None, f"a keyed request that reached the upstream left its record: {seen}"
        assert (row["state"], row["response_status"]) == ("completed", response.status_code), seen
        assert after[0] - before[0] in (0, 1)
        h.first.setdefault((tenant, upstream, key), (response.status_code, response.content))
        check_upstream_request(sent, calls[0], row["derived_key"], upstream)
        return
    check_upstream_request(sent, calls[0], None, upstream)
    new = h.run(h.newest(before[3]))
    forwarded = sent.method in SAFE_METHODS or UPSTREAMS[upstream].get("keyless", {}).get(sent.method)
    if forwarded:
        assert new == [], "a keyless request forwarded untracked leaves no row"
    else:
        assert [(r["keyless"], r["state"], r["response_status"]) for r in new] == [
            (True, "completed", response.status_code)
        ], "a keyless effect is audited once"


def check_admin(who: str, path: str, response: schemathesis.Response) -> None:
    """A tenant reads its own effects only; without a token, health says up or down and nothing else."""
    if (
        response.request.method == "HEAD"
        or response.status_code != 200
        or not response.headers.get("content-type", [""])[0].startswith("application/json")
    ):
        return
    doc = response.json()
    if path == "/_gateway/health" and who not in (*TENANTS, "admin"):
        assert doc == {"status": "ok"}, "without a token: up or down, nothing else"
    effects = (
        doc["effects"] if path == "/_gateway/effects" else [doc] if path == "/_gateway/effects/{id}" else []
    )
    if who in TENANTS:
        assert {e["tenant"] for e in effects} <= {who}, "a tenant reads its own effects only"


def _free_form_negated(case: schemathesis.Case) -> bool:
    """Whether a negative case broke only the proxy's free-form query or body, which the wire cannot tell.

    The proxy takes any query and any form values: a value of another JSON type is sent as text all the
    same, so such a case is a valid request, and the gateway is right to forward it.
    """
    if case.operation.path != PROXY or case.meta is None:
        return False
    negated = {loc for loc, info in case.meta.components.items() if info.mode is GenerationMode.NEGATIVE}
    return bool(negated & {ParameterLocation.QUERY, ParameterLocation.BODY})


def exercise(h: Harness, case: schemathesis.Case, who: str, mode: GenerationMode) -> None:
    calls_before = len(h.upstream.calls)
    before = h.run(h.table())
    base_url = h.url if case.operation.path == PROXY else h.admin_url
    response = case.call(base_url=base_url, session=h.session, headers=credentials(who), timeout=30)
    checks = CHECKS
    if mode is GenerationMode.NEGATIVE and not _free_form_negated(case):
        checks = [*CHECKS, negative_data_rejection]
    case.validate_response(response, checks=checks)
    if case.operation.path == PROXY:
        check_proxy(h, who, response, h.upstream.calls[calls_before:], before)
    else:
        assert len(h.upstream.calls) == calls_before, "the admin API never calls an upstream"
        check_admin(who, case.operation.path, response)


@pytest.mark.parametrize(("label", "mode"), RUNS)
def test_the_gateway_answers_as_its_document_says(harness: Harness, label: str, mode: GenerationMode) -> None:
    """Generated requests to one operation: no 5xx, answers as documented, no record lost, nothing added."""
    operation = harness.schema.find_operation_by_label(label)
    tried = 0

    @given(case=operation.as_strategy(generation_mode=mode), who=st.sampled_from(PRINCIPALS))
    # schemathesis filters much of what it draws for some invalid forms; that is its cost, not a finding.
    @settings(max_examples=CASES, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    def run(case: schemathesis.Case, who: str) -> None:
        nonlocal tried
        tried += 1
        exercise(harness, case, who, mode)

    try:
        run()
    finally:
        FUZZ_COUNTS.append((label, mode.value, tried))
