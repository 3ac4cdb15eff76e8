"""The audit pages' routes: sign-in and sign-out, the list, an effect's page, and an operator's verdict.

A browser signs in once with a token and holds a session cookie (:mod:`gateway.sessions`); API clients
may still send the admin token as ``Authorization: Bearer`` or a tenant's ``Effect-Gateway-Token``, and a
single-tenant gateway without an admin token (loopback only) is open, as for the JSON routes. Every
form posted here must come from this origin and carry a CSRF token bound to the session; the cookie is
``SameSite=Strict`` as well. Every answer is HTML for a person, errors included, under a
Content-Security-Policy that allows no script at all.
"""

from __future__ import annotations

import codecs
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from aiohttp import web
from multidict import MultiDict

from gateway import audit_page, effect_page, operators, problems, replies, scopes, urlencoded
from gateway.audit_page import BASE, Chrome, Listing
from gateway.auth import is_admin, operator_of, tenant_of
from gateway.decision import verdict_refused
from gateway.effect_page import ResolveForm, Verdict
from gateway.effects_json import MAX_ID, next_query, parse_filter, parse_resolution, whole_number
from gateway.errors import BadName, CursorUnknown, FormRefused, NoSuchEffect, NotAwaitingOperator
from gateway.record import EffectRecord, StoredResponse
from gateway.runtime import RUNTIME, Runtime, read_request_body, verdict_given
from gateway.scopes import Scope
from gateway.sessions import (
    ADMIN,
    COOKIE,
    LIFETIME,
    Principal,
    Session,
    SessionKeys,
    forgetting,
    holder,
    sent_sessions,
)
from gateway.settings import Settings
from gateway.sign_ins import SignIns

# No scripts, no frames, no plug-ins; styles only from our own stylesheet; forms post only to us.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    # The Referer goes to this origin only (the CSRF check reads it when a browser sends no Origin).
    "Referrer-Policy": "same-origin",
    # Pages hold the audit and CSRF tokens: no shared cache keeps them, no back button shows a stale one.
    "Cache-Control": "no-store",
}
# A header name is an RFC 9110 token: anything else would break the replay, not just look odd.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
OUTCOMES = {
    "happened": "Recorded: the effect happened. The agent's next retry with this key gets the response "
    "below, and nothing is sent.",
    "did-not-happen": "Recorded: the effect did not happen. The agent's next retry with this key sends "
    "the request again.",
}


class _Keyring:
    """The session keys, made at the first request: the key secret may have to come from the database."""

    keys: SessionKeys | None = None


KEYRING = web.AppKey("audit_keyring", _Keyring)
SIGN_INS = web.AppKey("audit_sign_ins", SignIns)
log = logging.getLogger("effect_gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application) -> None:
    app[KEYRING] = _Keyring()
    app[SIGN_INS] = SignIns()
    app.router.add_get(BASE, list_effects)
    app.router.add_get(BASE + "/style.css", stylesheet)
    app.router.add_post(BASE + "/sign-in", sign_in)
    app.router.add_post(BASE + "/sign-out", sign_out)
    app.router.add_get(BASE + "/{id}", show_effect)
    app.router.add_post(BASE + "/{id}/resolve", resolve_effect)


class PageError(Exception):
    """An error answered as an HTML page with this status."""

    def __init__(
        self, status: int, title: str, detail: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail
        self.headers = dict(headers or {})


def _html(text: str, status: int = 200, **headers: str) -> web.Response:
    return web.Response(
        text=text,
        status=status,
        content_type="text/html",
        charset="utf-8",
        headers={**SECURITY_HEADERS, **headers},
    )


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location, **SECURITY_HEADERS})


