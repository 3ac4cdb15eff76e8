"""How bodies are kept in ``effect_bodies``: deflated when that pays, else as they are.

Bodies are most of what the gateway writes: of a new effect's WAL and disk, its request and response
are over half. Postgres compresses a row only once it is over 2 KB, and then with pglz (lz4 only where
the server was built with it), which finds repeated strings but cannot use a small alphabet: hex, base64
and most JSON of a kilobyte or two come out as long as they went in. Deflate's Huffman stage does shrink
them, to a half for hex and a third or less for everyday JSON, at about 10 microseconds a kilobyte.

The ``coding`` column says which: ``''`` for the bytes as they were, ``'deflate'`` for a raw deflate
stream (RFC 1951, no zlib header). Anything that reads the table goes through :func:`unpack`; a body
read by hand is ``zlib.decompress(content, -15)`` in Python.
"""

from __future__ import annotations

import zlib

from gateway.errors import StoreRejected

AS_SENT = ""
DEFLATE = "deflate"

# A small window and little memory: a body of a few kilobytes loses nothing to them, and setting up the
# default 32 KiB window and 128 KiB of state costs 60 microseconds on every call, more than compressing.
_WBITS = -12
_MEM_LEVEL = 4
_LEVEL = 1  # levels above 1 shrink these bodies by a few percent for several times the time
# Below this there is little to gain. Above it deflating holds up the event loop too long for what a
# rare large body saves: 16 KiB of hex takes about 0.15 ms here, 64 KiB over a millisecond.
_SMALLEST = 128
_LARGEST = 16 * 1024


class BodyUnreadable(StoreRejected):
    """A stored body this gateway cannot read back: a coding it does not know, or a damaged stream."""


def pack(body: bytes) -> tuple[str, bytes]:
    """The coding and bytes to store for ``body``: deflated if that saves at least an eighth."""
    if not _SMALLEST <= len(body) <= _LARGEST:
        return AS_SENT, body
    deflater = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS, _MEM_LEVEL)
    packed = deflater.compress(body) + deflater.flush()
    if len(packed) > len(body) - len(body) // 8:
        return AS_SENT, body
    return DEFLATE, packed


def unpack(coding: str, stored: bytes) -> bytes:
    """The body as it was sent, from what :func:`pack` stored."""
    if coding == AS_SENT:
        return stored
    if coding != DEFLATE:
        raise BodyUnreadable(
            f"a stored body has coding {coding!r}, which this version of the gateway cannot read"
        )
    try:
        # The largest window reads any raw stream, whatever window it was written with.
        return zlib.decompress(stored, -zlib.MAX_WBITS)
    except zlib.error as exc:
        raise BodyUnreadable(f"a stored body is not the deflate stream its coding says: {exc}") from exc
