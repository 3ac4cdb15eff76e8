"""The request fingerprint: what makes two requests with one key the same request.

Method, path, canonical query, canonical body and the upstream's chosen headers; never credentials.
JSON and form bodies are canonicalised so that an SDK that re-serialises the same parameters in another
order is still recognised as the same request (Stripe compares parameters, not bytes, for the same reason).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl, urlencode

# Never part of a fingerprint: credentials, and the headers that belong to the gateway itself.
NEVER_FINGERPRINTED = frozenset(
    {"authorization", "cookie", "proxy-authorization", "effect-gateway-token", "idempotency-key"}
)


def canonical_query(query: str) -> str:
    pairs = parse_qsl(query, keep_blank_values=True)
    # A stable sort keeps the order of repeated names (arrays), which does carry meaning.
    return urlencode(sorted(pairs, key=lambda pair: pair[0]))


def canonical_body(body: bytes, content_type: str) -> bytes:
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        try:
            return json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
        except (ValueError, UnicodeDecodeError):
            return body
    if media == "application/x-www-form-urlencoded":
        try:
            text = body.decode("ascii")
        except UnicodeDecodeError:
            return body
        return canonical_query(text).encode()
    return body


def fingerprint(
    method: str,
    path: str,
    query: str,
    body: bytes,
    headers: Mapping[str, str],
    chosen_headers: Iterable[str],
    secret_headers: Iterable[str] = (),
) -> str:
    """A hex SHA-256 over the parts of a request that decide what the upstream does."""
    never = NEVER_FINGERPRINTED | {name.lower() for name in secret_headers}
    lowered = {name.lower(): value for name, value in headers.items()}
    digest = hashlib.sha256()

    def part(value: bytes) -> None:
        digest.update(len(value).to_bytes(8, "big"))
        digest.update(value)

    part(method.upper().encode())
    part(path.encode())
    part(canonical_query(query).encode())
    part(canonical_body(body, lowered.get("content-type", "")))
    for name in sorted({name.lower() for name in chosen_headers} - never):
        part(name.encode())
        part(lowered.get(name, "").encode())
    return digest.hexdigest()
