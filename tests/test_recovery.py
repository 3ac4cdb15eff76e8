"""Recovery of records in doubt: native keys, probes (HTTP and Python), retention, operators."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.database import RETAINED, backdate_bodies, effect_rows, purge_as_owner
from tests.gateways import gateway_server
from tests.support import ROOT
from tests.upstreams import ORDER_SEARCH, Upstream

SEARCH = ORDER_SEARCH


async def order(
    http: aiohttp.ClientSession, url: str, key: str = "k", wait: int = 0
) -> tuple[int, dict[str, str], Any]:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    if wait:
        headers["Prefer"] = f"wait={wait}"
    async with http.post(f"{url}/shop/orders", data=b'{"items":["atta"]}', headers=headers) as resp:
        body = await resp.read()
        return resp.status, dict(resp.headers), json.loads(body) if body else None


def flaky_first(upstream: Upstream, status: int = 500) -> None:
    """The first order is created and then answered with ``status``, as a crashing upstream might."""

    async def create(request: web.Request) -> web.Response:
        if len(upstream.effects("/orders")) == 1:
            return web.json_response({"error": "lost"}, status=status)
        return web.json_response({"order": len(upstream.effects("/orders"))}, status=201)

    upstream.routes["/orders"] = create


def busy_first(upstream: Upstream) -> None:
    """The first order is answered 503 without being placed; the next is placed, as order P-2."""

    async def create(request: web.Request) -> web.Response:
        if len(upstream.effects("/orders")) == 1:
            return web.json_response({"error": "overloaded"}, status=503)
        return web.json_response({"order": "P-2"}, status=201)

    upstream.routes["/orders"] = create


async def test_native_key_resend_completes_the_record(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A timed-out call to a key-honouring upstream completes on retry with the upstream's replay."""
    upstream.key_header = "Idempotency-Key"
    slow_once: list[int] = []

    async def create(request: web.Request) -> web.Response:
        if not slow_once:
            slow_once.append(1)
            await asyncio.sleep(0.6)  # the gateway gives up at 300 ms; the order is still created
        return web.json_response({"order": "N-1"}, status=201)

    upstream.routes["/orders"] = create
    cfg = {
        "shop": {"base_url": upstream.url, "timeout": "300ms", "native_key": {"header": "Idempotency-Key"}}
    }
    async with gateway_server(dsn, upstreams=cfg, lease_grace="500ms") as gw:
        assert (await order(http, gw.url))[0] == 504
        status, _, body = await order(http, gw.url, wait=5)
    assert (status, body) == (201, {"order": "N-1"})
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["recovered_by"], row["attempt"]) == ("completed", "native_key", 2)
    assert upstream.effects_created() == 1


