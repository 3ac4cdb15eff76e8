"""JSON request bodies, parsed once and strictly: for the fingerprint, for the stamp, and nothing else.

The upstream must get the agent's bytes, so a document is never re-serialised: the stamp is spliced into
the text as sent (numbers, key order, escapes and whitespace kept). The fingerprint's canonical form
equates only what is provably one document: key order and insignificant whitespace. Strings compare by
their decoded value; numbers by their literal text, because ``10.50`` and ``10.5``, ``-0`` and ``0``,
``1e400`` and ``2e400`` are different to some parser an upstream may use.

Documents that parsers disagree on are refused instead of guessed at: duplicate keys (first wins in some
parsers, last in others), NaN and Infinity (not JSON), invalid UTF-8, anything after the document, and
nesting deeper than :data:`MAX_DEPTH`.

The scanning is the standard library's C scanner, with hooks that keep number literals and catch
duplicates; only the objects on the stamp's path are walked here, to learn where the stamp goes.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from json.encoder import encode_basestring_ascii
from typing import Any

# serde_json's default recursion limit, the strictest of the common parsers an upstream may use, so a
# document we accept is one they accept; no API body an agent sends comes near it. It also keeps the
# standard library's recursive scanner far from Python's recursion limit (10,000 deep is a 400 here,
# never a RecursionError).
MAX_DEPTH = 128

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# A JSON string, for the depth check only: the scanner itself decides what a valid string is. One that
# never ends runs to the end of the text (the scanner refuses it before anything after it), so every
# character is read once. With the closing quote required, the search started over at each quote inside
# such a string and read the rest of the text again: 16 KiB of escaped quotes took 4 s, a megabyte hours.
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# ASCII escapes give every string, lone surrogates too, exactly one spelling.
_string = encode_basestring_ascii


class JsonRefused(ValueError):
    """The body is not one unambiguous JSON document."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonRefused(f"the key {key!r} appears twice in one object")
            seen.add(key)
    return obj


def _constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not a JSON value")


# Numbers are kept as their literal text, in bytes: never rounded nor turned into Infinity, never
# confused with a string, and (unlike a str subclass or Decimal) cheap to make by the hundred thousand.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_object,
    parse_float=str.encode,
    parse_int=str.encode,
    parse_constant=_constant,
    strict=True,
)
# The C scanner that json.loads runs, callable at any index; typeshed does not list the attribute.
_scan: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class StampSite:
    """Where a field at a dotted path goes: before ``at`` in the text, creating the ``missing`` parents."""

    at: int
    after_member: bool
    missing: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Blocked:
    """The path cannot be stamped; ``reason`` says why (a parent is not an object, say)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Taken:
    """The document already has a value at the path."""


Site = StampSite | Blocked | Taken


@dataclass(frozen=True, slots=True)
class JsonDocument:
    text: str
    value: Any
    # Where the stamp's path leads in this document; None when parsed without a path.
    site: Site | None

    def canonical(self) -> bytes:
        return canonical(self.value).encode()

    def stamped(self, value: str) -> bytes:
        """The agent's bytes with ``"field":"value"`` added at the path, and nothing else changed."""
        site = self.site
        if isinstance(site, Blocked):
            raise JsonRefused(site.reason)
        if not isinstance(site, StampSite):
            raise JsonRefused("the document already has a value where the key is stamped")
        member = json.dumps(value)
        for name in reversed(site.missing[1:]):
            member = "{" + json.dumps(name) + ":" + member + "}"
        member = json.dumps(site.missing[0]) + ":" + member
        text = self.text[: site.at] + ("," if site.after_member else "") + member + self.text[site.at :]
        return text.encode()


def parse(body: bytes, path: Sequence[str] = ()) -> JsonDocument:
    """Parse ``body`` strictly; with ``path``, also find where a field at that path would go."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonRefused(f"the body is not UTF-8 (byte {exc.start})") from None
    _check_depth(text)
    start = _skip(text, 0)
    site: Site | None = None
    if path and text.startswith("{", start):
        value, end, site = _walk_object(text, start, tuple(path))
    else:
        value, end = _value(text, start)
        if path:
            site = Blocked("the JSON body is not an object, so the key cannot be stamped into it")
    end = _skip(text, end)
    if end != len(text):
        raise JsonRefused(f"something follows the JSON document at character {end}")
    return JsonDocument(text, value, site)


def loads(body: bytes) -> Any:
    """Plain Python values from a strict parse, for the gateway's own JSON inputs (admin requests)."""
    return _python(parse(body).value)


