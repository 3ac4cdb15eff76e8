"""aiohttp wiring, kept thin: HTTP in, :class:`gateway.service.Inbound` to the service, HTTP out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gateway import admin, audit_routes, problems
from gateway.errors import StoreRejected, StoreUnavailable
from gateway.keys import KeySyntaxError, parse_key
from gateway.policy import upstream_policies
from gateway.probes import Prober
from gateway.record import StoredResponse
from gateway.runtime import RUNTIME, Runtime, tenant_of
from gateway.schema import migrate
from gateway.service import EffectService, Inbound, Reply
from gateway.settings import Settings
from gateway.store import Store, StoreLimits
from gateway.upstream import UpstreamClient

log = logging.getLogger("effect_gateway")

# The audit's run and step columns; as long as a key, so any journal's ids fit.
MAX_LABEL = 255
# An encoded slash, backslash, dot or NUL lets a path mean one thing to us and another upstream.
_ENCODED_TRICKS = re.compile(r"%(2f|5c|2e|00)", re.IGNORECASE)
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d+)", re.IGNORECASE)


DSN = web.AppKey("dsn", str)


def make_app(settings: Settings, dsn: str) -> web.Application:
    """The gateway as an aiohttp application; ``dsn`` is the Postgres to use (already running)."""
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[problem_middleware])
    app[DSN] = dsn
    app.cleanup_ctx.append(_runtime(settings))
    admin.add_routes(app)
    audit_routes.add_routes(app)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


def _runtime(settings: Settings) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        await migrate(app[DSN])
        store = await Store.connect(app[DSN], max_size=settings.pool_size, limits=store_limits(settings))
        client = UpstreamClient(settings.max_response_bytes)
        prober = Prober(client.session)
        policies = upstream_policies(settings)
        for policy in policies.values():
            prober.check(policy)
        secret = settings.key_secret.get_secret_value().encode() if settings.key_secret else None
        service = EffectService(
            store,
            client,
            prober,
            secret or await store.key_secret(),
            retention=settings.retention,
            replay_cache_bytes=settings.replay_cache_bytes,
        )
        app[RUNTIME] = Runtime(settings, policies, store, service)
        purger = asyncio.create_task(_maintain_periodically(store, settings))
        try:
            yield
        finally:
            purger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await purger
            # Calls under way finish and record before the store closes (bounded by the longest lease).
            longest = max((p.lease.total_seconds() for p in policies.values()), default=0.0)
            await service.drain(timeout=longest)
            await client.close()
            await store.close()

    return ctx


async def _maintain_periodically(store: Store, settings: Settings) -> None:
    """Partitions made ahead, and days of bodies past the retention dropped, every purge_interval."""
    while True:
        try:
            await store.maintain(settings.retention, progress=log.info)
        except StoreUnavailable as exc:
            log.warning("retention skipped: %s", exc)
        except Exception:  # a periodic job must outlive any one failure; the next round tries again
            log.exception("retention failed")
        await asyncio.sleep(settings.purge_interval.total_seconds())


def store_limits(settings: Settings) -> StoreLimits:
    return StoreLimits(
        acquire=settings.pool_timeout, statement=settings.statement_timeout, lock=settings.lock_timeout
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def problem_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where errors become problem+json."""
    try:
        return await handler(request)
    except problems.Problem as problem:
        return problems.render(problem, instance=request.path_qs if request.path_qs.isascii() else None)
    except web.HTTPRequestEntityTooLarge as exc:
        return problems.render(problems.BodyTooLarge(exc.text or "the request body is too large"))
    except web.HTTPMethodNotAllowed:
        return problems.render(
            problems.MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
        )
    except web.HTTPNotFound:
        return problems.render(problems.NotFound(f"nothing at {request.path}"))
    except StoreUnavailable as exc:
        # Raised before anything was sent: a failure after sending is answered by the service itself.
        log.error("store unavailable: %s", exc)
        return problems.render(problems.StoreDown(f"{exc}; nothing was sent", headers={"Retry-After": "1"}))
    except StoreRejected as exc:
        log.error("store refused a request before anything was sent: %s", exc)
        return problems.render(
            problems.Problem(f"the request could not be recorded ({exc}); nothing was sent")
        )
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return problems.render(problems.Problem("the gateway failed unexpectedly; see its log"))


def split_target(raw_path: str) -> tuple[str, str, str]:
    """(upstream, path, query) from the raw request target; refuses anything that could escape."""
    path, _, query = raw_path.partition("?")
    if not path.startswith("/") or path.startswith("//") or "://" in path:
        raise problems.PathRefused("absolute URLs are not accepted; send /<upstream>/<path>")
    if "\\" in path or _ENCODED_TRICKS.search(path):
        raise problems.PathRefused("encoded slashes, backslashes, dots and NULs are refused in paths")
    upstream, _, rest = path[1:].partition("/")
    rest = "/" + rest
    if any(segment in (".", "..") for segment in rest.split("/")):
        raise problems.PathRefused("'.' and '..' are refused in paths")
    return upstream, rest, query


def _check_headers(request: web.Request) -> None:
    for name, value in request.headers.items():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise problems.BadRequest(f"header {name} is not valid UTF-8") from None


def _label(request: web.Request, header: str) -> str | None:
    value = request.headers.get(header)
    if value is not None and len(value) > MAX_LABEL:
        raise problems.BadRequest(f"{header} is longer than {MAX_LABEL} characters")
    return value


def _wait(request: web.Request, settings: Settings) -> float:
    match = _PREFER_WAIT.search(request.headers.get("Prefer", ""))
    if not match:
        return 0.0
    return min(float(match.group(1)), settings.max_wait.total_seconds())


async def proxy(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    upstream_name, path, query = split_target(request.raw_path)
    policy = runtime.policies.get(upstream_name)
    if policy is None:
        raise problems.UnknownUpstream(f"no upstream named {upstream_name!r} is configured")
    tenant = tenant_of(request, runtime.settings)
    _check_headers(request)
    raw_key = request.headers.get("Idempotency-Key")
    key = None
    if raw_key is not None:
        try:
            key = parse_key(raw_key)
        except KeySyntaxError as exc:
            raise problems.KeyMalformed(str(exc)) from None
    body = await request.read()
    reply = await runtime.service.handle(
        Inbound(
            tenant=tenant,
            upstream=policy,
            method=request.method,
            path=path,
            query=query,
            headers=request.headers,
            body=body,
            key=key,
            wait=_wait(request, runtime.settings),
            run_id=_label(request, "Effect-Gateway-Run"),
            step=_label(request, "Effect-Gateway-Step"),
        )
    )
    return to_response(reply)


def to_response(reply: Reply) -> web.Response:
    return response_of(reply.response, replayed=reply.replayed)


def response_of(stored: StoredResponse, *, replayed: bool) -> web.Response:
    resp = web.Response(status=stored.status, body=stored.body)
    # Stored headers replace aiohttp's defaults (Content-Type, Date, Server) so a replay is identical.
    resp.headers.clear()
    for name, value in stored.headers:
        resp.headers.add(name, value)
    if replayed:
        resp.headers["Idempotent-Replayed"] = "true"
    return resp
