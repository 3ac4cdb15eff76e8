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
duplicates; only the objects on the stamp's path are walked here, to learn where the stamp goes, and
the arrays and objects too long to scan in one piece (see :func:`_value`).
"""

from __future__ import annotations

import json
import math
import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from json.encoder import encode_basestring_ascii
from typing import Any

from gateway.errors import JsonRefused

# serde_json's default recursion limit, the strictest of the common parsers an upstream may use, so a
# document we accept is one they accept; no API body an agent sends comes near it. It also keeps the
# standard library's recursive scanner far from Python's recursion limit (10,000 deep is a 400 here,
# never a RecursionError).
MAX_DEPTH = 128

# Arrays and objects in one agent's body. Each is an object Python's garbage collector then tracks,
# and its full passes, which hold the interpreter's lock (the event loop's too, whatever thread
# parses), grow with them: a megabyte of arrays nested to the limit is half a million, and stopped the
# event loop for 66 ms even read off it. Twenty thousand keep that to a few milliseconds, and no side
# effect an agent asks for (an order, a message, a batch of records) comes near it: that is twenty
# thousand records of plain fields, or a thousand of twenty nested objects each. A body of up to one
# piece (16 KiB) cannot hold that many, and is not counted. The gateway's own reading of JSON (a
# probe's search answer, an operator's verdict) has no such limit: those are not an agent's to shape.
MAX_CONTAINERS = 20_000

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# A JSON string as the scanner delimits it (it decides alone which escapes are valid), read possessively
# so that nothing is read twice.
_JSON_STRING = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
# A JSON string, for the depth check only. One that never ends runs to the end of the text (the scanner
# refuses it before anything after it), so every character is read once. With the closing quote
# required, the search started over at each quote inside such a string and read the rest of the text
# again: 16 KiB of escaped quotes took 4 s, a megabyte hours.
_STRING = re.compile(_JSON_STRING + "?", re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
# Members of an array or object that nest at most one array or object, each followed by its comma. A
# string is taken whole, escapes and all, so a comma or bracket in it is not mistaken for one outside
# it. Such a run is read in one scan (see _flat_members).
_FLAT = rf'(?:[^\[\]{{}}"\\]++|{_JSON_STRING})*+'
_FLAT_MEMBERS = re.compile(
    rf'(?:(?:[^\[\]{{}}"\\,]++|{_JSON_STRING}|\[{_FLAT}\]|\{{{_FLAT}\}})*+,)++', re.DOTALL
)
# After a look finds no run of short members, how many members are read one at a time before the next.
# A look that fails costs about what reading a member does; eight keeps the looks among members nested
# deeper to a ninth of the cost, and the members read alone after each such one to eight.
RUN_WAIT = 8
# What ends the text _last_comma reads by counting quotes.
_STRUCTURE = re.compile(r"[\[\]{}\\]")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
# The C scanner holds the interpreter's lock for as long as it reads one value, so a value is read in
# one call only when it fits in the largest of these pieces (16 Ki characters: a few milliseconds for
# the costliest shapes, 500 ns a character for arrays nested to the limit). A longer array or object is
# walked here member by member, each member read in the smallest piece that holds it; a megabyte of
# arrays held the lock (and the event loop, even from another thread) for a third of a second. Each
# piece is four times the last, so a member costs at most about five times its own length to find.
PIECES = (64, 256, 1024, 4096, 16384)
# ASCII escapes give every string, lone surrogates too, exactly one spelling.
_string = encode_basestring_ascii


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


def parse(body: bytes, path: Sequence[str] = (), *, most_containers: int | None = None) -> JsonDocument:
    """Parse ``body`` strictly; with ``path``, also find where a field at that path would go.

    ``most_containers``: refuse a body read in pieces that holds more arrays and objects (an agent's
    body: MAX_CONTAINERS); None for the gateway's own reading of an upstream's or an operator's JSON.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonRefused(f"the body is not UTF-8 (byte {exc.start})") from None
    start = _skip(text, 0)
    site: Site | None = None
    if path and text.startswith("{", start):
        depth = _Depth(0, _Budget(most_containers))
        value, end, site = _walk_object(text, start, tuple(path), depth.inside())
    else:
        value, end = _value(text, start, _Depth(0, _Budget(most_containers)))
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


