"""The request fingerprint: what makes two requests with one key the same request.

Method, path, canonical query, canonical body and the upstream's chosen headers; never credentials.
The canonical forms equate only spellings of one document (see :mod:`gateway.jsonbody` and
:mod:`gateway.urlencoded`): an SDK that re-serialises the same JSON in another key order is still
recognised, while two bodies that any parser could read differently never share a fingerprint.

An upstream may narrow what of the body counts (:class:`BodyFields`): only some fields, or all but some
volatile ones (a timestamp, a trace id). What is covered stays as strict as the whole body is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway import jsonbody, urlencoded
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
    body_fields: BodyFields | None = None,
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
    if body.covered is not None and body.covered[0] == body_fields:
        part(body.covered[1])  # built as the body was read, for these same fields
    else:
        part(covered(body, body_fields))
    for name in sorted({name.lower() for name in chosen_headers} - never):
        # Every value of a repeated header, in order: the upstream sees them all.
        values = [value for header, value in headers.items() if header.lower() == name]
        part(name.encode())
        part(len(values).to_bytes(8, "big"))
        for value in values:
            part(value.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def covered(body: RequestBody, body_fields: BodyFields | None) -> bytes:
    """Return what of ``body`` the fingerprint covers (``body_fields``, or all of it), in canonical form."""
    return body.canonical() if body_fields is None else body_fields.canonical(body)


@dataclass(frozen=True, slots=True)
class BodyFields:
    """The fields of a JSON or form body that the fingerprint covers: only ``names``, or all but them.

    JSON names are dotted paths through objects (``metadata.trace_id``); form names are field names, and
    cover the bracketed names under them too (``metadata`` covers ``metadata[trace_id]``). Any other body
    is covered whole. Where a path meets something other than an object before its end, that value is
    covered whole: a path never covers less than it names.
    """

    only: bool  # True: ``names`` are all that is covered; False: everything but ``names`` is
    names: tuple[str, ...]

    @classmethod
    def covering(cls, names: Sequence[str]) -> BodyFields:
        return cls(True, tuple(names))

    @classmethod
    def ignoring(cls, names: Sequence[str]) -> BodyFields:
        return cls(False, tuple(names))

    def canonical(self, body: RequestBody) -> bytes:
        if body.json is not None:
            value = body.json.value
            if type(value) is not dict:
                return body.canonical()  # no field names a top level that is not an object
            paths = [name.split(".") for name in self.names]
            if self.only:
                return jsonbody.canonical(
                    [_covered(value, path, name) for path, name in zip(paths, self.names, strict=True)]
                ).encode()
            for path in paths:
                value = _without(value, path)
            return jsonbody.canonical(value).encode()
        if body.kind == "form":
            names = [name.encode() for name in self.names]
            kept = tuple(pair for pair in body.form if _form_match(pair.name, names) == self.only)
            return urlencoded.canonical(kept)
        return body.canonical()


def _covered(value: dict[str, Any], path: list[str], name: str) -> list[Any]:
    """``[name]`` when the path leads to no member, else ``[name, depth, value]``: the value where it ends,
    or the first one on the way that is not an object (covered whole)."""
    at: Any = value
    for depth, segment in enumerate(path):
        if type(at) is not dict:
            return [name, str(depth), at]
        if segment not in at:
            return [name]
        at = at[segment]
    return [name, str(len(path)), at]


def _without(value: dict[str, Any], path: list[str]) -> dict[str, Any]:
    """``value`` less the member at ``path``, copied along the path only; unchanged if there is none."""
    head, rest = path[0], path[1:]
    if head not in value:
        return value
    if not rest:
        return {k: v for k, v in value.items() if k != head}
    inner = value[head]
    if type(inner) is not dict:
        return value  # the path leads through something that is not an object: nothing is left out
    return {**value, head: _without(inner, rest)}


def _form_match(name: bytes, names: list[bytes]) -> bool:
    return any(name == wanted or name.startswith(wanted + b"[") for wanted in names)
