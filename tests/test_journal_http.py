"""The httpx integration: unit tests with respx, and one through a real gateway and upstream."""

from __future__ import annotations

from collections.abc import Iterator

import asyncpg
import httpx
import pytest
import respx

from journal import Journal, StepContext, keyed_client
from journal.http import KeyedSyncTransport
from journal.journal import _current
from tests.gateways import gateway_server
from tests.upstreams import Upstream


@pytest.fixture
def step() -> Iterator[StepContext]:
    """A step under way, as Run.step sets it up."""
    ctx = StepContext("run-7", 4, "order")
    token = _current.set(ctx)
    yield ctx
    _current.reset(token)


@respx.mock
async def test_unsafe_requests_in_a_step_carry_the_steps_key(step: StepContext) -> None:
    """POST, PUT, PATCH and DELETE get Idempotency-Key run:step and the run/step headers; GET does not."""
    route = respx.route(host="shop.test").mock(return_value=httpx.Response(201))
    async with keyed_client() as http:
        await http.post("https://shop.test/orders", json={"items": ["atta"]})
        await http.get("https://shop.test/orders")
    posted, got = route.calls[0].request, route.calls[1].request
    assert posted.headers["Idempotency-Key"] == "run-7:4"
    assert (posted.headers["Effect-Gateway-Run"], posted.headers["Effect-Gateway-Step"]) == ("run-7", "4")
    assert "Idempotency-Key" not in got.headers


@respx.mock
async def test_a_random_key_made_up_by_an_sdk_is_replaced(step: StepContext) -> None:
    """An SDK's own key (random per attempt) is overridden, so its retries and the re-run share one."""
    route = respx.post("https://pay.test/v1/charges").mock(return_value=httpx.Response(200))
    async with keyed_client() as http:
        for sdk_key in ("stripe-node-retry-1f3a", "stripe-node-retry-99bc"):
            await http.post(
                "https://pay.test/v1/charges", data={"amount": "4200"}, headers={"Idempotency-Key": sdk_key}
            )
    assert [c.request.headers["Idempotency-Key"] for c in route.calls] == ["run-7:4", "run-7:4"]


@respx.mock
async def test_distinct_calls_in_one_step_get_distinct_deterministic_keys() -> None:
    """The n-th distinct call of a step gets run:step:n; the same calls on a re-run get the same keys."""
    respx.route(host="mail.test").mock(return_value=httpx.Response(202))
    seen: list[list[str]] = []
    for _ in range(2):  # the first run and its re-run
        token = _current.set(StepContext("run-8", 5, "email"))
        try:
            async with keyed_client() as http:
                keys = []
                for to in ("a@x.test", "b@x.test", "a@x.test"):
                    resp = await http.post("https://mail.test/messages", json={"to": to})
                    keys.append(resp.request.headers["Idempotency-Key"])
        finally:
            _current.reset(token)
        seen.append(keys)
    assert seen[0] == ["run-8:5", "run-8:5:2", "run-8:5"]
    assert seen[1] == seen[0]


@respx.mock
async def test_requests_outside_a_step_are_left_alone() -> None:
    """Outside a step there is no key to give; the request goes as the caller made it."""
    route = respx.post("https://shop.test/orders").mock(return_value=httpx.Response(201))
    async with keyed_client() as http:
        await http.post("https://shop.test/orders", json={}, headers={"Idempotency-Key": "callers-own"})
    assert route.calls[0].request.headers["Idempotency-Key"] == "callers-own"


@respx.mock
def test_the_sync_transport_stamps_too(step: StepContext) -> None:
    """Synchronous SDK clients get the same treatment through KeyedSyncTransport."""
    route = respx.post("https://shop.test/orders").mock(return_value=httpx.Response(201))
    with httpx.Client(transport=KeyedSyncTransport()) as http:
        http.post("https://shop.test/orders", json={})
    assert route.calls[0].request.headers["Idempotency-Key"] == "run-7:4"


async def test_a_rerun_through_the_gateway_replays_instead_of_ordering_again(
    dsn: str, postgres_dsn: str, upstream: Upstream
) -> None:
    """Killed between the effect and the checkpoint, the re-run's request is the same key: replayed."""
    conn = await asyncpg.connect(postgres_dsn)
    await conn.execute("drop table if exists agent_steps, agent_runs")
    await conn.close()
    journal = await Journal.connect(postgres_dsn)
    try:
        async with (
            gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw,
            keyed_client() as http,
        ):

            async def order(ctx: StepContext) -> dict[str, object]:
                resp = await http.post(f"{gw.url}/shop/orders", json={"items": ["atta"]})
                return {
                    "status": resp.status_code,
                    "replayed": resp.headers.get("Idempotent-Replayed"),
                    **resp.json(),
                }

            first = await (await journal.run("run-9")).step("order", order)
            # the crash: the effect happened, the checkpoint did not
            conn = await asyncpg.connect(postgres_dsn)
            await conn.execute("delete from agent_steps where run_id = 'run-9'")
            await conn.close()
            second = await (await journal.run("run-9")).step("order", order)
    finally:
        await journal.close()
    assert first["replayed"] is None
    assert second["replayed"] == "true"
    assert first["id"] == second["id"]
    assert len(upstream.effects()) == 1
    assert upstream.calls[0].headers.get("Effect-Gateway-Run") is None, (
        "the gateway's own headers stay with it"
    )
