"""Prometheus metrics of a real gateway: what came of each request, the parts' latencies, the states."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import platform
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import aiohttp
import asyncpg
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.decision import review
from gateway.metrics import Metrics, sweep_left_behind
from tests.database import runtime_url
from tests.factories import new_effect
from tests.gateways import Gateway, children, decisions, gateway_server, start_gateway_process
from tests.support import PORT_ZERO, ROOT
from tests.upstreams import ORDER_SEARCH, Upstream, upstream_server

SEARCH = ORDER_SEARCH
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: aiohttp.ClientSession, url: str, **headers: str) -> Samples:
    """Every sample of the gateway's metrics, by name and labels."""
    async with http.get(f"{url}/_gateway/metrics", headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = await resp.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def requests(samples: Samples, upstream: str) -> dict[tuple[str, str], float]:
    """Requests to ``upstream`` by (outcome, problem), the ones that happened."""
    found = {}
    for (name, labels), n in samples.items():
        by = dict(labels)
        if name == "effect_gateway_requests_total" and by["upstream"] == upstream and n:
            found[by["outcome"], by["problem"]] = n
    return found


async def post(
    http: aiohttp.ClientSession,
    url: str,
    key: str | None,
    body: bytes = b'{"items":["atta"]}',
    wait: int = 0,
    token: str | None = None,
) -> int:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Effect-Gateway-Token"] = token
    if key is not None:
        headers["Idempotency-Key"] = key
    if wait:
        headers["Prefer"] = f"wait={wait}"
    async with http.post(url, data=body, headers=headers) as resp:
        await resp.read()
        return resp.status


def first_answered(upstream: Upstream, status: int) -> None:
    """The first order is created and answered ``status`` (a crash upstream); the rest are 201."""

    async def create(request: web.Request) -> web.Response:
        if len(upstream.effects("/orders")) == 1:
            return web.json_response({"error": "lost"}, status=status)
        return web.json_response({"order": len(upstream.effects("/orders"))}, status=201)

    upstream.routes["/orders"] = create


def slow_once(upstream: Upstream, seconds: float) -> None:
    """The first order takes ``seconds`` (past the gateway's timeout) but is created all the same."""
    first: list[int] = []

    async def create(request: web.Request) -> web.Response:
        if not first:
            first.append(1)
            await asyncio.sleep(seconds)
        return web.json_response({"mail": "sent"}, status=201)

    upstream.routes["/send"] = create


async def test_each_request_is_counted_by_what_came_of_it(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Sent, replayed, recovered by probe and by native key, key reused, redirected, refused and failed."""
    first_answered(upstream, 500)
    upstream.serve_search()

    async def moved(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "http://127.0.0.1:9/orders"})

    upstream.routes["/moved"] = moved
    async with upstream_server() as mail:
        mail.key_header = "Idempotency-Key"
        slow_once(mail, 0.6)
        upstreams = {
            "shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": SEARCH},
            "mail": {"base_url": mail.url, "timeout": "300ms", "native_key": {"header": "Idempotency-Key"}},
            "down": {"base_url": "http://127.0.0.1:9", "connect_timeout": "1s"},
        }
        async with gateway_server(dsn, upstreams=upstreams, lease_grace="500ms") as gw:
            shop, mailer = f"{gw.url}/shop/orders", f"{gw.url}/mail/send"
            assert await post(http, shop, "k1") == 500  # sent: the upstream's own 500, in doubt
            assert await post(http, shop, "k1") == 201  # the probe finds the order
            assert await post(http, shop, "k1") == 201  # from memory
            assert await post(http, shop, "k1", b'{"items":["dal"]}') == 422
            assert await post(http, shop, None) == 400
            assert await post(http, f"{gw.url}/shop/moved", "k2") == 502  # not relayed, nothing done
            assert await post(http, f"{gw.url}/nowhere/x", "k1") == 404
            assert await post(http, f"{gw.url}/down/x", "k1") == 502
            assert await post(http, mailer, "m1") == 504
            assert await post(http, mailer, "m1", wait=5) == 201  # re-sent under the native key
            metrics = await scrape(http, gw.admin_url)
    assert requests(metrics, "shop") == {
        ("sent", ""): 1,
        ("recovered_probe", ""): 1,
        ("replayed", ""): 1,
        ("key_reused", "key-reused"): 1,
        ("refused", "key-missing"): 1,
        ("redirected", "upstream-redirected"): 1,
    }
    assert requests(metrics, "") == {("refused", "unknown-upstream"): 1}
    assert requests(metrics, "down") == {("failed", "upstream-unreachable"): 1}
    assert requests(metrics, "mail") == {("failed", "upstream-timeout"): 1, ("recovered_native_key", ""): 1}
    assert value(metrics, "effect_gateway_probes_total", upstream="shop", result="found") == 1
    assert value(metrics, "effect_gateway_probes_total", upstream="shop", result="not_found") == 0
    assert value(metrics, "effect_gateway_replay_cache_total", result="hit") == 2  # k1's replay, k1's reuse
    histogram = "effect_gateway_upstream_duration_seconds_count"
    assert value(metrics, histogram, upstream="shop", call="send") == 2  # k1 and k2
    assert value(metrics, histogram, upstream="shop", call="probe") == 1
    assert value(metrics, histogram, upstream="mail", call="send") == 2
    timeout = value(metrics, "effect_gateway_upstream_duration_seconds_sum", upstream="mail", call="send")
    assert timeout >= 0.3  # the call that timed out took the whole timeout
    latency = "effect_gateway_request_duration_seconds_count"
    assert value(metrics, latency, upstream="shop", outcome="replayed") == 1
    assert value(metrics, latency, upstream="mail", outcome="recovered_native_key") == 1
    statements = "effect_gateway_store_duration_seconds_count"
    assert value(metrics, statements, statement="claim") == 6  # shop k1 twice, k2, down, mail twice
    assert value(metrics, statements, statement="settle") >= 4
    assert value(metrics, "effect_gateway_effects", state="completed") == 2
    assert value(metrics, "effect_gateway_effects", state="retryable") == 2  # down's and k2: nothing sent


async def test_a_twin_in_flight_a_lease_taken_over_and_a_verdict_are_counted(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A second request with the same key answered 409, a dead gateway's lease taken over, a review and
    the operator's verdict."""
    arrived, release = asyncio.Event(), asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.json_response({"order": "held"}, status=201)

    upstream.routes["/held"] = held
    upstream.routes["/slow"] = lambda request: _late(0.6)
    upstream.key_header = "Idempotency-Key"
    upstreams = {
        "shop": {"base_url": upstream.url, "native_key": {"header": "Idempotency-Key"}},
        "bare": {"base_url": upstream.url, "timeout": "300ms"},
    }
    # No replays from memory: the record the dead gateway left must be read from Postgres.
    async with gateway_server(dsn, upstreams=upstreams, lease_grace="500ms", replay_cache_bytes=0) as gw:
        first = asyncio.create_task(post(http, f"{gw.url}/shop/held", "same-key"))
        await arrived.wait()
        assert await post(http, f"{gw.url}/shop/held", "same-key") == 409
        release.set()
        assert await first == 201
        # A gateway that died after sending leaves its record pending until the lease runs out.
        assert await post(http, f"{gw.url}/shop/orders", "dead") == 201
        await _as_left_by_a_dead_gateway(dsn, "dead")
        assert await post(http, f"{gw.url}/shop/orders", "dead") == 201  # the native key recovers it
        # Nothing can tell whether the bare upstream's slow call happened: review, then a verdict.
        assert await post(http, f"{gw.url}/bare/slow", "doubt") == 504
        assert await post(http, f"{gw.url}/bare/slow", "doubt", wait=5) == 409  # once the lease is over
        async with http.get(f"{gw.admin_url}/_gateway/effects?state=needs_review") as resp:
            (effect,) = (await resp.json())["effects"]
        verdict = {"happened": False, "attempt": effect["attempt"]}
        async with http.post(f"{gw.admin_url}/_gateway/effects/{effect['id']}/resolve", json=verdict) as resp:
            assert resp.status == 200
        metrics = await scrape(http, gw.admin_url)
    assert requests(metrics, "shop") == {
        ("sent", ""): 2,
        ("in_flight", "in-flight"): 1,
        ("recovered_native_key", ""): 1,
    }
    assert requests(metrics, "bare") == {
        ("failed", "upstream-timeout"): 1,
        ("needs_review", "outcome-unknown"): 1,
    }
    assert value(metrics, "effect_gateway_leases_taken_over_total", upstream="shop") == 1
    assert value(metrics, "effect_gateway_leases_taken_over_total", upstream="bare") == 0
    verdicts = "effect_gateway_operator_verdicts_total"
    assert value(metrics, verdicts, upstream="bare", verdict="did_not_happen") == 1


async def _late(seconds: float) -> web.Response:
    await asyncio.sleep(seconds)
    return web.json_response({"slow": True}, status=201)


async def _as_left_by_a_dead_gateway(dsn: str, key: str) -> None:
    """The record of ``key`` as a gateway SIGKILLed after sending leaves it: pending, its lease run out."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """with e as (
                   update effects set state = 'pending', may_have_sent = true, completed_at = null,
                       lease_expires_at = now() - interval '1 second'
                   where key = $1
                   returning id, created_at, scope, tenant, upstream
               )
               insert into open_effects (state, id, created_at, scope, tenant, upstream)
               select 'pending', id, created_at, scope, tenant, upstream from e""",
            key,
        )
    finally:
        await conn.close()


async def test_a_scrape_storm_reads_the_states_from_the_store_once(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Fifty scrapes at once and more right after: the effects by state are read from Postgres once."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        assert await post(http, f"{gw.url}/shop/orders", "s1") == 201
        storm = await asyncio.gather(*(scrape(http, gw.admin_url) for _ in range(50)))
        assert await post(http, f"{gw.url}/shop/orders", "s2") == 201
        after = await scrape(http, gw.admin_url)
    reads = "effect_gateway_store_duration_seconds_count"
    assert value(after, reads, statement="state_counts") == 1
    assert {value(one, "effect_gateway_effects", state="completed") for one in storm} == {1}
    assert value(after, "effect_gateway_effects", state="completed") == 1  # a few seconds old, by design
    assert value(after, "effect_gateway_requests_total", upstream="shop", outcome="sent", problem="") == 2


def _with_tokens(
    dsn: str, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> contextlib.AbstractAsyncContextManager[Gateway]:
    """A gateway with an admin token (adm-1) and tenant a's (tok-a), sending to ``upstream`` as shop."""
    monkeypatch.setenv("ADMIN", "adm-1")
    monkeypatch.setenv("TA", "tok-a")
    return gateway_server(
        dsn,
        upstreams={"shop": {"base_url": upstream.url}},
        tenants={"a": {"token": "env:TA"}},
        admin={"token": "env:ADMIN"},
    )


async def test_a_storm_of_health_requests_with_tokens_reads_the_states_once_per_viewer(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twenty health requests at once with the admin's token and twenty with a tenant's: the counts by
    state are read from Postgres once for each of the two, and the scrape after them reads none."""
    async with _with_tokens(dsn, upstream, monkeypatch) as gw:
        assert await post(http, f"{gw.url}/shop/orders", "h1", token="tok-a") == 201

        async def health(**headers: str) -> dict[str, int]:
            async with http.get(f"{gw.admin_url}/_gateway/health", headers=headers) as resp:
                assert resp.status == 200, await resp.text()
                counts: dict[str, int] = (await resp.json())["effects"]
                return counts

        storm = await asyncio.gather(
            *(health(Authorization="Bearer adm-1") for _ in range(20)),
            *(health(**{"Effect-Gateway-Token": "tok-a"}) for _ in range(20)),
        )
        after = await scrape(http, gw.admin_url, Authorization="Bearer adm-1")
    assert value(after, "effect_gateway_store_duration_seconds_count", statement="state_counts") == 2
    assert [counts.get("completed") for counts in storm] == [1] * 20 + [None] * 20  # a tenant's: open only
    assert value(after, "effect_gateway_effects", state="completed") == 1


async def test_metrics_need_the_admin_token_when_one_is_set(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a token a scrape gets 401; a tenant's gets its own effects only; the admin's, everything."""
    async with _with_tokens(dsn, upstream, monkeypatch) as gw:
        async with http.get(f"{gw.admin_url}/_gateway/metrics") as resp:
            refused = (resp.status, resp.content_type, await resp.text())
        assert await post(http, f"{gw.url}/shop/orders", "t1", token="tok-a") == 201
        tenant = await scrape(http, gw.admin_url, **{"Effect-Gateway-Token": "tok-a"})
        metrics = await scrape(http, gw.admin_url, Authorization="Bearer adm-1")
    assert refused[:2] == (401, "application/problem+json")
    assert {name for name, _ in tenant} == {"effect_gateway_effects"}  # no gateway-wide traffic
    assert value(metrics, "effect_gateway_requests_total", upstream="shop", outcome="sent", problem="") == 1
    assert "effect_gateway" not in refused[2]
    assert json.loads(refused[2])["type"].endswith("/admin-token-required")
    assert value(metrics, "effect_gateway_effects", state="needs_review") == 0


async def test_a_scrape_of_either_worker_counts_the_requests_both_served(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`serve` with two workers: one scrape counts both workers' requests, and a killed worker's too."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 2\nlog_format = "json"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    temp = tmp_path / "tmp"  # where the gateway makes the workers' metrics directory
    temp.mkdir()
    gateway = start_gateway_process(config, {"TMPDIR": str(temp)})
    assert gateway.stderr is not None
    log = gateway.stderr
    try:
        sent = 0
        # A connection of its own per request, so that each is accepted by whichever worker is first.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
            while len({d["pid"] for d in decisions(log.lines)}) < 2 and sent < 200:
                assert await post(fresh, f"{gateway.url}/shop/orders", f"w{sent}") == 201
                sent += 1
                await asyncio.sleep(0.01)  # the worker's line, written before its answer, to be read
            served_by = {d["pid"] for d in decisions(log.lines)}
            assert len(served_by) == 2, f"{sent} requests, all served by one worker"
            before = await scrape(fresh, gateway.admin_url)
            victim = min(served_by)
            os.kill(victim, signal.SIGKILL)
            for _ in range(100):  # the parent starts another worker in its place
                if len(now := children(gateway.proc.pid)) == 2 and victim not in now:
                    break
                await asyncio.sleep(0.05)
            after = await scrape(fresh, gateway.admin_url)
        shared = list(temp.glob("effect-gateway-metrics-*"))
        assert len(shared) == 1
        assert any(shared[0].iterdir())  # the workers' files
    finally:
        gateway.stop()
    counted = "effect_gateway_requests_total"
    assert value(before, counted, upstream="shop", outcome="sent", problem="") == sent
    assert value(after, counted, upstream="shop", outcome="sent", problem="") == sent
    assert value(after, "effect_gateway_effects", state="completed") == sent
    assert list(temp.iterdir()) == []  # the metrics directory goes with the gateway


def test_a_killed_gateways_metrics_directory_is_removed_by_the_next(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """A gateway SIGKILLed with its workers leaves its metrics directory; the next gateway removes it.

    It removes only directories no running gateway holds, and none that are not a gateway's.
    """
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 2\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    temp = tmp_path / "tmp"
    temp.mkdir()
    someone_elses = temp / "effect-gateway-metrics-notapid-x"  # no lock file in it: not a gateway's
    someone_elses.mkdir()
    killed = start_gateway_process(config, {"TMPDIR": str(temp)})
    workers = children(killed.proc.pid)
    assert len(workers) == 2
    killed.kill()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    left = set(temp.glob(f"effect-gateway-metrics-{killed.proc.pid}-*"))
    assert len(left) == 1
    second = start_gateway_process(config, {"TMPDIR": str(temp)})
    try:
        now = set(temp.iterdir())
        assert sweep_left_behind(str(temp)) == []  # a running gateway's directory stays
    finally:
        second.stop()
    assert now & left == set()
    assert {p.name.split("-")[3] for p in now} == {str(second.proc.pid), "notapid"}
    assert list(temp.iterdir()) == [someone_elses]


def test_every_metric_is_in_the_operations_guide() -> None:
    """An operator finds each metric the gateway exports, by the name a scrape shows, in the guide."""
    exported = Metrics(["shop"]).exposition({"completed": 0}).decode()
    names = {line.split()[2] for line in exported.splitlines() if line.startswith("# HELP ")}
    guide = (ROOT / "docs" / "operations.md").read_text()
    assert len(names) == 13
    assert [name for name in sorted(names) if f"`{name}`" not in guide] == []


_FORK_AFTER_COUNTING = """
import os, sys
asked = []
getpid = os.getpid
os.getpid = lambda: asked.append(1) or getpid()  # before prometheus-client takes it as its default
from prometheus_client.parser import text_string_to_metric_families
from gateway.metrics import Metrics

metrics = Metrics(["shop"], shared_dir=sys.argv[1])
sent = metrics.upstream("shop").request("sent", "")[0]
asked.clear()
for _ in range(1000):
    sent.inc(0)
print(len(asked))
sent.inc()
child = os.fork()
if child == 0:  # a process that counts after a fork, with its parent's metrics already made
    for _ in range(5):
        sent.inc()
    os._exit(0)
os.waitpid(child, 0)
sent.inc(2)
for family in text_string_to_metric_families(metrics.exposition(None).decode()):
    for sample in family.samples:
        if sample.name == "effect_gateway_requests_total" and sample.labels["outcome"] == "sent":
            print(sample.value)
"""


def test_a_process_forked_after_counting_counts_in_files_of_its_own(tmp_path: Path) -> None:
    """An update asks the kernel for no pid, and after a fork the pid is the child's own."""
    shared = tmp_path / "shared"
    shared.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _FORK_AFTER_COUNTING, str(shared)],
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(shared)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    asked, total = done.stdout.split()
    assert asked == "0", "getpid was called for metric updates"
    # Sharing the parent's file, the two would overwrite each other's count: 3 or 6, never 8.
    assert total == "8.0"
    assert len(list(shared.glob("counter_*.db"))) == 2


async def test_a_scrape_says_which_version_of_the_gateway_answers(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """effect_gateway_build_info is 1, labelled with the installed package's version and Python's."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        metrics = await scrape(http, gw.admin_url)
    built = value(
        metrics,
        "effect_gateway_build_info",
        version=importlib.metadata.version("effect-gateway"),
        python=platform.python_version(),
    )
    assert built == 1


async def test_a_request_for_no_upstream_is_logged_with_its_path_and_a_browsers_icon_is_not_counted(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A request naming no configured upstream is logged with the path it asked for and counted as
    refused; a browser's own fetch of /favicon.ico is logged alike but left out of the metrics."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        with caplog.at_level(logging.INFO, logger="effect_gateway.decision"):
            for target in ("/favicon.ico", "/shpo/orders"):
                async with http.get(f"{gw.url}{target}") as resp:
                    assert resp.status == 404
        metrics = await scrape(http, gw.admin_url)
    paths = [r.decision["path"] for r in caplog.records if hasattr(r, "decision")]
    assert paths == ["/favicon.ico", "/shpo/orders"]
    assert requests(metrics, "") == {("refused", "unknown-upstream"): 1}


async def test_the_oldest_effect_waiting_for_review_has_its_age_in_the_metrics(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An effect waiting for review since an hour ago shows as an hour old; with none in doubt, that
    state's age is 0, so an alert on either threshold has a series to read."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        store = gw.runtime.store
        record, _ = await store.claim(new_effect("waits"), timedelta(0))
        assert record is not None
        assert await store.send_to_review(record, review(record), "nothing can tell") is not None
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(
                "update open_effects set created_at = now() - interval '1 hour' where id = $1", record.id
            )
        finally:
            await conn.close()
        metrics = await scrape(http, gw.admin_url)
    assert 3600 <= value(metrics, "effect_gateway_oldest_waiting_seconds", state="needs_review") < 3660
    assert value(metrics, "effect_gateway_oldest_waiting_seconds", state="in_doubt") == 0
    assert ("effect_gateway_oldest_waiting_seconds", (("state", "in_doubt"),)) in metrics
