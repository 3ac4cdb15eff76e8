"""SIGHUP reloads the configuration: tokens and upstream timeouts change, anything unsafe is refused."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from agent_example.processes import Service
from gateway import reload
from gateway.errors import ConfigError
from gateway.policy import upstream_policies
from gateway.sessions import COOKIE
from gateway.settings import Settings, load_settings
from tests.database import runtime_url
from tests.gateways import children, decisions, gateway_server, start_gateway_process
from tests.support import PORT_ZERO
from tests.upstreams import Upstream


def _settings(**changes: Any) -> Settings:
    """A gateway with a tenant, an operator, an admin token and two upstreams, with ``changes`` over it."""
    given: dict[str, Any] = {
        "tenants": {"grocer": {"token": "grocer-1"}, "baker": {"token": "baker-1"}},
        "operators": {"ana": {"token": "ana-1"}},
        "admin": {"token": "admin-1"},
        "upstreams": {
            "shop": {"base_url": "http://127.0.0.1:9001", "timeout": "10s"},
            "pay": {
                "base_url": "http://127.0.0.1:9003",
                "native_key": {"ttl": "24h"},
                "inject_headers": {"Authorization": "Bearer sk-1"},
            },
        },
    }
    for path, value in changes.items():
        *parents, last = path.split("__")
        section = given
        for name in parents:
            section = section.setdefault(name, {})
        if value is None:
            section.pop(last)
        else:
            section[last] = value
    return load_settings(None, **given)


# --- what may change, and what is refused: the pure comparison ----------------------------------------

APPLIED = [
    ({"tenants__grocer__token": "grocer-2"}, ["tenants.grocer.token"]),
    ({"tenants__miller": {"token": "miller-1"}}, ["tenants.miller.token (added)"]),
    ({"tenants__baker": None}, ["tenants.baker.token (removed)"]),
    ({"admin__token": "admin-2"}, ["admin.token"]),
    ({"operators__ana__token": "ana-2"}, ["operators.ana.token"]),
    ({"operators__ana__tenant": "grocer"}, ["operators.ana.tenant (None -> 'grocer')"]),
    ({"upstreams__shop__timeout": "2s"}, ["upstreams.shop.timeout (10s -> 2s)"]),
    (
        {"upstreams__pay__inject_headers": {"Authorization": "Bearer sk-2"}},
        ["upstreams.pay.inject_headers.Authorization"],
    ),
    ({}, []),
]


@pytest.mark.parametrize(("changes", "described"), APPLIED)
def test_who_may_call_and_upstream_timeouts_are_applied(
    changes: dict[str, Any], described: list[str]
) -> None:
    """Tokens, tenants and operators coming and going, an upstream's timeout and its injected credentials
    are applied, each named in the log line without its secret value."""
    compared = reload.compare(_settings(), _settings(**changes))
    assert compared.refused == ()
    assert [change.describe() for change in compared.applied] == described
    line = reload.applied_line(compared)
    assert not any(secret in line for secret in ("grocer-2", "miller-1", "admin-2", "ana-2", "sk-2"))


REFUSED = [
    ({"listen": "127.0.0.1:9999"}, "listen", "sockets are bound at start"),
    ({"workers": 4}, "workers", "worker processes"),
    ({"database_url": "postgresql://u@db/x"}, "database_url", "connections to Postgres"),
    ({"lease_grace": "30s"}, "lease_grace", "sent again"),
    ({"retention": "1d"}, "retention", "sent again"),
    ({"upstreams__pay__native_key": {"ttl": "12h"}}, "upstreams.pay.native_key.ttl", "sent again"),
    ({"upstreams__pay__native_key": None}, "upstreams.pay.native_key", "sent again"),
    ({"upstreams__shop__base_url": "http://127.0.0.1:9009"}, "upstreams.shop.base_url", "sent again"),
    ({"upstreams__shop__repeat_harmless": True}, "upstreams.shop.repeat_harmless", "sent again"),
    ({"upstreams__shop__connect_timeout": "1s"}, "upstreams.shop.connect_timeout", "connection pool"),
    (
        {"upstreams__pay__inject_headers": {"X-Key": "k"}},
        "upstreams.pay.inject_headers.Authorization",
        "never stored",
    ),
    ({"upstreams__mail": {"base_url": "http://127.0.0.1:9002"}}, "upstreams.mail.base_url", "sent again"),
    ({"tenants": {}, "operators": {}, "admin": {}}, "tenants", "agents present a token"),
    ({"log_format": "text"}, "log_format", "restart to change it"),
]


@pytest.mark.parametrize(("changes", "setting", "why"), REFUSED)
def test_what_decides_a_resend_or_is_bound_at_start_is_refused(
    changes: dict[str, Any], setting: str, why: str
) -> None:
    """A change to what decides whether an effect may be sent again, or to what is bound at start, is
    refused by name with its reason, and then nothing else of the file is applied either."""
    compared = reload.compare(_settings(), _settings(tenants__grocer__token="grocer-2", **changes))
    assert compared.applied == ()
    refused = {refusal.setting: refusal.reason for refusal in compared.refused}
    assert setting in refused, compared.refused
    assert why in refused[setting]
    line = reload.refused_line(compared.refused)
    assert line.startswith("configuration not reloaded, going on with the one running: ")
    assert f"{setting} changed, but " in line


def test_opening_the_admin_listener_to_anyone_is_refused() -> None:
    """Removing the last token of a single-tenant gateway's admin is refused: its listener chose at start
    to ask operators for a token."""
    alone = load_settings(None, admin={"token": "admin-1"})
    compared = reload.compare(alone, load_settings(None))
    assert [refusal.setting for refusal in compared.refused] == ["admin.token"]


def test_a_file_that_does_not_validate_is_refused_in_one_line() -> None:
    """A configuration read again that does not validate is refused with the line start-up would give."""

    def bad() -> Settings:
        raise ConfigError("bad setting upstreams.shop.timeout: 'soon' is not a duration")

    verdict = reload.read_again(_settings(), bad)
    assert verdict.settings is None
    assert verdict.line == (
        "configuration not reloaded, going on with the one running: bad setting upstreams.shop.timeout: "
        "'soon' is not a duration"
    )


# --- a real gateway, signalled ------------------------------------------------------------------------

# Long enough to outlast the shortened timeout many times over, short enough for a test.
SLOW = 1.5


def _write(config: Path, dsn: str, upstream: Upstream, *, workers: int, **extra: str) -> None:
    settings = {
        "database_url": f'"{runtime_url(dsn)}"',
        "workers": str(workers),
        "timeout": '"10s"',
        "token": '"grocer-1"',
        "ttl": '"24h"',
        **extra,
    }
    listen = (
        f'listen = {settings["listen"]}\nadmin_listen = "127.0.0.1:0"\n'
        if "listen" in settings
        else PORT_ZERO
    )
    config.write_text(
        f"database_url = {settings['database_url']}\n{listen}workers = {settings['workers']}\n"
        f"[tenants.grocer]\ntoken = {settings['token']}\n"
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\ntimeout = {settings["timeout"]}\n'
        f"native_key = {{ ttl = {settings['ttl']} }}\n"
    )


def _serve_slowly(upstream: Upstream) -> None:
    async def slow(_request: web.Request) -> web.Response:
        await asyncio.sleep(SLOW)
        return web.json_response({"slow": True})

    upstream.routes["/slow"] = slow


async def _get(url: str, path: str, token: str) -> int:
    # A connection of its own each time: the kernel hands each new connection to one of the workers.
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http,
        http.get(f"{url}/shop{path}", headers={"Effect-Gateway-Token": token}) as resp,
    ):
        await resp.read()
        return resp.status


def _log(gateway: Service) -> list[dict[str, Any]]:
    assert gateway.stderr is not None
    return [json.loads(line) for line in list(gateway.stderr.lines) if line.startswith("{")]


async def _said(gateway: Service, start: str, count: int) -> list[dict[str, Any]]:
    """The lines of the log whose message starts with ``start``, once there are ``count`` of them."""
    for _ in range(100):
        said = [doc for doc in _log(gateway) if doc["message"].startswith(start)]
        if len(said) >= count:
            return said
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {count} lines {start!r}: {[d['message'] for d in _log(gateway)]}")


async def test_a_new_token_is_taken_by_every_worker_on_sighup(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """A tenant's token changed in the file and SIGHUP sent: every worker refuses the old token and
    accepts the new one, each says once that it reloaded, and no line shows either token."""
    config = tmp_path / "gateway.toml"
    _write(config, dsn, upstream, workers=2)
    gateway = start_gateway_process(config)
    try:
        workers = children(gateway.proc.pid)
        assert len(workers) == 2
        assert await _get(gateway.url, "/before", "grocer-1") == 201
        _write(config, dsn, upstream, workers=2, token='"grocer-2"')
        os.kill(gateway.proc.pid, signal.SIGHUP)
        reloaded = await _said(gateway, "configuration reloaded", 2)
        assert {doc["pid"] for doc in reloaded} == workers
        assert all(doc["message"] == "configuration reloaded: tenants.grocer.token" for doc in reloaded)
        # Until each worker has answered both (the kernel hands connections to whichever worker
        # accepts first, so it may take a few dozen tries on a busy machine; most runs need two).
        for n in range(200):
            assert await _get(gateway.url, f"/old/{n}", "grocer-1") == 401
            assert await _get(gateway.url, f"/new/{n}", "grocer-2") == 201
            answered = {d["pid"] for d in decisions(gateway.stderr.lines) if d["path"].startswith("/new/")}  # type: ignore[union-attr]
            refused = {d["pid"] for d in decisions(gateway.stderr.lines) if d["path"].startswith("/old/")}  # type: ignore[union-attr]
            if answered == refused == workers:
                break
        assert answered == refused == workers, "every worker answered both tokens"
    finally:
        gateway.stop()
    assert gateway.stderr is not None
    text = "".join(gateway.stderr.whole())
    assert "grocer-2" not in text
    assert "grocer-1" not in text


async def test_a_shorter_timeout_applies_on_sighup(dsn: str, upstream: Upstream, tmp_path: Path) -> None:
    """An upstream's timeout shortened in the file and SIGHUP sent to a single-process gateway: a call
    that used to wait for the slow upstream now times out."""
    _serve_slowly(upstream)
    config = tmp_path / "gateway.toml"
    _write(config, dsn, upstream, workers=1)
    gateway = start_gateway_process(config)
    try:
        assert await _get(gateway.url, "/slow", "grocer-1") == 200
        _write(config, dsn, upstream, workers=1, timeout='"200ms"')
        os.kill(gateway.proc.pid, signal.SIGHUP)
        (said,) = await _said(gateway, "configuration reloaded", 1)
        assert said["message"] == "configuration reloaded: upstreams.shop.timeout (10s -> 0.2s)"
        assert await _get(gateway.url, "/slow", "grocer-1") == 504
    finally:
        gateway.stop()


async def test_an_unsafe_change_is_refused_in_one_line_and_the_old_configuration_serves(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """A file that changes listen and a native key's TTL (and a token) is refused in one line naming both,
    and every worker goes on with the old configuration: the old token still works, the new one not."""
    config = tmp_path / "gateway.toml"
    _write(config, dsn, upstream, workers=2)
    gateway = start_gateway_process(config)
    try:
        _write(config, dsn, upstream, workers=2, token='"grocer-2"', ttl='"1h"', listen='"127.0.0.1:1"')
        os.kill(gateway.proc.pid, signal.SIGHUP)
        (refused,) = await _said(gateway, "configuration not reloaded", 1)
        assert refused["level"] == "error"
        assert refused["pid"] == gateway.proc.pid  # the supervisor's: one line, not one per worker
        assert "listen changed, but the gateway's sockets are bound at start" in refused["message"]
        assert "upstreams.shop.native_key.ttl changed, but it decides whether an effect" in refused["message"]
        for n in range(6):
            assert await _get(gateway.url, f"/old/{n}", "grocer-1") == 201
            assert await _get(gateway.url, f"/new/{n}", "grocer-2") == 401
    finally:
        gateway.stop()
    assert not [doc for doc in _log(gateway) if doc["message"].startswith("configuration reloaded")]


async def test_a_file_that_does_not_validate_is_refused_and_the_gateway_serves_on(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """A file with a bad duration, SIGHUP sent: one line gives the reason, naming the setting, and the
    gateway goes on serving with the configuration it had."""
    config = tmp_path / "gateway.toml"
    _write(config, dsn, upstream, workers=1)
    gateway = start_gateway_process(config)
    try:
        _write(config, dsn, upstream, workers=1, timeout='"soon"', token='"grocer-2"')
        os.kill(gateway.proc.pid, signal.SIGHUP)
        (refused,) = await _said(gateway, "configuration not reloaded", 1)
        assert refused["message"].startswith(
            "configuration not reloaded, going on with the one running: bad setting upstreams.shop.timeout: "
        )
        assert await _get(gateway.url, "/still", "grocer-1") == 201
        assert gateway.proc.poll() is None
    finally:
        gateway.stop()


async def test_a_removed_tenants_audit_sessions_end_when_a_worker_applies_the_reload(
    dsn: str, upstream: Upstream
) -> None:
    """Once a worker applies a reload that removes a tenant, the audit page no longer takes the sessions
    signed in with that tenant's token; the admin's session goes on."""
    tenants = {"a": {"token": "tok-a"}, "b": {"token": "tok-b"}}
    given: dict[str, Any] = {"upstreams": {"shop": {"base_url": upstream.url}}, "admin": {"token": "adm-1"}}
    async with (
        gateway_server(dsn, tenants=tenants, **given) as gw,
        aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http,
    ):

        async def sign_in(token: str) -> str:
            form = {"token": token, "next": "/_gateway/audit"}
            async with http.post(
                f"{gw.admin_url}/_gateway/audit/sign-in",
                data=form,
                headers={"Origin": gw.admin_url},
                allow_redirects=False,
            ) as resp:
                return resp.cookies[COOKIE].value

        async def page(cookie: str) -> int:
            headers = {"Cookie": f"{COOKIE}={cookie}"}
            async with http.get(
                f"{gw.admin_url}/_gateway/audit", headers=headers, allow_redirects=False
            ) as resp:
                return resp.status

        tenant_a, admin = await sign_in("tok-a"), await sign_in("adm-1")
        assert (await page(tenant_a), await page(admin)) == (200, 200)
        running = gw.runtime.settings
        new = running.model_copy(update={"tenants": {"b": running.tenants["b"]}})
        verdict = reload.read_again(running, lambda: new)
        assert verdict.line == "configuration reloaded: tenants.a.token (removed)"
        assert verdict.settings is not None
        gw.runtime.reconfigure(verdict.settings, upstream_policies(verdict.settings))
        assert (await page(tenant_a), await page(admin)) == (401, 200)


def test_durations_in_the_table_read_as_the_file_writes_them() -> None:
    """The applied line shows a duration as the file would (10s, 0.2s), not as Python prints it."""
    change = reload.Change(
        ("upstreams", "shop", "timeout"), timedelta(seconds=10), timedelta(milliseconds=200)
    )
    assert change.describe() == "upstreams.shop.timeout (10s -> 0.2s)"


async def test_a_file_that_is_not_text_is_refused_and_every_worker_serves_on(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """Bytes that are not UTF-8 written into the file, SIGHUP sent to a gateway of two workers: one line
    says so, and the gateway goes on serving (it used to stop, the supervisor's reading having failed)."""
    config = tmp_path / "gateway.toml"
    _write(config, dsn, upstream, workers=2)
    gateway = start_gateway_process(config)
    try:
        with config.open("ab") as file:
            file.write(b"\xff\xfe garbage\n")
        os.kill(gateway.proc.pid, signal.SIGHUP)
        (refused,) = await _said(gateway, "configuration not reloaded", 1)
        assert "is not UTF-8 text" in refused["message"]
        assert await _get(gateway.url, "/still", "grocer-1") == 201
        assert gateway.proc.poll() is None
    finally:
        gateway.stop()


async def test_a_worker_started_after_a_reload_serves_the_configuration_applied(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """A worker killed after a reload is started again with the configuration then applied: the new
    token, not the one the gateway started with, nor one written to the file since without SIGHUP."""
    config = tmp_path / "gateway.toml"
    _write(config, dsn, upstream, workers=2)
    gateway = start_gateway_process(config)
    try:
        workers = children(gateway.proc.pid)
        _write(config, dsn, upstream, workers=2, token='"grocer-2"')
        os.kill(gateway.proc.pid, signal.SIGHUP)
        await _said(gateway, "configuration reloaded", 2)
        _write(config, dsn, upstream, workers=2, token='"grocer-3"')  # not applied: no SIGHUP
        os.kill(min(workers), signal.SIGKILL)
        for _ in range(300):  # the supervisor starts another in its place, within a second or so
            started = children(gateway.proc.pid) - workers
            if started:
                break
            await asyncio.sleep(0.05)
        assert started, "no worker took the killed one's place"
        answered: set[int] = set()
        for n in range(200):  # until the new worker has answered one (the kernel picks the worker)
            assert await _get(gateway.url, f"/new/{n}", "grocer-2") == 201
            answered = {d["pid"] for d in decisions(gateway.stderr.lines) if d["path"].startswith("/new/")}  # type: ignore[union-attr]
            if started <= answered:
                break
        assert started <= answered, "the new worker answered the applied token"
        assert await _get(gateway.url, "/first", "grocer-1") == 401
        assert await _get(gateway.url, "/unapplied", "grocer-3") == 401
    finally:
        gateway.stop()
