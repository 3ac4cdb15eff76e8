"""The fingerprint: one per document, never one for two documents. Tables and hypothesis properties."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway import urlencoded
from gateway.body import RequestBody, read_body
from gateway.fingerprint import BodyFields, canonical_query, fingerprint
from tests.gateways import gateway_server
from tests.strategies import (
    DIFFERENT_NUMBERS,
    FORM_BYTES,
    OBJECT,
    TREE,
    json_text,
    meaning,
    spelled,
    twin_trees,
    whatwg_pairs,
)
from tests.upstreams import Upstream

JSON = {"Content-Type": "application/json"}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def fp(body: bytes, headers: dict[str, str] = JSON, query: str = "", **kw: Any) -> str:
    parsed = read_body(body, headers.get("Content-Type", ""))
    chosen = kw.get("chosen", ["content-type"])
    return fingerprint("POST", "/o", query, parsed, headers, chosen, body_fields=kw.get("fields"))


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


# Escapes, bare and cut short, in any case, "+" and bytes that are not ASCII.
FORM_PARTS = st.lists(
    st.sampled_from([b"%", b"%4", b"%41", b"%ff", b"%G1", b"+", b"a", b"=", b"%%", b"\xff"])
)


@given(FORM_PARTS.map(b"".join), st.integers(3, 11))
def test_a_form_component_read_in_pieces_reads_as_in_one(component: bytes, size: int) -> None:
    """A long field is decoded and respelled in pieces (so no one call holds the event loop); read in
    pieces of a few bytes, it gives the bytes and the canonical spelling of one reading."""
    whole = (urlencoded._decode(component), urlencoded._canonical(component))
    kept = urlencoded.PIECE
    urlencoded.PIECE = size
    try:
        assert (urlencoded._decode(component), urlencoded._canonical(component)) == whole
    finally:
        urlencoded.PIECE = kept


# --- only some body fields, or all but some -------------------------------------------------------------

# Dotted paths of one or two segments, over the keys the test documents use most.
SEGMENT = st.sampled_from(["a", "b", "ref", "metadata"])
PATHS = st.lists(st.lists(SEGMENT, min_size=1, max_size=2).map(".".join), min_size=1, max_size=3, unique=True)
ABSENT = object()


def _independent(paths: list[str]) -> list[str]:
    """Paths none of which lies under another (setting one would then overwrite the other)."""
    return [p for p in paths if not any(p != q and (p + ".").startswith(q + ".") for q in paths)]


@st.composite
def with_values(draw: st.DrawFn, doc: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """``doc`` with any value, or none, at each of ``paths`` (parents made objects where they were not)."""
    out = _copy(doc)
    for path in paths:
        *parents, last = path.split(".")
        at = out
        for segment in parents:
            if not isinstance(at.get(segment), dict):
                at[segment] = {}
            at = at[segment]
        value = draw(st.just(ABSENT) | TREE)
        if value is ABSENT:
            at.pop(last, None)
        else:
            at[last] = value
    return out


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def _without(tree: dict[str, Any], path: list[str]) -> dict[str, Any]:
    """The model of fingerprint_ignore: the member at the path gone, where the path runs through objects."""
    head, *rest = path
    if head not in tree:
        return tree
    if not rest:
        return {k: v for k, v in tree.items() if k != head}
    if not isinstance(tree[head], dict):
        return tree
    return {**tree, head: _without(tree[head], rest)}


def _picked(tree: dict[str, Any], paths: list[str]) -> Any:
    """The model of fingerprint_fields: per path, nothing, or how deep it got and the value found there."""
    picked = []
    for path in paths:
        at: Any = tree
        found: Any = ()
        for depth, segment in enumerate(path.split(".")):
            if not isinstance(at, dict):
                found = (depth, meaning(at))
                break
            if segment not in at:
                found = None
                break
            at = at[segment]
        else:
            found = (len(path.split(".")), meaning(at))
        picked.append(found)
    return tuple(picked)


@given(OBJECT, PATHS, st.data())
def test_requests_that_differ_only_in_ignored_fields_fingerprint_the_same(
    doc: dict[str, Any], paths: list[str], data: st.DataObject
) -> None:
    """fingerprint_ignore: whatever value an ignored field has, or none at all, the fingerprint is one."""
    paths = _independent(paths)
    one, other = data.draw(with_values(doc, paths)), data.draw(with_values(doc, paths))
    ignore = BodyFields.ignoring(paths)
    assert fp(data.draw(json_text(one)).encode(), fields=ignore) == fp(
        data.draw(json_text(other)).encode(), fields=ignore
    )


@given(twin_trees(), PATHS, st.data())
def test_with_fields_ignored_any_other_difference_still_differs(
    twins: tuple[dict[str, Any], dict[str, Any]], paths: list[str], data: st.DataObject
) -> None:
    """fingerprint_ignore: two documents share a fingerprint exactly when the rest of them means the same."""
    one, other = (data.draw(with_values(tree, _independent(paths))) for tree in twins)
    covered_one, covered_other = one, other
    for path in paths:
        covered_one, covered_other = (
            _without(covered_one, path.split(".")),
            _without(covered_other, path.split(".")),
        )
    ignore = BodyFields.ignoring(paths)
    same = fp(data.draw(json_text(one)).encode(), fields=ignore) == fp(
        data.draw(json_text(other)).encode(), fields=ignore
    )
    assert same == (meaning(covered_one) == meaning(covered_other))


@given(twin_trees(), PATHS, st.data())
def test_only_the_chosen_fields_count_and_each_strictly(
    twins: tuple[dict[str, Any], dict[str, Any]], paths: list[str], data: st.DataObject
) -> None:
    """fingerprint_fields: two documents share a fingerprint exactly when the chosen fields mean the same."""
    # Values at the chosen paths, or the documents as drawn (where a path may meet a list or a string).
    one, other = twins
    if data.draw(st.booleans()):
        one, other = (data.draw(with_values(tree, _independent(paths))) for tree in twins)
    fields = BodyFields.covering(paths)
    same = fp(data.draw(json_text(one)).encode(), fields=fields) == fp(
        data.draw(json_text(other)).encode(), fields=fields
    )
    assert same == (_picked(one, paths) == _picked(other, paths))


FORM_NAME = st.sampled_from(
    [b"amount", b"currency", b"metadata[trace]", b"metadata[order]", b"metadatax", b"items[0]"]
)


@given(
    st.lists(st.tuples(FORM_NAME, FORM_BYTES), max_size=5),
    st.lists(st.tuples(FORM_NAME, FORM_BYTES), max_size=5),
    st.lists(st.sampled_from(["amount", "metadata", "items"]), min_size=1, max_size=2, unique=True),
    st.booleans(),
    st.data(),
)
def test_form_fields_are_chosen_by_name_and_the_names_under_them(
    one: list[tuple[bytes, bytes]],
    other: list[tuple[bytes, bytes]],
    names: list[str],
    only: bool,
    data: st.DataObject,
) -> None:
    """Form fields: `metadata` covers `metadata[trace]`, not `metadatax`; covered pairs count in order."""
    fields = BodyFields.covering(names) if only else BodyFields.ignoring(names)

    def counted(pairs: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        def named(name: bytes) -> bool:
            return any(name == n.encode() or name.startswith(n.encode() + b"[") for n in names)

        return [(name, value) for name, value in pairs if named(name) == only]

    def form(pairs: list[tuple[bytes, bytes]]) -> bytes:
        return b"&".join(data.draw(spelled(name)) + b"=" + data.draw(spelled(value)) for name, value in pairs)

    assert (fp(form(one), FORM, fields=fields) == fp(form(other), FORM, fields=fields)) == (
        counted(one) == counted(other)
    )


def test_covered_fields_stay_as_strict_as_the_whole_body() -> None:
    """Numbers by their text, a changed covered field, a body that is not an object: all still count."""
    ignore = BodyFields.ignoring(["sent_at"])
    assert fp(b'{"a":10.5,"sent_at":"1"}', fields=ignore) != fp(b'{"a":10.50,"sent_at":"2"}', fields=ignore)
    assert fp(b'{"a":1,"sent_at":"1"}', fields=ignore) == fp(b'{"sent_at":"2","a":1}', fields=ignore)
    only = BodyFields.covering(["items"])
    assert fp(b'{"items":[1],"note":"x"}', fields=only) == fp(b'{"items":[1],"note":"y"}', fields=only)
    assert fp(b'{"items":[1]}', fields=only) != fp(b'{"items":[1.0]}', fields=only)
    assert fp(b'{"items":null}', fields=only) != fp(b"{}", fields=only)
    deeper = BodyFields.covering(["items.sku"])  # items is a list: a path never covers less than it names
    assert fp(b'{"items":[1]}', fields=deeper) != fp(b'{"items":[2]}', fields=deeper)
    # No field names a top level that is not an object, nor any part of a body that is neither form nor JSON.
    assert fp(b"[1]", fields=only) != fp(b"[2]", fields=only)
    assert fp(b"x=1", {"Content-Type": "text/plain"}, fields=only) != fp(
        b"x=2", {"Content-Type": "text/plain"}, fields=only
    )


async def test_through_the_gateway_an_ignored_field_is_replayed_and_never_sent(
    dsn: str, upstream: Upstream
) -> None:
    """A retry with a new sent_at is one request: replayed, its sent_at never sent; another `to` is 422."""
    upstreams = {"mail": {"base_url": upstream.url, "fingerprint_ignore": ["sent_at"]}}
    answers = []
    async with gateway_server(dsn, upstreams=upstreams) as gw, aiohttp.ClientSession() as http:
        for text in (
            '{"to": "me@example.com", "sent_at": "2025-01-01T10:00:00Z"}',
            '{"sent_at": "2025-01-01T10:05:00Z", "to": "me@example.com"}',
            '{"to": "you@example.com", "sent_at": "2025-01-01T10:05:00Z"}',
            '{"to": "me@example.com", "sent_at": "1", "sent_at": "2"}',
        ):
            async with http.post(
                f"{gw.url}/mail/messages",
                data=text,
                headers={"Idempotency-Key": "run-1:5", "Content-Type": "application/json"},
            ) as resp:
                answers.append((resp.status, resp.headers.get("Idempotent-Replayed"), await resp.read()))
    (first, replay, reused, duplicate) = answers
    assert (first[0], replay[:2], replay[2]) == (201, (201, "true"), first[2])
    assert reused[0] == 422
    assert (duplicate[0], json.loads(duplicate[2])["type"][-14:]) == (
        400,
        "body-malformed",
    )  # even if ignored
    assert [json.loads(call.body)["sent_at"] for call in upstream.effects()] == ["2025-01-01T10:00:00Z"]
