"""The httpx integration: every unsafe request made inside a step carries the step's key.

``Idempotency-Key`` is set to ``{run_id}:{step}`` (``{run_id}:{step}:{n}`` for the n-th distinct call of
a step), replacing any random key an SDK invented, so the SDK's own retries and the agent's re-run share
one key. ``Effect-Gateway-Run`` and ``Effect-Gateway-Step`` go along for the gateway's audit.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import httpx

from journal.journal import current_step

UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def step_headers(method: str, url: str, body: bytes = b"") -> dict[str, str]:
    """The headers that give a call made inside a step the step's key; none outside a step or for reads.

    For HTTP clients other than httpx (a stripe-python HTTP client, aiohttp): set these on the request
    after the SDK has set its own, so they replace any key it made up. ``method``, ``url`` and ``body``
    tell a step's distinct calls apart, so an SDK's retry of one call gets that call's key again.
    """
    ctx = current_step()
    if ctx is None or method.upper() not in UNSAFE:
        return {}
    digest = hashlib.sha256()
    digest.update(method.upper().encode())
    digest.update(b"\0" + url.encode() + b"\0")
    digest.update(body)
    return {
        "Idempotency-Key": ctx.key_for(digest.digest()),
        "Effect-Gateway-Run": ctx.run_id,
        "Effect-Gateway-Step": str(ctx.step),
    }


def stamp(request: httpx.Request) -> None:
    """Give ``request`` the current step's key, if it is unsafe and made inside a step."""
    body = b""
    # A streamed body is not read here: the method and URL tell the calls of a step apart.
    with contextlib.suppress(httpx.RequestNotRead):
        body = request.content
    request.headers.update(step_headers(request.method, str(request.url), body))


class KeyedTransport(httpx.AsyncBaseTransport):
    """Wraps a transport so that every request through it is stamped, whoever built the request."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        stamp(request)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


class KeyedSyncTransport(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport | None = None) -> None:
        self._inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        stamp(request)
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


def keyed_client(*, transport: httpx.AsyncBaseTransport | None = None, **kwargs: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose unsafe requests inside a step carry the step's key."""
    return httpx.AsyncClient(transport=KeyedTransport(transport), **kwargs)