def _check_depth(text: str, allowed: int) -> None:
    """Refuse ``text`` (the start of a value, and what follows it) if it nests deeper than ``allowed``."""
    # Fewer opening brackets than allowed, strings and all, cannot nest past it; most texts end here.
    if text.count("[") + text.count("{") <= allowed:
        return
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    # Fewer brackets than the limit cannot nest past it; most bodies end here.
    if len(brackets) > allowed and max(accumulate(map(_DEPTH_STEP.__getitem__, brackets))) > allowed:
        raise JsonRefused(f"the JSON body nests deeper than {MAX_DEPTH} levels")


@dataclass(slots=True)
class _Budget:
    """The arrays and objects a body read in pieces may still hold; ``most`` None: no limit."""

    most: int | None
    left: int = 0

    def __post_init__(self) -> None:
        self.left = self.most or 0

    def spend(self, text: str) -> None:
        """Count the arrays and objects of ``text`` (one value, at most a piece long) against the budget."""
        if self.most is not None and ("[" in text or "{" in text):
            brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
            self.left -= brackets.count("[") + brackets.count("{")
            self.check()

    def check(self) -> None:
        if self.most is not None and self.left < 0:
            raise JsonRefused(f"the JSON body holds more than {self.most:,} arrays and objects")


@dataclass(slots=True)
class _Depth:
    """How many arrays and objects are open around a value, and whether the rest of the text is checked.

    ``checked``: the text from the value on was found to nest no deeper than the limit allows from
    here, so the members after it, at this depth, need no check of their own.
    """

    open: int
    # Shared by every level of one body.
    budget: _Budget
    checked: bool = False
    # The index in PIECES of the smallest piece that would have held the last member here: members
    # alike in size start there, which spares the scans that fail on smaller pieces (each raises an
    # error, a few microseconds). It follows the last member's size, not the largest so far: one long
    # member followed by short ones kept every later member in the largest piece, checked for depth and
    # copied whole, and a megabyte cut so took minutes.
    fits: int = 0
    # Members to read one at a time before looking for a run of short ones again (see _flat_members).
    wait: int = 0

    def inside(self) -> _Depth:
        """The depth within an array or object opened here, which the budget counts."""
        if self.open + 1 > MAX_DEPTH:
            raise JsonRefused(f"the JSON body nests deeper than {MAX_DEPTH} levels")
        self.budget.left -= 1
        self.budget.check()
        return _Depth(self.open + 1, self.budget)


def _skip(text: str, idx: int) -> int:
    match = _WHITESPACE.match(text, idx)
    assert match is not None  # the pattern matches the empty string
    return match.end()


def _value(text: str, idx: int, depth: _Depth) -> tuple[Any, int]:
    """The value at ``text[idx]``, read by the C scanner in pieces of at most 16 Ki characters at a time.

    A value is read whole from a piece of the text that starts with it and holds it (a piece is a
    copy, so the scanner never reads past its end); a piece whose end cuts the value makes the scanner
    fail, and the next larger piece is tried. An array or object that no piece holds is walked here,
    member by member; a longer string or number is read in one call, which costs a nanosecond or so a
    character. Each piece is checked for depth before it is scanned, the scanner being recursive.
    """
    allowed = MAX_DEPTH - depth.open
    if len(text) - idx <= PIECES[-1]:  # all that is left fits in a piece (every body up to 16 KiB)
        if not depth.checked:
            _check_depth(text[idx:] if idx else text, allowed)
            depth.checked = True
        value, end = _scan_at(text, idx)
        if len(text) > PIECES[-1]:  # the end of a body read in pieces
            depth.budget.spend(text[idx:end])
        return value, end
    tried = depth.fits
    while tried < len(PIECES):
        size = PIECES[tried]
        piece = text[idx : idx + size]
        _check_depth(piece, allowed)
        try:
            value, end = _scan(piece, 0)
        except (StopIteration, json.JSONDecodeError):
            end = size  # cut short by the piece's end, or not JSON: the whole text will say which
        # A number is read as far as it is one: cut at "1.|5" or "1e|5" it reads as 1, so a value
        # followed in the piece by what could have gone on with a number may be cut short.
        if end < size and piece[end] not in ".eE":
            depth.fits = bisect_right(PIECES, end)
            depth.budget.spend(piece[:end])
            return value, idx + end
        tried = max(tried + 1, _first_holding(text, idx))  # the next piece that may hold it
    if text.startswith("[", idx):
        return _walk_array(text, idx, depth.inside())
    if text.startswith("{", idx):
        value, end, _ = _walk_object(text, idx, (), depth.inside())
        return value, end
    return _scan_at(text, idx)


