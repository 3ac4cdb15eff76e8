"""Signing in to the audit page: signed session cookies, their attributes and lifetime, and CSRF refusals.

What a browser does is in tests/test_audit_browser.py; here are the HTTP exchanges a browser would not
make on its own (a foreign Origin, a forged token) and the session rules themselves.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gateway import urlencoded
from gateway.sessions import (
    ADMIN,
    COOKIE,
    LIFETIME,
    Principal,
    SessionKeys,
    forgetting,
    holder,
    sent_sessions,
)
from tests.database import effect_rows
from tests.gateways import Gateway, gateway_server
from tests.strategies import FORM_BYTES, spelled, whatwg_pairs
from tests.upstreams import Upstream

AUDIT = "/_gateway/audit"
NOW = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)
TOKENS = {ADMIN: "adm-1", Principal("a"): "tok-a"}


def test_a_session_holds_who_signed_in_until_it_expires() -> None:
    """A cookie reads back as the admin or the tenant that signed in, for LIFETIME and not a second more."""
    keys = SessionKeys(b"secret")
    cookie, issued = keys.issue(Principal("a"), "tok-a", NOW)
    session = keys.read(cookie, TOKENS, NOW + LIFETIME - timedelta(seconds=1))
    assert session is not None
    assert (session.principal, session.id) == (Principal("a"), issued.id)
    assert keys.read(cookie, TOKENS, NOW + LIFETIME) is None
    admin_cookie, _ = keys.issue(ADMIN, "adm-1", NOW)
    admin = keys.read(admin_cookie, TOKENS, NOW)
    assert admin is not None
    assert admin.principal == ADMIN


def test_a_forged_tampered_or_foreign_cookie_is_no_session() -> None:
    """Changing any character, or a cookie signed by another gateway's secret, gets no session."""
    keys = SessionKeys(b"secret")
    cookie, _ = keys.issue(Principal("a"), "tok-a", NOW)
    claims, _, mac = cookie.partition(".")
    assert keys.read(claims + "." + mac[:-1] + ("A" if mac[-1] != "A" else "B"), TOKENS, NOW) is None
    other = SessionKeys(b"another secret").issue(ADMIN, "adm-1", NOW)[0]
    assert keys.read(other, TOKENS, NOW) is None
    assert keys.read("not a cookie", TOKENS, NOW) is None
    assert keys.read("", TOKENS, NOW) is None


def test_rotating_or_removing_a_token_ends_its_sessions() -> None:
    """A session names its token by fingerprint: a new token in the configuration ends the old sessions."""
    keys = SessionKeys(b"secret")
    cookie, _ = keys.issue(Principal("a"), "tok-a", NOW)
    assert keys.read(cookie, {**TOKENS, Principal("a"): "tok-a2"}, NOW) is None
    assert keys.read(cookie, {ADMIN: "adm-1"}, NOW) is None
    assert keys.read(cookie, TOKENS, NOW) is not None


def test_only_a_configured_token_signs_in_and_csrf_tokens_are_per_session() -> None:
    """The token says who signs in; each session's CSRF token is its own."""
    assert holder("tok-a", TOKENS) == Principal("a")
    assert holder("adm-1", TOKENS) == ADMIN
    assert holder("tok-", TOKENS) is None
    keys = SessionKeys(b"secret")
    one = keys.issue(ADMIN, "adm-1", NOW)[1]
    two = keys.issue(ADMIN, "adm-1", NOW)[1]
    assert keys.csrf_ok(one, keys.csrf(one))
    assert not keys.csrf_ok(two, keys.csrf(one))
    assert not keys.csrf_ok(one, "")


def _attributes(set_cookie: str) -> dict[str, str]:
    """A Set-Cookie value's attributes, by lower-case name."""
    pairs = (part.strip().partition("=") for part in set_cookie.split(";")[1:])
    return {name.lower(): value for name, _, value in pairs}


