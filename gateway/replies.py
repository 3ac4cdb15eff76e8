"""What the agent gets back: the upstream's answer, or the problem that says why it has none."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import assert_never

from gateway import problems
from gateway.decision import repeats_request
from gateway.endings import (
    AwaitsOperator,
    Ending,
    Fenced,
    FencedDuring,
    InFlight,
    KeyMissing,
    KeyReused,
    ProbeTooSoon,
    ProbeUnavailable,
    Redirected,
    ResponseGone,
    Unanswered,
    Unrecorded,
)
from gateway.errors import (
    BadCoding,
    BadName,
    BodyUnreadable,
    CursorUnknown,
    DecodedTooLarge,
    FormRefused,
    GatewayError,
    HeaderRefused,
    JsonRefused,
    KeySyntaxError,
    NoSuchEffect,
    NotAwaitingOperator,
    StampError,
    StoreRejected,
    StoreUnavailable,
    UnsupportedCoding,
    WritesLost,
)
from gateway.outcome import Answered, NoAnswer, NotSent, Outcome
from gateway.policy import UpstreamPolicy
from gateway.record import StoredResponse


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer for the agent: the upstream's (``replayed`` when it is the stored one of an earlier
    request). A request that ends without one ends with an :data:`gateway.endings.Ending` instead."""

    response: StoredResponse
    replayed: bool
    effect_id: int | None


def reply(outcome: Outcome, effect_id: int | None) -> Reply | Unanswered:
    """Answer with what the upstream answered, or say that it gave no answer."""
    if isinstance(outcome, Answered):
        return Reply(StoredResponse(outcome.status, outcome.headers, outcome.body), False, effect_id)
    return Unanswered(outcome, effect_id)


def redirected(
    outcome: Outcome, policy: UpstreamPolicy, effect_id: int | None, method: str
) -> Redirected | None:
    """Say when an answer is a redirect that repeats the request, which is never relayed (None: it is not).

    A client that follows it (requests and aiohttp do by default) would send the request again to
    wherever Location points, past the gateway: on the first answer and on every replay, with the
    agent's Effect-Gateway-Token. The upstream did not act (the record is retryable): say so instead.
    """
    if not (isinstance(outcome, Answered) and repeats_request(outcome.status, method)):
        return None
    location = next((value for name, value in outcome.headers if name.lower() == "location"), "")
    # Stored header text stands for the upstream's bytes (surrogate-escaped): shown here as text.
    shown = location.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return Redirected(effect_id, outcome.status, shown, policy.name)


def stored(outcome: Outcome) -> StoredResponse | None:
    """Return the upstream's answer as the audit stores it; None when nothing answered."""
    if isinstance(outcome, Answered):
        return StoredResponse(outcome.status, outcome.headers, outcome.body)
    return None


def describe(outcome: Outcome) -> str:
    """Say in a few words what came of a send ("answered 201", or why nothing answered), for the history."""
    match outcome:
        case Answered(status=status):
            return f"answered {status}"
        case NotSent(reason=reason) | NoAnswer(reason=reason):
            return reason
    assert_never(outcome)


def problem(ending: Ending) -> problems.Problem:
    """Turn how a request ended into the problem its agent gets: the one place that picks the status,
    the ``Retry-After`` and the words."""
    match ending:
        case KeyReused(effect_id=effect_id):
            return problems.KeyReused(
                "this Idempotency-Key was first used with a different method, path, query or body",
                effect_id=effect_id,
            )
        case KeyMissing(method=method, upstream=upstream):
            return problems.KeyMissing(
                f"{method} to {upstream} needs an Idempotency-Key header: without one a retry would do the "
                "effect again"
            )
        case InFlight(effect_id=effect_id, retry_after=retry_after, why=why, waiting=waiting):
            then = {
                "wait over": "retry, or send Prefer: wait=N",
                "client left": "the client went away while waiting for it",
                "no seat": f"{waiting} requests wait for it already",
            }[why]
            return problems.InFlight(
                f"another request with this key is in flight; {then}",
                headers=_retry_after(retry_after),
                effect_id=effect_id,
            )
        case Fenced(effect_id=effect_id, during=during, answer=answer):
            return problems.Fenced(_fenced(during, answer), headers={"Retry-After": "1"}, effect_id=effect_id)
        case AwaitsOperator(effect_id=effect_id, answer=None):
            return problems.OutcomeUnknown(
                f"the effect may have happened and nothing can tell; {how_to_resolve(ending)}",
                effect_id=effect_id,
            )
        case AwaitsOperator(effect_id=effect_id, answer=answer, error=error):
            return problems.OutcomeUnknown(
                f"the upstream {answer} but the gateway could not record the answer ({error}); nothing will "
                f"be sent again for this key until it is resolved: {how_to_resolve(ending)}",
                effect_id=effect_id,
            )
        case ResponseGone(effect_id=None, why=why):
            return problems.ResponsePurged(why)
        case ResponseGone(effect_id=effect_id, why=why):
            return problems.ResponsePurged(
                "the effect happened and is never sent again; its response was dropped after the retention "
                f"and {why}",
                effect_id=effect_id,
            )
        case ProbeUnavailable(effect_id=effect_id, detail=detail):
            return problems.ProbeUnavailable(detail, headers={"Retry-After": "5"}, effect_id=effect_id)
        case ProbeTooSoon(effect_id=effect_id, detail=detail, retry_after=retry_after):
            wait = _retry_after(retry_after)
            return problems.ProbeTooSoon(
                f"{detail} (the upstream's probe.lag); nothing was sent and the record is unchanged, retry "
                f"in {wait['Retry-After']}s",
                headers=wait,
                effect_id=effect_id,
            )
        case Unrecorded(effect_id=effect_id, error=error, lease=lease):
            return problems.StoreDown(
                f"the upstream was called but its outcome could not be recorded ({error}); retry with the "
                "same key to recover it",
                headers=_retry_after(lease),
                effect_id=effect_id,
            )
        case Unanswered(outcome=outcome, effect_id=effect_id):
            return _unanswered(outcome, effect_id)
        case Redirected(effect_id=effect_id, status=status, location=location, upstream=upstream):
            return problems.UpstreamRedirected(
                f"the upstream answered {status} with Location {location or '(none)'}: it did not act on the "
                "request and asks for it there. The gateway relays no redirect that repeats a request, which "
                "a client following it would send past the gateway. Nothing was done; once "
                f"upstreams.{upstream}.base_url points where it moved, retry with the same key",
                effect_id=effect_id,
                location=location,
            )
    assert_never(ending)