async def test_probe_found_completes_from_the_probes_answer(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Rule 3, found: the effect exists upstream; the record completes from the probe, nothing re-sent."""
    flaky_first(upstream)
    upstream.serve_search()
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": SEARCH}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] == 500
        status, headers, body = await order(http, gw.url)
        again = await order(http, gw.url)
    assert status == 201
    assert headers["Idempotent-Replayed"] == "true"
    assert body["reference"].startswith("eg_")
    assert again[2] == body
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["recovered_by"]) == ("completed", "probe")
    assert len(upstream.effects()) == 1


async def test_probe_not_found_sends(dsn: str, upstream: Upstream, http: aiohttp.ClientSession) -> None:
    """Rule 3, not found: the effect does not exist upstream, so the retry sends it (once)."""
    busy_first(upstream)
    upstream.routes["/orders/search"] = lambda request: _json({"items": []})
    # A search that would list an order the moment it is placed: "not found" is trusted at once.
    probe = {**SEARCH, "lag": "0s"}
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": probe}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] == 503
        status, headers, body = await order(http, gw.url)
    assert (status, body) == (201, {"order": "P-2"})
    assert "Idempotent-Replayed" not in headers
    (row,) = await effect_rows(dsn)
    assert row["state"] == "completed"
    assert row["recovered_by"] is None
    assert any(e.get("reason") == "probe" for e in row["history"])


async def _json(doc: Any, status: int = 200) -> web.Response:
    return web.json_response(doc, status=status)


def lagging_search(upstream: Upstream, lag: float) -> None:
    """A search that lists each order ``lag`` seconds after it was placed, as a search index refreshes."""
    placed: dict[int, float] = {}

    async def search(request: web.Request) -> web.Response:
        now = asyncio.get_running_loop().time()
        listed = [
            {"order": call.body.decode()}
            for n, call in enumerate(upstream.effects("/orders"))
            if request.query["ref"] in call.body.decode() and n in placed and now - placed[n] >= lag
        ]
        return web.json_response({"items": listed})

    async def create(request: web.Request) -> web.Response:
        placed[len(upstream.effects("/orders")) - 1] = asyncio.get_running_loop().time()
        if len(upstream.effects("/orders")) == 1:
            return web.json_response({"error": "crashed after commit"}, status=500)
        return web.json_response({"order": len(upstream.effects("/orders"))}, status=201)

    upstream.routes["/orders"] = create
    upstream.routes["/orders/search"] = search


async def test_a_search_that_lists_an_order_late_is_not_trusted_at_once(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Right after a 500, a search that lists orders a second late finds nothing: 503, not a second order.

    By default (probe.lag, a minute) "not found" is trusted only a minute after the latest attempt's
    answer; the record stays in doubt and Retry-After says how long. Before, the retry probed at once,
    found nothing yet, and placed the order a second time.
    """
    lagging_search(upstream, lag=1.0)
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": SEARCH}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] == 500
        status, headers, body = await order(http, gw.url)
    assert (status, body["type"].rsplit("/", 1)[1]) == (503, "probe-too-soon")
    assert 55 <= int(headers["Retry-After"]) <= 60
    assert len(upstream.effects("/orders")) == 1
    (row,) = await effect_rows(dsn)
    assert row["state"] == "in_doubt"
    assert any("too soon" in (event.get("note") or "") for event in row["history"])


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "never-placed"])
async def test_once_the_lag_has_passed_the_probe_is_trusted(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, placed: bool
) -> None:
    """After Retry-After the search has caught up: it finds the order (replayed), or finds none and sends."""
    lagging_search(upstream, lag=0.5)
    if not placed:  # the first attempt is answered 503 without placing anything
        upstream.routes["/orders"] = lambda request: _json({"error": "overloaded"}, status=503)
    cfg = {
        "shop": {
            "base_url": upstream.url,
            "stamp": {"json_field": "client_reference"},
            "probe": {**SEARCH, "lag": "1s"},
        }
    }
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] in (500, 503)
        status, headers, _ = await order(http, gw.url)
        assert status == 503
        await asyncio.sleep(int(headers["Retry-After"]))
        if not placed:
            upstream.routes["/orders"] = lambda request: _json({"order": "P-2"}, status=201)
        status, headers, body = await order(http, gw.url)
    assert status == 201
    assert ("Idempotent-Replayed" in headers) is placed
    assert "client_reference" in body["order"] if placed else body == {"order": "P-2"}
    assert len(upstream.effects("/orders")) == (1 if placed else 2)
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["recovered_by"]) == ("completed", "probe" if placed else None)


@pytest.mark.parametrize("failure", ["timeout", "garbage", "status"])
async def test_a_failed_probe_is_503_and_leaves_the_record_as_it_was(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, failure: str
) -> None:
    """A probe that times out, answers garbage or an error status gives 503; nothing is sent."""
    flaky_first(upstream)

    async def broken(request: web.Request) -> web.Response:
        if failure == "timeout":
            await asyncio.sleep(1)
        if failure == "garbage":
            return web.Response(text="<html>oops</html>", content_type="text/html")
        return web.json_response({"error": "search down"}, status=500)

    upstream.routes["/orders/search"] = broken
    cfg = {
        "shop": {
            "base_url": upstream.url,
            "timeout": "300ms",
            "stamp": {"json_field": "client_reference"},
            "probe": SEARCH,
        }
    }
    async with gateway_server(dsn, upstreams=cfg, lease_grace="500ms") as gw:
        assert (await order(http, gw.url))[0] == 500
        (before,) = await effect_rows(dsn)
        status, headers, body = await order(http, gw.url)
        assert status == 503
        assert body["type"].endswith("/probe-failed")
        assert "Retry-After" in headers
        (after,) = await effect_rows(dsn)
        assert (after["state"], after["response_status"]) == (before["state"], before["response_status"])
        assert after["state"] == "in_doubt"
        # the probe mends: the next retry finds the order instead of placing a second one
        upstream.serve_search()
        status, _, body = await order(http, gw.url)
    assert status == 201
    assert len(upstream.effects("/orders")) == 1


