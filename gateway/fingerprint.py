"""The request fingerprint: what makes two requests with one key the same request.

Method, path, canonical query, canonical body and the upstream's chosen headers; never credentials.
The canonical forms equate only spellings of one document (see :mod:`gateway.jsonbody` and
:mod:`gateway.urlencoded`): an SDK that re-serialises the same JSON in another key order is still
recognised, while two bodies that any parser could read differently never share a fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from gateway import urlencoded
from gateway.body import RequestBody

# Never part of a fingerprint: credentials, and the headers that belong to the gateway itself.
NEVER_FINGERPRINTED = frozenset(
    {"authorization", "cookie", "proxy-authorization", "effect-gateway-token", "idempotency-key"}
)


def canonical_query(query: str) -> str:
    """The query's pairs in their order, each byte spelled one way (``+`` is a space)."""
    return urlencoded.canonical(urlencoded.pairs(query.encode("utf-8", "surrogateescape"))).decode()


def fingerprint(
    method: str,
    path: str,
    query: str,
    body: RequestBody,
    headers: Mapping[str, str],
    chosen_headers: Iterable[str],
    secret_headers: Iterable[str] = (),
) -> str:
    """A hex SHA-256 over the parts of a request that decide what the upstream does."""
    never = NEVER_FINGERPRINTED | {name.lower() for name in secret_headers}
    digest = hashlib.sha256()

    def part(value: bytes) -> None:
        # Length-prefixed, so no two sequences of parts run together into the same bytes.
        digest.update(len(value).to_bytes(8, "big"))
        digest.update(value)

    part(method.upper().encode())
    part(path.encode("utf-8", "surrogateescape"))
    part(canonical_query(query).encode())
    part(body.kind.encode())
    part(body.canonical())
    for name in sorted({name.lower() for name in chosen_headers} - never):
        # Every value of a repeated header, in order: the upstream sees them all.
        values = [value for header, value in headers.items() if header.lower() == name]
        part(name.encode())
        part(len(values).to_bytes(8, "big"))
        for value in values:
            part(value.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()
