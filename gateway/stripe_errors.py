"""The gateway's own errors in Stripe's shape, for upstreams with ``error_format = "stripe"``.

stripe-python turns an error answer into an exception by its status and ``error.type``: 400 and 404 with
``idempotency_error`` are :class:`IdempotencyError`, any other 400 and 404 :class:`InvalidRequestError`,
401 :class:`AuthenticationError`, everything else :class:`APIError`. It retries 409 and 5xx by itself
unless ``Stripe-Should-Retry: false`` says that a retry cannot help (and retries what
``Stripe-Should-Retry: true`` marks). So each problem type gets the status and type that raise the class a
user of the SDK expects, and says whether the SDK's own retry (with the same key) is worth it.

The table is data, one row per problem type (tests/test_stripe_errors.py keeps it complete); the
contract's table in docs/contract.md is written from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StripeType = Literal["api_error", "idempotency_error", "invalid_request_error"]


@dataclass(frozen=True, slots=True)
class StripeShape:
    status: int
    type: StripeType
    # Whether stripe-python should retry the call with the same key (Stripe-Should-Retry).
    retry: bool
    # Stripe's own code where Stripe has one for the case; otherwise the problem type's name.
    code: str | None = None


_BAD = StripeShape(400, "invalid_request_error", retry=False)

SHAPES: dict[str, StripeShape] = {
    "key-missing": _BAD,
    "key-malformed": _BAD,
    # The key is used wrongly: stripe-python's IdempotencyError, as Stripe answers a key reused.
    "key-random": StripeShape(400, "idempotency_error", retry=False),
    "key-reused": StripeShape(400, "idempotency_error", retry=False),
    "path-refused": _BAD,
    "bad-request": _BAD,
    "body-malformed": _BAD,
    "cannot-stamp": _BAD,
    "stamp-reserved": _BAD,
    # 413, 415 and 405 would be APIError, which reads as "Stripe failed": the request itself is wrong.
    "body-too-large": _BAD,
    "encoding-unsupported": _BAD,
    "method-not-allowed": _BAD,
    "token-required": StripeShape(401, "invalid_request_error", retry=False),
    "admin-token-required": StripeShape(401, "invalid_request_error", retry=False),
    # A web page, not an SDK, sent it: nothing a retry changes.
    "browser-refused": StripeShape(403, "invalid_request_error", retry=False),
    "unknown-upstream": StripeShape(404, "invalid_request_error", retry=False),
    "not-found": StripeShape(404, "invalid_request_error", retry=False),
    # Nothing was claimed or sent: a retry that sends the whole body in time goes through.
    "request-timeout": StripeShape(408, "api_error", retry=True),
    # What Stripe answers for concurrent use of one key; stripe-python retries it, then raises APIError.
    "in-flight": StripeShape(409, "idempotency_error", retry=True, code="idempotency_key_in_use"),
    # Only an operator can settle it: a retry gets the same answer.
    "outcome-unknown": StripeShape(409, "api_error", retry=False),
    "fenced": StripeShape(409, "api_error", retry=True),
    "not-resolvable": StripeShape(409, "invalid_request_error", retry=False),
    "response-purged": StripeShape(410, "api_error", retry=False),
    "internal": StripeShape(500, "api_error", retry=False),
    # Nothing was sent, or it may have been and a retry with the same key recovers it, never sends twice.
    "upstream-unreachable": StripeShape(502, "api_error", retry=True),
    "upstream-broken": StripeShape(502, "api_error", retry=True),
    # The upstream moved: a retry is answered the same until base_url points where it went.
    "upstream-redirected": StripeShape(502, "api_error", retry=False),
    # The answer would be as large again.
    "response-too-large": StripeShape(502, "api_error", retry=False),
    "probe-failed": StripeShape(503, "api_error", retry=True),
    # A retry after Retry-After can tell; stripe-python's own retries may come sooner and be told again.
    "probe-too-soon": StripeShape(503, "api_error", retry=True),
    "store-unavailable": StripeShape(503, "api_error", retry=True),
    # An operator must reconcile first: retrying cannot help until then.
    "database-lost-writes": StripeShape(503, "api_error", retry=False),
    "upstream-timeout": StripeShape(504, "api_error", retry=True),
}


def shape(problem_type: str) -> StripeShape:
    return SHAPES.get(problem_type, SHAPES["internal"])
