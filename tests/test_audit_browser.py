"""The audit page in a real browser: Debian's headless Chromium, driven by Playwright, as a person uses it.

One browser for the module, a fresh context (no cookies) per test. Screenshots land in
test-artifacts/audit/ for a person to look at; their paths are printed at the end of the run.
`make test` installs Chromium when it is missing (as root, with apt-get); without it these tests fail
and say so, never skip.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Browser, ConsoleMessage, Dialog, Page, expect

from tests.database import effect_rows, empty_effects
from tests.gateways import Gateway, gateway_server
from tests.support import ROOT, SCREENSHOTS
from tests.upstreams import Upstream, upstream_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

ARTIFACTS = ROOT / "test-artifacts" / "audit"
AUDIT = "/_gateway/audit"
ADMIN = {"admin": {"token": "env:ADMIN"}}
CREATED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


@dataclass
class Person:
    """A browser tab with what it would show a person beyond the page: dialogs and console errors."""

    page: Page
    dialogs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        await self.page.screenshot(path=str(path), full_page=True)
        SCREENSHOTS.append(path)
        return path

    async def sign_in(self, url: str, token: str) -> None:
        await self.page.goto(url + AUDIT)
        await expect(self.page.get_by_role("heading", name="Sign in")).to_be_visible()
        await self.page.get_by_label("Token").fill(token)
        await self.page.get_by_role("button", name="Sign in").click()

    async def keys(self) -> list[str]:
        """The key column of the table, top to bottom."""
        return await self.page.locator("tbody td.key").all_inner_texts()


@pytest_asyncio.fixture(loop_scope="module")
async def person(browser: Browser) -> AsyncIterator[Person]:
    context = await browser.new_context(viewport={"width": 1360, "height": 900})
    page = await context.new_page()
    seen = Person(page)

    async def dismiss(dialog: Dialog) -> None:
        seen.dialogs.append(dialog.message)
        await dialog.dismiss()

    def console(message: ConsoleMessage) -> None:
        # A script or style the Content-Security-Policy blocked shows here. A page answered 401, 403 or 404
        # (sign in, refused, no such effect) is logged as a resource that failed to load: that is no error.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            seen.errors.append(message.text)

    page.on("dialog", dismiss)
    page.on("console", console)
    yield seen
    await context.close()
    assert seen.dialogs == [], "a page ran a script"
    assert seen.errors == [], "the page logged errors (a blocked script or style?)"


@pytest_asyncio.fixture(loop_scope="module")
async def db(postgres_dsn: str) -> str:
    await empty_effects(postgres_dsn)
    return postgres_dsn


@pytest_asyncio.fixture(loop_scope="module")
async def shop() -> AsyncIterator[Upstream]:
    async with upstream_server() as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADMIN", "adm-1")
    monkeypatch.setenv("TA", "tok-a")
    monkeypatch.setenv("TB", "tok-b")


async def order(
    http: aiohttp.ClientSession, gw: Gateway, key: str, path: str = "/orders", **headers: str
) -> tuple[int, bytes, dict[str, str]]:
    """What an agent does: one call through the gateway with a key."""
    async with http.post(
        f"{gw.url}/shop{path}",
        data=b'{"items":["atta"]}',
        headers={"Idempotency-Key": key, "Content-Type": "application/json", **headers},
    ) as resp:
        return resp.status, await resp.read(), dict(resp.headers)


def flaky(upstream: Upstream, path: str = "/flaky") -> None:
    """``path`` answers 500: the effect may have happened, and with no probe nothing can tell."""

    async def boom(request: web.Request) -> web.Response:
        return web.Response(status=500, text="upstream broke")

    upstream.routes[path] = boom


async def needs_review(http: aiohttp.ClientSession, gw: Gateway, key: str, **headers: str) -> None:
    for _ in range(2):  # the 500 leaves it in doubt; the retry finds nothing to recover it by
        await order(http, gw, key, "/flaky", **headers)


async def test_a_person_signs_in_sees_the_effects_and_filters_and_pages_them(
    db: str, shop: Upstream, http: aiohttp.ClientSession, person: Person, tokens: None
) -> None:
    """Sign in with the admin token; counts link to a state; filters and paging keep the query string."""
    flaky(shop)
    async with gateway_server(db, upstreams={"shop": {"base_url": shop.url}}, **ADMIN) as gw:
        for n in range(5):
            run = {"Effect-Gateway-Run": "run-a" if n < 3 else "run-b", "Effect-Gateway-Step": str(n)}
            await order(http, gw, f"k{n}", **run)
        await needs_review(http, gw, "k-flaky")
        page = person.page
        await person.sign_in(gw.admin_url, "not-the-token")
        await expect(page.get_by_role("alert")).to_contain_text(
            "not the admin token, an operator's, or a tenant's"
        )
        await page.get_by_label("Token").fill("adm-1")
        await page.get_by_role("button", name="Sign in").click()
        await expect(page.get_by_role("heading", name="Effects")).to_be_visible()
        await expect(page.locator("header.top")).to_contain_text("admin · until")
        assert await person.keys() == ["k-flaky", "k4", "k3", "k2", "k1", "k0"]
        await expect(page.get_by_role("status")).to_contain_text("1 effect waits for an operator")
        created = await page.locator("tbody td.when").first.inner_text()
        assert CREATED.match(created), created
        await person.shot("list-admin.png")

        await page.get_by_role("link", name="completed: 5").click()
        await expect(page).to_have_url(re.compile(r"state=completed"))
        assert set(await page.locator("tbody .badge").all_inner_texts()) == {"completed"}

        await page.goto(f"{gw.admin_url}{AUDIT}?limit=2")
        await page.get_by_label("State", exact=True).select_option("completed")
        await page.get_by_label("Run").fill("run-a")
        await page.get_by_role("button", name="Filter").click()
        assert await person.keys() == ["k2", "k1"]
        await page.get_by_role("link", name="Older →").click()
        assert await person.keys() == ["k0"]
        await expect(page).to_have_url(re.compile(r"[?&]run=run-a"))
        await expect(page).to_have_url(re.compile(r"[?&]state=completed"))
        await expect(page).to_have_url(re.compile(r"[?&]limit=2"))
        await expect(page.get_by_label("Run")).to_have_value("run-a")
        await expect(page.get_by_role("link", name="Older →")).to_have_count(0)
        await person.shot("list-filtered-page-2.png")
        await page.get_by_role("link", name="← Newest").click()
        assert await person.keys() == ["k2", "k1"]

        await page.goto(gw.admin_url + AUDIT)
        await page.get_by_label("Key").fill("k3")
        await page.get_by_role("button", name="Filter").click()
        assert await person.keys() == ["k3"]
        await page.goto(f"{gw.admin_url}{AUDIT}?since=1h")
        assert len(await person.keys()) == 6
        await page.goto(f"{gw.admin_url}{AUDIT}?until=1h")
        await expect(page.locator("tbody")).to_contain_text("No effects match these filters.")
        await page.goto(f"{gw.admin_url}{AUDIT}?until=2999-01-01T00:00Z&limit=4")
        assert await person.keys() == ["k-flaky", "k4", "k3", "k2"]
        await page.goto(f"{gw.admin_url}{AUDIT}?since=yesterday")
        await expect(page.get_by_role("alert")).to_contain_text("since='yesterday' is neither an ISO time")


async def test_an_operator_resolves_an_effect_as_happened_and_the_agent_retry_replays_that_body(
    db: str, shop: Upstream, http: aiohttp.ClientSession, person: Person, tokens: None
) -> None:
    """The effect's page shows the request and a timeline; "happened" with a JSON body is what replays."""
    flaky(shop)
    async with gateway_server(db, upstreams={"shop": {"base_url": shop.url}}, **ADMIN) as gw:
        run = {"Effect-Gateway-Run": "run-7", "Effect-Gateway-Step": "place-order"}
        await needs_review(http, gw, "order-7", **run)
        calls = len(shop.calls)
        page = person.page
        await person.sign_in(gw.admin_url, "adm-1")
        await page.get_by_role("link", name="Show them").click()
        await page.get_by_role("link", name="1", exact=True).click()
        await expect(page.get_by_role("heading", name="Effect 1")).to_contain_text("needs_review")
        await expect(page.locator("dl.facts").first).to_contain_text("run-7 : place-order")
        await expect(page.locator("pre").first).to_have_text('{"items":["atta"]}')
        timeline = page.locator("ol.timeline li")
        await expect(timeline.first).to_contain_text("Claimed")
        await expect(timeline.last).to_contain_text("Sent to review")
        assert CREATED.match((await timeline.first.locator("time").inner_text()).strip())
        await expect(page.get_by_role("button", name="Did not happen")).to_be_enabled()
        await person.shot("effect-needs-review.png")

        happened = page.get_by_role("form", name="happened")
        await happened.get_by_label("Status").fill("201")
        await happened.get_by_label("Body").fill("{oops")
        await happened.get_by_role("button", name="Happened: record this response").click()
        await expect(page.get_by_role("alert")).to_contain_text("The body is not JSON")
        await expect(happened.get_by_label("Body")).to_have_value("{oops")
        body = '{\n  "id": 77,\n  "status": "placed"\n}'
        await happened.get_by_label("Body").fill(body)
        await happened.get_by_label("Your name").fill("Asha")
        await happened.get_by_role("button", name="Happened: record this response").click()

        await expect(page.get_by_role("status")).to_contain_text("Recorded: the effect happened")
        await expect(page.get_by_role("heading", name="Effect 1")).to_contain_text("completed")
        await expect(page.get_by_role("button", name="Did not happen")).to_have_count(0)
        await expect(page.locator("pre").last).to_have_text(body)
        await expect(timeline.last).to_contain_text("Resolved by an operator")
        await expect(timeline.last).to_contain_text("by: admin: Asha")
        await person.shot("effect-resolved.png")

        status, replayed, headers = await order(http, gw, "order-7", "/flaky", **run)
    assert (status, replayed.decode()) == (201, body)
    assert headers["Idempotent-Replayed"] == "true"
    assert headers["Content-Type"] == "application/json"
    assert len(shop.calls) == calls  # nothing was sent for the retry