def _fenced(during: FencedDuring, answer: str | None) -> str:
    if answer is not None:
        # A newer attempt holds the record: a resolve command naming this one would be refused.
        return (
            f"the upstream {answer} but the answer could not be recorded, and a newer attempt has taken this "
            "key over; retry to get its outcome"
        )
    if during == "probing":
        return "a newer attempt took over while probing; retry"
    if during == "late to send":
        return "this gateway's attempt was taken over while it was late to send; retry"
    return "this gateway's attempt was taken over by a newer one; retry to get the recorded outcome"


def _unanswered(outcome: NotSent | NoAnswer, effect_id: int | None) -> problems.Problem:
    match outcome:
        case NotSent(reason=reason):
            return problems.UpstreamUnreachable(
                f"{reason}; nothing was sent, retry with the same key",
                headers={"Retry-After": "1"},
                effect_id=effect_id,
            )
        case NoAnswer(reason=reason, too_large=True):
            kind: type[problems.Problem] = problems.ResponseTooLarge
        case NoAnswer(reason=reason, timed_out=True):
            kind = problems.UpstreamTimeout
        case NoAnswer(reason=reason):
            kind = problems.UpstreamBroken
    return kind(
        f"{reason}; the effect may have happened, retry with the same key to recover it", effect_id=effect_id
    )


def problem_of_error(exc: GatewayError) -> problems.Problem:
    """Turn one of the gateway's own errors, raised on the way to an answer, into the agent's problem: the
    table the problem middleware reads. Every path that could send checks these before anything is
    sent; a failure after sending is an ending of the driver's (:class:`Unrecorded`), never one of these.
    """
    match exc:
        case WritesLost():
            return problems.DatabaseLostWrites(f"{exc}; nothing was sent")
        case StoreUnavailable():
            return problems.StoreDown(f"{exc}; nothing was sent", headers={"Retry-After": "1"})
        case StoreRejected():
            return problems.Problem(f"the request could not be recorded ({exc}); nothing was sent")
        case BodyUnreadable(effect_id=effect_id):
            # Only the response of an effect that happened is read on this path: it is not sent again.
            detail = f"{exc}; the effect is not sent again, and an operator must look at it"
            return problems.Problem(detail, effect_id=effect_id)
        case NoSuchEffect():
            return problems.NotFound(str(exc))
        case NotAwaitingOperator(effect_id=effect_id):
            return problems.NotResolvable(str(exc), effect_id=effect_id)
        case BadName():
            return problems.BadRequest(f"Effect-Gateway-Operator: {exc}")
        case CursorUnknown():
            return problems.BadRequest(f"{exc}: page on with the answer's next link")
        case KeySyntaxError():
            return problems.KeyMalformed(str(exc))
        case UnsupportedCoding():
            return problems.EncodingUnsupported(str(exc))
        case DecodedTooLarge():
            return problems.BodyTooLarge(str(exc))
        case BadCoding():
            return problems.BodyMalformed(str(exc))
        case JsonRefused() | FormRefused():
            return problems.BodyMalformed(f"{exc}; nothing was sent")
        case StampError():
            return problems.CannotStamp(str(exc))
        case HeaderRefused():
            return problems.Problem(f"the stored answer cannot be written: {exc}")
    return problems.Problem(f"the gateway failed: {exc}")


def answer(result: Reply | Ending) -> Reply:
    """Return the reply, or raise the problem that says why there is none."""
    if isinstance(result, Reply):
        return result
    raise problem(result)


def _retry_after(wait: timedelta) -> dict[str, str]:
    # Whole seconds, never 0: an agent told 0 would retry at once, and a wait under a second rounds up.
    return {"Retry-After": str(max(1, math.ceil(wait.total_seconds())))}


def how_to_resolve(waiting: AwaitsOperator) -> str:
    """Return the commands an operator runs to resolve the effect, naming the attempt to judge.

    The one for "it did not happen" runs as written; the one for "it happened" needs the response to
    replay filled in, which only the operator knows.
    """
    effect_id, attempt = waiting.effect_id, waiting.attempt
    command = f"effect-gateway resolve {effect_id} --attempt {attempt}"
    return (
        f"an operator who finds it did not happen runs `{command} --did-not-happen`, one who finds it did "
        f"runs `{command} --happened --status STATUS --body BODY` with the response to replay (or POST "
        f'/_gateway/effects/{effect_id}/resolve with "attempt": {attempt})'
    )
