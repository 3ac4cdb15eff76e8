"""The work of reading agent input grows in proportion to its size, whatever its shape (hypothesis).

A shape here is a few tokens repeated (with a few before and after), which is how input that makes a
reader slow usually looks: a pattern that rescans from each repetition, a copy of the rest after each
piece. Each reader is timed on the shape at two sizes, 16 times apart, in CPU time of this thread (so
other work on the machine hardly moves it); the property fails when the cost per byte grows with the
size, or passes a bound far above what linear reading costs. ``make fuzz`` runs thousands of shapes,
with hypothesis steering toward the slowest ones (target()); ``make test`` runs a few, and always the
shapes below that once took hours.
"""

from __future__ import annotations

import gc
import gzip
import time
from collections.abc import Callable

import pytest
from hypothesis import example, given, settings, target
from hypothesis import strategies as st

from gateway import codings, jsonbody, urlencoded
from gateway.body import FORM, read_body
from gateway.errors import FormRefused, JsonRefused, KeySyntaxError
from gateway.fingerprint import canonical_query
from gateway.jsonbody import StampSite
from gateway.keys import parse_key

# A fifth of the profile's examples: each times two sizes, and `make test` runs the shapes that once took
# hours whatever the count (the @example lines); `make fuzz` still searches a thousand shapes per reader.
SEARCH = settings(max_examples=max(10, settings.default.max_examples // 5))
SMALL = 8 * 1024
LARGE = 16 * SMALL
# Cost per byte at the larger size over that at the smaller one. Linear work is about 1 (less where a
# fixed cost per call is spread over more bytes); work that grows with the square of the size is 16.
MOST_GROWTH = 4.0
# Nanoseconds of CPU per byte, at either size. The slowest linear shapes that `make fuzz` found, query
# strings of one- and two-byte pairs (a Python object per pair), take about 1,000 here; the quadratic
# depth check took 22,500 at 8 KiB and 78,000 at 16 KiB. Ten times the slowest linear one, so that a
# slower machine does not fail it; quadratic work that passes it at 8 KiB still fails on its growth.
MOST_NS_PER_BYTE = 10_000.0
# A run this long is too slow whatever the others take (the bound allows 1.3 s at the larger size).
TOO_LONG_NS = 2_000_000_000
# Timings per size, of which the fastest counts: an interrupt or a collection makes one slower, never
# faster.
RUNS = 3

# Pieces of JSON, forms, queries and keys that readers treat specially: quotes and escapes, brackets,
# separators, percent escapes (bare ones too), the stamps' names.
TOKENS = [
    '"', '\\"', "\\\\", "\\", "\\u00e9", "\\ud800", "\\ude00", "\\n", "[", "]", "{", "}", ",", ":", "1",
    "-0.5e3", "true", "null", " ", "\n", "a", "é", "%", "%FF", "%5B", "&", "=", "+", ";", "metadata", "[ref]",
    "ref",
]  # fmt: skip
PIECE = st.lists(st.sampled_from(TOKENS), min_size=1, max_size=8).map("".join)
ENDS = st.lists(st.sampled_from(TOKENS), max_size=6).map("".join)
# A run of plain text before the repeated part, as long as one or several of the JSON reader's pieces
# (64 to 16 Ki characters): one long member followed by short ones once kept every later member in a
# piece that held the long one, a minute for 64 KiB. At most a quarter of the smaller size, so that the
# repeated part, not this cheap run, is most of what is timed there.
LONG = st.sampled_from([0, 100, 2000]).map("a".__mul__)


def _shape(head: str, unit: str, tail: str, size: int) -> bytes:
    """``unit`` repeated between ``head`` and ``tail`` to about ``size`` bytes."""
    raw_head, raw_unit, raw_tail = head.encode(), unit.encode(), tail.encode()
    count = max(1, (size - len(raw_head) - len(raw_tail)) // len(raw_unit))
    return raw_head + raw_unit * count + raw_tail


def _json(body: bytes) -> object:
    try:
        document = jsonbody.parse(body, ("metadata", "ref"))
    except JsonRefused:
        return None
    # What the gateway does next with a document it accepts: its fingerprint, and the stamp.
    return document.canonical(), isinstance(document.site, StampSite) and document.stamped("eg_1")


def _form(body: bytes) -> object:
    try:
        return read_body(body, FORM).canonical()
    except FormRefused:
        return None


def _query(body: bytes) -> object:
    query = body.decode()
    return (
        canonical_query(query),
        urlencoded.sets_name(body, "ref"),
        urlencoded.sets_name(body, "a", nested=True),
    )


def _key(body: bytes) -> object:
    try:
        return parse_key(body.decode())
    except KeySyntaxError:
        return None


READERS: dict[str, Callable[[bytes], object]] = {"json": _json, "form": _form, "query": _query, "key": _key}


def ns_per_byte(read: Callable[[bytes], object], body: bytes) -> float:
    """The fastest of a few runs, in nanoseconds of this thread's CPU per byte of ``body``.

    The collector is paused while a run is timed: a full collection of everything the test process
    holds (hypothesis's own data among it) is no cost of the reader's.
    """
    best = float("inf")
    for _ in range(RUNS):
        gc.disable()
        try:
            start = time.thread_time_ns()
            read(body)
            best = min(best, time.thread_time_ns() - start)
        finally:
            gc.enable()
        if best > TOO_LONG_NS:
            break  # more runs would only take longer to say so
    return best / len(body)


def assert_linear(read: Callable[[bytes], object], make: Callable[[int], bytes], label: str) -> None:
    """Time ``read`` on ``make(SMALL)`` and ``make(LARGE)``; fail if the cost per byte grows or is absurd."""
    small = ns_per_byte(read, make(SMALL))
    assert small <= MOST_NS_PER_BYTE, f"{label}: {small:.0f} ns per byte at {SMALL} bytes"
    large = ns_per_byte(read, make(LARGE))
    target(large, label=f"{label}: ns per byte")
    target(large / small, label=f"{label}: growth per byte")
    assert large <= MOST_NS_PER_BYTE, f"{label}: {large:.0f} ns per byte at {LARGE} bytes"
    assert large / small <= MOST_GROWTH, (
        f"{label}: {small:.0f} ns per byte at {SMALL} bytes, {large:.0f} at {LARGE}: it grows with the size"
    )


@pytest.mark.parametrize("reader", list(READERS))
@SEARCH
@given(head=ENDS, long=LONG, middle=ENDS, unit=PIECE, tail=ENDS)
# The shape of issue 28: an unterminated string of escaped quotes (16 KiB took 4 s, 1 MiB hours).
@example(head='{"a":"', long="", middle="", unit='\\"', tail="")
@example(head="", long="", middle="", unit='"\\', tail="")
@example(head="[", long="", middle="", unit="[" * 127 + "]" * 127 + ",", tail="[]]")
@example(head='{"s":"', long="", middle="", unit="\\ud83d\\ude00\\ud800", tail='"}')
@example(head="", long="", middle="", unit="a=%FF&b=%&c+d=1&", tail="")
# One long string, then short arrays, each read in the piece that held the string: 64 KiB took 16 s
# after a string of 5,000 characters, 128 KiB took 8 s after one of 2,000.
@example(head='["', long="a" * 2000, middle='"', unit=",[]", tail="]")
# Members nested two deep, which no run of short members holds: looking for one before each member
# made them two to three times slower.
@example(head="[", long="", middle="", unit="[[]],", tail="1]")
@example(head='{"a":[', long="", middle="", unit='{"b":[1,2,{"c":"x"}]},', tail="0]}")
# An escape after every short member: runs found by counting quotes ended at each, a member or two long.
@example(head='{"a":[', long="", middle="", unit='1,"\\n",', tail="0]}")
def test_reading_input_costs_time_in_proportion_to_its_size(
    reader: str, head: str, long: str, middle: str, unit: str, tail: str
) -> None:
    """Each reader of agent input (JSON, form, query, key) costs the same per byte at 8 KiB and 128 KiB."""
    assert_linear(READERS[reader], lambda size: _shape(head + long + middle, unit, tail, size), reader)


def _decode(body: bytes) -> object:
    try:
        return codings.decode(body, ["gzip"], LARGE, most=1)
    except ValueError:  # too large, or not gzip: refusing costs time too
        return None


@SEARCH
@given(
    member=st.binary(max_size=64),
    level=st.integers(0, 9),
    cut=st.integers(0, 8),
)
@example(member=b"", level=9, cut=0)
def test_decoding_costs_time_in_proportion_to_the_body(member: bytes, level: int, cut: int) -> None:
    """A gzip body of many members, whole or cut short, costs the same per byte at 8 KiB and 128 KiB."""
    one = gzip.compress(member, compresslevel=level, mtime=0)

    def body(size: int) -> bytes:
        whole = one * max(1, size // len(one))
        return whole[: len(whole) - cut]

    assert_linear(_decode, body, "gzip")


def test_a_megabyte_of_empty_gzip_members_costs_no_more_per_byte_than_64_kib() -> None:
    """52,428 empty gzip members (a megabyte) decode at the same cost per byte as 3,276 of them."""
    member = gzip.compress(b"", mtime=0)
    small = ns_per_byte(_decode, member * (64 * 1024 // len(member)))
    large = ns_per_byte(_decode, member * (1024 * 1024 // len(member)))
    # Copying the rest of the body after each member made the megabyte cost 10 times more per byte.
    assert large / small <= MOST_GROWTH, f"{small:.0f} ns per byte at 64 KiB, {large:.0f} at 1 MiB"


@pytest.mark.parametrize(
    ("layers", "most", "refused"),
    [(1, 1, False), (2, 1, True), (2, 2, False), (1, 0, True), (10_000, 1, True)],
)
def test_more_codings_than_allowed_are_refused_before_any_is_decoded(
    layers: int, most: int, refused: bool
) -> None:
    """A body with more Content-Encoding layers than max_content_codings is refused, naming the setting."""
    body = b"{}"
    for _ in range(layers if layers < 100 else 0):
        body = gzip.compress(body)
    if refused:
        with pytest.raises(codings.TooManyCodings, match=f"at most {most} .*max_content_codings"):
            codings.decode(body, ["gzip"] * layers, 1024, most)
    else:
        assert codings.decode(body, ["gzip"] * layers, 1024, most) == b"{}"
