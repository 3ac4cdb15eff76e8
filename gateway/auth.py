"""Who the caller is: the tenant an agent's token names, the admin token, or a named operator's.

Tokens are compared in constant time, every tenant's each time, so the time taken says nothing about
which token is close.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass

from aiohttp import web

from gateway import problems
from gateway.settings import Settings

log = logging.getLogger("effect_gateway")


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


@dataclass(frozen=True, slots=True)
class Operator:
    """A person signed in by their own token: every verdict they give records their name."""

    name: str
    scope: frozenset[str] | None  # the tenants whose effects they see and resolve; None: every tenant's


def _bearer(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (RFC 6750: the scheme in any case), or None."""
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    # A bare token is refused, so it never works by accident.
    return given.strip() if scheme.lower() == "bearer" else None


def operator_of(request: web.Request, settings: Settings) -> Operator | None:
    """The named operator whose token the request carries as a Bearer, or whom a trusted proxy names
    in ``admin.operator_header``; None."""
    given = _bearer(request)
    found = None
    for name, operator in settings.operators.items():
        # compare_digest with every operator's: the time taken says nothing about which token is close.
        if given is not None and _same_secret(given, operator.token.get_secret_value()):
            found = Operator(name, operator.scope)
    return found or _named_by_proxy(request, settings)


def _named_by_proxy(request: web.Request, settings: Settings) -> Operator | None:
    """The operator a trusted reverse proxy names (admin.operator_header), if configured under that
    name; the header from any other address is ignored."""
    header = settings.admin.operator_header
    if header is None or header not in request.headers or not _from_trusted_proxy(request, settings):
        return None
    named = request.headers.getall(header)
    if len(named) != 1:
        # A proxy that adds its header beside the client's own would pass on the client's first.
        log.warning("the proxy's %s came %d times: believed in none", header, len(named))
        return None
    name = named[0].strip()
    operator = settings.operators.get(name)
    if operator is None:
        log.warning("the proxy named %r, who is no operator configured under [operators]", name[:64])
        return None
    return Operator(name, operator.scope)


def _from_trusted_proxy(request: web.Request, settings: Settings) -> bool:
    try:
        peer = ipaddress.ip_address(request.remote or "")
    except ValueError:  # a Unix socket, or no peer
        return False
    return any(peer in ipaddress.ip_network(net, strict=False) for net in settings.admin.trusted_proxies)


def is_admin(request: web.Request, settings: Settings) -> bool:
    """Say whether the request may use the admin surface: it carries the admin token as a Bearer."""
    token = settings.admin.token
    if token is None:
        # No admin token: only a single-tenant gateway, whose admin listener is on loopback alone, is open.
        return settings.admin_open
    given = _bearer(request)
    return given is not None and _same_secret(given, token.get_secret_value())