def _page(handler: Handler) -> Handler:
    """Errors on these routes are pages for a person, not problem+json."""

    async def page(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except PageError as exc:
            return _html(audit_page.error_page(exc.title, exc.detail, None), exc.status, **exc.headers)
        except problems.Problem as exc:
            return problems.closing_if_asked(
                _html(audit_page.error_page(exc.title, exc.detail, None), exc.status), exc
            )

    return page


# Fields in one of the audit's own forms: a verdict has eight; a thousand leaves room for any script.
_MOST_FIELDS = 1000
# Charsets a form may name (as codecs.lookup names them): the page sends UTF-8, a script may send Latin-1
# or ASCII. Not every codec Python has: UTF-7 decodes into lone surrogates, which no later step can
# encode, and the punycode decoder takes quadratic time (a megabyte held a worker for 12 s).
_CHARSETS = frozenset({"utf-8", "iso8859-1", "ascii"})
_UNREADABLE = "The form could not be read"


async def _form(request: web.Request) -> Mapping[str, str]:
    """The posted form with every field read as the text it was sent as, or a 400 page (a 408 page
    when the body does not arrive within request_body_timeout).

    Read here rather than by aiohttp, which reads an escape of bytes that are not text in the form's
    charset (``%FF`` in UTF-8) as U+FFFD: an operator's name, or the response body of a verdict, would
    be kept as other text than the one sent. Only urlencoded forms, as the page sends them: aiohttp's
    multipart reader takes any codec and transfer encoding a part names. A field given twice is refused
    too: which of two verdicts or bodies was meant, the form does not say.
    """
    raw = await read_request_body(request, _runtime(request).settings)
    if request.content_type != "application/x-www-form-urlencoded":
        if not raw:
            return MultiDict()
        raise PageError(400, _UNREADABLE, "The audit's forms are sent urlencoded, as its page sends them.")
    try:
        fields = urlencoded.text_fields(raw, _MOST_FIELDS, _charset(request))
    except FormRefused as exc:
        raise PageError(400, _UNREADABLE, _sentence(exc)) from None
    except UnicodeDecodeError:
        raise PageError(
            400, _UNREADABLE, "Its fields must be text in its charset (UTF-8 if none is named)."
        ) from None
    twice = _given_twice(name for name, _ in fields)
    if twice is not None:
        raise PageError(400, _UNREADABLE, f"The field {twice[:50]!r} is given more than once.")
    return MultiDict(fields)


def _charset(request: web.Request) -> str:
    """The charset the form names, if it is one of :data:`_CHARSETS`; UTF-8 if it names none."""
    try:
        charset = codecs.lookup(request.charset or "utf-8").name
    except LookupError:
        charset = ""
    if charset not in _CHARSETS:
        raise PageError(400, _UNREADABLE, "Its charset must be UTF-8 (or Latin-1, or ASCII).")
    return charset


def _given_twice(names: Iterable[str]) -> str | None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _sentence(exc: Exception) -> str:
    """An error's message as a sentence of its own."""
    why = str(exc)
    return f"{why[:1].upper()}{why[1:]}."


def _now() -> datetime:
    return datetime.now(UTC)


def _runtime(request: web.Request) -> Runtime:
    return request.app[RUNTIME]


async def _keys(request: web.Request) -> SessionKeys:
    keyring = request.app[KEYRING]
    if keyring.keys is None:
        runtime = _runtime(request)
        given = runtime.settings.key_secret
        secret = given.get_secret_value().encode() if given else await runtime.store.key_secret()
        keyring.keys = SessionKeys(secret)
    return keyring.keys


def _tokens(settings: Settings) -> dict[Principal, str]:
    """Every token a person may sign in with: each tenant's, and the admin's when there is one."""
    tokens = {Principal(name): t.token.get_secret_value() for name, t in settings.tenants.items()}
    for name, operator in settings.operators.items():
        # Whose effects they see is read from the configuration at each request (_scope_of).
        tokens[Principal(None, name)] = operator.token.get_secret_value()
    if settings.admin.token is not None:
        tokens[ADMIN] = settings.admin.token.get_secret_value()
    return tokens


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is looking: whose effects they read (None: all), how they got in, and their session."""

    scope: Scope
    who: str
    session: Session | None
    keys: SessionKeys
    operator: str | None = None  # a named operator's name, recorded with each verdict they give

    @property
    def may_resolve(self) -> bool:
        return self.scope is None or self.operator is not None

    @property
    def csrf(self) -> str:
        return self.keys.csrf(self.session)

    def chrome(self) -> Chrome:
        return Chrome(self.who, self.csrf, self.session is not None)


async def _viewer(request: web.Request) -> Viewer | None:
    """The caller by API token, by session cookie, or as the open gateway; None: they must sign in."""
    settings = _runtime(request).settings
    keys = await _keys(request)
    if is_admin(request, settings):
        if settings.admin.token is None:
            return Viewer(None, "open gateway: loopback only, no admin token", None, keys)
        return Viewer(None, "admin (bearer token)", None, keys)
    if (operator := operator_of(request, settings)) is not None:
        return Viewer(operator.scope, f"operator {operator.name} (bearer token)", None, keys, operator.name)
    if settings.tenants and "Effect-Gateway-Token" in request.headers:
        tenant = tenant_of(request, settings)
        return Viewer(frozenset({tenant}), f"tenant {tenant} (token)", None, keys)
    sent = _sessions_sent(request)
    # Two sessions: another page set one, and which is the operator's the request does not say.
    session = keys.read(sent[0], _tokens(settings), _now()) if len(sent) == 1 else None
    if session is None:
        return None
    who = f"{session.principal.label} · until {audit_page.utc(session.expires)}"
    return Viewer(_scope_of(session.principal, settings), who, session, keys, session.principal.operator)


def _scope_of(principal: Principal, settings: Settings) -> Scope:
    """Whose effects the one signed in sees: an operator's, as the configuration says now."""
    if principal.operator is not None:
        return settings.operators[principal.operator].scope
    return None if principal.tenant is None else frozenset({principal.tenant})


def _https(request: web.Request) -> bool:
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return forwarded == "https" or request.scheme == "https"


def _same_origin(request: web.Request) -> bool:
    """Whether a POST comes from a page of this origin (Origin, or Referer when a browser sent none)."""
    own = f"{'https' if _https(request) else 'http'}://{request.host}"
    origin = request.headers.get("Origin")
    if origin is not None:
        return origin == own
    referer = request.headers.get("Referer", "")
    return referer == own or referer.startswith(own + "/")


def _check_form(request: web.Request, viewer: Viewer, form: Mapping[str, object]) -> None:
    if not _same_origin(request):
        raise PageError(403, "Refused", "This form was sent from another site; use the audit page itself.")
    given = form.get("csrf")
    if not isinstance(given, str) or not viewer.keys.csrf_ok(viewer.session, given):
        raise PageError(
            403, "Refused", "The form's CSRF token is missing or out of date: reload the page and try again."
        )


def _sessions_sent(request: web.Request) -> list[str]:
    return sent_sessions(request.headers.getall("Cookie", ()))


def _forget_sessions(request: web.Request, resp: web.StreamResponse, keep: str | None = None) -> None:
    """Delete every copy of the session cookie this request could carry (but the one at ``keep``)."""
    for value in forgetting(request.rel_url.raw_path, request.host, secure=_https(request), keep=keep):
        resp.headers.add("Set-Cookie", value)


_TWO_SESSIONS = (
    "Your browser sent two audit sessions: a page on another port of this host set one (cookies are "
    "shared by every port of a host), and which one is yours cannot be told. Both are deleted; sign in "
    "again."
)


def _sign_in_page(request: web.Request, next_path: str, error: str | None = None) -> web.Response:
    two = len(_sessions_sent(request)) > 1
    resp = _html(
        audit_page.sign_in(next_path, error or (_TWO_SESSIONS if two else None)),
        401,
        **{"WWW-Authenticate": 'Bearer realm="effect-gateway"'},
    )
    if two:
        _forget_sessions(request, resp)
    return resp


def _safe_next(value: object) -> str:
    """Where to go after signing in: a page of the audit, never another site."""
    if not isinstance(value, str) or re.search(r"[\\\r\n]", value):
        return BASE
    return value if value == BASE or value.startswith((BASE + "/", BASE + "?")) else BASE


@_page
async def list_effects(request: web.Request) -> web.StreamResponse:
    viewer = await _viewer(request)
    if viewer is None:
        return _sign_in_page(request, request.path_qs)
    runtime = _runtime(request)
    # An HTML form sends every field; an empty one is no filter.
    query = {k: v.strip() for k, v in request.query.items() if v.strip()}
    error = None
    try:
        where = parse_filter(query)
        records = await scopes.find(runtime.store, where, viewer.scope)
        older = next_query(where, records[-1]) if len(records) == where.limit else None
    except problems.BadRequest as exc:
        error, records, older = exc.detail, [], None
    except CursorUnknown as exc:
        # Worded as the effects API words it; shown on this page rather than answered in JSON.
        error, records, older = replies.problem_of_error(exc).detail, [], None
    page = Listing(
        records=records,
        # Read now, not from the metrics' cache: an operator who has just resolved an effect comes back
        # to this page and must not see it still counted as needing review. The read is bounded (each
        # open state's count stops at the store's EXACT_OPEN_COUNT) and a person asks it, not a probe.
        counts=await scopes.counts(runtime.store.state_counts, viewer.scope) or {},
        query={k: v for k, v in query.items() if k != "before"},
        older=older,
        upstreams=sorted(runtime.policies),
        may_resolve=viewer.may_resolve,
        paged="before" in query,
        error=error,
    )
    return _html(audit_page.listing(page, viewer.chrome()), 400 if error else 200)


async def _load(request: web.Request, scope: Scope) -> EffectRecord:
    raw = request.match_info["id"]
    effect_id = whole_number(raw, 1, MAX_ID)
    store = _runtime(request).store
    record = await scopes.get(store, effect_id, scope) if effect_id is not None else None
    if record is None:
        raise PageError(404, "No such effect", f"There is no effect {raw} among those you may see.")
    return record


def _verdict(record: EffectRecord, viewer: Viewer, form: ResolveForm | None = None) -> Verdict:
    """Whether the record waits for an operator: the decision's own rule, asked, not repeated here."""
    refused = verdict_refused(record)
    blocked = None if refused is None else refused.reason
    return Verdict(viewer.may_resolve, blocked, viewer.csrf, form or ResolveForm())


@_page
async def show_effect(request: web.Request) -> web.StreamResponse:
    viewer = await _viewer(request)
    if viewer is None:
        return _sign_in_page(request, request.path_qs)
    record = await _load(request, viewer.scope)
    outcome = OUTCOMES.get(request.query.get("resolved", ""))
    message = ("ok", outcome) if outcome else None
    return _html(effect_page.effect(record, viewer.chrome(), _verdict(record, viewer), message))


def _entered(form: Mapping[str, object]) -> ResolveForm:
    def text(name: str, default: str = "") -> str:
        value = form.get(name, default)
        return value if isinstance(value, str) else default

    return ResolveForm(
        status=text("status", "200").strip(),
        headers=text("headers"),
        # Browsers send a textarea's line breaks as CRLF; the person typed plain line breaks.
        body=text("body").replace("\r\n", "\n"),
        kind="text" if text("kind") == "text" else "json",
        by=text("by").strip(),
    )


_NOT_IN_A_HEADER = re.compile("[\x00-\x08\x0a-\x1f\x7f\x85\u2028\u2029]")


def _response(entered: ResolveForm) -> StoredResponse:
    """The response to replay, from the "happened" form: checked as the JSON route checks it."""
    if whole_number(entered.status, 0, 999) is None:
        raise problems.BadRequest("The status must be a number from 200 to 599.")
    headers: list[list[str]] = []
    # Lines end at a line break only, and only spaces and tabs around a name or value are not part of
    # it (HTTP's whitespace). Other controls and line separators are refused: splitlines made two
    # headers of one at U+2028, and kept as typed they make a replay that HTTP clients refuse (h11).
    for line in entered.headers.replace("\r\n", "\n").split("\n"):
        if not line.strip(" \t"):
            continue
        if _NOT_IN_A_HEADER.search(line):
            raise problems.BadRequest(
                f"The header line {line!r} holds a control character or line separator."
            )
        name, colon, value = line.partition(":")
        if not colon or not _HEADER_NAME.match(name.strip(" \t")):
            raise problems.BadRequest(f"The header line {line!r} is not 'Name: value'.")
        headers.append([name.strip(" \t"), value.strip(" \t")])
    if entered.kind == "json":
        try:
            json.loads(entered.body)
        except ValueError as exc:
            raise problems.BadRequest(
                f"The body is not JSON ({exc}); choose text for any other body."
            ) from None
    if entered.body and not any(name.lower() == "content-type" for name, _ in headers):
        headers.append(
            ["Content-Type", "application/json" if entered.kind == "json" else "text/plain; charset=utf-8"]
        )
    doc = {
        "happened": True,
        "response": {"status": int(entered.status), "headers": headers, "body": entered.body},
    }
    _, response = parse_resolution(doc)
    assert response is not None, "happened: true always has a response"
    return response


@_page
async def resolve_effect(request: web.Request) -> web.StreamResponse:
    """An operator's verdict from the page, carried out by :func:`gateway.operators.resolve`."""
    viewer = await _viewer(request)
    if viewer is None:
        ended = None if len(_sessions_sent(request)) > 1 else "Your session ended: sign in again."
        return _sign_in_page(request, BASE + "/" + request.match_info["id"], ended)
    form = await _form(request)
    _check_form(request, viewer, form)
    if not viewer.may_resolve:
        raise PageError(
            403,
            "Only an operator resolves",
            "A tenant reads its effects; an operator's token or the admin token resolves them.",
        )
    record = await _load(request, viewer.scope)
    happened = form.get("happened")
    if happened not in ("yes", "no"):
        raise PageError(400, "Which verdict?", "Say whether the effect happened (yes) or not (no).")
    entered = _entered(form)
    response = None
    try:
        try:
            operators.check_name(_recorded_as(viewer, entered.by))
        except BadName as exc:
            raise problems.BadRequest(_sentence(exc)) from None
        if happened == "yes":
            response = _response(entered)
    except problems.BadRequest as exc:
        again = _verdict(record, viewer, replace(entered, error=exc.detail))
        return _html(effect_page.effect(record, viewer.chrome(), again), 400)
    by = _recorded_as(viewer, entered.by)
    runtime = _runtime(request)
    try:
        resolved = await operators.resolve(
            runtime.store,
            record.id,
            attempt=_judged_attempt(form),
            happened=happened == "yes",
            response=response,
            by=by,
        )
    except NoSuchEffect:
        raise PageError(404, "No such effect", f"There is no effect {record.id}.") from None
    except NotAwaitingOperator as exc:
        fresh = await _load(request, None)
        message = ("error", f"Not resolved: {exc}.")
        return _html(effect_page.effect(fresh, viewer.chrome(), _verdict(fresh, viewer), message), 409)
    verdict_given(runtime, resolved, happened == "yes", by)
    return _redirect(f"{BASE}/{record.id}?resolved={'happened' if happened == 'yes' else 'did-not-happen'}")


def _recorded_as(viewer: Viewer, typed: str | None) -> str:
    """Who a verdict from the page is recorded as (gateway.operators.recorded_as)."""
    return operators.recorded_as(viewer.operator, typed, "admin, on the audit page")


def _judged_attempt(form: Mapping[str, object]) -> int:
    """The attempt the page showed when the verdict was given (a hidden field of the form)."""
    value = form.get("attempt")
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 9:
        raise PageError(
            400, "Which attempt?", "The form lost the attempt it was judged on; open the effect again."
        )
    return int(value)


@_page
async def sign_in(request: web.Request) -> web.StreamResponse:
    form = await _form(request)
    if not _same_origin(request):
        raise PageError(403, "Refused", "This sign-in was sent from another site; use the audit page itself.")
    next_path = _safe_next(form.get("next"))
    settings = _runtime(request).settings
    if is_admin(request, settings) and settings.admin.token is None:
        return _redirect(next_path)  # the open gateway: nothing to sign in to
    # The connection's peer: behind a reverse proxy, the proxy's, which every sign-in through it shares.
    address, sign_ins, now = request.remote or "(unknown)", request.app[SIGN_INS], time.monotonic()
    if (left := sign_ins.wait(address, now)) > 0:
        # Not logged: the failure that began the wait was, and a line per refusal would let anyone fill
        # the log at the rate they can send.
        raise PageError(
            429,
            "Too many failed sign-ins",
            f"Too many tokens that did not work came from this address: try again in {math.ceil(left)} s.",
            {"Retry-After": str(math.ceil(left))},
        )
    token = form.get("token")
    token = token.strip() if isinstance(token, str) else ""
    principal = holder(token, _tokens(settings)) if token else None
    if principal is None:
        count, waits = sign_ins.failed(address, now)
        log.warning(
            "a sign-in to the audit page from %s failed (%d in a row)%s",
            address,
            count,
            f"; it may try again in {waits:g} s" if waits else "",
        )
        return _sign_in_page(
            request, next_path, "That token is not the admin token, an operator's, or a tenant's."
        )
    cookie, _ = (await _keys(request)).issue(principal, token, _now())
    resp = _redirect(next_path)
    # Any copy at another path (set by a page on another port) would be sent beside the new one.
    _forget_sessions(request, resp, keep=BASE)
    resp.set_cookie(
        COOKIE,
        cookie,
        max_age=int(LIFETIME.total_seconds()),
        path=BASE,
        httponly=True,
        samesite="Strict",
        secure=_https(request),
    )
    return resp


@_page
async def sign_out(request: web.Request) -> web.StreamResponse:
    viewer = await _viewer(request)
    form = await _form(request)
    if viewer is not None and viewer.session is not None:
        _check_form(request, viewer, form)
    resp = _redirect(BASE)
    _forget_sessions(request, resp)
    return resp


async def stylesheet(request: web.Request) -> web.Response:
    return web.Response(
        text=audit_page.STYLESHEET,
        content_type="text/css",
        charset="utf-8",
        headers={"Cache-Control": "max-age=3600", "X-Content-Type-Options": "nosniff"},
    )
