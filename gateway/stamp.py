"""Stamping the derived key into a request, where a probe can find the effect later.

The stamp and the native key are the gateway's alone: an agent's request that already carries a value
under either name is refused (see :func:`reserved_use`), keyed or not, or the upstream would see two
values and might believe the agent's (a keyless request could plant another tenant's derived key).
"""

from __future__ import annotations

from collections.abc import Mapping

from multidict import CIMultiDict

from gateway import jsonbody, urlencoded
from gateway.body import RequestBody
from gateway.errors import JsonRefused, StampError
from gateway.headers import same_header
from gateway.jsonbody import Taken
from gateway.policy import StampKind, UpstreamPolicy

# The agent's own key is the gateway's input and never forwarded, so a native header of this name
# (Stripe's) is the gateway's to set without any conflict.
AGENT_KEY_HEADER = "idempotency-key"


def stamp_request(
    kind: StampKind,
    name: str,
    value: str,
    *,
    query: str,
    headers: CIMultiDict[str],
    body: RequestBody,
) -> tuple[str, bytes]:
    """Return (query, body) with the key stamped; header stamps are written into ``headers``."""
    raw = body.raw
    if kind == "header":
        headers[name] = value
    elif kind == "query_param":
        query = urlencoded.append(query.encode(), name, value).decode()
    elif kind == "json_field":
        document = body.json or jsonbody.parse(b"{}", name.split("."))
        try:
            raw = document.stamped(value)
        except JsonRefused as exc:
            raise StampError(str(exc)) from None
    elif kind == "form_field":
        if raw and body.kind != "form":
            raise StampError(
                "the body is not a form (application/x-www-form-urlencoded) to stamp a field into"
            )
        raw = urlencoded.append(raw, name, value)
    return query, raw


def reserved_use(
    policy: UpstreamPolicy, headers: Mapping[str, str], query: str, body: RequestBody
) -> str | None:
    """What in the agent's request takes a name the gateway sets upstream, or None when nothing does.

    Names are compared as the upstream's parser may read them, not only as the gateway does: a header
    spelled with ``_`` for ``-``, and pairs after a ``;`` (Rack 2 and Python before 3.9.2 split on it),
    would be a second value under the gateway's name there, and the upstream might believe the agent's.
    """
    reserved = {same_header(policy.native_header)} if policy.native_header else set()
    if policy.stamp is not None and policy.stamp[0] == "header":
        reserved.add(same_header(policy.stamp[1]))
    for header in headers:
        # The agent's own Idempotency-Key is never forwarded; any other spelling of it would be.
        if header.lower() != AGENT_KEY_HEADER and same_header(header) in reserved:
            return f"the header {header}"
    if policy.stamp is None:
        return None
    kind, name = policy.stamp
    if kind == "query_param" and urlencoded.sets_name(query.encode(), name):
        return f"the query parameter {name}"
    if kind in ("json_field", "form_field"):
        # Rails' params and PHP's $_REQUEST merge the query into the body's fields, Rails with the query
        # winning, and shallowly: a query's metadata[a] replaces the body's whole metadata, stamp and all.
        top = name.split(".")[0] if kind == "json_field" else name.partition("[")[0] or name
        if urlencoded.sets_name(query.encode(), top, nested=True):
            return (
                f"the query parameter {top} (or {top}[...]: frameworks that merge the query into the body "
                f"read it as the body's {name})"
            )
    if kind == "form_field" and body.kind != "json" and _names_form_field(body.raw, name):
        return f"the form field {name}"
    if kind == "json_field" and body.json is not None and isinstance(body.json.site, Taken):
        return f"the JSON field {name}"
    return None


def _names_form_field(raw: bytes, name: str) -> bool:
    """Whether a body that is not JSON sets the form field ``name``, however the upstream reads it.

    Read as a form whatever its Content-Type says (Rack reads a POST without one as a form), and as
    multipart by the field names its parts give.
    """
    return urlencoded.sets_name(raw, name) or b'name="' + name.encode() + b'"' in raw
