"""A request's body as the gateway reads it: parsed once, for the fingerprint and for the stamp.

The parse happens at the edge (gateway.proxy), before anything is claimed, so a body the gateway cannot
read unambiguously is refused with nothing recorded or sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway import jsonbody, urlencoded
from gateway.jsonbody import JsonDocument

FORM = "application/x-www-form-urlencoded"
BodyKind = Literal["json", "form", "opaque"]


@dataclass(frozen=True, slots=True)
class RequestBody:
    # The bytes forwarded upstream before any stamp: the agent's, less any Content-Encoding.
    raw: bytes
    kind: BodyKind = "opaque"
    json: JsonDocument | None = None
    form: tuple[urlencoded.Pair, ...] = ()
    # What of the body the fingerprint covers, in its canonical form, when it was built where the body
    # was read (see gateway.proxy): off the event loop for a large body, where building it for a
    # megabyte of small arrays takes a tenth of a second. With the fields it covers (a
    # gateway.fingerprint.BodyFields, or None for the whole body): the fingerprint uses it for those only.
    covered: tuple[object, bytes] | None = None

    def canonical(self) -> bytes:
        """What the fingerprint sees: one spelling per document (see jsonbody and urlencoded)."""
        if self.json is not None:
            return self.json.canonical()
        if self.kind == "form":
            return urlencoded.canonical(self.form)
        return self.raw


def is_json(media: str) -> bool:
    return media == "application/json" or media.endswith("+json")


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def read_body(raw: bytes, content_type: str, json_path: Sequence[str] = ()) -> RequestBody:
    """Parse ``raw`` as its Content-Type says; ``json_path`` (a JSON stamp's) makes it JSON regardless.

    Raises :class:`gateway.errors.JsonRefused` for a body that should be JSON and is not one
    unambiguous document, :class:`gateway.errors.FormRefused` for a form of too many fields. An
    empty body is no document at all, of any kind.
    """
    media = media_type(content_type)
    if raw and (json_path or is_json(media)):
        return RequestBody(
            raw, "json", jsonbody.parse(raw, json_path, most_containers=jsonbody.MAX_CONTAINERS)
        )
    if media == FORM:
        urlencoded.check_size(raw)
        return RequestBody(raw, "form", form=urlencoded.pairs(raw))
    return RequestBody(raw)
