"""Strict JSON bodies: what is refused, and stamps spliced into the agent's own bytes (hypothesis)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway import jsonbody
from gateway.errors import JsonRefused
from tests.strategies import OBJECT, TREE, json_text

DEEP = b"[" * 10_000 + b"]" * 10_000


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"a":1,"a":2}', "appears twice"),
        (b'{"a":1,"\\u0061":2}', "appears twice"),
        (b'{"a":NaN}', "NaN"),
        (b'{"a":Infinity}', "Infinity"),
        (b'{"a":-Infinity}', "Infinity"),
        (DEEP, "deeper than 128"),
        (b'{"a":' * 10_000 + b"1" + b"}" * 10_000, "deeper than 128"),
        (b'{"a":"caf\xe9"}', "not UTF-8"),
        (b'{"a":1} x', "follows the JSON document"),
        (b'{"a":1}{}', "follows the JSON document"),
        (b"\xef\xbb\xbf{}", "expected a JSON value"),
        (b"", "expected a JSON value"),
        (b'{"a":1,}', "expected a key"),
        (b"[01]", "not JSON"),
    ],
)
def test_documents_parsers_disagree_on_are_refused(body: bytes, why: str) -> None:
    """Duplicates, NaN/Infinity, deep nesting, bad UTF-8 and trailing bytes: refused, never guessed at."""
    with pytest.raises(JsonRefused, match=why):
        jsonbody.parse(body, ("ref",))


def test_nesting_is_checked_before_any_recursion() -> None:
    """10,000 levels are refused at once: no RecursionError, no second spent."""
    started = time.perf_counter()
    with pytest.raises(JsonRefused):
        jsonbody.parse(DEEP)
    assert time.perf_counter() - started < 1
    assert len(jsonbody.parse(b"[" * 128 + b"]" * 128).value) == 1  # the limit itself is fine


def test_the_stamp_keeps_every_byte_of_the_agents_document() -> None:
    """Numbers, key order, escapes and whitespace stay as sent; only "field":"value" is added."""
    body = '{ "amount": 12345678901234567.89, "price" : 10.50, "big": 1e400, "s": "caf\\u00e9 \u00e9" }\n'
    stamped = jsonbody.parse(body.encode(), ("metadata", "ref")).stamped("eg_1")
    assert stamped == body.replace('\u00e9" }', '\u00e9","metadata":{"ref":"eg_1"} }').encode()


@pytest.mark.parametrize(
    ("body", "path", "why"),
    [
        (b"[1]", ("ref",), "not an object"),
        (b'"x"', ("ref",), "not an object"),
        (b'{"metadata":3}', ("metadata", "ref"), "'metadata' is not an object"),
    ],
)
def test_a_document_without_room_for_the_stamp_cannot_be_stamped(
    body: bytes, path: tuple[str, ...], why: str
) -> None:
    """A body that is not an object, or a parent that is not one, has no place for the key."""
    with pytest.raises(JsonRefused, match=why):
        jsonbody.parse(body, path).stamped("k")


def test_loads_gives_plain_values_and_refuses_what_python_cannot_hold() -> None:
    """The admin API reads strict JSON into Python; a number too large for a float is refused."""
    assert jsonbody.loads(b'{"a":[1,2.5,"x",null,true]}') == {"a": [1, 2.5, "x", None, True]}
    with pytest.raises(JsonRefused):
        jsonbody.loads(b"[1e400]")


# --- properties ------------------------------------------------------------------------------------------

PATH = st.lists(st.sampled_from(["a", "b", "ref", "metadata"]), min_size=1, max_size=3).map(tuple)


def has_room(tree: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether a field can go at ``path``: free, and every parent an object or missing."""
    node: Any = tree
    for part in path[:-1]:
        if part not in node:
            return True
        node = node[part]
        if not isinstance(node, dict):
            return False
    return path[-1] not in node


