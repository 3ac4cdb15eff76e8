"""Signing in to the audit page: signed session cookies, their attributes and lifetime, and CSRF refusals.

What a browser does is in tests/test_audit_browser.py; here are the HTTP exchanges a browser would not
make on its own (a foreign Origin, a forged token) and the session rules themselves.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gateway.sessions import ADMIN, LIFETIME, Principal, SessionKeys, holder

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
