"""error_format = "stripe": the real stripe-python through a real gateway sees its own errors.

The gateway's errors on such an upstream come in Stripe's shape, with the statuses and types that
stripe-python turns into the exception docs/contract.md lists, and Stripe-Should-Retry saying whether the
SDK's own retry (under the same key) can help.
"""

from __future__ import annotations

import asyncio
import re
import socket
import tomllib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
import stripe
from aiohttp import web

from agent_example.upstreams import payments
from gateway import problems
from gateway.stripe_errors import SHAPES
from tests.database import effect_rows, failing_database
from tests.gateways import gateway_server
from tests.support import ROOT
from tests.upstreams import Upstream, serving

# The payments upstream exactly as the example configuration has it (Stripe's error shape among it).
PAYMENTS = tomllib.loads((ROOT / "examples" / "gateway.toml").read_text())["upstreams"]["payments"]
CHARGE = {"amount": 4200, "currency": "inr", "source": "tok_visa"}


class CountingClient(stripe.HTTPXClient):
    """stripe-python's httpx client, counting the requests stripe-python makes (its retries included).

    Its retries go at once, unless ``backoff``: stripe-python's own backoff (half a second and up) is
    time the tests would only wait out. Only a test that needs another request to finish meanwhile keeps
    it.
    """

    def __init__(self, *, backoff: bool = False) -> None:
        super().__init__()
        self.requests = 0
        self.backoff = backoff

    def _sleep_time_seconds(self, num_retries: int, *args: Any) -> float:
        # stripe-python's own hook for its backoff (private; its own tests use it), where to turn it off.
        return super()._sleep_time_seconds(num_retries, *args) if self.backoff else 0.0

    async def request_async(
        self, method: str, url: str, headers: Mapping[str, str], post_data: Any = None
    ) -> tuple[bytes, int, Mapping[str, str]]:
        self.requests += 1
        return await super().request_async(method, url, headers, post_data)


def stripe_at(url: str, http: stripe.HTTPClient | None = None, retries: int = 0) -> stripe.StripeClient:
    return stripe.StripeClient(
        "sk_test_held_by_the_gateway",
        base_addresses={"api": url},
        http_client=http or stripe.HTTPXClient(),
        max_network_retries=retries,
    )


async def charge(client: stripe.StripeClient, key: str | None, **params: Any) -> stripe.Charge:
    options: dict[str, Any] = {"idempotency_key": key} if key else {}
    return await client.v1.charges.create_async({**CHARGE, **params}, options)


@pytest.fixture
async def payments_url() -> AsyncIterator[str]:
    async with serving(payments.make_app()) as url:
        yield url


async def test_a_key_reused_for_another_charge_raises_stripes_idempotency_error(
    dsn: str, payments_url: str, upstream: Upstream
) -> None:
    """Another amount under a used key is IdempotencyError, as from Stripe; problem+json stays the default."""
    upstreams = {"payments": {**PAYMENTS, "base_url": payments_url}, "shop": {"base_url": upstream.url}}
    async with gateway_server(dsn, upstreams=upstreams) as gw:
        client = stripe_at(f"{gw.url}/payments")
        first = await charge(client, "run-1:4")
        again = await charge(client, "run-1:4")
        with pytest.raises(stripe.IdempotencyError) as caught:
            await charge(client, "run-1:4", amount=9900)
        async with aiohttp.ClientSession() as http:
            for items in (["atta"], ["ghee"]):
                async with http.post(
                    f"{gw.url}/shop/orders", json={"items": items}, headers={"Idempotency-Key": "run-1:5"}
                ) as resp:
                    shop_answer = resp.status, resp.content_type, await resp.json()
    assert (again.id, again.last_response.headers["Idempotent-Replayed"]) == (first.id, "true")
    error = caught.value
    assert error.error is not None
    assert (error.http_status, error.error.type, error.error.code) == (400, "idempotency_error", "key_reused")
    assert error.error.doc_url == "https://effect-gateway.dev/problems/key-reused"
    assert "different method, path, query or body" in str(error.user_message)
    assert error.headers is not None
    assert error.headers["Stripe-Should-Retry"] == "false"
    status, content_type, body = shop_answer
    assert (status, content_type, body["type"]) == (
        422,
        "application/problem+json",
        "https://effect-gateway.dev/problems/key-reused",
    )
    charges = [row for row in await effect_rows(dsn) if row["upstream"] == "payments"]
    assert len(charges) == 1


async def test_a_key_stripe_python_made_up_is_refused_where_step_keys_are_wanted(
    dsn: str, payments_url: str
) -> None:
    """Without the step's key, stripe-python's own random key is IdempotencyError; nothing is charged."""
    async with gateway_server(dsn, upstreams={"payments": {**PAYMENTS, "base_url": payments_url}}) as gw:
        with pytest.raises(stripe.IdempotencyError) as caught:
            await charge(stripe_at(f"{gw.url}/payments"), None)
    assert caught.value.error is not None
    assert (caught.value.http_status, caught.value.error.code) == (400, "key_random")
    assert "ends in a UUID" in str(caught.value.user_message)
    assert await effect_rows(dsn) == []
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{payments_url}/v1/charges/search", params={"query": "metadata['idempotency_key']:'x'"}
        ) as resp,
    ):
        assert (await resp.json())["data"] == []


