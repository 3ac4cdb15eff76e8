"""Request bodies sent with a ``Content-Encoding``: decoded here, within the body limit, or refused.

The gateway fingerprints, stamps, stores and forwards the decoded body (without ``Content-Encoding``):
a stamp cannot be spliced into compressed bytes, and a fingerprint of compressed bytes would tell two
compressors' output of one document apart. aiohttp's server would decode gzip, deflate (and br or zstd
when their optional packages are installed) itself but keep the header, and pass any other coding
through; the gateway turns that off (see :mod:`gateway.app`) so that the rule lives here, in one place.

The decoded size is bounded as it is produced, so a small bomb is refused (413) before it fills memory.
The work is bounded too: a body may have at most as many codings as the settings allow (one by default:
each layer is decoded whole, so 10,000 gzip layers in a megabyte took 5 s), and any number of gzip
members costs time in proportion to the body.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from gateway.errors import BadCoding, DecodedTooLarge, UnsupportedCoding

# RFC 9110 section 8.4.1; x-gzip is the same coding by another name.
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
DECODED = frozenset(_WBITS)


class TooManyCodings(UnsupportedCoding):
    """The body has more codings than the gateway decodes."""


# zlib copies the input it was given past the end of a gzip member (unused_data), so a body fed whole
# was copied again after each member: 50,000 empty members (a megabyte) took 0.7 s. Fed in pieces of
# this size, each copy is at most a piece, and small pieces cost one call of Python per kilobyte.
_PIECE = 1024


def codings_of(values: Iterable[str]) -> list[str]:
    """The codings of ``Content-Encoding`` header values, in the order they were applied."""
    found = [c.strip().lower() for value in values for c in value.split(",")]
    return [c for c in found if c and c != "identity"]


def decode(body: bytes, codings: list[str], limit: int, most: int) -> bytes:
    """Undo ``codings`` (the last applied is undone first), never producing more than ``limit`` bytes.

    Refuses more than ``most`` codings before decoding any.
    """
    if len(codings) > most:
        raise TooManyCodings(
            f"Content-Encoding names {len(codings)} codings; this gateway decodes at most {most} "
            "(the setting max_content_codings)"
        )
    for coding in reversed(codings):
        if coding not in _WBITS:
            raise UnsupportedCoding(
                f"Content-Encoding {coding!r} is not decoded here; send {', '.join(sorted(DECODED))} or none"
            )
        body = _inflate(body, coding, limit)
    return body


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    out = bytearray()
    view = memoryview(data)
    inflater = _inflater(data, coding)
    at = 0  # how much of data has been given to an inflater
    # What an inflater was given past the end of its stream: the start of the next gzip member.
    left = b""
    while left or at < len(data):
        piece: bytes | memoryview
        if left:
            piece, left = left, b""
        else:
            piece, at = view[at : at + _PIECE], at + _PIECE
        try:
            out += inflater.decompress(piece, limit + 1 - len(out))
        except zlib.error as exc:
            raise BadCoding(f"the body is not valid {coding} data: {exc}") from None
        if len(out) > limit or inflater.unconsumed_tail:
            raise DecodedTooLarge(f"the body decodes to more than {limit} bytes")
        if inflater.eof:
            left = inflater.unused_data
            if not left and at >= len(data):
                return bytes(out)
            # A gzip body may be several members one after another (RFC 1952 section 2.2).
            if coding == "deflate":
                raise BadCoding("something follows the deflate stream")
            inflater = _inflater(data, coding)
    raise BadCoding(f"the {coding} body is cut short")


def _inflater(data: bytes, coding: str) -> zlib._Decompress:
    wbits = _WBITS[coding]
    # Some clients send raw deflate without the zlib wrapper RFC 9110 asks for; its first byte tells.
    if coding == "deflate" and data[:1] and data[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS
    return zlib.decompressobj(wbits)
