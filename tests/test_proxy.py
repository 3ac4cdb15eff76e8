"""The gateway's HTTP contract, end to end: a real gateway, real Postgres, real upstream servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.database import database_text, effect_rows, failing_database
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream, raw_exchange

PROBLEM = "application/problem+json"


def shop(upstream: Upstream, **extra: Any) -> dict[str, Any]:
    return {"shop": {"base_url": upstream.url, "timeout": "2s", **extra}}


@pytest.fixture
async def gateway(dsn: str, upstream: Upstream) -> AsyncIterator[Gateway]:
    async with gateway_server(dsn, upstreams=shop(upstream), lease_grace="1s") as gw:
        yield gw


async def post(
    http: aiohttp.ClientSession, url: str, key: str | None = "k1", body: Any = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    hdrs = {"Content-Type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}}
    if key is not None:
        hdrs["Idempotency-Key"] = key
    data = json.dumps(body if body is not None else {"items": ["atta"]}).encode()
    async with http.post(url, data=data, headers=hdrs) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def problem_type(body: bytes) -> str:
    doc = json.loads(body)
    return str(doc["type"]).rsplit("/", 1)[1]


# --- keys ---------------------------------------------------------------------------------------------


async def test_post_without_a_key_is_refused_and_nothing_is_sent(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession, dsn: str
) -> None:
    """POST and PATCH need an Idempotency-Key: 400 problem+json, the upstream sees nothing."""
    for method in ("POST", "PATCH"):
        async with http.request(method, f"{gateway.url}/shop/orders", data=b"{}") as resp:
            assert resp.status == 400
            assert resp.content_type == PROBLEM
            assert problem_type(await resp.read()) == "key-missing"
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


@pytest.mark.parametrize(
    "bad", ['"unterminated', '""', "has space", "caf\u00e9", "x" * 256, '"a"b"', '"\\n"']
)
async def test_malformed_keys_are_refused_and_nothing_is_sent(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession, bad: str
) -> None:
    """Keys that are empty, too long, not visible ASCII or badly quoted get 400 key-malformed."""
    status, headers, body = await post(http, f"{gateway.url}/shop/orders", key=bad)
    assert status == 400
    assert headers["Content-Type"] == PROBLEM
    assert problem_type(body) == "key-malformed"
    assert upstream.calls == []


async def test_quoted_and_bare_forms_name_the_same_key(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The IETF sf-string form "abc" and Stripe's bare abc are one key: the second is a replay."""
    first = await post(http, f"{gateway.url}/shop/orders", key='"order-1"')
    second = await post(http, f"{gateway.url}/shop/orders", key="order-1")
    assert first[0] == 201
    assert second[1].get("Idempotent-Replayed") == "true"
    assert len(upstream.effects()) == 1


async def test_same_key_with_another_body_is_422_and_nothing_is_sent(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Reusing a key for a different request is refused before anything reaches the upstream."""
    assert (await post(http, f"{gateway.url}/shop/orders", body={"items": ["atta"]}))[0] == 201
    status, _, body = await post(http, f"{gateway.url}/shop/orders", body={"items": ["paneer"]})
    assert status == 422
    assert problem_type(body) == "key-reused"
    status, _, body = await post(http, f"{gateway.url}/shop/other", body={"items": ["atta"]})
    assert status == 422
    assert len(upstream.effects()) == 1


async def test_reordered_json_is_the_same_request(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An SDK that re-serialises the same parameters in another order is recognised, not refused."""
    url = f"{gateway.url}/shop/orders"
    async with http.post(
        url, data=b'{"a":1,"b":2}', headers={"Idempotency-Key": "k", "Content-Type": "application/json"}
    ) as r1:
        assert r1.status == 201
    async with http.post(
        url, data=b'{ "b": 2, "a": 1 }', headers={"Idempotency-Key": "k", "Content-Type": "application/json"}
    ) as r2:
        assert r2.status == 201
        assert r2.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.effects()) == 1


