"""What the agent gets back: the upstream's answer, or the problem that says why it has none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from gateway import problems
from gateway.decision import repeats_request
from gateway.outcome import Answered, NoAnswer, NotSent, Outcome
from gateway.policy import UpstreamPolicy
from gateway.record import EffectRecord, StoredResponse


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer for the agent: the upstream's (``replayed`` when it is the stored one of an earlier
    request); every other ending is a :class:`gateway.problems.Problem` raised instead."""

    response: StoredResponse
    replayed: bool
    effect_id: int | None


def reply(outcome: Outcome, effect_id: int | None) -> Reply:
    match outcome:
        case Answered():
            return Reply(StoredResponse(outcome.status, outcome.headers, outcome.body), False, effect_id)
        case NotSent(reason=reason):
            raise problems.UpstreamUnreachable(
                f"{reason}; nothing was sent, retry with the same key",
                headers={"Retry-After": "1"},
                effect_id=effect_id,
            )
        case NoAnswer(reason=reason, too_large=True):
            raise problems.ResponseTooLarge(
                f"{reason}; the effect may have happened, retry with the same key to recover it",
                effect_id=effect_id,
            )
        case NoAnswer(reason=reason, timed_out=True):
            raise problems.UpstreamTimeout(
                f"{reason}; the effect may have happened, retry with the same key to recover it",
                effect_id=effect_id,
            )
        case NoAnswer(reason=reason):
            raise problems.UpstreamBroken(
                f"{reason}; the effect may have happened, retry with the same key to recover it",
                effect_id=effect_id,
            )
    assert_never(outcome)


def refuse_redirect(outcome: Outcome, policy: UpstreamPolicy, effect_id: int | None, method: str) -> None:
    """A redirect that keeps the method is never relayed for a request that may have an effect.

    A client that follows it (requests and aiohttp do by default) would send the request again to
    wherever Location points, past the gateway: on the first answer and on every replay, with the
    agent's Effect-Gateway-Token. The upstream did not act (the record is retryable): say so instead.
    """
    if not (isinstance(outcome, Answered) and repeats_request(outcome.status, method)):
        return
    location = next((value for name, value in outcome.headers if name.lower() == "location"), "")
    # Stored header text stands for the upstream's bytes (surrogate-escaped): shown here as text.
    shown = location.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    raise problems.UpstreamRedirected(
        f"the upstream answered {outcome.status} with Location {shown or '(none)'}: it did not act on the "
        "request and asks for it there. The gateway relays no redirect that repeats a request, which a "
        "client following it would send past the gateway. Nothing was done; once "
        f"upstreams.{policy.name}.base_url points where it moved, retry with the same key",
        effect_id=effect_id,
        location=shown,
    )


def stored(outcome: Outcome) -> StoredResponse | None:
    if isinstance(outcome, Answered):
        return StoredResponse(outcome.status, outcome.headers, outcome.body)
    return None


def describe(outcome: Outcome) -> str:
    match outcome:
        case Answered(status=status):
            return f"answered {status}"
        case NotSent(reason=reason) | NoAnswer(reason=reason):
            return reason
    assert_never(outcome)


def key_reused(effect_id: int) -> problems.Problem:
    return problems.KeyReused(
        "this Idempotency-Key was first used with a different method, path, query or body",
        effect_id=effect_id,
    )


def purged(record: EffectRecord, why: str) -> problems.Problem:
    return problems.ResponsePurged(
        f"the effect happened and is never sent again; its response was dropped after the retention and "
        f"{why}",
        effect_id=record.id,
    )


def outcome_unknown(record: EffectRecord) -> problems.Problem:
    return problems.OutcomeUnknown(
        f"the effect may have happened and nothing can tell; {how_to_resolve(record)}",
        effect_id=record.id,
    )


def how_to_resolve(record: EffectRecord) -> str:
    """Return the commands an operator runs to resolve ``record``, naming the attempt to judge.

    The one for "it did not happen" runs as written; the one for "it happened" needs the response to
    replay filled in, which only the operator knows.
    """
    command = f"effect-gateway resolve {record.id} --attempt {record.attempt}"
    return (
        f"an operator who finds it did not happen runs `{command} --did-not-happen`, one who finds it did "
        f"runs `{command} --happened --status STATUS --body BODY` with the response to replay (or POST "
        f'/_gateway/effects/{record.id}/resolve with "attempt": {record.attempt})'
    )
