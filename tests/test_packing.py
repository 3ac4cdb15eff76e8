"""Bodies as the store keeps them: deflated when that saves an eighth, always read back as they were sent."""

from __future__ import annotations

import json
import os
import tracemalloc
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import packing

ORDER = json.dumps(
    {"order": "ord_1", "lines": [{"sku": f"sku-{n}", "name": "basmati rice", "qty": n} for n in range(20)]}
).encode()


# Bodies like an agent's: JSON lists of a few repeated shapes, most of them long enough to be deflated.
def agent_json(min_lines: int = 0) -> st.SearchStrategy[bytes]:
    line = st.fixed_dictionaries(
        {
            "sku": st.sampled_from(["atta", "dal", "ghee", "rice"]),
            "qty": st.integers(0, 99),
            "note": st.text(max_size=8),
        }
    )
    return st.lists(line, min_size=min_lines, max_size=150).map(
        lambda lines: json.dumps({"lines": lines}).encode()
    )


def test_everyday_json_is_kept_in_a_fraction_of_its_size() -> None:
    """An order's JSON takes under a third of its size."""
    coding, stored = packing.pack(ORDER)
    assert coding == packing.ZLIB
    assert len(stored) < len(ORDER) // 3
    assert packing.unpack(coding, stored) == ORDER


def test_hex_that_pglz_cannot_shrink_is_halved() -> None:
    """A hex token, which Postgres's own compression leaves as long as it was, takes under 60%."""
    token = b'{"token": "' + os.urandom(500).hex().encode() + b'"}'
    coding, stored = packing.pack(token)
    assert coding == packing.ZLIB
    assert len(stored) < len(token) * 0.6
    assert packing.unpack(coding, stored) == token


@pytest.mark.parametrize(
    "body",
    [
        os.urandom(1000),  # random bytes: deflate would only add to them
        zlib.compress(ORDER),  # already compressed (a gzip download, say)
        ORDER[:127],  # too short to be worth it
        b"",
        b"x" * (16 * 1024 + 1),  # large: deflating it would hold up the event loop
    ],
    ids=["random", "compressed", "short", "empty", "large"],
)
def test_a_body_deflate_does_not_pay_for_is_kept_as_sent(body: bytes) -> None:
    """Bodies outside 128 B..16 KiB, or that deflate saves less than an eighth of, are stored as sent."""
    assert packing.pack(body) == (packing.AS_SENT, body)


def test_the_largest_body_packed_is_16_kib() -> None:
    """16 KiB of JSON is still deflated; one byte more is not (the "large" case above)."""
    body = json.dumps(["atta"] * 5000).encode()[: 16 * 1024]
    assert packing.pack(body)[0] == packing.ZLIB


@given(agent_json() | st.binary(max_size=4096) | st.text(max_size=2048).map(str.encode))
def test_what_is_stored_reads_back_as_it_was_sent(body: bytes) -> None:
    """Whatever is stored, deflated or not, reads back byte for byte."""
    assert packing.unpack(*packing.pack(body)) == body


@given(agent_json(min_lines=30))
def test_agents_json_is_deflated(body: bytes) -> None:
    """JSON of a kilobyte or more, of the shapes agents send, is always worth deflating."""
    assert len(body) >= 1024
    assert packing.pack(body)[0] == packing.ZLIB


def test_a_coding_of_a_newer_version_is_refused_by_name() -> None:
    """A coding this version does not know is refused, naming it, not handed on as garbage."""
    with pytest.raises(packing.BodyUnreadable, match="'zstd'"):
        packing.unpack("zstd", b"\x28\xb5\x2f\xfd")


def test_every_flipped_bit_and_every_cut_is_refused() -> None:
    """Damaged bytes are never read back as a body: the stream's check catches each single flipped bit,
    and a stream cut short or with bytes after its end is refused too."""
    coding, stored = packing.pack(ORDER)
    damaged = [
        stored[:n] + bytes([stored[n] ^ (1 << bit)]) + stored[n + 1 :]
        for n in range(len(stored))
        for bit in range(8)
    ]
    damaged += [stored[:n] for n in range(len(stored))] + [stored + b"\x00", stored + stored]
    for bad in damaged:
        with pytest.raises(packing.BodyUnreadable):
            packing.unpack(coding, bad)


def test_a_stream_that_inflates_past_what_any_gateway_packs_is_refused() -> None:
    """A stored stream the gateway did not write (8 KB that inflate to 8 MB) is refused before it takes
    the memory it asks for."""
    bomb = zlib.compress(bytes(8 * 1024 * 1024))
    tracemalloc.start()
    try:
        with pytest.raises(packing.BodyUnreadable, match="inflates past 65536 bytes"):
            packing.unpack(packing.ZLIB, bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024
    largest_legacy = bytes(64 * 1024)  # the first version packed up to 64 KiB
    deflater = zlib.compressobj(1, zlib.DEFLATED, -12)
    assert (
        packing.unpack(packing.RAW_DEFLATE, deflater.compress(largest_legacy) + deflater.flush())
        == largest_legacy
    )


def test_a_raw_deflate_body_of_the_first_version_reads_back_with_any_window() -> None:
    """Rows the first version stored as 'deflate' (raw, a 4 KiB window) still read back, as does a raw
    stream of the widest window."""
    body = os.urandom(3000).hex().encode() * 4  # repeats 6 KB apart: only a wide window finds them
    for wbits in (-12, -15):
        deflater = zlib.compressobj(1, zlib.DEFLATED, wbits)
        assert packing.unpack(packing.RAW_DEFLATE, deflater.compress(body) + deflater.flush()) == body


def test_a_body_read_by_hand_is_zlib_decompress() -> None:
    """The docs tell operators zlib.decompress(content): it must read what pack wrote."""
    coding, stored = packing.pack(ORDER)
    assert coding == packing.ZLIB
    assert zlib.decompress(stored) == ORDER