# --- replay -------------------------------------------------------------------------------------------


async def test_replay_is_identical_to_the_byte_with_the_replayed_header(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A retry gets the stored status, headers and body byte for byte, plus Idempotent-Replayed."""

    async def odd(_: web.Request) -> web.Response:
        resp = web.Response(status=202, body=b"\x00\xffbinary\r\n", headers={"X-Order": "7", "ETag": '"v1"'})
        resp.headers.add("X-Multi", "a")
        resp.headers.add("X-Multi", "b")
        resp.content_type = "application/octet-stream"
        return resp

    upstream.routes["/orders"] = odd
    url = f"{gateway.url}/shop/orders"
    async with http.post(url, data=b"{}", headers={"Idempotency-Key": "r"}) as first:
        first_headers = [(k, v) for k, v in first.headers.items()]
        first_body = await first.read()
    async with http.post(url, data=b"{}", headers={"Idempotency-Key": "r"}) as second:
        second_headers = [(k, v) for k, v in second.headers.items()]
        second_body = await second.read()
    assert first.status == second.status == 202
    assert second_body == first_body == b"\x00\xffbinary\r\n"
    assert ("Idempotent-Replayed", "true") in second_headers
    assert [h for h in second_headers if h[0] != "Idempotent-Replayed"] == first_headers
    assert ("X-Multi", "a") in first_headers
    assert ("X-Multi", "b") in first_headers
    assert "Idempotent-Replayed" not in dict(first_headers)
    assert len(upstream.effects()) == 1


async def test_fifty_concurrent_requests_with_one_key_make_one_upstream_call(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """50 at once with one key: one upstream call, and all 50 end with the same response."""

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        return web.json_response({"order": len(upstream.calls)}, status=201)

    upstream.routes["/orders"] = slow
    results = await asyncio.gather(
        *(post(http, f"{gateway.url}/shop/orders", key="same", Prefer="wait=10") for _ in range(50))
    )
    assert len(upstream.effects()) == 1
    assert {status for status, _, _ in results} == {201}
    assert {body for _, _, body in results} == {b'{"order": 1}'}
    assert sum(1 for _, h, _ in results if h.get("Idempotent-Replayed") == "true") == 49


async def test_a_twin_in_flight_gets_409_with_retry_after(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Without Prefer: wait, a request whose key another request holds is told to retry, not sent."""
    release = asyncio.Event()

    async def held(_: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"ok": True}, status=201)

    upstream.routes["/orders"] = held
    first = asyncio.create_task(post(http, f"{gateway.url}/shop/orders", key="held"))
    await upstream.received.wait()
    status, headers, body = await post(http, f"{gateway.url}/shop/orders", key="held")
    assert status == 409
    assert problem_type(body) == "in-flight"
    assert int(headers["Retry-After"]) >= 1
    release.set()
    assert (await first)[0] == 201
    assert len(upstream.effects()) == 1


