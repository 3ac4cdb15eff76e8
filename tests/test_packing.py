"""Bodies as the store keeps them: deflated when that saves an eighth, always read back as they were sent."""

from __future__ import annotations

import json
import os
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import packing

ORDER = json.dumps(
    {"order": "ord_1", "lines": [{"sku": f"sku-{n}", "name": "basmati rice", "qty": n} for n in range(20)]}
).encode()


def test_everyday_json_is_kept_in_a_fraction_of_its_size() -> None:
    coding, stored = packing.pack(ORDER)
    assert coding == packing.DEFLATE
    assert len(stored) < len(ORDER) // 3
    assert packing.unpack(coding, stored) == ORDER


def test_hex_that_pglz_cannot_shrink_is_halved() -> None:
    token = b'{"token": "' + os.urandom(500).hex().encode() + b'"}'
    coding, stored = packing.pack(token)
    assert coding == packing.DEFLATE
    assert len(stored) < len(token) * 0.6
    assert packing.unpack(coding, stored) == token


@pytest.mark.parametrize(
    "body",
    [
        os.urandom(1000),  # random bytes: deflate would only add to them
        zlib.compress(ORDER),  # already compressed (a gzip download, say)
        ORDER[:127],  # too short to be worth it
        b"",
        b"x" * (64 * 1024 + 1),  # large: Postgres compresses a row over 2 KB itself
    ],
    ids=["random", "compressed", "short", "empty", "large"],
)
def test_a_body_deflate_does_not_pay_for_is_kept_as_sent(body: bytes) -> None:
    assert packing.pack(body) == (packing.AS_SENT, body)


@given(st.binary(max_size=4096) | st.text(max_size=2048).map(str.encode))
def test_what_is_stored_reads_back_as_it_was_sent(body: bytes) -> None:
    assert packing.unpack(*packing.pack(body)) == body


def test_a_coding_of_a_newer_version_is_refused_by_name() -> None:
    with pytest.raises(packing.UnknownCoding, match="'zstd'"):
        packing.unpack("zstd", b"\x28\xb5\x2f\xfd")


def test_a_body_read_by_hand_inflates_with_the_standard_window() -> None:
    """The module's docstring tells operators zlib.decompress(body, -15): it must read what pack wrote."""
    coding, stored = packing.pack(ORDER)
    assert coding == packing.DEFLATE
    assert zlib.decompress(stored, -15) == ORDER