def _first_holding(text: str, idx: int) -> int:
    """The index in PIECES of the first piece that may hold the value at ``text[idx]``.

    An array or object ends with a bracket, so a piece without one cannot hold it, and need not be
    scanned to fail. Deep in a long document, each level so costs one search (memchr) instead of five
    failed scans: 62 arrays of numbers nested 126 deep, a megabyte, took 3 s read in pieces.
    """
    if not text.startswith(("[", "{"), idx):
        return 0
    end = idx + PIECES[-1]
    closes = [at for at in (text.find("]", idx, end), text.find("}", idx, end)) if at >= 0]
    return bisect_right(PIECES, min(closes) - idx) if closes else len(PIECES)


def _scan_at(text: str, idx: int) -> tuple[Any, int]:
    try:
        value, end = _scan(text, idx)
    except StopIteration:
        raise JsonRefused(f"expected a JSON value at character {idx}") from None
    except json.JSONDecodeError as exc:
        raise JsonRefused(f"the body is not JSON: {exc}") from None
    return value, end


def _walk_array(text: str, idx: int, depth: _Depth) -> tuple[list[Any], int]:
    """The array at ``text[idx]`` ("["), as the scanner would read it, a member at a time."""
    items: list[Any] = []
    idx = _skip(text, idx + 1)
    if text.startswith("]", idx):
        return items, idx + 1
    while True:
        if flat := _flat_members(text, idx, "[]", depth):
            values, idx = flat
            items.extend(values)
        value, idx = _value(text, idx, depth)
        items.append(value)
        idx = _skip(text, idx)
        if text.startswith(",", idx):
            idx = _skip(text, idx + 1)
            continue
        if text.startswith("]", idx):
            return items, idx + 1
        raise JsonRefused(f"expected ',' or ']' at character {idx}")


def _walk_object(
    text: str, idx: int, path: tuple[str, ...], depth: _Depth
) -> tuple[dict[str, Any], int, Site]:
    """The object at ``text[idx]`` ("{"), as the scanner would read it, and where ``path`` leads in it."""
    pairs: list[tuple[str, Any]] = []
    site: Site | None = None
    # A member the path goes on inside is walked to find the stamp's place, not read in a run.
    walked = path[0] if len(path) > 1 else None
    idx = _skip(text, idx + 1)
    if text.startswith("}", idx):
        return _object(pairs), idx + 1, StampSite(idx, after_member=False, missing=path)
    while True:
        if flat := _flat_members(text, idx, "{}", depth, walked):
            members, idx = flat
            pairs.extend(members.items())
            if path and path[0] in members:
                site = Taken()
        if not text.startswith('"', idx):
            raise JsonRefused(f"expected a key in double quotes at character {idx}")
        key, idx = _value(text, idx, depth)
        idx = _skip(text, idx)
        if not text.startswith(":", idx):
            raise JsonRefused(f"expected ':' at character {idx}")
        idx = _skip(text, idx + 1)
        if not path or key != path[0]:
            value, idx = _value(text, idx, depth)
        elif len(path) == 1:
            value, idx = _value(text, idx, depth)
            site = Taken()
        elif text.startswith("{", idx):
            value, idx, site = _walk_object(text, idx, path[1:], depth.inside())
        else:
            value, idx = _value(text, idx, depth)
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


