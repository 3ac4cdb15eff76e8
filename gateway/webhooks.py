"""The webhook's rounds: find the effects that wait for an operator, post a notification of each, and
record how every delivery went.

With a ``[webhook]`` configured, every serving worker runs a round each ``interval`` (gateway.parts).
The sweep that finds new waits runs in one worker at a time (a transaction-level advisory lock, which
holds through a pooler in transaction mode); deliveries are taken one at a time by whichever worker is
free (gateway.notification_rows), so two never post the same notification at once. A delivery that
fails is tried again later with a growing wait, and given up after ``give_up_after`` (logged, recorded).

A receiver may still see one twice: a worker that dies after its POST and before recording it leaves
the notification to be posted again. Every delivery carries the notification's id (in the body, in
``Effect-Gateway-Notification`` and as ``Idempotency-Key``) for the receiver to drop such a repeat.
Neither the URL nor the token is ever logged or stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import aiohttp

import gateway
from gateway import notifications
from gateway.notifications import GiveUp, Notice, Shape
from gateway.settings import Settings
from gateway.store import Store
from gateway.telemetry import Telemetry

log = logging.getLogger("effect_gateway")

NOTIFICATION_HEADER = "Effect-Gateway-Notification"
# Deliveries one round makes at most, one after another: an incident sends a handful of effects to
# review, and Slack takes about one message a second per webhook; what is left waits for the next round.
ROUND_DELIVERIES = 20
# Added to the timeout to make a delivery's lease: time to write down what came of it.
RECORD_GRACE = timedelta(seconds=5)


# The most of a receiver's answer read before the connection is dropped instead: a webhook answers
# "ok" or a little JSON; 64 KiB holds any of those.
ANSWER_READ = 64 * 1024


@dataclass(frozen=True, slots=True)
class WebhookPlan:
    """The webhook's settings as plain values."""

    url: str
    shape: Shape
    token: str | None
    in_doubt_after: timedelta
    interval: timedelta
    timeout: timedelta
    retry_after: timedelta
    give_up_after: timedelta
    admin_url: str | None
    # How long a finished notification of an effect no longer open is kept: the gateway's retention.
    retention: timedelta

    @classmethod
    def of(cls, settings: Settings) -> WebhookPlan | None:
        """The plan of ``settings``' [webhook], or None without one."""
        hook = settings.webhook
        if hook is None:
            return None
        return cls(
            url=hook.url.get_secret_value(),
            shape=hook.shape,
            token=hook.token.get_secret_value() if hook.token else None,
            in_doubt_after=hook.in_doubt_after,
            interval=hook.interval,
            timeout=hook.timeout,
            retry_after=hook.retry_after,
            give_up_after=hook.give_up_after,
            admin_url=hook.admin_url,
            retention=settings.retention,
        )


@dataclass(frozen=True, slots=True)
class Answer:
    """What a receiver made of one delivery: its status (None: no answer at all) or why it failed."""

    status: int | None
    error: str | None = None
    # A 429's or 503's Retry-After, in seconds.
    asked: timedelta | None = None


