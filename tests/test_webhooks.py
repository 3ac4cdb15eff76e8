"""Told, not found: a configured webhook hears of each effect that waits for an operator, once per wait.

A real gateway on port 0 sends real effects to a real upstream that fails them; a real aiohttp
receiver on port 0 plays the operator's webhook, and fails deliveries as a receiver that is down would.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from gateway.errors import ConfigError
from gateway.settings import load_settings
from gateway.store import opened
from tests.database import effect
from tests.factories import new_effect
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream, serving

# Short timings, so that a test takes a second or two: a round every 50 ms, a retry 50 ms after a
# failed delivery (then 100, 200, ...).
FAST = {"interval": "50ms", "retry_after": "50ms", "timeout": "2s"}
# Generous bound on any wait below, on a loaded machine.
PATIENCE = 15.0
TOKEN = "hook-token-of-the-tests"


@dataclass
class Receiver:
    """A webhook receiver: fails the first ``fails`` deliveries of each notification (a 500, then a
    connection dropped without an answer, then 500 again), then takes it."""

    fails: int = 2
    url: str = ""
    # Every request that arrived: its headers and JSON body.
    arrived: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    # The bodies it answered 200, in order.
    accepted: list[dict[str, Any]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        doc = json.loads(await request.read())
        self.arrived.append((dict(request.headers), doc))
        tries = sum(1 for _, seen in self.arrived if _id(seen) == _id(doc))
        if tries <= self.fails:
            if tries % 2 == 0:
                assert request.transport is not None
                request.transport.close()  # dropped: no answer at all
                await asyncio.sleep(0.1)
            return web.Response(status=500, text="down for maintenance")
        self.accepted.append(doc)
        return web.Response(text="ok")

    def told(self) -> list[tuple[Any, ...]]:
        """(event, effect id, attempt) of each notification accepted, in order."""
        return [(d["event"], d["effect"]["id"], d["effect"]["attempt"]) for d in self.accepted]


def _id(doc: dict[str, Any]) -> str:
    # The Slack shape has no id field: its text ends with it.
    return str(doc.get("id") or doc["text"].rsplit(" ", 1)[1])


@asynccontextmanager
async def receiver(fails: int = 2) -> AsyncIterator[Receiver]:
    hook = Receiver(fails)
    app = web.Application()
    app.router.add_post("/hook/T000/B000/secret-part", hook.handle)
    async with serving(app) as url:
        hook.url = f"{url}/hook/T000/B000/secret-part"
        yield hook


@asynccontextmanager
async def told(
    dsn: str, upstream: Upstream, fails: int = 2, **webhook: str
) -> AsyncIterator[tuple[Receiver, Gateway]]:
    """A receiver that fails its first ``fails`` tries, and a gateway in front of ``upstream`` that
    tells it (``webhook``: settings beside the url and FAST's timings)."""
    async with (
        receiver(fails) as hook,
        gateway_server(
            dsn, upstreams={"shop": {"base_url": upstream.url}}, webhook={"url": hook.url, **FAST, **webhook}
        ) as gw,
    ):
        yield hook, gw


async def until(condition: Any, what: str) -> None:
    """Until ``condition()`` is true, within PATIENCE seconds."""
    for _ in range(int(PATIENCE / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still not {what} after {PATIENCE}s")


def rounds(gw: Gateway) -> float:
    """How many sweeps this gateway has run (its store's "notice" statements)."""
    registry = gw.runtime.telemetry.metrics.registry
    found = registry.get_sample_value("effect_gateway_store_duration_seconds_count", {"statement": "notice"})
    return found or 0.0


async def more_rounds(*gateways: Gateway, count: int = 5) -> None:
    """Until each gateway has swept ``count`` more times: long enough for a repeat to have arrived."""
    start = [rounds(gw) for gw in gateways]
    await until(
        lambda: all(rounds(gw) >= n + count for gw, n in zip(gateways, start, strict=True)),
        f"{count} more rounds",
    )


async def notification_rows(dsn: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("select * from effect_notifications order by noticed_at, effect_id, attempt")
    finally:
        await conn.close()
    return [dict(row) for row in rows]


async def order(http: aiohttp.ClientSession, gw: Gateway, key: str) -> int:
    async with http.post(
        f"{gw.url}/shop/orders",
        data=b'{"items":["atta"]}',
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    ) as resp:
        return resp.status


async def failing(request: web.Request) -> web.Response:
    """The shop fails every order with a 500: it may or may not have placed it."""
    return web.json_response({"error": "boom"}, status=500)


async def test_an_effect_sent_to_review_is_told_once_however_often_the_receiver_fails_first(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each wait for review reaches the webhook exactly once, after two failed deliveries, and again
    when the same effect, resolved as not done and retried, waits for review at its next attempt."""
    monkeypatch.setenv("HOOK_TOKEN", TOKEN)
    upstream.routes["/orders"] = failing
    async with told(dsn, upstream, token="env:HOOK_TOKEN") as (hook, gw):
        assert await order(http, gw, "k") == 500  # in doubt
        assert await order(http, gw, "k") == 409  # no probe, no native key: review, attempt 1
        await until(lambda: len(hook.accepted) == 1, "told of the first review")
        await more_rounds(gw)
        first = await notification_rows(dsn)

        async with http.post(
            f"{gw.admin_url}/_gateway/effects/1/resolve", json={"happened": False, "attempt": 1}
        ) as resp:
            assert resp.status == 200
        assert await order(http, gw, "k") == 500  # sent again (attempt 2), in doubt again
        assert await order(http, gw, "k") == 409  # review again, attempt 2
        await until(lambda: len(hook.accepted) == 2, "told of the second review")
        await more_rounds(gw)
        second = await notification_rows(dsn)

    assert hook.told() == [("needs_review", 1, 1), ("needs_review", 1, 2)]
    assert len(hook.arrived) == 6, "two failed deliveries and one taken, for each wait"
    assert len(upstream.effects()) == 2
    [row] = first
    assert (row["tries"], row["last_status"], row["last_error"]) == (3, 200, None)
    assert row["delivered_at"] is not None
    assert row["gave_up_at"] is None
    assert [(r["attempt"], r["tries"]) for r in second] == [(1, 3), (2, 3)]
    doc = hook.accepted[0]
    assert doc["effect"] | {"created_at": None} == {
        "id": 1,
        "tenant": "default",
        "upstream": "shop",
        "method": "POST",
        "path": "/orders",
        "state": "needs_review",
        "attempt": 1,
        "created_at": None,
        "run_id": None,
        "step": None,
    }
    assert doc["audit_path"] == "/_gateway/audit/1"
    assert "effect-gateway resolve 1 --attempt 1 --did-not-happen" in doc["what_to_do"]
    headers = [h for h, d in hook.arrived if d["id"] == doc["id"]]
    assert {h["Effect-Gateway-Notification"] for h in headers} == {doc["id"]}, "one id for every try"
    assert {h["Authorization"] for h in headers} == {f"Bearer {TOKEN}"}
    assert "atta" not in json.dumps(hook.accepted), "no request body is ever told"
    assert TOKEN not in json.dumps(second, default=str)
    assert "secret-part" not in json.dumps(second, default=str)


async def test_an_effect_left_in_doubt_is_told_once_it_has_waited_in_doubt_after(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """An effect in doubt that nobody retries, and one whose gateway died holding it, are each told
    once, as in doubt, once they have waited in_doubt_after; one retried in time is not told."""
    upstream.routes["/orders"] = failing
    # in_doubt_after: long enough that effect 3's two requests, back to back, come well within it on
    # a loaded machine; short enough to keep the test quick.
    async with told(dsn, upstream, in_doubt_after="3s") as (hook, gw):
        assert await order(http, gw, "left") == 500  # effect 1: in doubt, and its agent never retries
        async with opened(dsn) as store:
            # Effect 2: claimed by a gateway that died before it could record anything.
            died, _ = await store.claim(new_effect("died"), timedelta(0))
        assert died is not None
        assert await order(http, gw, "retried") == 500  # effect 3: retried at once, to review
        assert await order(http, gw, "retried") == 409
        await until(lambda: len(hook.accepted) == 3, "told of the three")
        await more_rounds(gw)
        rows = await notification_rows(dsn)

    assert sorted(hook.told()) == [("in_doubt", 1, 1), ("in_doubt", 2, 1), ("needs_review", 3, 1)]
    assert len(hook.arrived) == 9
    in_doubt = {d["effect"]["id"]: d for d in hook.accepted if d["event"] == "in_doubt"}
    assert (in_doubt[1]["effect"]["state"], in_doubt[2]["effect"]["state"]) == ("in_doubt", "pending")
    assert all(d["waited_seconds"] >= 3 for d in in_doubt.values())
    assert [r["tries"] for r in rows] == [3, 3, 3]


async def test_many_sweeps_of_two_gateways_tell_each_wait_once(dsn: str, upstream: Upstream) -> None:
    """Two gateways on one database, sweeping every 20 ms, deliver each wait once between them."""
    webhook = FAST | {"interval": "20ms"}
    async with receiver(fails=0) as hook:
        cfg: dict[str, Any] = {
            "upstreams": {"shop": {"base_url": upstream.url}},
            "webhook": {"url": hook.url, **webhook},
        }
        async with gateway_server(dsn, **cfg) as one, gateway_server(dsn, **cfg) as two:
            await effect(dsn, "a", "b", "c", review=True)
            await until(lambda: len(hook.accepted) == 3, "told of the three")
            await more_rounds(one, two, count=10)
            # And sweeps at the very same moment, beside theirs.
            again = await asyncio.gather(
                *(
                    one.runtime.store.notifications.notice_waits(timedelta(hours=1), timedelta(days=7))
                    for _ in range(8)
                )
            )
            await more_rounds(one, two)
    assert sorted(hook.told()) == [("needs_review", 1, 1), ("needs_review", 2, 1), ("needs_review", 3, 1)]
    assert len(hook.arrived) == 3
    assert set(again) <= {0, None}


async def test_the_slack_shape_is_a_message_slack_posts(dsn: str, upstream: Upstream) -> None:
    """With shape = "slack" the receiver gets what Slack's incoming webhooks accept: JSON with a text,
    linking to the effect's audit page when admin_url is given."""
    async with told(dsn, upstream, fails=0, shape="slack", admin_url="https://ops.example:8788") as (hook, _):
        await effect(dsn, "k", review=True)
        await until(lambda: len(hook.accepted) == 1, "told")
    [(headers, doc)] = hook.arrived
    assert headers["Content-Type"] == "application/json"
    assert list(doc) == ["text"]
    assert doc["text"].startswith("*Effect 1 needs review* (attempt 1, waiting ")
    assert "<https://ops.example:8788/_gateway/audit/1|audit page>" in doc["text"]
    assert "`POST shop/orders`, tenant default, run run-1 step 4" in doc["text"]
    assert doc["text"].endswith(f"notification {headers['Effect-Gateway-Notification']}")


async def test_a_receiver_that_never_takes_it_is_given_up_on_and_logged(
    dsn: str, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    """Past give_up_after, a notification nobody took is tried no more, recorded as given up, and a
    line in the log says so."""
    # Tries 50 ms apart, doubling: about five within give_up_after, at least two on any machine.
    async with told(dsn, upstream, fails=1000, give_up_after="2s") as (hook, gw):
        with caplog.at_level(logging.INFO, logger="effect_gateway"):
            await effect(dsn, "k", review=True)

            async def given_up() -> bool:
                return any(r["gave_up_at"] for r in await notification_rows(dsn))

            for _ in range(int(PATIENCE / 0.05)):
                if await given_up():
                    break
                await asyncio.sleep(0.05)
            tried = len(hook.arrived)
            await more_rounds(gw)
        [row] = await notification_rows(dsn)
    assert row["gave_up_at"] is not None
    assert row["delivered_at"] is None
    assert row["tries"] == tried >= 2
    assert len(hook.arrived) == tried, "nothing more after giving up"
    said = [r.getMessage() for r in caplog.records]
    assert sum("gave up on notification" in line for line in said) == 1
    assert not any("secret-part" in line for line in said), "the URL is never logged"


async def test_without_a_webhook_nothing_is_swept(dsn: str, upstream: Upstream) -> None:
    """No [webhook]: effects waiting for review cost nothing more, not a statement."""
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        await effect(dsn, "k", review=True)
        await asyncio.sleep(0.3)  # several rounds, had there been any
        assert rounds(gw) == 0
    assert await notification_rows(dsn) == []


@pytest.mark.parametrize(
    ("webhook", "line"),
    [
        (
            {"url": "ftp://hooks.example/T0/B0/secret-part"},
            "bad setting webhook.url: must be an http:// or https:// URL (give it as 'env:NAME' when it "
            "holds a secret)",
        ),
        (
            {"url": "env:NO_SUCH_HOOK"},
            "bad setting webhook.url: environment variable NO_SUCH_HOOK is not set",
        ),
        (
            {"url": "https://h/x", "in_doubt_after": "0s"},
            "bad setting webhook.in_doubt_after: must be more than 0s",
        ),
        (
            {"url": "https://h/x", "shape": "teams"},
            "bad setting webhook.shape: Input should be 'json' or 'slack'",
        ),
        (
            {"url": "https://h/x", "interval": "soon"},
            "bad setting webhook.interval: 'soon' is not a duration",
        ),
        (
            {"url": "https://h/x", "retry_after": "1m", "give_up_after": "30s"},
            "bad setting webhook: give_up_after must be at least retry_after, or no delivery would be "
            "retried",
        ),
        ({"url": "https://h/x", "retries": 3}, "bad setting webhook.retries: Extra inputs are not permitted"),
        ({"shape": "slack"}, "bad setting webhook.url: Field required"),
    ],
)
def test_a_bad_webhook_setting_stops_start_up_in_one_line(webhook: dict[str, Any], line: str) -> None:
    """A wrong [webhook] value stops the gateway with one line naming the setting, never the URL."""
    with pytest.raises(ConfigError) as caught:
        load_settings(None, webhook=webhook)
    assert str(caught.value).startswith(line)
    assert "\n" not in str(caught.value)
    assert "secret-part" not in str(caught.value)