async def test_a_tenant_sees_only_its_own_effects_and_cannot_resolve(
    db: str, shop: Upstream, http: aiohttp.ClientSession, person: Person, tokens: None
) -> None:
    """Signed in with a tenant's token: that tenant's effects, no resolve forms, and a POST refused."""
    flaky(shop)
    tenants = {"a": {"token": "env:TA"}, "b": {"token": "env:TB"}}
    async with gateway_server(db, upstreams={"shop": {"base_url": shop.url}}, tenants=tenants, **ADMIN) as gw:
        await needs_review(http, gw, "a-review", **{"Effect-Gateway-Token": "tok-a"})
        await order(http, gw, "a-done", **{"Effect-Gateway-Token": "tok-a"})
        await order(http, gw, "b-secret", **{"Effect-Gateway-Token": "tok-b"})
        page = person.page
        await person.sign_in(gw.admin_url, "tok-a")
        await expect(page.locator("header.top")).to_contain_text("tenant a")
        assert await person.keys() == ["a-done", "a-review"]
        await expect(page.locator("main")).not_to_contain_text("b-secret")
        await expect(page.get_by_role("status")).to_contain_text("the gateway's admin resolves them")
        await person.shot("list-tenant.png")

        await page.get_by_role("link", name="1", exact=True).click()
        await expect(page.locator("main")).to_contain_text("the gateway's admin resolves it")
        await expect(page.get_by_role("button", name="Did not happen")).to_have_count(0)
        await expect(page.get_by_role("button", name=re.compile("Happened"))).to_have_count(0)
        csrf = await page.locator("header.top input[name=csrf]").get_attribute("value")
        assert csrf
        refused = await page.context.request.post(
            f"{gw.admin_url}{AUDIT}/1/resolve",
            form={"csrf": csrf, "happened": "no"},
            headers={"Origin": gw.admin_url},
        )
        assert refused.status == 403
        assert "the admin token resolves them" in await refused.text()
        ids = {row["key"]: row["id"] for row in await effect_rows(db)}
        await page.goto(f"{gw.admin_url}{AUDIT}/{ids['b-secret']}")
        await expect(page.get_by_role("heading", name="No such effect")).to_be_visible()

        await page.goto(gw.admin_url + AUDIT)
        await page.get_by_role("button", name="Sign out").click()
        await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        await page.goto(f"{gw.admin_url}{AUDIT}/1")
        await expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert [r["state"] for r in await effect_rows(db)] == ["needs_review", "completed", "completed"]