def test_every_copy_of_a_session_cookie_a_browser_could_send_is_named_for_deletion() -> None:
    """Deleting takes the name, the path and the domain: each path that reaches the page, for the host
    alone and each domain above a host name (none for an address); the copy to keep is left alone."""
    sent = [f"a=1; {COOKIE}=x;{COOKIE} = y ; {COOKIE.upper()}=z", f"{COOKIE}=w"]
    assert sent_sessions(sent) == ["x", "y", "w"]
    on_a_name = forgetting(AUDIT, "audit.gw.example:8788", secure=True, keep=AUDIT)
    targets = [(_attributes(value)["path"], _attributes(value).get("domain")) for value in on_a_name]
    paths = ["/", "/_gateway", "/_gateway/", AUDIT]
    domains = [None, "audit.gw.example", "gw.example"]
    assert targets == [(p, d) for p in paths for d in domains if (p, d) != (AUDIT, None)]
    assert all(value.endswith("; HttpOnly; SameSite=Strict; Secure") for value in on_a_name)
    on_an_address = forgetting(AUDIT + "/12", "[::1]:8788", secure=False)
    assert [_attributes(value)["path"] for value in on_an_address] == [*paths, AUDIT + "/", AUDIT + "/12"]
    assert all(_attributes(value)["max-age"] == "0" for value in on_an_address)


# --- over HTTP ---------------------------------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # No cookie jar: each test sends exactly the cookie (and Origin) it means to.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as session:
        yield session