@given(OBJECT, PATH, st.data())
def test_stamping_never_produces_invalid_json_nor_changes_the_rest(
    tree: dict[str, Any], path: tuple[str, ...], data: st.DataObject
) -> None:
    """The stamped body is valid JSON with the key at the path, and the agent's bytes around one insertion."""
    text = data.draw(json_text(tree))
    document = jsonbody.parse(text.encode(), path)
    if not has_room(tree, path):
        with pytest.raises(JsonRefused):
            document.stamped("eg_k")
        return
    stamped = document.stamped("eg_k").decode()
    parsed = json.loads(stamped)  # the standard library reads it, and so does the gateway
    jsonbody.parse(stamped.encode())
    node = parsed
    for part in path:
        node = node[part]
    assert node == "eg_k"
    prefix = next((i for i, (x, y) in enumerate(zip(text, stamped, strict=False)) if x != y), len(text))
    assert stamped.startswith(text[:prefix])
    assert stamped.endswith(text[prefix:]), "one insertion; the rest of the agent's bytes unchanged"


@given(st.text(alphabet='{}[]",:0123456789.eE-+ \nabtrufalsNIy\\', max_size=24) | st.builds(json.dumps, TREE))
def test_the_strict_parser_accepts_exactly_what_json_loads_reads_unambiguously(text: str) -> None:
    """Whatever we accept, the standard parser reads alike; we refuse only bad JSON or ambiguous JSON."""
    objects: list[list[tuple[str, Any]]] = []
    constants: list[str] = []

    def remember(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        objects.append(pairs)
        return dict(pairs)

    try:
        json.loads(text, object_pairs_hook=remember, parse_constant=constants.append)
        readable = True
    except (ValueError, RecursionError):
        readable = False
    try:
        ours = jsonbody.parse(text.encode()).value
    except JsonRefused:
        ambiguous = bool(constants) or any(len(dict(pairs)) != len(pairs) for pairs in objects)
        assert not readable or ambiguous, "refused a document the standard parser reads plainly"
        return
    assert readable, "accepted something the standard parser refuses"
    assert json.loads(jsonbody.compact(ours)) == json.loads(text)


# --- long documents, read in pieces -------------------------------------------------------------------------

# Pieces of a few characters, so that even short documents are walked member by member; and one piece
# larger than any document, so that every document is one scan, as it was before documents were cut up.
TINY = (1, 2, 4, 8)
WHOLE = (1 << 40,)


@contextmanager
def pieces(sizes: tuple[int, ...]) -> Iterator[None]:
    kept = jsonbody.PIECES
    jsonbody.PIECES = sizes
    try:
        yield
    finally:
        jsonbody.PIECES = kept


def reading(body: bytes, path: tuple[str, ...]) -> object:
    """What parse makes of ``body``: its values in order, its canonical form and stamp site, or a refusal."""
    try:
        document = jsonbody.parse(body, path)
    except JsonRefused:
        return JsonRefused
    return jsonbody.compact(document.value), document.canonical(), document.site


@given(
    st.text(alphabet='{}[]",:0123456789.eE-+ \nabtrufalsNIy\\', max_size=40)
    | st.builds(json.dumps, TREE)
    | OBJECT.flatmap(json_text),
    st.sampled_from([(), ("a",), ("a", "b"), ("metadata", "ref")]),
)
# Runs of short members are read in one scan, cut at a comma between members: never at one in a string
# or an array, never leaving a member out, never taking a duplicate or the stamp's place for granted.
@example('["a,b","c]",[1,2],{"d":3},4]', ())
@example('[1,"\\",",",5]', ())
@example("[1, 2, ,3]", ())
@example("[1,2,3,4,]", ())
@example('{"a":1,"b":2,"a":3}', ())
@example('{"a":1,"b":2}', ("a",))
@example('{"b":1,"metadata":2,"c":3}', ("metadata", "ref"))
@example("[1,2,3,1.5e3,-0,4]", ())
@example('["a","b,c","d",1,"e,"]', ())
@example('[1,"x\\",y",2,"z"]', ())
# The stamp's parent object among short members: it is walked, never read past in a run.
@example('{"a":{},"d":2,"e":3}', ("a", "b"))
@example('{"c":1,"a":{"b":1},"d":2}', ("a", "b"))
@example('{"c":1,"a":7,"d":2,"e":3}', ("a", "b"))
def test_a_document_read_in_pieces_reads_as_in_one_scan(text: str, path: tuple[str, ...]) -> None:
    """Any text, read in pieces of a few characters, gives the values, site or refusal of one scan."""
    body = text.encode()
    with pieces(TINY):
        in_pieces = reading(body, path)
    with pieces(WHOLE):
        whole = reading(body, path)
    assert in_pieces == whole


@pytest.mark.parametrize("opener", ["[", '{"a":', '[{"b":'])
@pytest.mark.parametrize("sizes", [TINY, jsonbody.PIECES], ids=["tiny", "default"])
def test_the_depth_limit_holds_for_a_document_read_in_pieces(opener: str, sizes: tuple[int, ...]) -> None:
    """Nesting to 128 levels is read, and one more refused, however long the document is."""
    closer = "".join({"[": "]", "{": "}"}[c] for c in opener if c in "[{")[::-1]
    filler = " " * 20_000 if sizes is jsonbody.PIECES else ""  # longer than the largest piece
    levels = 128 // len(closer)
    with pieces(sizes):
        for depth, refused in [(levels, False), (levels + 1, True)]:
            body = (opener * depth + filler + "1" + closer * depth).encode()
            if refused:
                with pytest.raises(JsonRefused, match="deeper than 128"):
                    jsonbody.parse(body)
            else:
                assert jsonbody.parse(body, ("a",)).canonical().count(b"1") == 1


@pytest.mark.parametrize(
    "body",
    [
        b"[" + b"[]," * 349_000 + b"[]]",
        b"[" + (b"[" * 127 + b"]" * 127 + b",") * 4_100 + b"[]]",
        b"{" + b",".join(b'"k%010d":1' % i for i in range(65_000)) + b"}",
        b'{"a":[' + b'{"b":[1,2,{"c":"x"}]},' * 47_000 + b"0]}",
    ],
    ids=["empty-arrays", "nested-to-the-limit", "many-keys", "objects-in-an-array"],
)
def test_no_scan_of_a_megabyte_reads_more_than_a_piece(body: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call of the C scanner, which holds the interpreter's lock, reads at most 16 Ki characters."""
    calls: list[int] = []
    scan = jsonbody._scan

    def counted(text: str, idx: int) -> tuple[Any, int]:
        value, end = scan(text, idx)
        calls.append(end - idx)
        return value, end

    monkeypatch.setattr(jsonbody, "_scan", counted)
    document = jsonbody.parse(body, ("metadata", "ref"))
    assert len(body) > 1_000_000
    assert max(calls) <= jsonbody.PIECES[-1], "one call read more than the largest piece"
    with pieces(WHOLE):
        assert document.canonical() == jsonbody.parse(body).canonical()


@pytest.mark.parametrize(
    ("body", "containers"),
    [
        (b"[" + b"[]," * 19_998 + b"[]]", 20_000),
        (b"[" + b"[]," * 19_999 + b"[]]", 20_001),
        (b"[" + (b"[" * 127 + b"]" * 127 + b",") * 4_100 + b"[]]", 520_702),
        (b'{"a":[' + b'{"b":[1,2,{"c":"x"}]},' * 7_000 + b"0]}", 21_002),
        # Brackets in strings are text, not arrays: they count for nothing.
        (b'{"a":[' + b'"[{[{"' + b',"[[]]"' * 60_000 + b"]}", 2),
    ],
    ids=["at-the-limit", "one-past", "nested-megabyte", "records", "brackets-in-strings"],
)
def test_a_body_holds_at_most_twenty_thousand_arrays_and_objects(body: bytes, containers: int) -> None:
    """An agent's body of more arrays and objects than MAX_CONTAINERS is refused (brackets in strings do
    not count); the gateway's own reading of JSON, such as a probe's answer, has no such limit."""
    assert len(body) > jsonbody.PIECES[-1]
    limit = jsonbody.MAX_CONTAINERS
    if containers > limit:
        with pytest.raises(JsonRefused, match="more than 20,000 arrays and objects"):
            jsonbody.parse(body, most_containers=limit)
    else:
        assert jsonbody.parse(body, most_containers=limit).value is not None
    assert jsonbody.parse(body).value is not None