async def test_a_form_on_another_site_cannot_resolve_with_the_persons_session(
    db: str, shop: Upstream, http: aiohttp.ClientSession, person: Person, tokens: None
) -> None:
    """A signed-in person who clicks a button on another site: no cookie goes along, nothing is resolved."""
    flaky(shop)
    async with gateway_server(db, upstreams={"shop": {"base_url": shop.url}}, **ADMIN) as gw:
        await needs_review(http, gw, "k1")
        await person.sign_in(gw.admin_url, "adm-1")
        await expect(person.page.get_by_role("heading", name="Effects")).to_be_visible()

        async def lure(request: web.Request) -> web.Response:
            form = (
                f'<form method="post" action="{gw.admin_url}{AUDIT}/1/resolve">'
                '<input type="hidden" name="happened" value="no"><input type="hidden" name="csrf" value="x">'
                "<button>Win a prize</button></form>"
            )
            return web.Response(text=form, content_type="text/html")

        shop.routes["/lure"] = lure
        # localhost is another site than 127.0.0.1 for the browser's SameSite rules.
        await person.page.goto(shop.url.replace("127.0.0.1", "localhost") + "/lure")
        await person.page.get_by_role("button", name="Win a prize").click()
        await expect(person.page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert [r["state"] for r in await effect_rows(db)] == ["needs_review"]


async def test_script_looking_keys_and_paths_are_shown_as_text(
    db: str, shop: Upstream, http: aiohttp.ClientSession, person: Person
) -> None:
    """What an agent sent is data: a key that looks like markup shows as its characters and runs nothing."""
    keys = ["<script>alert(1)</script>", "<img/src=x/onerror=alert(2)>"]
    async with gateway_server(db, upstreams={"shop": {"base_url": shop.url}}) as gw:  # open: loopback only
        for key in keys:
            assert (await order(http, gw, key))[0] == 201
        page = person.page
        await page.goto(gw.admin_url + AUDIT)
        await expect(page.locator("header.top")).to_contain_text("open gateway")
        assert await person.keys() == keys[::-1]
        await page.get_by_role("link", name="1", exact=True).click()
        await expect(page.locator("dl.facts").first).to_contain_text(keys[0])
        await person.shot("effect-script-key.png")


async def test_a_named_operator_signs_in_as_themselves_and_their_verdict_carries_their_name(
    db: str, shop: Upstream, http: aiohttp.ClientSession, person: Person, tokens: None
) -> None:
    """Signed in with their own token, the page names the operator, and their verdict's timeline entry
    names them, with the ticket they typed beside it."""
    flaky(shop)
    operators = {"operators": {"asha": {"token": "op-asha"}}}
    async with gateway_server(db, upstreams={"shop": {"base_url": shop.url}}, **ADMIN, **operators) as gw:
        await needs_review(http, gw, "order-9")
        page = person.page
        await person.sign_in(gw.admin_url, "op-asha")
        await expect(page.locator("header")).to_contain_text("operator asha")
        await page.goto(f"{gw.admin_url}{AUDIT}/1")
        await page.get_by_role("form", name="did not happen").get_by_label("Your name").fill("INC-7")
        await page.get_by_role("button", name="Did not happen").click()
        await expect(page.get_by_role("status")).to_contain_text("Recorded: the effect did not happen")
        timeline = page.locator("ol.timeline li")
        await expect(timeline.last).to_contain_text("by: asha (INC-7)")
        await person.shot("effect-resolved-by-operator.png")