def canonical(value: Any) -> str:
    """Sorted keys, no whitespace, strings by decoded value, numbers by their literal text."""
    return _write(value, sort_keys=True)


def compact(value: Any) -> str:
    """A parsed value written back without whitespace, keys in their order, numbers as they were."""
    return _write(value, sort_keys=False)


def _write(value: Any, sort_keys: bool) -> str:
    kind = type(value)
    if kind is dict:
        keys = sorted(value) if sort_keys else value
        return "{" + ",".join([_string(k) + ":" + _write(value[k], sort_keys) for k in keys]) + "}"
    if kind is list:
        return "[" + ",".join([_write(v, sort_keys) for v in value]) + "]"
    if kind is str:
        return _string(value)
    if kind is bytes:  # a number
        return str(value.decode())
    return "true" if value is True else "false" if value is False else "null"


def _check_depth(text: str) -> None:
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    # Fewer brackets than the limit cannot nest past it; most bodies end here.
    if len(brackets) > MAX_DEPTH and max(accumulate(map(_DEPTH_STEP.__getitem__, brackets))) > MAX_DEPTH:
        raise JsonRefused(f"the JSON body nests deeper than {MAX_DEPTH} levels")


def _skip(text: str, idx: int) -> int:
    match = _WHITESPACE.match(text, idx)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _value(text: str, idx: int) -> tuple[Any, int]:
    try:
        value, end = _scan(text, idx)
    except StopIteration:
        raise JsonRefused(f"expected a JSON value at character {idx}") from None
    except json.JSONDecodeError as exc:
        raise JsonRefused(f"the body is not JSON: {exc}") from None
    return value, end


def _walk_object(text: str, idx: int, path: tuple[str, ...]) -> tuple[dict[str, Any], int, Site]:
    """The object at ``text[idx]`` ("{"), as the scanner would read it, and where ``path`` leads in it."""
    pairs: list[tuple[str, Any]] = []
    site: Site | None = None
    idx = _skip(text, idx + 1)
    if text.startswith("}", idx):
        return _object(pairs), idx + 1, StampSite(idx, after_member=False, missing=path)
    while True:
        if not text.startswith('"', idx):
            raise JsonRefused(f"expected a key in double quotes at character {idx}")
        key, idx = _value(text, idx)
        idx = _skip(text, idx)
        if not text.startswith(":", idx):
            raise JsonRefused(f"expected ':' at character {idx}")
        idx = _skip(text, idx + 1)
        if key != path[0]:
            value, idx = _value(text, idx)
        elif len(path) == 1:
            value, idx = _value(text, idx)
            site = Taken()
        elif text.startswith("{", idx):
            value, idx, site = _walk_object(text, idx, path[1:])
        else:
            value, idx = _value(text, idx)
            site = Blocked(f"the JSON field {key!r} is not an object")
        pairs.append((key, value))
        end_of_member = idx
        idx = _skip(text, idx)
        if text.startswith(",", idx):
            idx = _skip(text, idx + 1)
            continue
        if text.startswith("}", idx):
            break
        raise JsonRefused(f"expected ',' or '}}' at character {idx}")
    return _object(pairs), idx + 1, site or StampSite(end_of_member, after_member=True, missing=path)


def _python(value: Any) -> Any:
    if isinstance(value, bytes):  # a number
        literal = value.decode()
        try:
            number = float(literal) if any(c in literal for c in ".eE") else int(literal)
        except ValueError:  # more digits than int() converts
            raise JsonRefused(f"the number {literal[:20]}... is too long") from None
        if number in (math.inf, -math.inf):
            raise JsonRefused(f"the number {literal[:20]} is too large")
        return number
    if isinstance(value, dict):
        return {k: _python(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_python(v) for v in value]
    return value
