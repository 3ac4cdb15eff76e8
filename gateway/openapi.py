"""The gateway's OpenAPI document, served at ``/_gateway/openapi.json``: the admin API, the audit pages and
the proxy.

Built from the code's own constants (problem types and their statuses, page and id limits, key and label
lengths), so it cannot drift from what the gateway does; tests/test_openapi.py checks that its paths are
exactly the routes the application registers, and tests/test_schemathesis.py that a real gateway answers
as it says.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from typing import Any

from aiohttp import web

from gateway import effects_json, problems
from gateway.audit_page import BASE as AUDIT
from gateway.keys import MAX_KEY_LENGTH, MAX_LABEL
from gateway.sessions import COOKIE
from gateway.states import State

PATH = "/_gateway/openapi.json"
# The status of a request whose head is not HTTP (a control character in a header, a bad request line).
UNPARSABLE = 400
# The proxy forwards any method; these are the ones OpenAPI can name.
PROXY_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# Raised by the middleware on every route: a header sent twice or not UTF-8, a failure of our own.
EVERY_ROUTE = ("bad-request", "key-malformed", "internal")
# What the proxy itself may answer (the admin-only types are never among them); not-found and
# method-not-allowed are for paths under /_gateway/ that no route of the gateway serves.
PROXY_PROBLEMS = tuple(
    name for name in problems.problem_types() if name not in ("admin-token-required", "not-resolvable")
)
# An Idempotency-Key: Stripe's bare form (not starting with a quote), or the IETF sf-string form, in
# which only \" and \\ are escapes (gateway.keys.parse_key).
_VISIBLE = r"\x21-\x7e"
KEY_PATTERN = (
    rf"^(?:[\x21\x23-\x7e][{_VISIBLE}]{{0,{MAX_KEY_LENGTH - 1}}}"
    rf'|"(?:[\x21\x23-\x5b\x5d-\x7e]|\\["\\]){{1,{MAX_KEY_LENGTH}}}")$'
)
_TEXT = {"type": "string"}
_TEXT_OR_NULL = {"type": ["string", "null"]}
_WHEN = {"type": ["string", "null"], "format": "date-time"}
_HEADER_PAIRS = {
    "type": "array",
    "items": {"type": "array", "prefixItems": [_TEXT, _TEXT], "minItems": 2, "maxItems": 2},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _problem_responses(names: Iterable[str], *, also: dict[str, Any] | None = None) -> dict[str, Any]:
    """One response per status that these problem types have, each naming the types it may carry."""
    by_status: dict[int, list[str]] = {}
    for name in dict.fromkeys([*names, *EVERY_ROUTE]):
        by_status.setdefault(problems.problem_types()[name].status, []).append(name)
    responses: dict[str, Any] = {}
    for status, names_here in sorted(by_status.items()):
        schema = {
            "allOf": [
                _ref("Problem"),
                {
                    "properties": {
                        "type": {"enum": [problems.TYPE_BASE + n for n in names_here]},
                        "status": {"const": status},
                    }
                },
            ]
        }
        content = {problems.CONTENT_TYPE: {"schema": schema}, **(also or {})}
        description = ", ".join(names_here)
        if status == UNPARSABLE:
            # aiohttp's own answer to a head it cannot parse, before any route or middleware runs.
            content.setdefault("text/plain", {"schema": _TEXT})
            description += "; or, as text/plain, a request head the HTTP server cannot parse"
        responses[str(status)] = {"description": description, "content": content}
    return responses


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _html(description: str, **extra: Any) -> dict[str, Any]:
    return {"description": description, "content": {"text/html": {"schema": {"type": "string"}}}, **extra}


def _with_head(get: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """GET and the HEAD aiohttp answers beside it: the same statuses and headers, never a body."""
    head = {
        **get,
        "operationId": get["operationId"] + "Head",
        "responses": {
            status: {k: v for k, v in response.items() if k != "content"}
            for status, response in get["responses"].items()
        },
    }
    return {"get": get, "head": head}


ADMIN_READ: list[dict[str, list[str]]] = [{"admin": []}, {"tenant": []}, {}]
AUDIT_READ: list[dict[str, list[str]]] = [{"admin": []}, {"tenant": []}, {"session": []}, {}]
_ID = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 1, "maximum": effects_json.MAX_ID},
}
_AUDIT_ID = {**_ID, "description": "an effect's id (other text: a 404 page)", "schema": _TEXT}
_FILTERS = [
    {"name": "state", "in": "query", "schema": {"type": "string", "enum": [s.value for s in State]}},
    {"name": "upstream", "in": "query", "schema": {"type": "string"}},
    {"name": "run", "in": "query", "schema": {"type": "string"}},
    {"name": "key", "in": "query", "schema": {"type": "string"}},
    {
        "name": "since",
        "in": "query",
        "description": "an ISO time (UTC unless it names a zone) or a duration back from now such as 1h",
        "schema": {"type": "string"},
    },
    {"name": "until", "in": "query", "description": "as since", "schema": {"type": "string"}},
    {
        "name": "limit",
        "in": "query",
        "schema": {
            "type": "integer",
            "minimum": 1,
            "maximum": effects_json.MAX_PAGE,
            "default": effects_json.DEFAULT_PAGE,
        },
    },
    {
        "name": "before",
        "in": "query",
        "description": "an id: the page of effects older than it (the answer's next links it)",
        "schema": {"type": "integer", "minimum": 1, "maximum": effects_json.MAX_ID},
    },
]


def _effect_schemas() -> dict[str, Any]:
    summary = {
        "id": {"type": "integer", "minimum": 1},
        "tenant": _TEXT,
        "upstream": _TEXT,
        "key": _TEXT,
        "method": _TEXT,
        "path": _TEXT,
        "query": _TEXT,
        "tool": _TEXT_OR_NULL,
        "state": {"type": "string", "enum": [s.value for s in State]},
        "attempt": {"type": "integer", "minimum": 1},
        "resolvable": {"type": "boolean"},
        "response_status": {"type": ["integer", "null"]},
        "recovered_by": _TEXT_OR_NULL,
        "run_id": _TEXT_OR_NULL,
        "step": _TEXT_OR_NULL,
        "created_at": _WHEN,
        "first_sent_at": _WHEN,
        "last_sent_at": _WHEN,
        "completed_at": _WHEN,
        "replays": {"type": "integer", "minimum": 0},
        "response_purged": {"type": "boolean"},
    }
    full = {
        "derived_key": _TEXT,
        "fingerprint": _TEXT,
        "may_have_sent": {"type": "boolean"},
        "lease_expires_at": _WHEN,
        "request_headers": {"type": "object", "additionalProperties": _TEXT},
        "request_body": _TEXT_OR_NULL,
        "request_body_base64": _TEXT,
        "response_headers": {"oneOf": [_HEADER_PAIRS, {"type": "null"}]},
        "response_body": _TEXT_OR_NULL,
        "response_body_base64": _TEXT,
        "history": {"type": "array", "items": {"type": "object"}},
        "unreadable": {
            "type": ["object", "null"],
            "properties": {"request": _TEXT, "response": _TEXT, "history": _TEXT},
            "additionalProperties": False,
            "description": (
                "why a stored body cannot be read back (it is null, a response's headers too), or the "
                "history (it is empty)"
            ),
        },
    }
    return {
        "EffectSummary": {"type": "object", "required": list(summary), "properties": summary},
        "Effect": {
            "type": "object",
            "description": "bodies are text, or *_base64 when they are not UTF-8",
            "required": [*summary, "derived_key", "fingerprint", "history"],
            "properties": {**summary, **full},
        },
        "EffectPage": {
            "type": "object",
            "required": ["effects", "next"],
            "properties": {
                "effects": {"type": "array", "items": _ref("EffectSummary")},
                "next": {**_TEXT_OR_NULL, "description": "the next page's URL, with the same filters"},
            },
        },
    }


def _resolution_schema() -> dict[str, Any]:
    attempt = {
        "type": "integer",
        "minimum": 1,
        "maximum": effects_json.MAX_ID,
        "description": "the attempt you judged; the verdict holds only if the effect has not changed since",
    }
    response = {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"type": "integer", "minimum": 100, "maximum": 599},
            "headers": {"oneOf": [{"type": "object", "additionalProperties": _TEXT}, _HEADER_PAIRS]},
            "json": {"description": "the body to replay, as JSON"},
            "body": {"type": "string", "description": "the body to replay, as text"},
        },
    }
    return {
        "oneOf": [
            {
                "type": "object",
                "required": ["happened", "attempt"],
                "properties": {"happened": {"const": False}, "attempt": attempt},
            },
            {
                "type": "object",
                "required": ["happened", "attempt", "response"],
                "properties": {"happened": {"const": True}, "attempt": attempt, "response": response},
            },
        ]
    }


def _admin_paths() -> dict[str, Any]:
    read = ("admin-token-required", "token-required", "store-unavailable")
    return {
        "/_gateway/health": _with_head(
            {
                "operationId": "health",
                "summary": "Up or down for anyone; the counts for a token",
                "security": ADMIN_READ,
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["status"],
                            "properties": {
                                # "warning" (the admin's view only) when the partitions run out soon
                                "status": {"enum": ["ok", "warning"]},
                                "effects": {"type": "object", "additionalProperties": {"type": "integer"}},
                                "needs_review": {"type": "integer"},
                                "upstreams": {"type": "array", "items": _TEXT},
                                "worker": {"type": "integer"},
                                "partitions": {
                                    "type": "object",
                                    "required": ["days_left"],
                                    "properties": {"days_left": {"type": "number", "minimum": 0}},
                                },
                                "warnings": {"type": "array", "items": _TEXT},
                            },
                        },
                        "this worker serves, Postgres answers, and rows stored now have partitions",
                    ),
                    **_problem_responses(("store-unavailable",)),
                },
            }
        ),
        "/_gateway/metrics": _with_head(
            {
                "operationId": "metrics",
                "summary": "Prometheus text: effect records by state",
                "security": ADMIN_READ,
                "responses": {
                    "200": {"description": "metrics", "content": {"text/plain": {"schema": _TEXT}}},
                    **_problem_responses(read),
                },
            }
        ),
        "/_gateway/effects": _with_head(
            {
                "operationId": "listEffects",
                "summary": "A page of the audit, newest first",
                "security": ADMIN_READ,
                "parameters": _FILTERS,
                "responses": {
                    "200": _json(_ref("EffectPage"), "a page of effects"),
                    **_problem_responses(read),
                },
            }
        ),
        "/_gateway/effects/{id}": _with_head(
            {
                "operationId": "getEffect",
                "summary": "One effect in full: request, response and history",
                "security": ADMIN_READ,
                "parameters": [_ID],
                "responses": {
                    "200": _json(_ref("Effect"), "the effect"),
                    **_problem_responses((*read, "not-found")),
                },
            }
        ),
        "/_gateway/effects/{id}/resolve": {
            "post": {
                "operationId": "resolveEffect",
                "summary": "An operator's verdict on an effect that waits for one (admin token only)",
                "security": [{"admin": []}, {}],
                "parameters": [_ID],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _resolution_schema()}},
                },
                "responses": {
                    "200": _json(_ref("Effect"), "resolved: the effect as it is now"),
                    **_problem_responses(
                        (
                            "admin-token-required",
                            "not-found",
                            "not-resolvable",
                            "body-malformed",
                            "request-timeout",
                            "body-too-large",
                            "store-unavailable",
                        )
                    ),
                },
            }
        },
        PATH: _with_head(
            {
                "operationId": "openapi",
                "summary": "This document",
                "security": [{}],
                "responses": {
                    "200": _json({"type": "object"}, "the OpenAPI document"),
                    **_problem_responses(()),
                },
            }
        ),
    }


LOCATION = {"Location": {"schema": _TEXT}}
# The listeners' default ports (gateway.settings: listen, admin_listen).
PROXY_PORT, ADMIN_PORT = 8787, 8788


def _server(description: str, port: int) -> dict[str, Any]:
    return {
        "url": "http://{host}:{port}",
        "description": description,
        "variables": {"host": {"default": "127.0.0.1"}, "port": {"default": str(port)}},
    }


def _audit_paths() -> dict[str, Any]:
    # Errors of the pages are pages; only the middleware's (a bad header, the store down) are problems.
    page_problems = _problem_responses(("store-unavailable", "body-too-large"), also={"text/html": {}})
    form = "application/x-www-form-urlencoded"
    see_other = {"description": "done: go to Location", "headers": LOCATION}
    sign_in_page = _html("sign in first (the sign-in page)")
    refused = _html("a form from another site, or without its CSRF token")
    verdict = {
        "type": "object",
        "properties": {
            "csrf": _TEXT,
            "attempt": _TEXT,
            "happened": {"type": "string", "enum": ["yes", "no"]},
            "status": _TEXT,
            "headers": {**_TEXT, "description": "one 'Name: value' a line"},
            "body": _TEXT,
            "kind": {"type": "string", "enum": ["json", "text"]},
            "by": _TEXT,
        },
    }
    return {
        AUDIT: _with_head(
            {
                "operationId": "auditList",
                "summary": "The audit for a person: filters, paging, counts per state",
                "security": AUDIT_READ,
                "parameters": [{**p, "schema": _TEXT} for p in _FILTERS],
                "responses": {
                    "200": _html("the list"),
                    "400": _html("a filter it cannot read, said on the page"),
                    "401": sign_in_page,
                    **page_problems,
                },
            }
        ),
        AUDIT + "/style.css": _with_head(
            {
                "operationId": "auditStylesheet",
                "security": [{}],
                "responses": {
                    "200": {"description": "the stylesheet", "content": {"text/css": {"schema": _TEXT}}},
                    **page_problems,
                },
            }
        ),
        AUDIT + "/sign-in": {
            "post": {
                "operationId": "auditSignIn",
                "summary": "Sign in with the admin token or a tenant's: sets the session cookie",
                "security": [{}],
                "requestBody": {
                    "content": {
                        form: {"schema": {"type": "object", "properties": {"token": _TEXT, "next": _TEXT}}}
                    }
                },
                "responses": {
                    "303": {**see_other, "headers": {**LOCATION, "Set-Cookie": {"schema": _TEXT}}},
                    "401": _html("that token is neither the admin's nor a tenant's"),
                    "403": refused,
                    **page_problems,
                },
            }
        },
        AUDIT + "/sign-out": {
            "post": {
                "operationId": "auditSignOut",
                "security": AUDIT_READ,
                "requestBody": {
                    "content": {form: {"schema": {"type": "object", "properties": {"csrf": _TEXT}}}}
                },
                "responses": {
                    "303": see_other,
                    "401": _html("a token that is neither the admin's nor a tenant's"),
                    "403": refused,
                    **page_problems,
                },
            }
        },
        AUDIT + "/{id}": _with_head(
            {
                "operationId": "auditEffect",
                "summary": "An effect's page: request, response, history, and the resolve forms",
                "security": AUDIT_READ,
                "parameters": [
                    _AUDIT_ID,
                    {"name": "resolved", "in": "query", "schema": {"enum": ["happened", "did-not-happen"]}},
                ],
                "responses": {
                    "200": _html("the effect's page"),
                    "401": sign_in_page,
                    "404": _html("no such effect among those you may see"),
                    **page_problems,
                },
            }
        ),
        AUDIT + "/{id}/resolve": {
            "post": {
                "operationId": "auditResolve",
                "summary": "The resolve forms of an effect's page (admin only)",
                "security": AUDIT_READ,
                "parameters": [_AUDIT_ID],
                "requestBody": {"content": {form: {"schema": verdict}}},
                "responses": {
                    "303": see_other,
                    "400": _html("the form lacks a verdict or its response cannot be replayed"),
                    "401": sign_in_page,
                    "403": refused,
                    "404": _html("no such effect"),
                    "409": _html("not resolved: the effect is not waiting for an operator now"),
                    **page_problems,
                },
            }
        },
    }


def _proxy_operation(method: str) -> dict[str, Any]:
    replayed = {
        "Idempotent-Replayed": {
            "description": "only on a replay of the stored answer; never the upstream's own",
            "schema": {"const": "true"},
        }
    }
    upstream_answer: dict[str, Any] = {"*/*": {"schema": {}}}
    responses = _problem_responses(PROXY_PROBLEMS, also=upstream_answer)
    for response in responses.values():
        response["headers"] = replayed
        response["description"] += "; or the upstream's own answer with this status"
    operation: dict[str, Any] = {
        "operationId": "proxy" + method.capitalize(),
        "summary": "Forwarded to the upstream of that name: recorded, and replayed on a retry with the key",
        "security": [{"tenant": []}, {}],
        "parameters": [
            {
                "name": "upstream",
                "in": "path",
                "required": True,
                "description": "a configured upstream's name (any other is 404 unknown-upstream)",
                "schema": {"type": "string", "minLength": 1},
            },
            {
                "name": "path",
                "in": "path",
                "required": True,
                "description": "the path at the upstream, sent as it came (one or more segments)",
                "schema": {"type": "string"},
            },
            {
                "name": "query",
                "in": "query",
                "description": "the query: any names and values, sent as they came",
                "style": "form",
                "explode": True,
                "schema": {"type": "object"},
            },
            {
                "name": "Idempotency-Key",
                "in": "header",
                "description": f"the effect's key, the same on every retry: 1 to {MAX_KEY_LENGTH} visible "
                'ASCII characters, bare (run-1:4) or quoted ("run-1:4"); required on POST and PATCH '
                "unless the upstream says otherwise",
                "schema": {"type": "string", "pattern": KEY_PATTERN},
            },
            {
                "name": "Prefer",
                "in": "header",
                "description": (
                    "wait=N: wait up to N seconds (at most max_wait) for another request with this key "
                    "in flight"
                ),
                "schema": _TEXT,
            },
            *(
                {
                    "name": name,
                    "in": "header",
                    "description": "the agent's run and step, kept in the audit; a control character "
                    "or an invisible formatting one (a bidi override, a zero-width space) is a 400",
                    "schema": {"type": "string", "maxLength": MAX_LABEL},
                }
                for name in ("Effect-Gateway-Run", "Effect-Gateway-Step")
            ),
        ],
        "responses": {
            **responses,
            "default": {
                "description": "the upstream's answer: its status, header bytes and body; or its replay",
                "headers": replayed,
                "content": upstream_answer,
            },
        },
    }
    if method not in ("get", "head", "options", "trace"):
        operation["requestBody"] = {
            "description": "sent as it came, plus the stamp where the upstream's stamp is a body field",
            "content": {
                "application/json": {"schema": {}},
                "application/x-www-form-urlencoded": {
                    "schema": {"type": "object", "additionalProperties": _TEXT}
                },
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    return operation


def _problem_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "RFC 9457; clients branch on type, which never changes",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": {"type": "string", "enum": [problems.TYPE_BASE + n for n in problems.problem_types()]},
            "title": _TEXT,
            "status": {"type": "integer"},
            "detail": _TEXT,
            "instance": _TEXT,
            "effect_id": {"type": "integer", "minimum": 1},
        },
    }


def operations(item: dict[str, Any]) -> dict[str, Any]:
    """The operations of a path item by method, without its other fields (``servers``)."""
    return {method: operation for method, operation in item.items() if method in PROXY_METHODS}


@cache
def document() -> dict[str, Any]:
    """The whole document (one per process: everything in it is a constant of the code)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "effect-gateway",
            "version": "1",
            "description": "An idempotency sidecar: the proxy, its admin API and its audit pages. Errors "
            'are problem+json; an upstream configured with error_format = "stripe" answers the proxy\'s '
            "errors in Stripe's shape instead (docs/contract.md). Two listeners serve it: the proxy's path "
            "is the agents' (the listen setting), every /_gateway/ path the admin listener's (admin_listen), "
            "where this document is served; the agents' listener also answers GET /_gateway/health, up or "
            "down only.",
        },
        # The default addresses; a configuration names its own (listen, admin_listen).
        "servers": [_server("the admin listener (admin_listen)", ADMIN_PORT)],
        "paths": {
            **_admin_paths(),
            **_audit_paths(),
            "/{upstream}/{path}": {
                "servers": [_server("the agents' listener (listen)", PROXY_PORT)],
                **{method: _proxy_operation(method) for method in PROXY_METHODS},
            },
        },
        "components": {
            "schemas": {"Problem": _problem_schema(), **_effect_schemas()},
            "securitySchemes": {
                "admin": {"type": "http", "scheme": "bearer", "description": "the admin token"},
                "tenant": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "Effect-Gateway-Token",
                    "description": "a tenant's token: its own effects only",
                },
                "session": {"type": "apiKey", "in": "cookie", "name": COOKIE, "description": "audit sign-in"},
            },
        },
    }


@cache
def _body() -> bytes:
    return json.dumps(document(), indent=1).encode()


async def serve(_: web.Request) -> web.Response:
    return web.Response(body=_body(), content_type="application/json")
