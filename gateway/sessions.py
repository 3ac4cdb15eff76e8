"""Sign-in sessions for the audit page: a signed cookie that every gateway process accepts, and CSRF tokens.

A browser cannot send ``Authorization: Bearer``, so a person signs in once with the admin token or a
tenant's token and holds a cookie instead. The cookie is stateless (no table, no shared memory): its
claims are signed with a key derived from the gateway's key secret, which every worker process and every
gateway on the same database share. It carries a keyed fingerprint of the token it was signed in with,
so changing that token in the configuration ends its sessions, and changing the key secret ends all.

No I/O and no aiohttp here: the routes (:mod:`gateway.audit_routes`) pass the cookie, the tokens and
the time in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

COOKIE = "effect_gateway_audit"
# A working shift: a person signs in once a day, and a cookie copied off a laptop stops working the same
# day. A stateless cookie cannot be revoked one by one (sign-out only deletes the browser's copy), so
# its lifetime is the bound on how long a stolen one is good for; rotating the token ends it at once.
LIFETIME = timedelta(hours=8)
# The label that makes the session key a key of its own: HMAC(key secret, label). Derived keys for
# upstreams use the key secret differently, so neither key says anything about the other.
_LABEL = b"effect-gateway/audit-session/v1"
# 128 bits: a session id nobody guesses, and a MAC nobody forges, in 22 characters each.
_ID_BYTES = 16
_MAC_BYTES = 16


@dataclass(frozen=True, slots=True)
class Principal:
    """Who signed in: the admin (neither), one tenant (read only), or a named operator (who resolves,
    among the tenants the configuration gives them, or every tenant's)."""

    tenant: str | None
    operator: str | None = None

    @property
    def label(self) -> str:
        if self.operator is not None:
            return f"operator {self.operator}"
        return "admin" if self.tenant is None else f"tenant {self.tenant}"

    def _claim(self) -> str:
        if self.operator is not None:
            return "operator:" + self.operator
        return "admin" if self.tenant is None else "tenant:" + self.tenant


ADMIN = Principal(None)


@dataclass(frozen=True, slots=True)
class Session:
    principal: Principal
    # Random per sign-in; the CSRF token is bound to it.
    id: str
    expires: datetime


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sent_sessions(cookie_headers: Iterable[str]) -> list[str]:
    """Every value the browser sent under :data:`COOKIE` in these Cookie headers, in the order sent.

    Read here rather than by aiohttp, which keeps the last value of a name. Cookies ignore ports: a page
    on another port of this host (an upstream's page on the agents' listener, any local web app) can set
    a cookie of this name for ``Path=/``, and the browser sends it after the operator's own. More than
    one value means someone else set one, and which is the operator's the request does not say.
    """
    values = []
    for header in cookie_headers:
        for pair in header.split(";"):
            name, equals, value = pair.partition("=")
            if equals and name.strip(" \t") == COOKIE:
                values.append(value.strip(" \t"))
    return values


# What a path or a host may hold to be written into a Set-Cookie header as it is.
_COOKIE_PATH = re.compile(r"/[A-Za-z0-9/_.~%-]*")
_HOST_NAME = re.compile(r"[a-z0-9-]+(\.[a-z0-9-]+)+")
_EXPIRED = "Max-Age=0; Expires=Thu, 01 Jan 1970 00:00:00 GMT"


def _paths(path: str) -> list[str]:
    """Every cookie path that a browser sends with a request for ``path`` (RFC 6265, section 5.1.4):
    each leading part that ends before or at a slash, and the path itself."""
    found = ["/"]
    for at, char in enumerate(path):
        if char == "/" and at > 0:
            found += [path[:at], path[: at + 1]]
    found.append(path)
    return [p for p in dict.fromkeys(found) if _COOKIE_PATH.fullmatch(p)]


def _domains(host: str) -> list[str]:
    """The domains whose cookies a browser sends to ``host`` (``name:port``): the name and each one above
    it, of two labels at least. None for an address, whose cookies are the host's own only."""
    name = host.rpartition(":")[0] if host.rpartition(":")[2].isdigit() else host
    name = name.lower()
    try:
        ipaddress.ip_address(name.strip("[]"))
        return []
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(name):
        return []
    labels = name.split(".")
    return [".".join(labels[at:]) for at in range(len(labels) - 1)]


def forgetting(path: str, host: str, *, secure: bool, keep: str | None = None) -> list[str]:
    """Set-Cookie values that delete every copy of the session cookie a browser could send with a
    request for ``path`` on ``host``: at each path that matches it, for the host alone and for each
    domain above it. ``keep``: the path whose host-only copy is left alone (the one signing in sets).

    The browser deletes only a cookie whose name, domain and path all match, and the request names none
    of them, so each is named. One set by a page from a domain this host is not under cannot reach it.
    """
    flags = "; HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")
    domains = [""] + [f"; Domain={domain}" for domain in _domains(host)]
    return [
        f"{COOKIE}=; {_EXPIRED}; Path={each}{domain}{flags}"
        for each in _paths(path)
        for domain in domains
        if not (each == keep and not domain)
    ]


