"""Stamping the derived key into a request, where a probe can find the effect later."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote, urlencode

from gateway.policy import StampKind


class StampError(ValueError):
    """The request has no place for the stamp (e.g. a JSON field on a body that is not an object)."""


def stamp_request(
    kind: StampKind, name: str, value: str, *, query: str, headers: dict[str, str], body: bytes
) -> tuple[str, bytes]:
    """Return (query, body) with the key stamped; header stamps are written into ``headers``."""
    if kind == "header":
        headers[name] = value
    elif kind == "query_param":
        query = f"{query}&{urlencode({name: value})}" if query else urlencode({name: value})
    elif kind == "json_field":
        body = _stamp_json(body, name, value)
    elif kind == "form_field":
        pair = f"{quote(name, safe='')}={quote(value, safe='')}"
        body = (body + b"&" + pair.encode()) if body else pair.encode()
    return query, body


def _stamp_json(body: bytes, dotted: str, value: str) -> bytes:
    try:
        doc: Any = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise StampError("the body is not JSON, so the key cannot be stamped into a JSON field") from None
    if not isinstance(doc, dict):
        raise StampError("the JSON body is not an object, so the key cannot be stamped into it")
    target = doc
    *parents, leaf = dotted.split(".")
    for part in parents:
        target = target.setdefault(part, {})
        if not isinstance(target, dict):
            raise StampError(f"the JSON field {part!r} is not an object")
    target[leaf] = value
    return json.dumps(doc, separators=(",", ":")).encode()
