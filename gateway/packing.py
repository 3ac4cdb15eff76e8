"""How bodies are kept in ``effect_bodies``: deflated when that pays, else as they are.

Bodies are most of what the gateway writes: of a new effect's WAL and disk, its request and response
are over half. Postgres compresses a row only once it is over 2 KB, and then with pglz (lz4 only where
the server was built with it), which finds repeated strings but cannot use a small alphabet: hex, base64
and most JSON of a kilobyte or two come out as long as they went in. Deflate's Huffman stage does shrink
them, to a half for hex and a third or less for everyday JSON, at about 10 microseconds a kilobyte.

The ``coding`` column says which: ``''`` for the bytes as they were, ``'zlib'`` for a zlib stream
(RFC 1950: deflate with a header and an Adler-32 check, so damaged bytes are refused rather than
replayed). Anything that reads the table goes through :func:`unpack`; a body read by hand is
``zlib.decompress(content)`` in Python. ``'deflate'`` (a raw stream, no check) was written by the first
version of this module and is still read.
"""

from __future__ import annotations

import zlib

from gateway.errors import BodyUnreadable

AS_SENT = ""
ZLIB = "zlib"
RAW_DEFLATE = "deflate"

# A small window and little memory: a body of a few kilobytes loses nothing to them, and setting up the
# default 32 KiB window and 128 KiB of state costs 60 microseconds on every call, more than compressing.
_WBITS = 12
_MEM_LEVEL = 4
_LEVEL = 1  # levels above 1 shrink these bodies by a few percent for several times the time
# Below this there is little to gain. Above it deflating holds up the event loop too long for what a
# rare large body saves: 16 KiB of hex takes about 0.15 ms here, 64 KiB over a millisecond.
_SMALLEST = 128
_LARGEST = 16 * 1024
# No version has packed a body larger than this (the first packed up to 64 KiB): a stored stream that
# inflates past it was not written by the gateway, and is refused before it can take the memory it asks.
_MOST_EVER_PACKED = 64 * 1024


def pack(body: bytes) -> tuple[str, bytes]:
    """The coding and bytes to store for ``body``: deflated if that saves at least an eighth."""
    if not _SMALLEST <= len(body) <= _LARGEST:
        return AS_SENT, body
    deflater = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS, _MEM_LEVEL)
    packed = deflater.compress(body) + deflater.flush()
    if len(packed) > len(body) - len(body) // 8:
        return AS_SENT, body
    return ZLIB, packed


def unpack(coding: str, stored: bytes) -> bytes:
    """The body as it was sent, from what :func:`pack` stored; :class:`BodyUnreadable` if it cannot be."""
    if coding == AS_SENT:
        return stored
    if coding not in (ZLIB, RAW_DEFLATE):
        raise BodyUnreadable(
            f"a stored body has coding {coding!r}, which this version of the gateway cannot read"
        )
    # The largest window reads a stream written with any window. A stream cut short, or with bytes after
    # its end, is refused: zlib.decompress would pass the first silently.
    inflater = zlib.decompressobj(zlib.MAX_WBITS if coding == ZLIB else -zlib.MAX_WBITS)
    try:
        body = inflater.decompress(stored, _MOST_EVER_PACKED + 1)
    except zlib.error as exc:
        raise BodyUnreadable(f"a stored body fails its {coding} check: {exc}") from exc
    if len(body) > _MOST_EVER_PACKED:
        raise BodyUnreadable(
            f"a stored body inflates past {_MOST_EVER_PACKED} bytes, more than any gateway packs"
        )
    if not inflater.eof or inflater.unused_data:
        raise BodyUnreadable(f"a stored body is not one whole {coding} stream")
    return body