class Webhook:
    """Rounds of one worker: notice the new waits, then deliver what is due."""

    def __init__(self, plan: WebhookPlan, store: Store, telemetry: Telemetry) -> None:
        self.plan = plan
        self._store = store
        self._telemetry = telemetry
        # No redirects followed (a 3xx is a failure: the URL is wrong, and the token must not follow it
        # elsewhere), no proxy from the environment, no cookies kept between deliveries.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=plan.timeout.total_seconds()),
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        await self._session.close()

    async def round(self) -> None:
        """Record the waits not yet told, then deliver up to ROUND_DELIVERIES of those due."""
        new = await self._store.notifications.notice_waits(self.plan.in_doubt_after, self.plan.retention)
        if new:
            log.debug("%d new waits to tell the webhook of", new)
        lease = self.plan.timeout + RECORD_GRACE
        for _ in range(ROUND_DELIVERIES):
            taken = await self._store.notifications.take_notification(lease)
            if taken is None:
                return
            await self.deliver(*taken)

    async def deliver(self, notice: Notice, now: datetime, scope: UUID) -> None:
        """Post ``notice`` (taken at ``now``, the database's clock) and record what came of it."""
        answer = await self._post(notice, now)
        what = (
            f"notification {notice.id} ({notice.event}: effect {notice.effect_id}, attempt {notice.attempt})"
        )
        if answer.status is not None and notifications.delivered(answer.status):
            if await self._record(notice, scope, answer, None, delivered=True):
                self._telemetry.notification(notice.event, "delivered")
                log.info("%s delivered to the webhook (%d) at try %d", what, answer.status, notice.tries)
            return
        why = answer.error or f"answered {answer.status}"
        next_try = notifications.after_failure(
            notice,
            now,
            retry_after=self.plan.retry_after,
            give_up_after=self.plan.give_up_after,
            asked=answer.asked,
        )
        if isinstance(next_try, GiveUp):
            if await self._record(notice, scope, answer, None, delivered=False):
                self._telemetry.notification(notice.event, "gave_up")
                log.error(
                    "gave up on %s after %d tries since %s: %s; the effect is on the audit page",
                    what,
                    notice.tries,
                    notice.noticed_at.isoformat(timespec="seconds"),
                    why,
                )
            return
        if await self._record(notice, scope, answer, next_try.wait, delivered=False):
            self._telemetry.notification(notice.event, "failed")
            log.warning(
                "%s not delivered to the webhook at try %d: %s; next try in %gs",
                what,
                notice.tries,
                why,
                next_try.wait.total_seconds(),
            )

    async def _record(
        self, notice: Notice, scope: UUID, answer: Answer, retry: timedelta | None, *, delivered: bool
    ) -> bool:
        recorded = await self._store.notifications.record_delivery(
            notice, scope, status=answer.status, error=answer.error, retry=retry, delivered=delivered
        )
        if not recorded:
            # This worker stalled past the delivery's lease and another took it: theirs is the record.
            log.warning("notification %s: another try took it meanwhile; this answer is dropped", notice.id)
        return recorded

    async def _post(self, notice: Notice, now: datetime) -> Answer:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"effect-gateway/{gateway.__version__}",
            NOTIFICATION_HEADER: notice.id,
            # A receiver that honours keys drops a repeat by itself.
            "Idempotency-Key": notice.id,
        }
        if self.plan.token is not None:
            headers["Authorization"] = f"Bearer {self.plan.token}"
        data = notifications.body(notice, now, self.plan.shape, self.plan.admin_url)
        try:
            async with self._session.post(
                self.plan.url, data=data, headers=headers, allow_redirects=False
            ) as resp:
                # Read to its end (up to a bound), so the connection can be used again; a longer
                # answer closes it instead: a receiver's body is never worth a worker's memory.
                if len(await resp.content.read(ANSWER_READ)) == ANSWER_READ:
                    resp.close()
                return Answer(resp.status, asked=_retry_after(resp.headers.get("Retry-After")))
        except TimeoutError:
            return Answer(None, f"no answer within {self.plan.timeout.total_seconds():g}s")
        except aiohttp.ClientConnectorError as exc:
            # Its text names the host and port, never the URL's path (a Slack webhook's secret).
            return Answer(None, f"could not connect: {exc.os_error.strerror or type(exc.os_error).__name__}")
        except aiohttp.ServerDisconnectedError:
            return Answer(None, "the connection was closed before an answer")
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            # ValueError: a URL that passed its check but cannot be sent (a host IDNA refuses).
            return Answer(None, type(exc).__name__)


def _retry_after(value: str | None) -> timedelta | None:
    """Retry-After in seconds (a date is rare from a webhook receiver, and ignored)."""
    if value is None or not value.strip().isdigit():
        return None
    return timedelta(seconds=int(value.strip()))
