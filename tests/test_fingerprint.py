"""The fingerprint: one per document, never one for two documents. Tables and hypothesis properties."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway.body import RequestBody, read_body
from gateway.fingerprint import canonical_query, fingerprint
from tests.strategies import (
    DIFFERENT_NUMBERS,
    FORM_BYTES,
    json_text,
    meaning,
    spelled,
    twin_trees,
    whatwg_pairs,
)

JSON = {"Content-Type": "application/json"}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def fp(body: bytes, headers: dict[str, str] = JSON, query: str = "", **kw: Any) -> str:
    parsed = read_body(body, headers.get("Content-Type", ""))
    return fingerprint("POST", "/o", query, parsed, headers, kw.get("chosen", ["content-type"]))


def test_fingerprint_sees_what_changes_the_effect_and_never_credentials() -> None:
    """Method, path, query, body and chosen headers count; Authorization and secrets do not."""
    body = read_body(b'{"x":1}', "application/json")
    headers = {"Content-Type": "application/json", "Authorization": "A"}
    base = fingerprint("POST", "/orders", "a=1", body, headers, ["content-type", "authorization"])
    assert fingerprint("PUT", "/orders", "a=1", body, headers, ["content-type"]) != base
    assert fingerprint("POST", "/other", "a=1", body, headers, ["content-type"]) != base
    assert fingerprint("POST", "/orders", "a=2", body, headers, ["content-type"]) != base
    other = read_body(b'{"x":2}', "application/json")
    assert fingerprint("POST", "/orders", "a=1", other, headers, ["content-type"]) != base
    rotated = {"Content-Type": "application/json", "Authorization": "B"}
    assert fingerprint("POST", "/orders", "a=1", body, rotated, ["content-type", "authorization"]) == base
    with_secret = {**rotated, "X-Secret": "s"}
    assert fingerprint(
        "POST", "/orders", "a=1", body, with_secret, ["x-secret"], ["x-secret"]
    ) == fingerprint("POST", "/orders", "a=1", body, rotated, ["x-secret"], ["x-secret"])


@pytest.mark.parametrize(
    ("one", "other"),
    [
        *DIFFERENT_NUMBERS,
        (b'{"p":12345678901234567.89}', b'{"p":12345678901234568}'),
        (b'{"p":1}', b'{"p":"1"}'),
    ],
)
def test_numbers_that_differ_in_their_text_differ(one: bytes, other: bytes) -> None:
    """Numbers compare by their literal text: any parser may read 10.50 and 10.5 (or -0 and 0) apart."""
    assert fp(one) != fp(other)


def test_form_bytes_are_never_decoded_lossily() -> None:
    """%FF and %FE are two bytes, not one U+FFFD; + and %20 are both a space in a form."""
    assert fp(b"a=%FF", FORM) != fp(b"a=%FE", FORM)
    assert fp(b"", query="a=%FF") != fp(b"", query="a=%FE")
    assert fp(b"a=x+y", FORM) == fp(b"a=x%20y", FORM) == fp(b"%61=x%20y", FORM)
    assert fp(b"a=%zz", FORM) != fp(b"a=%25zz", FORM)  # a bare % is kept apart: some upstreams refuse it


def test_form_pairs_keep_their_order() -> None:
    """A form decoder may build other arrays when names move, so a reordered form is another request."""
    assert fp(b"i[][a]=1&i[][b]=2&i[][a]=3", FORM) != fp(b"i[][a]=1&i[][a]=3&i[][b]=2", FORM)


def test_every_value_of_a_repeated_chosen_header_counts() -> None:
    """The upstream sees every copy of a header, so the fingerprint does too."""
    body = RequestBody(b"x")
    one = fingerprint("POST", "/o", "", body, CIMultiDict([("X-Mode", "a"), ("X-Mode", "b")]), ["x-mode"])
    other = fingerprint("POST", "/o", "", body, CIMultiDict([("X-Mode", "c"), ("X-Mode", "b")]), ["x-mode"])
    assert one != other


# --- properties ------------------------------------------------------------------------------------------


@given(st.data())
def test_one_document_in_any_spelling_has_one_fingerprint(data: st.DataObject) -> None:
    """Key order, whitespace and string escapes never change the fingerprint of a JSON document."""
    tree, _ = data.draw(twin_trees())
    one = data.draw(json_text(tree)).encode()
    other = data.draw(json_text(tree)).encode()
    assert fp(one) == fp(other)


@given(st.data())
def test_two_documents_never_share_a_fingerprint(data: st.DataObject) -> None:
    """Two JSON documents meet in one fingerprint exactly when they say the same (numbers by text)."""
    tree, twin = data.draw(twin_trees())
    one = data.draw(json_text(tree)).encode()
    other = data.draw(json_text(twin)).encode()
    assert (fp(one) == fp(other)) == (meaning(tree) == meaning(twin))


@given(st.lists(st.tuples(FORM_BYTES, FORM_BYTES), max_size=4), st.data())
def test_form_spellings_of_the_same_pairs_share_a_fingerprint(
    pairs: list[tuple[bytes, bytes]], data: st.DataObject
) -> None:
    """Any percent-encoding of the same bytes, in the same order, is the same form and the same query."""
    forms = [
        b"&".join(data.draw(spelled(name)) + b"=" + data.draw(spelled(value)) for name, value in pairs)
        for _ in range(2)
    ]
    assert fp(forms[0], FORM) == fp(forms[1], FORM)
    assert canonical_query(forms[0].decode()) == canonical_query(forms[1].decode())


@given(st.binary(max_size=12), st.binary(max_size=12))
def test_forms_that_decode_differently_never_share_a_fingerprint(one: bytes, other: bytes) -> None:
    """Whatever the bytes, one fingerprint means one list of decoded pairs (the WHATWG form parser)."""
    if fp(one, FORM) == fp(other, FORM):
        assert whatwg_pairs(one) == whatwg_pairs(other)
