"""The OpenAPI document: exactly the application's routes, served to anyone, a valid document."""

from __future__ import annotations

import json
import re

import aiohttp
import schemathesis
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from aiohttp.web_urldispatcher import AbstractRoute
from hypothesis import given

from gateway import openapi, problems
from gateway.app import READINESS, make_admin_app, make_proxy_app
from gateway.errors import KeySyntaxError
from gateway.keys import parse_key
from gateway.settings import load_settings
from tests.gateways import gateway_server
from tests.strategies import KEY_VALUES

# A value for each path parameter the document names, to ask the router where the path leads.
SAMPLES = {"id": "1", "upstream": "shop", "path": "orders"}


async def _route_of(app: web.Application, method: str, path: str) -> AbstractRoute | None:
    url = re.sub(r"\{(\w+)\}", lambda m: SAMPLES[m.group(1)], path)
    match = await app.router.resolve(make_mocked_request(method, url, app=app))
    return None if match.http_exception is not None else match.route


async def test_the_document_has_every_route_and_only_routes() -> None:
    """Each documented operation is a route of the listener that serves it, and every route is documented."""
    # The proxy's path is the agents' listener's; every other path is the admin listener's, where nothing
    # of an upstream's is ever served. The agents' listener has one path of the gateway's own besides the
    # proxy: the readiness probe, at the admin listener's health path.
    settings = load_settings(None, upstreams={})
    apps = {"proxy": make_proxy_app(settings), "admin": make_admin_app(settings)}
    documented: dict[AbstractRoute, set[str]] = {}
    for path, item in openapi.document()["paths"].items():
        for method in openapi.operations(item):
            app = apps["proxy" if path == "/{upstream}/{path}" else "admin"]
            route = await _route_of(app, method.upper(), path)
            assert route is not None, f"{method.upper()} {path} is documented but no route serves it"
            proxied = route.resource is not None and route.resource.canonical == "/{tail}"
            assert proxied == (path == "/{upstream}/{path}"), f"{method.upper()} {path} reaches {route}"
            documented.setdefault(route, set()).add(method.upper())
    readiness = await _route_of(apps["proxy"], "GET", READINESS)
    assert readiness is not None
    assert readiness.resource is not None
    assert readiness.resource.canonical in openapi.document()["paths"]
    registered = {
        route: route.method
        for app in apps.values()
        for route in app.router.routes()
        if route.resource is not readiness.resource  # its GET and HEAD
    }
    assert set(documented) == set(registered), "routes missing from the document"
    for route, method in registered.items():
        wanted = {m.upper() for m in openapi.PROXY_METHODS} if method == "*" else {method}
        assert documented[route] == wanted, f"{route}: documented for {documented[route]}, serves {wanted}"


async def test_the_document_is_served_to_anyone_and_is_valid(dsn: str) -> None:
    """GET /_gateway/openapi.json without a token is the document, which schemathesis accepts as valid."""
    async with (
        gateway_server(dsn, admin={"token": "admin-token"}, tenants={"t": {"token": "t-token"}}) as gw,
        aiohttp.ClientSession() as http,
        http.get(gw.admin_url + openapi.PATH) as resp,
    ):
        assert resp.status == 200
        assert resp.content_type == "application/json"
        served = await resp.json()
    assert served == json.loads(json.dumps(openapi.document()))
    schemathesis.openapi.from_dict(served).validate()


def test_the_document_lists_every_problem_type_with_its_status() -> None:
    """Clients branch on problem types: the document names each one under its own status, on some route."""
    listed: dict[str, set[int]] = {}
    for item in openapi.document()["paths"].values():
        for operation in openapi.operations(item).values():
            for status, response in operation["responses"].items():
                body = response.get("content", {}).get(problems.CONTENT_TYPE, {}).get("schema", {})
                for part in body.get("allOf", []):
                    for uri in part.get("properties", {}).get("type", {}).get("enum", []):
                        listed.setdefault(uri.removeprefix(problems.TYPE_BASE), set()).add(int(status))
    assert listed == {name: {cls.status} for name, cls in problems.problem_types().items()}


@given(KEY_VALUES)
def test_the_documented_key_pattern_is_what_the_gateway_accepts(value: str) -> None:
    """A client that validates Idempotency-Key by the document accepts exactly the keys the gateway does."""
    try:
        parse_key(value)
        accepted = True
    except KeySyntaxError:
        accepted = False
    assert bool(re.fullmatch(openapi.KEY_PATTERN, value)) == accepted