def _flat_members(
    text: str, idx: int, brackets: str, depth: _Depth, walked: str | None = None
) -> tuple[Any, int] | None:
    """The members at ``text[idx]`` that nest at most one level, up to the last comma in a piece.

    Read in one scan, as the array or object (``brackets``) they are part of, and returned with the
    index of the member after them; None when there are none, or they hold the key ``walked`` (then
    they are read one at a time, up to that key's). One scan of a piece of a thousand numbers
    costs what one member read alone does: a megabyte of numbers took a quarter of a second read a
    member at a time. Only for a body read in pieces: a shorter one is read in one scan anyway.
    """
    if len(text) <= PIECES[-1]:
        return None
    if depth.wait:
        depth.wait -= 1
        return None
    # Less one: with a bracket at each end, the members scanned fit in the largest piece. At the
    # deepest level a member may not be an array or object.
    comma = _last_comma(text, idx, idx + PIECES[-1] - 1, nested=depth.open < MAX_DEPTH)
    if comma < 0:
        # Members nested deeper than one level are read one at a time, and a look before each would
        # make them twice as slow. The wait is short, so that runs are soon found again after one.
        depth.wait = RUN_WAIT
        return None
    members_text = text[idx:comma]
    # _last_comma reads strings and brackets as the scanner does, so in a valid document the comma
    # it finds separates two members: the scanner refuses the members before it only where the body is
    # not JSON. Refused here, not read again member by member: each member before the fault would
    # then look for a run again, a piece of 16 Ki characters for a member of two.
    try:
        members, _ = _scan(brackets[0] + members_text + brackets[1], 0)
    except StopIteration as missing:  # a value is missing, at this index of the scan
        raise JsonRefused(f"expected a JSON value at character {idx - 1 + missing.value}") from None
    except json.JSONDecodeError as exc:
        where = json.JSONDecodeError(exc.msg, text, idx - 1 + exc.pos)  # its line and column in the body
        raise JsonRefused(f"the body is not JSON: {where}") from None
    if not members:  # only whitespace before the comma
        raise JsonRefused(f"expected a JSON value at character {idx}")
    if walked in members:
        depth.wait = list(members).index(walked) + 1
        return None
    depth.budget.spend(members_text)
    return members, _skip(text, comma + 1)


def _last_comma(text: str, idx: int, end: int, *, nested: bool) -> int:
    """The index of the last comma in ``text[idx:end]`` after members that nest at most one level (none
    unless ``nested``), or -1.

    ``idx`` is where a member starts, outside any string. In text without brackets and backslashes,
    every quote opens or closes a string, so a comma after an even number of them is outside strings:
    numbers, words and plain strings are found so at the speed of str.count, twenty times faster than
    _FLAT_MEMBERS reads the rest. That is used when such text fills the piece, or there is no other
    choice: ending at the first escape, the runs found would hold a member or two.
    """
    if text.find(",", idx, end) < 0:  # one member fills the piece, if any does
        return -1
    structure = _STRUCTURE.search(text, idx, end)
    plain = structure.start() if structure else end
    if plain == end or not nested:
        # Up to `stop` the quotes are even: after the last of them, no string is open. A piece mostly
        # ends inside a string or just after one; then the comma is looked for before that string, and
        # once more before the one before it (in an object, a piece cut in a value's string ends just
        # after its key's).
        stop = plain if text.count('"', idx, plain) % 2 == 0 else text.rfind('"', idx, plain)
        for _ in range(2):
            start = text.rfind('"', idx, stop)
            comma = text.rfind(",", max(idx, start), stop)
            if comma >= 0:
                return comma
            if start < 0:
                break
            stop = text.rfind('"', idx, start)  # where the string that `start` closes opened
    if not nested:
        return -1
    run = _FLAT_MEMBERS.match(text, idx, end)
    return run.end() - 1 if run else -1


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
