"""Query strings and ``application/x-www-form-urlencoded`` bodies, read as bytes and never decoded lossily.

A decode to text would turn ``%FF`` and ``%FE`` into the same U+FFFD, and two different requests into
one fingerprint. Here a component is percent-decoded to bytes (``+`` as a space, as forms mean it) and
re-encoded one way, so only spellings of the same bytes meet. Pairs keep their order: a decoder that
builds arrays of objects from ``items[][a]=1&items[][b]=2`` reads another document when names move.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, quote_from_bytes, unquote_to_bytes

from gateway.errors import FormRefused

# A "%" that starts no escape is kept by form decoders as a literal "%", but some upstreams refuse it;
# it is therefore kept apart from a "%25" in the canonical form, as "%%": never in quote_from_bytes'
# output, where every "%" starts an escape.
_BARE_PERCENT_MARK = b"%%"
# What the canonical form spells otherwise than as it came: an escape, or a byte that is not unreserved
# (a bare "%" and "+" among them). Each has one canonical spelling, looked up in _SPELLED, so that a
# component is rewritten in one pass of C instead of being decoded and quoted again in Python.
_RESPELLED = re.compile(rb"%[0-9A-Fa-f]{2}|[^A-Za-z0-9_.~-]")


def _spelled() -> dict[bytes, bytes]:
    """Every match of _RESPELLED and its canonical spelling: each byte, and every escape in any case."""
    quoted = [quote_from_bytes(bytes([byte]), safe="").encode() for byte in range(256)]
    table = {bytes([byte]): quoted[byte] for byte in range(256)}
    # As sent, "+" is a space (forms mean it so) and a "%" matched alone starts no escape.
    table[b"+"], table[b"%"] = quoted[ord(" ")], _BARE_PERCENT_MARK
    hexdigits = "0123456789abcdefABCDEF"
    for high in hexdigits:
        for low in hexdigits:
            table[f"%{high}{low}".encode()] = quoted[int(high + low, 16)]
    return table


_SPELLED = _spelled()
# A form's component is decoded and respelled this many bytes at a time. Each is one call of C that
# holds the interpreter's lock (the event loop's too, whatever thread reads): unquote_to_bytes splits
# on every "%", and re.sub calls _respell without letting go, so one field of a megabyte of escapes
# held the loop for 30 to 35 ms. A piece of 16 KiB holds it for well under a millisecond.
PIECE = 16 * 1024


@dataclass(frozen=True, slots=True)
class Pair:
    name: bytes  # percent-decoded
    value: bytes | None  # percent-decoded; None when the pair has no "=" at all
    canonical: bytes  # the pair spelled the one way (see canonical())


def pairs(raw: bytes) -> tuple[Pair, ...]:
    """Every ``&``-separated pair, in order, empty ones included."""
    found = []
    for segment in raw.split(b"&"):
        name, eq, value = segment.partition(b"=")
        spelled = _canonical(name) + (b"=" + _canonical(value) if eq else b"")
        found.append(Pair(_decode(name), _decode(value) if eq else None, spelled))
    return tuple(found)


def canonical(parsed: tuple[Pair, ...]) -> bytes:
    """One spelling for every way of writing the same pairs in the same order."""
    return b"&".join(pair.canonical for pair in parsed)


# Fields in one form body: Django refuses more than 1,000 and Rack 3 more than 4,096; reading a
# megabyte of "&" as a million pairs held a core for seconds.
MAX_FIELDS = 10_000


def check_size(raw: bytes) -> None:
    if raw.count(b"&") >= MAX_FIELDS:
        raise FormRefused(f"the form has more than {MAX_FIELDS} fields")


def text_fields(raw: bytes, most: int, charset: str = "utf-8") -> list[tuple[str, str]]:
    """The fields of a form as text, each name and value decoded strictly in ``charset``.

    For the gateway's own pages: a lossy decode keeps other text than the one sent. Pairs are read as
    aiohttp reads them: an empty pair is no field, a pair without "=" has an empty value, and trailing
    whitespace (the line break of ``curl -d @file``) is part of no value. Raises UnicodeDecodeError
    (LookupError for an unknown charset), or FormRefused past ``most`` fields.
    """
    fields: list[tuple[str, str]] = []
    for segment in raw.rstrip().split(b"&"):
        if not segment:
            continue
        if len(fields) == most:
            raise FormRefused(f"the form has more than {most} fields")
        name, _, value = segment.partition(b"=")
        fields.append((_decode(name).decode(charset), _decode(value).decode(charset)))
    return fields


def sets_name(raw: bytes, name: str, *, nested: bool = False) -> bool:
    """Whether a pair of ``raw`` is named ``name`` once decoded, ``;`` separating pairs too.

    Some parsers still split on ``;`` (Rack 2, Python before 3.9.2). One pattern for every spelling of
    the name, so that any body is searched in one pass: this is asked of opaque bodies of any size too.
    ``nested``: a pair named ``name[...]`` counts too, which Rack and PHP read as a part of ``name``.
    """
    first, after_separator, longest = _spellings(name, nested)
    if first.match(raw):
        return True
    # A window at a time: the engine holds the interpreter's lock for a whole call, and a megabyte takes
    # 6 ms (27 before the pattern below). Windows overlap by the longest match, with what its end looks
    # at; a match that starts in the overlap is the next window's to find, where the window's end cannot
    # pass for the text's.
    for start in range(0, len(raw), _WINDOW):
        found = after_separator.search(raw, start, start + _WINDOW + longest)
        if found is not None and found.start() < start + _WINDOW:
            return True
    return False


# Bytes searched in one call of sets_name's pattern: a fraction of a millisecond.
_WINDOW = 64 * 1024


# Names are the stamps' of the configured upstreams (a handful), asked of every request: each pattern is
# built and compiled once. The bound only keeps memory bounded for callers that ask of many names.
@functools.lru_cache(maxsize=256)
def _spellings(name: str, nested: bool = False) -> tuple[re.Pattern[bytes], re.Pattern[bytes], int]:
    """Patterns for ``name`` at the start of a pair, however it may be percent-encoded.

    The first matches at the start of the text; the second from the separator before any other pair
    (a pattern that starts with a set of two bytes is searched for them first, four times faster than
    one that starts by looking behind). The number is the longest either reads, with what follows.
    """
    parts = []
    for byte in name.encode():
        hexed = f"{byte:02X}"
        escaped = f"%[{hexed[0]}{hexed[0].lower()}][{hexed[1]}{hexed[1].lower()}]".encode()
        if byte == 0x20:
            parts.append(b"(?: |\\+|" + escaped + b")")
        elif byte == 0x25:  # a "%" that starts no escape is kept as it is
            parts.append(b"(?:%(?![0-9A-Fa-f]{2})|" + escaped + b")")
        elif bytes([byte]) in b"+&;=":
            parts.append(escaped)
        else:
            parts.append(b"(?:" + re.escape(bytes([byte])) + b"|" + escaped + b")")
    end = b"=|[&;]|\\Z" + (b"|\\[|%5[Bb]" if nested else b"")
    spelled = b"".join(parts) + b"(?=" + end + b")"
    # A separator, three bytes per byte of the name escaped, and the three of "%5B" after it.
    longest = 1 + 3 * len(name.encode()) + 3
    return re.compile(spelled), re.compile(b"[&;]" + spelled), longest


def append(raw: bytes, name: str, value: str) -> bytes:
    """``raw`` with ``name=value`` added at the end, everything before it left as it was."""
    pair = f"{quote(name, safe='')}={quote(value, safe='')}".encode()
    return raw + b"&" + pair if raw else pair


def _decode(component: bytes) -> bytes:
    return b"".join(unquote_to_bytes(piece.replace(b"+", b" ")) for piece in _pieces(component))


def _canonical(component: bytes) -> bytes:
    """The component's bytes, each spelled the one way: unreserved as itself, any other as ``%XX``."""
    return b"".join(_RESPELLED.sub(_respell, piece) for piece in _pieces(component))


def _pieces(component: bytes) -> Iterator[bytes]:
    """``component`` in pieces of at most PIECE bytes (three or more), none cut inside an escape."""
    if len(component) <= PIECE:
        yield component
        return
    start = 0
    while start < len(component):
        end = start + PIECE
        # Before a "%" of the last two bytes: its escape, if it is one, is then read whole.
        percent = component.rfind(b"%", end - 2, end)
        end = percent if percent > start else end
        yield component[start:end]
        start = end


def _respell(found: re.Match[bytes]) -> bytes:
    return _SPELLED[found[0]]
