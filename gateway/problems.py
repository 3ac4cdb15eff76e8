"""problem+json (RFC 9457): every error of the gateway's own, each with a stable ``type``.

The ``type`` URIs are part of the contract: clients branch on them, so they never change. An upstream
with ``error_format = "stripe"`` gets the same errors in Stripe's shape (:mod:`gateway.stripe_errors`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

from aiohttp import web

from gateway import stripe_errors

if TYPE_CHECKING:
    from gateway.settings import ErrorFormat

TYPE_BASE = "https://effect-gateway.dev/problems/"
CONTENT_TYPE = "application/problem+json"


class Problem(Exception):
    """An error answered to the client; subclasses fix the status, type and title."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal"
    title: ClassVar[str] = "Internal gateway error"
    # Whether the answer ends the connection: set where the request's bytes cannot be trusted to end.
    closes_connection: ClassVar[bool] = False

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def body(self, instance: str | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "type": TYPE_BASE + self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance:
            doc["instance"] = instance
        doc.update(self.extra)
        return doc

    def stripe_body(self, shape: stripe_errors.StripeShape) -> dict[str, Any]:
        """Stripe's error object: its type and code, our detail as the message, our type as doc_url."""
        error: dict[str, Any] = {
            "type": shape.type,
            "code": shape.code or self.type.replace("-", "_"),
            "message": self.detail,
            "doc_url": TYPE_BASE + self.type,
        }
        error.update(self.extra)
        return {"error": error}


# The problem type an answer carries, for the request's metrics and log line (gateway.telemetry).
PROBLEM_TYPE = web.ResponseKey("problem_type", str)


def render(
    problem: Problem, instance: str | None = None, error_format: ErrorFormat = "problem+json"
) -> web.Response:
    """The one place that turns a Problem into an HTTP response, in the upstream's error format."""
    if error_format == "stripe":
        shape = stripe_errors.shape(problem.type)
        response = web.json_response(
            problem.stripe_body(shape),
            status=shape.status,
            headers={**problem.headers, "Stripe-Should-Retry": "true" if shape.retry else "false"},
        )
    else:
        response = web.Response(
            status=problem.status,
            body=json.dumps(problem.body(instance)).encode(),
            content_type=CONTENT_TYPE,
            headers=problem.headers,
        )
    response[PROBLEM_TYPE] = problem.type
    return closing_if_asked(response, problem)


def closing_if_asked(response: web.Response, problem: Problem) -> web.Response:
    """Set ``response`` (render's, or a page answering ``problem``) to close its connection when
    ``problem`` asks it to; returns it."""
    if problem.closes_connection:
        response.force_close()
    return response


class KeyMissing(Problem):
    status, type, title = 400, "key-missing", "Idempotency-Key is required"


class KeyMalformed(Problem):
    status, type, title = 400, "key-malformed", "Idempotency-Key is malformed"


class PathRefused(Problem):
    status, type, title = 400, "path-refused", "Path refused"


class BadRequest(Problem):
    status, type, title = 400, "bad-request", "Bad request"


class CannotStamp(Problem):
    status, type, title = 400, "cannot-stamp", "The request has no place for the stamped key"


class BodyMalformed(Problem):
    status, type, title = 400, "body-malformed", "The request body cannot be read unambiguously"


class StampReserved(Problem):
    status, type, title = 400, "stamp-reserved", "The request sets a name the gateway sets upstream"


class TokenRequired(Problem):
    status, type, title = 401, "token-required", "Effect-Gateway-Token is missing or wrong"


class AdminTokenRequired(Problem):
    status, type, title = 401, "admin-token-required", "Admin token is missing or wrong"


class BrowserRefused(Problem):
    status, type, title = 403, "browser-refused", "A browser may not call this upstream through the gateway"


class UnknownUpstream(Problem):
    status, type, title = 404, "unknown-upstream", "No such upstream"


class NotFound(Problem):
    status, type, title = 404, "not-found", "Not found"


class MethodNotAllowed(Problem):
    status, type, title = 405, "method-not-allowed", "Method not allowed"


class RequestTimeout(Problem):
    status, type, title = 408, "request-timeout", "The request body did not arrive in time"
    # What is left of the body may still come: it must not be read as the next request.
    closes_connection = True


class InFlight(Problem):
    status, type, title = 409, "in-flight", "A request with this key is still in flight"


class OutcomeUnknown(Problem):
    status, type, title = 409, "outcome-unknown", "The effect may have happened; an operator must resolve it"


class Fenced(Problem):
    status, type, title = 409, "fenced", "A newer attempt took over this key"


class NotResolvable(Problem):
    status, type, title = 409, "not-resolvable", "This effect is not waiting for an operator"


class ResponsePurged(Problem):
    status, type, title = 410, "response-purged", "The effect completed but its stored response was purged"


class BodyTooLarge(Problem):
    status, type, title = 413, "body-too-large", "Request body too large"


class EncodingUnsupported(Problem):
    status, type, title = 415, "encoding-unsupported", "The request's Content-Encoding is not decoded here"


class KeyRandom(Problem):
    status, type, title = 400, "key-random", "The Idempotency-Key looks made up for one call, not a step's"


class KeyReused(Problem):
    status, type, title = 422, "key-reused", "This key was used with a different request"


class UpstreamUnreachable(Problem):
    status, type, title = 502, "upstream-unreachable", "The upstream refused the connection; nothing was sent"


class UpstreamBroken(Problem):
    status, type, title = 502, "upstream-broken", "The connection broke after the request was sent"


class UpstreamRedirected(Problem):
    status, type, title = 502, "upstream-redirected", "The upstream redirected the request; nothing was done"


class ResponseTooLarge(Problem):
    status, type, title = 502, "response-too-large", "The upstream's response is too large to record"


class ProbeUnavailable(Problem):
    status, type, title = 503, "probe-failed", "Could not check whether the effect happened"


class ProbeTooSoon(Problem):
    status, type, title = (
        503,
        "probe-too-soon",
        "Too soon to tell: the search may not list the effect yet",
    )


class StoreDown(Problem):
    status, type, title = 503, "store-unavailable", "The effect store is unavailable"


class DatabaseLostWrites(Problem):
    status, type, title = 503, "database-lost-writes", "The database has lost writes this gateway made"


class UpstreamTimeout(Problem):
    status, type, title = 504, "upstream-timeout", "The upstream did not answer in time"


def problem_types() -> dict[str, type[Problem]]:
    """Every problem type by its stable name, ``internal`` (the base) first: for the docs and the OpenAPI."""
    return {Problem.type: Problem, **{cls.type: cls for cls in Problem.__subclasses__()}}