@pytest.fixture
def tokens(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    monkeypatch.setenv("ADMIN", "adm-1")
    monkeypatch.setenv("TA", "tok-a")
    return {"admin": {"token": "env:ADMIN"}, "tenants": {"a": {"token": "env:TA"}}}


async def _sign_in(
    http: aiohttp.ClientSession, url: str, token: str, **headers: str
) -> aiohttp.ClientResponse:
    async with http.post(
        f"{url}{AUDIT}/sign-in",
        data={"token": token, "next": AUDIT},
        headers={"Origin": url, **headers},
        allow_redirects=False,
    ) as resp:
        return resp


def _cookie(resp: aiohttp.ClientResponse) -> str:
    return resp.cookies[COOKIE].value


async def _page(http: aiohttp.ClientSession, url: str, cookie: str | None = None) -> tuple[int, str]:
    headers = {"Cookie": f"{COOKIE}={cookie}"} if cookie else {}
    async with http.get(url, headers=headers, allow_redirects=False) as resp:
        return resp.status, await resp.text()


async def test_signing_in_sets_a_strict_http_only_cookie_for_the_audit_pages(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """The cookie is HttpOnly, SameSite=Strict, scoped to the audit, 8 hours; Secure behind https."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        status, _ = await _page(http, gw.admin_url + AUDIT)
        assert status == 401
        resp = await _sign_in(http, gw.admin_url, "adm-1")
        assert (resp.status, resp.headers["Location"]) == (303, AUDIT)
        morsel = resp.cookies[COOKIE]
        assert morsel["httponly"] is True
        assert morsel["samesite"] == "Strict"
        assert morsel["path"] == AUDIT
        assert morsel["max-age"] == str(8 * 3600)
        assert not morsel["secure"]
        assert (await _page(http, gw.admin_url + AUDIT, _cookie(resp)))[0] == 200
        tls = {"X-Forwarded-Proto": "https", "Origin": gw.admin_url.replace("http:", "https:")}
        behind_tls = await _sign_in(http, gw.admin_url, "adm-1", **tls)
        assert behind_tls.cookies[COOKIE]["secure"] is True
        wrong = await _sign_in(http, gw.admin_url, "adm-2")
        assert wrong.status == 401
        assert COOKIE not in wrong.cookies


async def test_every_gateway_on_the_database_accepts_a_session_until_its_token_changes(
    dsn: str,
    upstream: Upstream,
    http: aiohttp.ClientSession,
    tokens: dict[str, object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second gateway process (another worker) takes the cookie; one with a rotated token does not."""
    shop = {"shop": {"base_url": upstream.url}}
    async with gateway_server(dsn, upstreams=shop, **tokens) as one:
        cookie = _cookie(await _sign_in(http, one.admin_url, "adm-1"))
    async with gateway_server(dsn, upstreams=shop, **tokens) as two:
        assert (await _page(http, two.admin_url + AUDIT, cookie))[0] == 200
    monkeypatch.setenv("ADMIN", "adm-rotated")
    async with gateway_server(dsn, upstreams=shop, **tokens) as rotated:
        status, _ = await _page(http, rotated.admin_url + AUDIT, cookie)
    assert status == 401


async def test_the_json_routes_take_no_cookie_and_the_pages_allow_no_script(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """The JSON API still wants its tokens; every page forbids scripts and caching."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        cookie = _cookie(await _sign_in(http, gw.admin_url, "adm-1"))
        async with http.get(
            f"{gw.admin_url}/_gateway/effects", headers={"Cookie": f"{COOKIE}={cookie}"}
        ) as resp:
            assert resp.status == 401
        async with http.get(gw.admin_url + AUDIT, headers={"Authorization": "Bearer adm-1"}) as resp:
            assert resp.status == 200
            policy = resp.headers["Content-Security-Policy"]
            assert resp.headers["Cache-Control"] == "no-store"
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
        async with http.get(gw.admin_url + AUDIT, headers={"Effect-Gateway-Token": "tok-a"}) as resp:
            assert resp.status == 200
    assert "default-src 'none'" in policy
    assert "form-action 'self'" in policy
    assert "script-src" not in policy
    assert "unsafe" not in policy


async def test_an_open_single_tenant_gateway_needs_no_sign_in(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Without tenants and an admin token (loopback only) the page opens as it always did."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        assert (await _page(http, gw.admin_url + AUDIT))[0] == 200


async def test_signing_in_never_sends_a_person_to_another_site(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """``next`` goes to an audit page only; a sign-in posted from another site is refused."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        for target in ("https://evil.example/", "//evil.example/_gateway/audit", f"{AUDIT}\\@evil"):
            async with http.post(
                f"{gw.admin_url}{AUDIT}/sign-in",
                data={"token": "adm-1", "next": target},
                headers={"Origin": gw.admin_url},
                allow_redirects=False,
            ) as resp:
                assert resp.headers["Location"] == AUDIT
        foreign = await _sign_in(http, gw.admin_url, "adm-1", Origin="http://localhost:1")
        assert foreign.status == 403
        assert COOKIE not in foreign.cookies


async def _needs_review(http: aiohttp.ClientSession, url: str, upstream: Upstream) -> None:
    """An effect the upstream answered 500 to, retried: nothing can tell, so it waits for an operator."""

    async def boom(request: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    upstream.routes["/orders"] = boom
    for _ in range(2):
        async with http.post(
            f"{url}/shop/orders",
            data=b"{}",
            headers={"Idempotency-Key": "k1", "Effect-Gateway-Token": "tok-a"},
        ) as resp:
            await resp.read()


async def _resolvable_page(
    http: aiohttp.ClientSession, gw: Gateway, upstream: Upstream, token: str = "adm-1"
) -> tuple[str, str, dict[str, str]]:
    """An effect waiting for an operator, and the session of ``token`` (the admin's) on its page:
    (cookie, csrf, attempt)."""
    await _needs_review(http, gw.url, upstream)
    cookie = _cookie(await _sign_in(http, gw.admin_url, token))
    _, page = await _page(http, f"{gw.admin_url}{AUDIT}/1", cookie)
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None
    shown = re.search(r'name="attempt" value="(\d+)"', page)
    assert shown is not None
    return cookie, found.group(1), {"attempt": shown.group(1)}


async def test_a_cross_site_resolve_is_refused_and_a_same_site_one_is_carried_out_once(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """With the cookie: no CSRF token, a wrong one, a foreign Origin, or none: 403; then it works, once."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        cookie, csrf, judged = await _resolvable_page(http, gw, upstream)
        attempts = [
            ({"Origin": gw.admin_url}, {}),
            ({"Origin": gw.admin_url}, {"csrf": "A" * len(csrf)}),
            ({"Origin": "http://localhost:1"}, {"csrf": csrf}),
            ({"Origin": "null"}, {"csrf": csrf}),
            ({}, {"csrf": csrf}),
        ]
        for headers, fields in attempts:
            async with http.post(
                f"{gw.admin_url}{AUDIT}/1/resolve",
                data={**fields, **judged, "happened": "no"},
                headers={"Cookie": f"{COOKIE}={cookie}", **headers},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 403, (headers, fields)
        assert [r["state"] for r in await effect_rows(dsn)] == ["needs_review"]
        async with http.post(
            f"{gw.admin_url}{AUDIT}/1/resolve",
            data={"csrf": csrf, **judged, "happened": "no"},
            headers={"Cookie": f"{COOKIE}={cookie}", "Referer": f"{gw.admin_url}{AUDIT}/1"},
            allow_redirects=False,
        ) as resp:
            assert (resp.status, resp.headers["Location"]) == (303, f"{AUDIT}/1?resolved=did-not-happen")
        assert [r["state"] for r in await effect_rows(dsn)] == ["retryable"]
        async with http.post(
            f"{gw.admin_url}{AUDIT}/1/resolve",
            data={"csrf": csrf, **judged, "happened": "no"},
            headers={"Cookie": f"{COOKIE}={cookie}", "Origin": gw.admin_url},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 409  # a second operator on a stale page: told why, nothing changes
            assert "Not resolved: it changed since it was judged" in await resp.text()
        async with http.post(
            f"{gw.admin_url}{AUDIT}/sign-out",
            data={"csrf": csrf},
            headers={"Cookie": f"{COOKIE}={cookie}", "Origin": gw.admin_url},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303
            assert resp.cookies[COOKIE]["max-age"] == "0"


@pytest.mark.parametrize(
    "fields",
    [
        {"happened": "no", "by": "a\x00b"},
        {"happened": "yes", "status": "\u00b2", "kind": "text", "body": "x"},
        {"happened": "yes", "status": "101", "kind": "text", "body": ""},
    ],
    ids=["nul-in-name", "non-ascii-digit-status", "informational-status"],
)
async def test_a_verdict_form_with_odd_fields_is_sent_back_with_the_error_and_changes_nothing(
    dsn: str,
    upstream: Upstream,
    http: aiohttp.ClientSession,
    tokens: dict[str, object],
    fields: dict[str, str],
) -> None:
    """A NUL in the name, a '²' or a 1xx as the status: the form comes back (400); it was a 500, or a 1xx
    stored as the answer every retry would get."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        cookie, csrf, judged = await _resolvable_page(http, gw, upstream)
        async with http.post(
            f"{gw.admin_url}{AUDIT}/1/resolve",
            data={"csrf": csrf, **judged, **fields},
            headers={"Cookie": f"{COOKIE}={cookie}", "Origin": gw.admin_url},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 400, await resp.text()
            assert 'class="notice error"' in await resp.text()
    assert [r["state"] for r in await effect_rows(dsn)] == ["needs_review"]


def _multipart(fields: dict[str, str], last: bytes) -> tuple[bytes, dict[str, str]]:
    """A multipart form of ``fields`` and a last part spelt out as ``last`` (its headers and content)."""
    parts = [f'Content-Disposition: form-data; name="{k}"\r\n\r\n{v}'.encode() for k, v in fields.items()]
    body = b"".join(b"--B\r\n" + part + b"\r\n" for part in [*parts, last]) + b"--B--\r\n"
    return body, {"Content-Type": "multipart/form-data; boundary=B"}


async def test_a_verdict_form_is_read_as_the_text_it_was_sent_as_and_nothing_else_is_taken(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """A name escaped as bytes that are not UTF-8 (%FF) is a 400 that changes nothing: it was kept as
    U+FFFD, another name than the one sent. So is a field given twice (which verdict?), a charset that
    is not UTF-8, Latin-1 or ASCII (UTF-7 gave a 500 and punycode held the worker), a form of 1,001
    fields, and any multipart form (a part that was not text was read as left empty, and an unknown
    transfer encoding was a 500). The same name as UTF-8, with "+" for its space, is kept."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        cookie, csrf, judged = await _resolvable_page(http, gw, upstream)
        fields = f"csrf={csrf}&attempt={judged['attempt']}&happened=no"
        sent = {"Cookie": f"{COOKIE}={cookie}", "Origin": gw.admin_url}
        before = await effect_rows(dsn)
        yes = {"csrf": csrf, **judged, "happened": "yes", "kind": "text"}
        not_text = "Its fields must be text in its charset"
        charset = "Its charset must be UTF-8 (or Latin-1, or ASCII)."
        multipart = "forms are sent urlencoded, as its page sends them"

        def named(name: str) -> dict[str, str]:
            return {"Content-Type": f"{form['Content-Type']}; charset={name}"}

        bad = [
            (f"{fields}&by=Jos%E9".encode(), form, not_text),
            (f"{fields}&by=%FF".encode(), form, not_text),
            (f"{fields}&by=ok&note=%C3%28".encode(), form, not_text),
            (f"{fields}&happened=yes&status=201&body=x".encode(), form, "is given more than once."),
            (f"{fields}&by=x".encode(), named("nosuch"), charset),
            (f"{fields}&by=%2B2AA-".encode(), named("utf-7"), charset),
            (f"{fields}&by=abc".encode(), named("punycode"), charset),
            (f"{fields}{'&a' * 998}".encode(), form, "The form has more than 1000 fields."),
            (*_multipart(yes, b'Content-Disposition: form-data; name="by"\r\n\r\nJos\xe9'), multipart),
            (
                *_multipart(
                    yes, b'Content-Disposition: form-data; name="by"\r\nContent-Transfer-Encoding: x\r\n\r\nx'
                ),
                multipart,
            ),
        ]
        for data, headers, why in bad:
            async with http.post(
                f"{gw.admin_url}{AUDIT}/1/resolve", data=data, headers={**sent, **headers}
            ) as resp:
                refused = (resp.status, why in await resp.text())
            assert refused == (400, True), data[-60:]
        assert await effect_rows(dsn) == before
        async with http.post(
            f"{gw.admin_url}{AUDIT}/1/resolve",
            data=f"{fields}&&by=Ana+Jos%E9".encode(),
            headers={**sent, **named("latin1")},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303, await resp.text()
    [row] = await effect_rows(dsn)
    assert (row["state"], row["history"][-1]["by"]) == ("retryable", "admin: Ana José")


async def test_a_verdicts_body_and_headers_are_replayed_as_typed(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """A body that starts with a line break keeps it when the form comes back with an error (a parser
    drops a line break right after <textarea>); a header with U+2028 or a vertical tab comes back with
    the form (it was split into two headers, or kept for a replay HTTP clients refuse), and a header
    value keeps its no-break spaces (they were stripped)."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        cookie, csrf, judged = await _resolvable_page(http, gw, upstream)
        sent = {"Cookie": f"{COOKIE}={cookie}", "Origin": gw.admin_url}
        typed = {"csrf": csrf, **judged, "happened": "yes", "status": "201", "body": "\n  first\nsecond"}
        async with http.post(
            f"{gw.admin_url}{AUDIT}/1/resolve", data={**typed, "kind": "json"}, headers=sent
        ) as resp:
            assert resp.status == 400
            shown = await resp.text()
        assert '<textarea id="body" name="body" rows="6">\n\n  first\nsecond</textarea>' in shown
        for odd in ("X-A: one\u2028X-B: two", "X-A: one\x0bX-B: two", "X-A: one\rX-B: two"):
            async with http.post(
                f"{gw.admin_url}{AUDIT}/1/resolve",
                data={**typed, "kind": "text", "headers": odd},
                headers=sent,
            ) as resp:
                refused = (resp.status, "holds a control character or line separator" in await resp.text())
            assert refused == (400, True), odd
        assert [r["state"] for r in await effect_rows(dsn)] == ["needs_review"]
        async with http.post(
            f"{gw.admin_url}{AUDIT}/1/resolve",
            data={**typed, "kind": "text", "headers": "X-A: \xa0one\xa0\r\nX-B: \ttwo\t"},
            headers=sent,
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303, await resp.text()
        async with http.get(f"{gw.admin_url}{AUDIT}/1", headers={"Cookie": f"{COOKIE}={cookie}"}) as resp:
            page = await resp.text()
        async with http.post(
            f"{gw.url}/shop/orders",
            data=b"{}",
            headers={"Idempotency-Key": "k1", "Effect-Gateway-Token": "tok-a"},
        ) as resp:
            replayed = (
                resp.status,
                resp.headers.getall("X-A"),
                resp.headers.getall("X-B"),
                await resp.text(),
            )
    assert replayed == (201, ["\xa0one\xa0"], ["two"], "\n  first\nsecond")
    assert "<pre>\n\n  first\nsecond</pre>" in page  # the page shows the answer's first line break too


def _deleted_paths(resp: aiohttp.ClientResponse) -> list[str]:
    """The paths at which the answer deletes the session cookie (for this host alone)."""
    answered = [
        _attributes(value)
        for value in resp.headers.getall("Set-Cookie", ())
        if value.startswith(f"{COOKIE}=;")
    ]
    return [each["path"] for each in answered if each.get("max-age") == "0" and "domain" not in each]


async def test_two_session_cookies_are_no_session_and_both_are_deleted(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """A browser that sends two audit sessions (a page on another port of the host set one for Path=/)
    gets the sign-in page saying so, in either order, and the answer deletes the cookie at every path
    that reaches the page. aiohttp kept the last one: a tenant's session planted after the admin's
    showed the operator that tenant's view, and a junk one locked the operator out for good."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        admin = _cookie(await _sign_in(http, gw.admin_url, "adm-1"))
        tenant = _cookie(await _sign_in(http, gw.admin_url, "tok-a"))
        for first, second in ((admin, tenant), (tenant, admin), (admin, "junk")):
            cookie = f"{COOKIE}={first}; other_app=1; {COOKIE}={second}"
            async with http.get(f"{gw.admin_url}{AUDIT}/7", headers={"Cookie": cookie}) as resp:
                page = await resp.text()
                assert resp.status == 401
                assert "two audit sessions" in page
                assert "tenant a" not in page
                deleted = _deleted_paths(resp)
        assert deleted == ["/", "/_gateway", "/_gateway/", AUDIT, AUDIT + "/", AUDIT + "/7"]
        status, page = await _page(http, gw.admin_url + AUDIT, admin)
        assert status == 200  # one session: the admin's, as before
        assert "admin" in page


async def test_signing_in_deletes_every_other_copy_and_keeps_its_own(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """Signing in sets the new session for the audit's path last, after deleting the copies at every
    other path, so a copy another page set cannot outlive the sign-in."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        resp = await _sign_in(http, gw.admin_url, "adm-1", Cookie=f"{COOKIE}=tossed")
        assert resp.status == 303
        assert _deleted_paths(resp) == ["/", "/_gateway", "/_gateway/", AUDIT + "/", AUDIT + "/sign-in"]
        last = resp.headers.getall("Set-Cookie")[-1]
        assert last.startswith(f"{COOKIE}={_cookie(resp)};")
        assert f"Path={AUDIT}" in last


async def test_a_cookie_of_other_text_is_no_session(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """A session cookie whose signature is not ASCII is the sign-in page; it was a 500."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens) as gw:
        status, page = await _page(http, f"{gw.admin_url}{AUDIT}", "YQ.\u00e9")
    assert status == 401
    assert "Sign in" in page


async def test_a_form_that_does_not_arrive_in_time_is_408_and_closes_the_connection(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """A sign-in whose body stalls is answered within request_body_timeout; it held the connection."""
    cfg = {"shop": {"base_url": upstream.url}}
    async with gateway_server(dsn, upstreams=cfg, request_body_timeout="300ms", **tokens) as gw:
        host, port = gw.admin_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST {AUDIT}/sign-in HTTP/1.1\r\nHost: {host}:{port}\r\nOrigin: {gw.admin_url}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\n"
        )
        writer.write(head.encode() + b"token=adm-1&next=")
        raw = await asyncio.wait_for(reader.read(), 5)  # the gateway closes the connection after it
        writer.close()
        assert (await _page(http, gw.admin_url + AUDIT))[0] == 401  # the gateway still answers
    status_line, _, rest = raw.partition(b"\r\n")
    assert status_line.split(b" ", 2)[1] == b"408", raw
    assert b"text/html" in rest
    assert b"did not arrive" in rest
    assert b"Set-Cookie" not in rest


@given(st.lists(st.tuples(FORM_BYTES, FORM_BYTES), max_size=4), st.data())
def test_a_form_reads_as_its_fields_say_or_not_at_all(
    fields: list[tuple[bytes, bytes]], data: st.DataObject
) -> None:
    """Every spelling of a form's fields reads as those fields, as text; a form with bytes that are not
    text in its charset does not read at all. Latin-1 reads %E9 as the é it is."""
    raw = b"&".join(data.draw(spelled(n)) + b"=" + data.draw(spelled(v)) for n, v in fields)
    try:
        expected = [(n.decode(), v.decode()) for n, v in whatwg_pairs(raw.rstrip())]
    except UnicodeDecodeError:
        with pytest.raises(UnicodeDecodeError):
            urlencoded.text_fields(raw, 10)
        return
    assert urlencoded.text_fields(raw, 10) == expected
    assert urlencoded.text_fields(b"by=Jos%E9&&x\n", 10, "iso-8859-1") == [("by", "José"), ("x", "")]


async def test_an_address_that_keeps_failing_to_sign_in_waits_before_its_next_try(
    dsn: str, upstream: Upstream, tokens: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    """Each failed sign-in is logged with its address; after three in a row the fourth makes the address
    wait a second, during which even the right token is refused unread (429), and after which it works."""
    shop = {"shop": {"base_url": upstream.url}}
    async with gateway_server(dsn, upstreams=shop, **tokens) as gw, aiohttp.ClientSession() as http:
        with caplog.at_level(logging.WARNING, logger="effect_gateway"):
            failed = [(await _sign_in(http, gw.admin_url, f"guess-{n}")).status for n in range(4)]
            refused = await _sign_in(http, gw.admin_url, "adm-1")
            await asyncio.sleep(1.1)
            admitted = await _sign_in(http, gw.admin_url, "adm-1")
    assert failed == [401, 401, 401, 401]  # the sign-in page again, saying the token did not work
    assert refused.status == 429
    assert refused.headers["Retry-After"] == "1"
    assert admitted.status == 303
    said = [r.getMessage() for r in caplog.records if "sign-in to the audit page" in r.getMessage()]
    failures = [f"a sign-in to the audit page from 127.0.0.1 failed ({n} in a row)" for n in (1, 2, 3)]
    assert said[:4] == [
        *failures,
        failures[0].replace("(1 in a row)", "(4 in a row); it may try again in 1 s"),
    ]
    assert len(said) == 4  # the refusal is not logged: a line each would let anyone fill the log


async def test_a_named_operators_verdict_on_the_page_records_their_name(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tokens: dict[str, object]
) -> None:
    """Signed in with their own token, an operator's verdict is recorded under their name, with what
    they typed beside it; the page says who is signed in."""
    operators = {"operators": {"asha": {"token": "op-asha"}}}
    async with gateway_server(
        dsn, upstreams={"shop": {"base_url": upstream.url}}, **tokens, **operators
    ) as gw:
        cookie, csrf, judged = await _resolvable_page(http, gw, upstream, token="op-asha")
        _, page = await _page(http, f"{gw.admin_url}{AUDIT}/1", cookie)
        async with http.post(
            f"{gw.admin_url}{AUDIT}/1/resolve",
            data={"csrf": csrf, "attempt": judged["attempt"], "happened": "no", "by": "INC-7"},
            headers={"Cookie": f"{COOKIE}={cookie}", "Origin": gw.admin_url},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303, await resp.text()
    assert "operator asha" in page
    [row] = await effect_rows(dsn)
    assert (row["state"], row["history"][-1]["by"]) == ("retryable", "asha (INC-7)")
