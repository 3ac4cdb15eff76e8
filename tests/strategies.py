"""Hypothesis strategies shared by the property tests: JSON texts, form and query strings, header bytes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Number literals as an agent's JSON library may write them: trailing zeros, exponents, -0, huge ones.
NUMBER = st.one_of(
    st.integers(-(10**20), 10**20).map(str),
    st.sampled_from(
        ["0", "-0", "10.50", "10.5", "1e400", "2e400", "1E2", "100", "0.1", "0.10000000000000000555"]
    ),
    st.tuples(st.integers(-999, 999), st.integers(0, 999), st.integers(-400, 400)).map(
        lambda t: f"{t[0]}.{t[1]}e{t[2]}"
    ),
)


# JSON numbers that some parser reads apart although a float cannot tell them apart.
DIFFERENT_NUMBERS = [
    (b'{"p":10.50}', b'{"p":10.5}'),
    (b'{"p":0.1}', b'{"p":0.10000000000000000555}'),
    (b'{"p":-0}', b'{"p":0}'),
    (b'{"p":1e400}', b'{"p":2e400}'),
]


class Literal(str):
    """A number in a test tree, written as its literal text."""


LEAF = st.one_of(
    st.none(),
    st.booleans(),
    NUMBER.map(Literal),
    st.text(max_size=6),
    st.sampled_from(["caf\u00e9", "\U0001f600"]),
)
KEY = st.text(max_size=4) | st.sampled_from(["a", "b", "ref", "metadata"])
TREE = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEY, inner, max_size=3),
    max_leaves=12,
)
OBJECT = st.dictionaries(KEY, TREE, max_size=5)
WHITESPACE = st.sampled_from(["", " ", "\n", "\t", "\r\n", "  "])


@st.composite
def json_text(draw: st.DrawFn, tree: Any) -> str:
    """One of the many ways to write ``tree``: any key order, whitespace and string escaping."""

    def ws() -> str:
        return draw(WHITESPACE)

    def write(value: Any) -> str:
        if isinstance(value, Literal):
            return str(value)
        if isinstance(value, str):
            return json.dumps(value, ensure_ascii=draw(st.booleans()))
        if isinstance(value, dict):
            keys = draw(st.permutations(list(value)))
            members = [ws() + write(k) + ws() + ":" + ws() + write(value[k]) + ws() for k in keys]
            return "{" + (",".join(members) or ws()) + "}"
        if isinstance(value, list):
            return "[" + (",".join(ws() + write(v) + ws() for v in value) or ws()) + "]"
        return json.dumps(value)

    return ws() + write(tree) + ws()


@st.composite
def twin_trees(draw: st.DrawFn) -> tuple[Any, Any]:
    """A document and either itself or a near copy with one leaf changed (a number respelled, say)."""
    tree = draw(OBJECT)
    if not tree or draw(st.booleans()):
        return tree, tree
    other = dict(tree)
    key = draw(st.sampled_from(sorted(tree)))
    other[key] = draw(TREE)
    return tree, other


# Bytes as a form or query component may carry them, and the ways of spelling each one.
FORM_BYTES = st.binary(max_size=6) | st.sampled_from([b"\xff", b"\xfe", b" ", b"+", b"%", b"&", b"=", b"a"])


@st.composite
def spelled(draw: st.DrawFn, raw: bytes) -> bytes:
    """``raw`` percent-encoded one of the ways a client may choose (upper or lower hex, + for space)."""
    out = bytearray()
    for byte in raw:
        char = bytes([byte])
        must = not (char.isalnum() and char.isascii()) and char not in b"-._~"
        if byte == 0x20 and draw(st.booleans()):
            out += b"+"
        elif must or draw(st.booleans()):
            hex_digits = f"{byte:02X}" if draw(st.booleans()) else f"{byte:02x}"
            out += b"%" + hex_digits.encode()
        else:
            out += char
    return bytes(out)


def whatwg_pairs(raw: bytes) -> list[tuple[bytes, bytes]]:
    """The WHATWG URL standard's application/x-www-form-urlencoded parser, on bytes."""
    from urllib.parse import unquote_to_bytes

    pairs = []
    for segment in raw.split(b"&"):
        if not segment:
            continue
        name, _, value = segment.partition(b"=")
        pairs.append(
            (unquote_to_bytes(name.replace(b"+", b" ")), unquote_to_bytes(value.replace(b"+", b" ")))
        )
    return pairs


def meaning(tree: Any) -> Any:
    """What a document says, for comparing trees: numbers by their text, never equal to strings."""
    if isinstance(tree, Literal):
        return ("number", str(tree))
    if isinstance(tree, str):
        return ("string", tree)
    if isinstance(tree, dict):
        return ("object", frozenset((k, meaning(v)) for k, v in tree.items()))
    if isinstance(tree, list):
        return ("array", tuple(meaning(v) for v in tree))
    return ("literal", repr(tree))


# Keys as a header carries them (no surrounding whitespace): bare, quoted, escaped, too long, odd bytes.
KEY_VALUES = (
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7F), max_size=260)
    | st.text(alphabet='ab"\\ \x7f\t', max_size=8)
    | st.integers(250, 260).map(lambda n: "k" * n)
    | st.integers(250, 258).map(lambda n: '"' + "k" * n + '"')
).filter(lambda value: value == value.strip(" \t"))
