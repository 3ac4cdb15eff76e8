"""The admin surface: health, metrics, the effects audit, and operator resolution."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import jsonbody, operators, problems, process, scopes
from gateway.auth import is_admin, operator_of, tenant_of
from gateway.effects_json import MAX_ID, effect_json, next_query, parse_filter, parse_resolution, whole_number
from gateway.errors import JsonRefused, StoreUnavailable
from gateway.metrics import states_exposition
from gateway.record import EffectRecord
from gateway.runtime import RUNTIME, Runtime, read_request_body, verdict_given
from gateway.scopes import Scope
from gateway.states import State

log = logging.getLogger("effect_gateway")
EXPOSITION = {"Content-Type": CONTENT_TYPE_LATEST}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/_gateway/health", health)
    app.router.add_get("/_gateway/metrics", metrics)
    app.router.add_get("/_gateway/effects", list_effects)
    app.router.add_get("/_gateway/effects/{id}", get_effect)
    app.router.add_post("/_gateway/effects/{id}/resolve", resolve_effect)


def _runtime(request: web.Request) -> Runtime:
    return request.app[RUNTIME]


def _viewer(request: web.Request, runtime: Runtime) -> Scope:
    """The tenants whose effects this caller may read; None for all (the admin, an operator of all)."""
    if is_admin(request, runtime.settings):
        return None
    if (operator := operator_of(request, runtime.settings)) is not None:
        return operator.scope
    if runtime.settings.tenants and "Effect-Gateway-Token" in request.headers:
        return frozenset({tenant_of(request, runtime.settings)})
    raise problems.AdminTokenRequired("send the admin token as Authorization: Bearer <token>")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, text=json.dumps(data, indent=1), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """Up or down for anyone (a load balancer holds no token); the counts for who may read them.

    Up means this worker serves, Postgres answers, and rows stored now have partitions to go into
    (made here if they have none, as a write would). Only Postgres's catalog is read for it, never an
    effect table, so a readiness probe costs the same at a billion effects as at none. The counts (open
    states exact up to audit_query.EXACT_OPEN_COUNT each, completed estimated; a tenant sees its own
    open ones) need a token, and are the ones the metrics show: read at most every few seconds for each
    viewer, however many ask. The admin also sees the days of partitions left, and a warning when they
    are few (partitions.WARN_DAYS).
    """
    runtime = _runtime(request)
    ahead = await runtime.store.partitions_ahead()  # down (503) when the store is
    if ahead.days_left <= 0:
        raise StoreUnavailable("no partition holds rows stored now, and none could be made")
    try:
        viewer = _viewer(request, runtime)
    except problems.Problem:
        return _json({"status": "ok"})
    counts = await scopes.counts(runtime.state_counts.get, viewer)
    if counts is None:
        raise StoreUnavailable("the effects by state could not be read")
    doc: dict[str, Any] = {
        "status": "ok",
        "effects": counts,
        "needs_review": counts[State.NEEDS_REVIEW.value],
        "upstreams": sorted(runtime.policies),
        "worker": process.pid(),
    }
    if viewer is None:  # every tenant's rows go into the same partitions: the admin's to look after
        doc["partitions"] = {"days_left": round(ahead.days_left, 2)}
        warnings = [ahead.warning(), await runtime.store.failover_warning()]
        found = [warning for warning in warnings if warning is not None]
        if found:
            doc["status"] = "warning"
            doc["warnings"] = found
    return _json(doc)


async def metrics(request: web.Request) -> web.Response:
    """The whole gateway's metrics in Prometheus text, whichever worker the scrape reached."""
    runtime = _runtime(request)
    viewer = _viewer(request, runtime)
    counts = await scopes.counts(runtime.state_counts.get, viewer)
    if viewer is not None:
        # A tenant's token reads its own effects (the open ones, as health counts them) and nothing
        # else: every other metric is the whole gateway's, every tenant's traffic in it.
        return web.Response(body=states_exposition(counts), headers=EXPOSITION)
    try:
        ahead = await runtime.store.partitions_ahead()
    except StoreUnavailable as exc:  # as the counts: left out of this scrape, the counters still answer
        log.warning("partitions' days left out of the metrics: %s", exc)
        ahead = None
    waiting = await runtime.oldest_waiting.get()
    exposition = runtime.telemetry.metrics.exposition(counts, ahead, waiting)
    return web.Response(body=exposition, headers=EXPOSITION)


async def list_effects(request: web.Request) -> web.Response:
    runtime = _runtime(request)
    scope = _viewer(request, runtime)  # first: who may ask, before what they asked is read
    where = parse_filter(dict(request.query))
    records = await scopes.find(runtime.store, where, scope)  # CursorUnknown: a 400 (replies)
    page: dict[str, Any] = {"effects": [effect_json(r, full=False) for r in records], "next": None}
    if len(records) == where.limit:
        nxt = request.rel_url.update_query(next_query(where, records[-1]))
        page["next"] = str(nxt)
    return _json(page)


async def _load(request: web.Request, scope: Scope) -> EffectRecord:
    runtime = _runtime(request)
    raw = request.match_info["id"]
    effect_id = whole_number(raw, 1, MAX_ID)
    if effect_id is None:
        raise problems.BadRequest(f"an effect id is a whole number from 1 to {MAX_ID}, not {raw!r}")
    record = await scopes.get(runtime.store, effect_id, scope)
    if record is None:
        raise problems.NotFound(f"no effect {raw}")
    return record


async def get_effect(request: web.Request) -> web.Response:
    record = await _load(request, _viewer(request, _runtime(request)))
    return _json(effect_json(record, full=True))


async def resolve_effect(request: web.Request) -> web.Response:
    runtime = _runtime(request)
    operator = operator_of(request, runtime.settings)
    if operator is None and not is_admin(request, runtime.settings):
        raise problems.AdminTokenRequired("resolving an effect needs an operator's token or the admin token")
    if request.content_type != "application/json":
        # A page on another site can post a form or text/plain without asking, but not JSON: on a
        # gateway open without an admin token, this is what keeps such a page from resolving effects.
        raise problems.BadRequest("send the verdict as Content-Type: application/json")
    given = request.headers.get("Effect-Gateway-Operator")
    by = operators.recorded_as(operator.name if operator is not None else None, given, "admin")
    operators.check_name(by)  # BadName: a 400 (gateway.replies.problem_of_error)
    record = await _load(request, operator.scope if operator is not None else None)
    try:
        doc = jsonbody.loads(await read_request_body(request, runtime.settings))
    except JsonRefused as exc:
        raise problems.BadRequest(f"the body must be JSON: {exc}") from None
    happened, response = parse_resolution(doc)
    attempt = doc.get("attempt")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or not 1 <= attempt <= MAX_ID:
        raise problems.BadRequest(
            '"attempt" must be the attempt you judged, as GET /_gateway/effects/{id} shows it: the verdict '
            "holds only if the effect has not changed since"
        )
    # NoSuchEffect is a 404 and NotAwaitingOperator a 409 (gateway.replies.problem_of_error).
    resolved = await operators.resolve(
        runtime.store, record.id, attempt=attempt, happened=happened, response=response, by=by
    )
    verdict_given(runtime, resolved, happened, by)
    return _json(effect_json(resolved, full=True))
