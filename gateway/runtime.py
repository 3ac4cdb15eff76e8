"""What the aiohttp handlers share: the running gateway's parts, and who the caller is."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from aiohttp import web

from gateway import problems
from gateway.policy import UpstreamPolicy
from gateway.service import EffectService
from gateway.settings import Settings
from gateway.store import Store


@dataclass(frozen=True, slots=True)
class Runtime:
    settings: Settings
    policies: dict[str, UpstreamPolicy]
    store: Store
    service: EffectService


RUNTIME = web.AppKey("runtime", Runtime)


def tenant_of(request: web.Request, settings: Settings) -> str:
    if not settings.tenants:
        return "default"
    token = request.headers.get("Effect-Gateway-Token", "")
    found = None
    for name, tenant in settings.tenants.items():
        # compare_digest on every tenant: the time taken says nothing about which token is close.
        if hmac.compare_digest(token.encode(), tenant.token.get_secret_value().encode()):
            found = name
    if found is None:
        raise problems.TokenRequired("send this tenant's token in the Effect-Gateway-Token header")
    return found


def is_admin(request: web.Request, settings: Settings) -> bool:
    token = settings.admin.token
    if token is None:
        # No admin token: only a single-tenant gateway, which listens on loopback alone, is open.
        return not settings.tenants
    given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(given.encode(), token.get_secret_value().encode())