async def test_a_client_that_disconnects_still_gets_its_result_recorded_and_replayed(
    gateway: Gateway, upstream: Upstream, dsn: str
) -> None:
    """Hanging up mid-call does not cancel the upstream call; the retry replays its result."""

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(0.5)
        return web.json_response({"order": "A-1"}, status=201)

    upstream.routes["/orders"] = slow
    async with aiohttp.ClientSession() as impatient:
        with pytest.raises(TimeoutError):
            await impatient.post(
                f"{gateway.url}/shop/orders",
                data=b"{}",
                headers={"Idempotency-Key": "gone", "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=0.1),
            )
    await asyncio.sleep(0.8)
    rows = await effect_rows(dsn)
    assert [(r["state"], r["response_status"]) for r in rows] == [("completed", 201)]
    async with aiohttp.ClientSession() as http:
        status, headers, body = await post(http, f"{gateway.url}/shop/orders", key="gone", body={})
        # the first request sent b"{}" as raw bytes; json.dumps({}) is the same body
    assert status == 201
    assert headers["Idempotent-Replayed"] == "true"
    assert json.loads(body) == {"order": "A-1"}
    assert len(upstream.effects()) == 1


# --- scoping and routing --------------------------------------------------------------------------------


async def test_one_tenant_cannot_replay_another_tenants_key(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tenants using the same key get two effects; neither sees the other's response."""
    monkeypatch.setenv("TOKEN_A", "secret-a")
    monkeypatch.setenv("TOKEN_B", "secret-b")
    tenants = {"a": {"token": "env:TOKEN_A"}, "b": {"token": "env:TOKEN_B"}}
    async with gateway_server(dsn, upstreams=shop(upstream), tenants=tenants) as gw:
        url = f"{gw.url}/shop/orders"
        a = await post(http, url, key="shared", Effect_Gateway_Token="secret-a")
        b = await post(http, url, key="shared", Effect_Gateway_Token="secret-b")
        nobody = await post(http, url, key="shared")
        wrong = await post(http, url, key="shared", Effect_Gateway_Token="secret-c")
    assert a[0] == b[0] == 201
    assert "Idempotent-Replayed" not in b[1]
    assert json.loads(a[2])["id"] != json.loads(b[2])["id"]
    assert nobody[0] == wrong[0] == 401
    effects = upstream.effects()
    assert len(effects) == 2
    assert all("Effect-Gateway-Token" not in call.headers for call in effects), "tenant tokens stay here"
    assert "secret-a" not in await database_text(dsn)
    # the derived keys differ, so the upstream's own key space cannot collide either
    rows = await effect_rows(dsn)
    assert {r["tenant"] for r in rows} == {"a", "b"}
    assert len({r["derived_key"] for r in rows}) == 2


async def test_unknown_upstream_is_404(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Only configured upstreams are reachable: the gateway is no open proxy."""
    status, headers, body = await post(http, f"{gateway.url}/elsewhere/orders")
    assert status == 404
    assert headers["Content-Type"] == PROBLEM
    assert problem_type(body) == "unknown-upstream"
    assert upstream.calls == []


@pytest.mark.parametrize(
    "target",
    [
        "/shop/../admin",
        "/shop/a/../../x",
        "/shop/%2e%2e/admin",
        "/shop/a%2fb",
        "/shop/a%2Fb",
        "/shop/a%5cb",
        "/shop/a\\b",
        "//evil.example/x",
        "/shop/http://evil.example/x",
        "http://localhost/shop/x",  # one naming another host is refused for its host (test_requests.py)
    ],
)
async def test_paths_that_could_escape_the_upstream_are_refused(
    gateway: Gateway, upstream: Upstream, target: str
) -> None:
    """'..', encoded slashes and dots, backslashes and absolute URLs never reach any upstream."""
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: p\r\nContent-Length: 2\r\n"
        "Connection: close\r\n\r\n{}".encode()
    )
    await writer.drain()
    raw = await reader.read()
    writer.close()
    assert raw.split(b" ", 2)[1] == b"400", raw
    assert b"problems/path-refused" in raw
    assert upstream.calls == []


async def test_the_query_and_path_are_forwarded(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """METHOD /<upstream>/<path>?<query> reaches <base_url>/<path>?<query>."""
    async with http.get(f"{gateway.url}/shop/orders/search?q=atta%20dal&n=2") as resp:
        assert resp.status == 201
    assert (upstream.calls[0].method, upstream.calls[0].path) == ("GET", "/orders/search")
    assert upstream.calls[0].query == "q=atta%20dal&n=2"


async def test_a_path_with_an_encoded_line_break_is_forwarded_as_sent(
    gateway: Gateway, upstream: Upstream
) -> None:
    """%0A in a path is no route's 404: the proxy forwards it, still encoded (found by schemathesis)."""
    raw = await raw_exchange(
        gateway.url, b"POST /shop/a%0Ab HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: nl\r\n"
    )
    assert raw.split(b" ", 2)[1] == b"201", raw
    assert [call.target for call in upstream.calls] == ["/a%0Ab"]


async def test_gateway_paths_no_route_serves_are_404_or_405_and_never_forwarded(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """PUT on a GET route is 405 with Allow; an unknown /_gateway/ path is 404 not-found, not an upstream.

    On the agents' listener every admin path is such a path: it says where the admin routes are.
    """
    for url in (gateway.url, gateway.admin_url):
        async with http.put(f"{url}/_gateway/health") as resp:
            assert resp.status == 405
            assert resp.headers["Allow"] == "GET, HEAD"
            assert problem_type(await resp.read()) == "method-not-allowed"
        async with http.get(f"{url}/_gateway/nothing") as resp:
            assert resp.status == 404
            assert problem_type(await resp.read()) == "not-found"
    async with http.get(f"{gateway.admin_url}/_gateway/effects/1/resolve") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
    for path in ("/_gateway/effects", "/_gateway/audit", "/_gateway/metrics", "/_gateway/openapi.json"):
        async with http.get(gateway.url + path) as resp:
            assert resp.status == 404, path
            assert "admin_listen" in (await resp.json())["detail"]
    assert upstream.calls == []


# --- credentials ------------------------------------------------------------------------------------------


async def test_credentials_are_injected_and_never_stored(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected secrets reach the upstream; neither they nor the agent's Authorization reach Postgres."""
    monkeypatch.setenv("SHOP_SECRET", "Bearer sk_live_injected_42")
    cfg = shop(upstream, inject_headers={"Authorization": "env:SHOP_SECRET"}, secret_headers=["X-Api-Key"])
    async with gateway_server(dsn, upstreams=cfg) as gw:
        status, _, _ = await post(
            http,
            f"{gw.url}/shop/orders",
            Authorization="Bearer agent_token_99",
            Cookie="session=c00kie",
            X_Api_Key="apikey-123",
        )
    assert status == 201
    sent = upstream.calls[0].headers
    assert sent["Authorization"] == "Bearer sk_live_injected_42"
    assert sent["X-Api-Key"] == "apikey-123"
    stored = await database_text(dsn)
    for secret in ("sk_live_injected_42", "agent_token_99", "c00kie", "apikey-123"):
        assert secret not in stored
    assert "agent_token_99" not in json.dumps(upstream.calls[0].headers)


async def test_the_upstream_receives_a_derived_key_and_stamp(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The native header carries a key derived from the scoped key; the stamp carries the same key."""
    cfg = shop(upstream, native_key={"header": "Idempotency-Key"}, stamp={"json_field": "client_reference"})
    async with gateway_server(dsn, upstreams=cfg) as gw:
        await post(http, f"{gw.url}/shop/orders", key="agent-key-1", body={"items": ["atta"]})
    call = upstream.calls[0]
    derived = call.headers["Idempotency-Key"]
    assert derived.startswith("eg_")
    assert "agent-key-1" not in derived
    assert json.loads(call.body) == {"items": ["atta"], "client_reference": derived}
    rows = await effect_rows(dsn)
    assert rows[0]["derived_key"] == derived


# --- outcomes ---------------------------------------------------------------------------------------------


async def test_refused_connection_leaves_retryable_and_the_retry_is_sent(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Nothing left the gateway, so nothing happened: the retry sends for real."""
    url_of_live = upstream.url
    # a port that refuses: bind one and close it
    probe_sock = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe_sock.sockets[0].getsockname()[1]
    probe_sock.close()
    await probe_sock.wait_closed()
    async with gateway_server(dsn, upstreams={"shop": {"base_url": f"http://127.0.0.1:{port}"}}) as gw:
        status, headers, body = await post(http, f"{gw.url}/shop/orders", key="refused")
    assert status == 502
    assert problem_type(body) == "upstream-unreachable"
    assert (await effect_rows(dsn))[0]["state"] == "retryable"
    async with gateway_server(dsn, upstreams={"shop": {"base_url": url_of_live}}) as gw:
        status, headers, _ = await post(http, f"{gw.url}/shop/orders", key="refused")
    assert status == 201
    assert "Idempotent-Replayed" not in headers
    assert len(upstream.effects()) == 1
    row = (await effect_rows(dsn))[0]
    assert (row["state"], row["attempt"]) == ("completed", 2)


@pytest.mark.parametrize("failure", ["timeout", "500", "reset"])
async def test_a_call_that_may_have_happened_is_never_resent_blindly(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, failure: str
) -> None:
    """Timeout, 500 or reset with no native key nor probe: in_doubt, then needs_review, one upstream call."""

    async def fail(request: web.Request) -> web.StreamResponse:
        if failure == "timeout":
            await asyncio.sleep(2)
        if failure == "reset":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.1)
        return web.json_response({"error": "boom"}, status=500)

    upstream.routes["/orders"] = fail
    cfg = {"shop": {"base_url": upstream.url, "timeout": "300ms"}}
    # A grace with room for a busy machine: the request must leave, not be late to send.
    async with gateway_server(dsn, upstreams=cfg, lease_grace="500ms") as gw:
        first = await post(http, f"{gw.url}/shop/orders", key="doubt")
        expected_first = {"timeout": 504, "500": 500, "reset": 502}[failure]
        assert first[0] == expected_first
        assert (await effect_rows(dsn))[0]["state"] == "in_doubt"
        await asyncio.sleep(0.9)  # past the lease (800 ms): the first attempt can no longer be under way
        for _ in range(3):
            status, _, body = await post(http, f"{gw.url}/shop/orders", key="doubt")
            assert status == 409
            assert problem_type(body) == "outcome-unknown"
    assert len(upstream.effects()) == 1
    assert (await effect_rows(dsn))[0]["state"] == "needs_review"


async def test_a_timed_out_call_is_not_recovered_while_its_lease_runs(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Right after a timeout the upstream may still be working: a retry is told to wait, not re-sent."""

    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.json_response({}, status=201)

    upstream.routes["/orders"] = hang
    cfg = {"shop": {"base_url": upstream.url, "timeout": "200ms", "repeat_harmless": True}}
    async with gateway_server(dsn, upstreams=cfg, lease_grace="2s") as gw:
        assert (await post(http, f"{gw.url}/shop/orders", key="slow"))[0] == 504
        status, headers, body = await post(http, f"{gw.url}/shop/orders", key="slow")
    assert status == 409
    assert problem_type(body) == "in-flight"
    assert int(headers["Retry-After"]) >= 1
    assert len(upstream.effects()) == 1


@pytest.mark.parametrize("status", [307, 308])
async def test_a_redirect_that_keeps_the_method_is_not_relayed_and_nothing_happens_past_the_gateway(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, status: int
) -> None:
    """A 307 or 308 to an order is 502 upstream-redirected naming its Location; the record is retryable.

    A client that follows redirects (aiohttp's default, as here; requests' too) cannot re-POST past the
    gateway. Before, the answer was stored as completed, relayed and replayed: the agent's client sent
    the order to the Location on every retry, straight to the upstream, with its Effect-Gateway-Token.
    Once base_url points where the upstream moved, the next retry places the order, once.
    """
    moved = f"{upstream.url}/v2/orders"

    async def old(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": moved})

    upstream.routes["/orders"] = old
    async with gateway_server(dsn, upstreams=shop(upstream)) as gw:
        for _ in range(3):
            async with http.post(
                f"{gw.url}/shop/orders", json={"items": ["atta"]}, headers={"Idempotency-Key": "moved"}
            ) as resp:
                assert resp.status == 502
                doc = await resp.json(content_type=PROBLEM)
            assert doc["type"].endswith("/upstream-redirected")
            assert doc["location"] == moved
            assert f"answered {status}" in doc["detail"]
        # a keyless PUT (audited) is not followed past the gateway either; a GET is relayed as it came
        async with http.put(f"{gw.url}/shop/orders", data=b"{}", allow_redirects=False) as resp:
            assert resp.status == 502
        async with http.get(f"{gw.url}/shop/orders", allow_redirects=False) as resp:
            assert (resp.status, resp.headers["Location"]) == (status, moved)
    assert upstream.effects("/v2/orders") == []
    rows = {row["key"]: row for row in await effect_rows(dsn)}
    assert (rows["moved"]["state"], rows["moved"]["response_status"]) == ("retryable", status)
    async with gateway_server(dsn, upstreams=shop(upstream, base_url=f"{upstream.url}/v2")) as gw:
        assert (await post(http, f"{gw.url}/shop/orders", key="moved"))[0] == 201
        assert (await post(http, f"{gw.url}/shop/orders", key="moved"))[0] == 201
    assert len(upstream.effects("/v2/orders")) == 1


@pytest.mark.parametrize("status", [301, 302])
async def test_a_301_or_302_to_a_put_patch_or_delete_is_not_relayed_but_to_a_post_it_is(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, status: int
) -> None:
    """301 and 302 repeat any method but POST (clients follow them with the same PUT, PATCH or DELETE).

    So to a keyed PUT, PATCH or DELETE they are 502 upstream-redirected and the record retryable, as 307
    and 308 are; to a POST, which clients turn into a GET, they are an answer like any other. Before,
    every one was completed and relayed, and aiohttp re-sent the PUT to the Location, past the gateway.
    """
    moved = f"{upstream.url}/v2/orders"

    async def old(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": moved})

    upstream.routes["/orders"] = old
    async with gateway_server(dsn, upstreams=shop(upstream)) as gw:
        for method in ("PUT", "PATCH", "DELETE"):
            async with http.request(
                method, f"{gw.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": f"k-{method}"}
            ) as resp:
                assert resp.status == 502
                assert (await resp.json(content_type=PROBLEM))["type"].endswith("/upstream-redirected")
        async with http.post(
            f"{gw.url}/shop/orders",
            json={"items": ["atta"]},
            headers={"Idempotency-Key": "k-POST"},
            allow_redirects=False,
        ) as resp:
            assert (resp.status, resp.headers["Location"]) == (status, moved)
    assert upstream.effects("/v2/orders") == []
    rows = {row["key"]: row["state"] for row in await effect_rows(dsn)}
    assert rows == {
        "k-PUT": "retryable",
        "k-PATCH": "retryable",
        "k-DELETE": "retryable",
        "k-POST": "completed",
    }


# --- bad input ----------------------------------------------------------------------------------------------


async def test_an_oversized_body_is_413_and_the_server_keeps_serving(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """A body over max_body_bytes is refused with problem+json; nothing is recorded or sent."""
    async with gateway_server(dsn, upstreams=shop(upstream), max_body_bytes=1024) as gw:
        async with http.post(
            f"{gw.url}/shop/orders", data=b"x" * 5000, headers={"Idempotency-Key": "big"}
        ) as resp:
            assert resp.status == 413
            assert resp.content_type == PROBLEM
            assert problem_type(await resp.read()) == "body-too-large"
        assert (await post(http, f"{gw.url}/shop/orders", key="small"))[0] == 201
    assert [r["key"] for r in await effect_rows(dsn)] == ["small"]
    assert len(upstream.effects()) == 1


async def test_non_utf8_headers_are_refused_without_crashing(
    gateway: Gateway, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Raw bytes that are not UTF-8 in a header get a 400, and the next request is served."""
    host, port = gateway.url.removeprefix("http://").split(":")
    for header in (b"Idempotency-Key: \xff\xfe", b"X-Note: caf\xe9"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /shop/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: u1\r\n"
            + header
            + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        await writer.drain()
        raw = await reader.read()
        writer.close()
        assert raw.split(b" ", 2)[1] == b"400", raw
    assert upstream.calls == []
    assert (await post(http, f"{gateway.url}/shop/orders", key="after"))[0] == 201


async def test_a_response_too_large_to_record_is_in_doubt_not_lost(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An answer over max_response_bytes cannot be replayed: 502 response-too-large, never re-sent blindly."""

    async def huge(_: web.Request) -> web.Response:
        return web.Response(body=b"x" * 5000, status=201)

    upstream.routes["/orders"] = huge
    cfg = shop(upstream, timeout="300ms")
    async with gateway_server(dsn, upstreams=cfg, max_response_bytes=1000, lease_grace="500ms") as gw:
        status, _, body = await post(http, f"{gw.url}/shop/orders", key="huge")
        assert status == 502
        assert problem_type(body) == "response-too-large"
        await asyncio.sleep(0.9)  # past the lease (800 ms): the first attempt can no longer be under way
        status, _, body = await post(http, f"{gw.url}/shop/orders", key="huge")
    assert status == 409
    assert problem_type(body) == "outcome-unknown"
    assert len(upstream.effects()) == 1


async def test_with_postgres_down_nothing_is_sent_and_service_resumes(
    postgres_dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """No claim, no call: 503 store-unavailable, the upstream untouched; once Postgres is back, it serves."""
    async with (
        failing_database(postgres_dsn, "outage") as db,
        gateway_server(db.dsn, upstreams=shop(upstream)) as gw,
    ):
        await db.cut()
        status, headers, body = await post(http, f"{gw.url}/shop/orders", key="down")
        assert status == 503
        assert problem_type(body) == "store-unavailable"
        assert "Retry-After" in headers
        assert upstream.calls == []
        await db.restore()
        # The pool replaces the connections that were cut at once; a pooler in front (make
        # test-pgbouncer) logs in to the server again after a second.
        for _ in range(10):
            status, _, _ = await post(http, f"{gw.url}/shop/orders", key="down")
            if status == 201:
                break
            await asyncio.sleep(0.3)
        assert status == 201
    assert len(upstream.effects()) == 1


async def test_an_outcome_that_cannot_be_recorded_is_recovered_not_resent(
    postgres_dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """Postgres goes away while the upstream works: 503 says so; the retry recovers by probe, one order."""
    release = asyncio.Event()

    async def place(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"order": "L-1", "ref": json.loads(await request.read())["ref"]}, status=201)

    async def search(request: web.Request) -> web.Response:
        ref = request.query["ref"]
        found = [{"order": "L-1", "ref": ref} for c in upstream.effects("/orders") if ref in c.body.decode()]
        return web.json_response({"items": found})

    upstream.routes["/orders"] = place
    upstream.routes["/orders/search"] = search
    cfg = shop(
        upstream,
        timeout="1s",
        stamp={"json_field": "ref"},
        probe={
            "path": "/orders/search?ref={key}",
            "found": "items.0",
            "status": 201,
            "routes": ["POST /orders"],
        },
    )
    async with failing_database(postgres_dsn, "lost_settle") as db:
        async with gateway_server(db.dsn, upstreams=cfg, lease_grace="200ms") as gw:
            first = asyncio.create_task(post(http, f"{gw.url}/shop/orders", key="lost"))
            await upstream.received.wait()  # claimed and sent: now the database goes away
            await db.cut()
            release.set()
            status, _, body = await first
            assert status == 503
            assert problem_type(body) == "store-unavailable"
            assert "could not be recorded" in json.loads(body)["detail"]
            await db.restore()
            # The pool replaces its cut connections (a pooler in front, after a second); Prefer: wait
            # outlasts the lease.
            for _ in range(10):
                status, _, body = await post(http, f"{gw.url}/shop/orders", key="lost", Prefer="wait=5")
                if status != 503:
                    break
                await asyncio.sleep(0.3)
        assert status == 201
        assert json.loads(body) == {"order": "L-1", "ref": (await effect_rows(db.dsn))[0]["derived_key"]}
        assert len(upstream.effects("/orders")) == 1
        assert (await effect_rows(db.dsn))[0]["recovered_by"] == "probe"