async def test_a_request_in_flight_is_retried_by_stripe_python_and_gets_the_one_charge(
    dsn: str, upstream: Upstream
) -> None:
    """A call under a key still in flight is 409, as from Stripe; stripe-python retries into the replay."""

    async def slow_charge(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.json_response({"id": f"ch_{len(upstream.effects())}", "object": "charge", "amount": 4200})

    upstream.routes["/v1/charges"] = slow_charge
    async with gateway_server(dsn, upstreams={"payments": {**PAYMENTS, "base_url": upstream.url}}) as gw:
        # The retries wait stripe-python's own backoff, long enough for the first call to finish.
        first_client, twin_client = CountingClient(), CountingClient(backoff=True)
        first = asyncio.create_task(charge(stripe_at(f"{gw.url}/payments", first_client), "run-2:4"))
        await upstream.received.wait()
        twin = await charge(stripe_at(f"{gw.url}/payments", twin_client, retries=5), "run-2:4")
        made = await first
    assert twin.id == made.id == "ch_1"
    assert twin.last_response is not None
    assert twin.last_response.headers["Idempotent-Replayed"] == "true"
    assert first_client.requests == 1
    assert twin_client.requests >= 2  # stripe-python met the 409 and retried under the same key
    assert len(upstream.effects()) == 1


async def test_an_outcome_only_an_operator_can_settle_is_not_retried_by_stripe_python(
    dsn: str, upstream: Upstream
) -> None:
    """A 5xx stripe-python retries lands on outcome-unknown: APIError at once, no retry loop, one charge."""

    async def lost(request: web.Request) -> web.Response:
        return web.json_response({"error": {"type": "api_error", "message": "lost"}}, status=500)

    upstream.routes["/v1/charges"] = lost
    # No native key and no probe: nothing can tell whether the first call happened.
    bare = {"base_url": upstream.url, "error_format": "stripe"}
    async with gateway_server(dsn, upstreams={"payments": bare}) as gw:
        counting = CountingClient()
        with pytest.raises(stripe.APIError) as caught:
            await charge(stripe_at(f"{gw.url}/payments", counting, retries=3), "run-3:4")
    assert type(caught.value) is stripe.APIError
    assert caught.value.error is not None
    assert (caught.value.http_status, caught.value.error.code) == (409, "outcome_unknown")
    assert "effect-gateway resolve 1" in str(caught.value.user_message)
    assert counting.requests == 2  # the upstream's own 500, retried once into the gateway's 409
    assert len(upstream.effects()) == 1
    (row,) = await effect_rows(dsn)
    assert row["state"] == "needs_review"


async def test_an_unreachable_upstream_and_a_store_down_are_api_errors_stripe_python_retries(
    postgres_dsn: str, payments_url: str
) -> None:
    """Nothing sent (upstream unreachable, or the store down): APIError after stripe-python's own retries."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
    upstreams = {
        "payments": {**PAYMENTS, "base_url": payments_url},
        "gone": {**PAYMENTS, "base_url": nowhere},
    }
    async with (
        failing_database(postgres_dsn, "stripe_errors") as db,
        gateway_server(db.dsn, upstreams=upstreams) as gw,
    ):
        unreachable = CountingClient()
        with pytest.raises(stripe.APIError) as no_upstream:
            await charge(stripe_at(f"{gw.url}/gone", unreachable, retries=1), "run-4:4")
        await db.cut()
        store_down = CountingClient()
        with pytest.raises(stripe.APIError) as no_store:
            await charge(stripe_at(f"{gw.url}/payments", store_down, retries=1), "run-4:5")
    for caught, counted, status, code in (
        (no_upstream, unreachable, 502, "upstream_unreachable"),
        (no_store, store_down, 503, "store_unavailable"),
    ):
        assert caught.value.error is not None
        assert (caught.value.http_status, caught.value.error.code, counted.requests) == (status, code, 2)


# --- the table in docs/contract.md, through stripe-python ------------------------------------------------

# Every problem type, the base class's own ("internal") among them.
TYPES: dict[str, type[problems.Problem]] = {"internal": problems.Problem, **problems.problem_types()}

_ROW = re.compile(r"^\| `([a-z-]+)` \| (\d{3}) \| `(\w+)` \| `(\w+)` \| (yes|no) \|$", re.MULTILINE)


def documented() -> dict[str, tuple[int, str, str, bool]]:
    text = (ROOT / "docs" / "contract.md").read_text()
    return {
        name: (int(status), kind, cls, retry == "yes")
        for name, status, kind, cls, retry in _ROW.findall(text)
    }


def test_every_problem_type_has_a_stripe_shape_and_a_row_in_the_contract() -> None:
    """No problem type ships without its Stripe status, type and retry, nor without its documented row."""
    assert set(SHAPES) == set(TYPES)
    assert set(documented()) == set(TYPES)


async def test_stripe_python_raises_for_each_problem_type_the_class_the_contract_documents() -> None:
    """Each gateway error in Stripe's shape is the exception, and the retry, that the contract says."""

    async def answer(request: web.Request) -> web.Response:
        problem = TYPES[request.match_info["type"]]
        return problems.render(problem("what went wrong", effect_id=7), error_format="stripe")

    app = web.Application()
    app.router.add_post("/{type}/v1/charges", answer)
    seen = {}
    async with serving(app) as url:
        for name in TYPES:
            with pytest.raises(stripe.StripeError) as caught:
                await charge(stripe_at(f"{url}/{name}"), "run-5:1")
            error = caught.value
            assert error.error is not None
            assert error.headers is not None
            assert (error.user_message, error.error.effect_id) == ("what went wrong", 7)
            retry = error.headers["Stripe-Should-Retry"] == "true"
            seen[name] = (error.http_status, error.error.type, type(error).__name__, retry)
    assert seen == documented()