async def test_a_search_probe_whose_route_answers_404_is_a_failed_probe(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A search (a probe with `found`) answering 404 is a route that is not there: 503, nothing sent.

    A search answers a list, found or not; its 404 is the route renamed, or a proxy in front that does
    not know it. Before, the 404 was read as "not found" and the order was placed a second time.
    """
    flaky_first(upstream)
    upstream.routes["/orders/search"] = lambda request: _json({"error": "no such route"}, status=404)
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": SEARCH}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] == 500
        status, headers, body = await order(http, gw.url)
    assert (status, body["type"].rsplit("/", 1)[1]) == (503, "probe-failed")
    assert "404" in body["detail"]
    assert "Retry-After" in headers
    assert len(upstream.effects("/orders")) == 1
    (row,) = await effect_rows(dsn)
    assert row["state"] == "in_doubt"


@pytest.mark.parametrize(
    "answer",
    [{"error": {"message": "bad query"}}, {}, None, [], {"items": None}, {"data": {"items": []}}],
    ids=["error", "empty", "null", "list", "items-null", "nested"],
)
async def test_a_search_answer_without_its_list_is_a_failed_probe(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, answer: object
) -> None:
    """A 200 from the search that has no list where `found` looks says nothing: 503, nothing sent.

    Only the list there and shorter than the index is "not found". Before, an error document or a
    changed shape (`{}`, `null`, `{"items": null}`, ...) read as "not found" and the order was placed again.
    """
    flaky_first(upstream)
    upstream.routes["/orders/search"] = lambda request: _json(answer)
    probe = {**SEARCH, "lag": "0s"}  # a "not found" would be trusted at once
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": probe}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] == 500
        status, _, body = await order(http, gw.url)
    assert (status, body["type"].rsplit("/", 1)[1]) == (503, "probe-failed")
    assert len(upstream.effects("/orders")) == 1


async def test_a_probe_by_key_reads_404_as_not_found(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A probe without `found` GETs the effect by its key: 404 is "no such effect", and the retry sends."""

    async def by_reference(request: web.Request) -> web.Response:
        return web.json_response({"error": "no such order"}, status=404)

    busy_first(upstream)
    upstream.routes["/orders/by-reference"] = by_reference
    probe = {"path": "/orders/by-reference?ref={key}", "status": 201, "lag": "0s", "routes": ["POST /orders"]}
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": probe}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] == 503
        status, _, body = await order(http, gw.url)
    assert (status, body) == (201, {"order": "P-2"})
    assert len(upstream.effects("/orders")) == 2
    assert [call.path for call in upstream.calls if call.method == "GET"] == ["/orders/by-reference"]
    (row,) = await effect_rows(dsn)
    assert row["state"] == "completed"


async def test_a_python_probe_registered_as_an_entry_point(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`probe = { entry_point = NAME }` loads a callable from the group effect_gateway.probes and uses it."""
    (tmp_path / "shop_probe.py").write_text(
        textwrap.dedent(
            """
            async def find_order(ctx):
                async with ctx.session.get(ctx.base_url + "/orders/search", params={"ref": ctx.key}) as resp:
                    items = (await resp.json())["items"]
                return {"found_by": "python", **items[0]} if items else None
            """
        )
    )
    dist = tmp_path / "shop_probe-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shop-probe\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[effect_gateway.probes]\nshop-orders = shop_probe:find_order\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flaky_first(upstream)
    upstream.serve_search()
    probe = {"entry_point": "shop-orders", "status": 201, "routes": ["POST /orders"]}
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}, "probe": probe}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        assert (await order(http, gw.url))[0] == 500
        status, _, body = await order(http, gw.url)
    assert status == 201
    assert body["found_by"] == "python"
    assert len(upstream.effects()) == 1
    sys.modules.pop("shop_probe", None)


async def test_a_missing_python_probe_stops_start_up(dsn: str, upstream: Upstream) -> None:
    """A probe entry point that does not exist is a configuration error, found at start, not at recovery."""
    from gateway.errors import ConfigError

    stamp = {"json_field": "client_reference"}
    cfg = {
        "shop": {
            "base_url": upstream.url,
            "stamp": stamp,
            "probe": {"entry_point": "no-such-probe", "routes": ["POST /orders"]},
        }
    }
    with pytest.raises(ConfigError, match="no-such-probe"):
        async with gateway_server(dsn, upstreams=cfg):
            pass


# --- retention ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["native", "probe", "neither"])
async def test_after_the_retention_a_retry_is_answered_by_the_probe_or_410(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, kind: str
) -> None:
    """Bodies are dropped after the retention (the audit row stays); a retry never sends the effect again.

    Not even under a native key the upstream may still remember: the retention outlasts any key's TTL,
    and a re-send without a lease can land after the upstream forgot the key.
    """
    cfg: dict[str, Any] = {"base_url": upstream.url, "stamp": {"json_field": "client_reference"}}
    if kind == "native":
        upstream.key_header = "Idempotency-Key"
        cfg["native_key"] = {"header": "Idempotency-Key"}
    if kind == "probe":
        upstream.serve_search()
        cfg["probe"] = SEARCH
    async with gateway_server(dsn, upstreams={"shop": cfg}, **RETAINED) as gw:
        first = await order(http, gw.url)
        assert first[0] == 201
        await backdate_bodies(dsn, days=10)
        await purge_as_owner(dsn)  # the owner's purge, on its schedule, drops the bodies
        (row,) = await effect_rows(dsn)
        assert row["response_body"] is None
        assert row["request_body"] is None
        assert row["state"] == "completed"
        status, _, body = await order(http, gw.url)
    if kind == "probe":
        assert status == 201
        assert body["reference"] == row["derived_key"]
    else:
        assert status == 410
        assert body["type"].endswith("/response-purged")
    assert len(upstream.effects()) == 1
    (row,) = await effect_rows(dsn)
    assert row["state"] == "completed"


# --- operators ----------------------------------------------------------------------------------------------


async def _needs_review(http: aiohttp.ClientSession, url: str, dsn: str) -> int:
    assert (await order(http, url))[0] == 500
    status, _, body = await order(http, url)
    assert status == 409
    assert body["type"].endswith("/outcome-unknown")
    (row,) = await effect_rows(dsn)
    assert row["state"] == "needs_review"
    return int(row["id"])


async def test_resolve_happened_replays_the_operators_response(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An operator who confirms the effect gives the response the agent's retry then receives."""
    flaky_first(upstream)
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        effect = await _needs_review(http, gw.url, dsn)
        async with http.get(f"{gw.admin_url}/_gateway/health") as resp:
            assert (await resp.json())["needs_review"] == 1
        async with http.get(f"{gw.admin_url}/_gateway/audit") as resp:
            assert "1 effect waits for an operator" in await resp.text()
        (row,) = await effect_rows(dsn)
        verdict = {
            "happened": True,
            "attempt": row["attempt"],
            "response": {"status": 201, "json": {"order": "found-by-hand"}},
        }
        async with http.post(f"{gw.admin_url}/_gateway/effects/{effect}/resolve", json=verdict) as resp:
            assert resp.status == 200
            assert (await resp.json())["state"] == "completed"
        status, headers, body = await order(http, gw.url)
        async with http.post(f"{gw.admin_url}/_gateway/effects/{effect}/resolve", json=verdict) as resp:
            assert resp.status == 409  # nothing left to resolve
    assert (status, body) == (201, {"order": "found-by-hand"})
    assert headers["Idempotent-Replayed"] == "true"
    assert len(upstream.effects()) == 1


async def test_resolve_did_not_happen_lets_the_next_retry_send(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An operator who finds no effect upstream releases the key: the next retry sends it."""
    flaky_first(upstream)
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        effect = await _needs_review(http, gw.url, dsn)
        async with http.post(
            f"{gw.admin_url}/_gateway/effects/{effect}/resolve", json={"happened": "maybe"}
        ) as resp:
            assert resp.status == 400
        (row,) = await effect_rows(dsn)
        judged = {"happened": False, "attempt": row["attempt"]}
        async with http.post(f"{gw.admin_url}/_gateway/effects/{effect}/resolve", json=judged) as resp:
            assert (await resp.json())["state"] == "retryable"
        status, _, body = await order(http, gw.url)
    assert (status, body) == (201, {"order": 2})
    (row,) = await effect_rows(dsn)
    assert (row["state"], row["recovered_by"]) == ("completed", "operator")


async def test_resolve_from_the_command_line(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`effect-gateway resolve ID --happened --status --body` does what the admin API does."""
    flaky_first(upstream)
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        effect = await _needs_review(http, gw.url, dsn)
        config = tmp_path / "gw.toml"
        config.write_text(f'database_url = "{dsn}"\n')
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "--config",
            str(config),
            "resolve",
            str(effect),
            "--attempt",
            str((await effect_rows(dsn))[0]["attempt"]),
            "--happened",
            "--status",
            "201",
            "--header",
            "Content-Type:application/json",
            "--body",
            '{"order":"cli"}',
            "--operator",
            "asha",
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert f"effect {effect} resolved as happened" in out.decode()
        status, _, body = await order(http, gw.url)
    assert (status, body) == (201, {"order": "cli"})
    (row,) = await effect_rows(dsn)
    assert row["history"][-1]["event"] == "resolved"
    assert row["history"][-1]["by"] == "command line: asha"