def holder(token: str, tokens: Mapping[Principal, str]) -> Principal | None:
    """Whose token this is, among the admin's, the operators' and the tenants' (``tokens``), or None."""
    found = None
    for principal, known in tokens.items():
        # compare_digest against every token: the time taken says nothing about which one is close.
        if hmac.compare_digest(token.encode(), known.encode()):
            found = principal
    return found


class SessionKeys:
    """Issues and checks session cookies and CSRF tokens with a key derived from the key secret."""

    def __init__(self, key_secret: bytes) -> None:
        self._key = hmac.new(key_secret, _LABEL, hashlib.sha256).digest()

    def _mac(self, purpose: str, text: str) -> str:
        digest = hmac.new(self._key, f"{purpose}\0{text}".encode(), hashlib.sha256).digest()
        return _b64(digest[:_MAC_BYTES])

    def fingerprint(self, token: str) -> str:
        """Names the token without revealing it: a copied cookie does not help guess the token."""
        return self._mac("token", token)

    def issue(self, principal: Principal, token: str, now: datetime) -> tuple[str, Session]:
        """A cookie value for ``principal``, who signed in with ``token``, good for :data:`LIFETIME`."""
        session = Session(principal, _b64(secrets.token_bytes(_ID_BYTES)), now + LIFETIME)
        claims = "|".join(
            (principal._claim(), str(int(session.expires.timestamp())), session.id, self.fingerprint(token))
        )
        return f"{_b64(claims.encode())}.{self._mac('session', claims)}", session

    def read(self, cookie: str | None, tokens: Mapping[Principal, str], now: datetime) -> Session | None:
        """The session in ``cookie`` if it is signed by us, unexpired, and its token is still configured."""
        if not cookie:
            return None
        encoded, _, mac = cookie.partition(".")
        try:
            claims = _unb64(encoded).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        # compare_digest takes text of ASCII only: a cookie of other text is no session.
        if not mac.isascii() or not hmac.compare_digest(mac, self._mac("session", claims)):
            return None
        who, expires, session_id, fingerprint = claims.split("|")
        # Whoever the configuration says holds that claim now (an operator's tenant may have changed).
        principal = next((p for p in tokens if p._claim() == who), None)
        until = datetime.fromtimestamp(int(expires), UTC)
        if principal is None or now >= until:
            return None
        token = tokens[principal]
        # The token was rotated or removed: every session signed in with the old one ends.
        if not hmac.compare_digest(fingerprint, self.fingerprint(token)):
            return None
        return Session(principal, session_id, until)

    def csrf(self, session: Session | None) -> str:
        """The token a form carries; bound to the session (or, without one, to this gateway's key)."""
        return self._mac("csrf", session.id if session else "")

    def csrf_ok(self, session: Session | None, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.csrf(session).encode())
