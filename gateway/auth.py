"""Who the caller is: the tenant an agent's token names, and whether a request carries the admin token.

Tokens are compared in constant time, every tenant's each time, so the time taken says nothing about
which token is close.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from gateway import problems
from gateway.settings import Settings


def _same_secret(given: str, secret: str) -> bool:
    # Bytes that are not UTF-8 arrive as lone surrogates; surrogateescape turns them back, never raises.
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), secret.encode())


def tenant_of(request: web.Request, settings: Settings) -> str:
    """Return the tenant whose token the request carries ("default" on a gateway without tenants)."""
    if not settings.tenants:
        return "default"
    token = request.headers.get("Effect-Gateway-Token", "")
    found = None
    for name, tenant in settings.tenants.items():
        # compare_digest on every tenant: the time taken says nothing about which token is close.
        if _same_secret(token, tenant.token.get_secret_value()):
            found = name
    if found is None:
        raise problems.TokenRequired("send this tenant's token in the Effect-Gateway-Token header")
    return found


def is_admin(request: web.Request, settings: Settings) -> bool:
    """Say whether the request may use the admin surface: it carries the admin token as a Bearer."""
    token = settings.admin.token
    if token is None:
        # No admin token: only a single-tenant gateway, whose admin listener is on loopback alone, is open.
        return settings.admin_open
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    # RFC 6750: "Bearer" (any case) and the token; a bare token is refused, so it never works by accident.
    return scheme.lower() == "bearer" and _same_secret(given.strip(), token.get_secret_value())
