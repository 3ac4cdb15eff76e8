"""Key syntax, scoping and derived keys; fingerprints. Property tests where a property is the point."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.fingerprint import canonical_query, fingerprint
from gateway.keys import MAX_KEY_LENGTH, KeySyntaxError, ScopedKey, parse_key

visible = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255)


@given(visible)
def test_bare_and_quoted_forms_parse_to_the_same_key(key: str) -> None:
    """Any visible-ASCII key reads the same bare and as an RFC 8941 sf-string."""
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if not key.startswith('"'):
        assert parse_key(key) == key
    assert parse_key(quoted) == key


@given(st.text(min_size=1, max_size=300))
def test_parse_key_accepts_only_what_the_contract_allows(raw: str) -> None:
    """Whatever comes in, the result is 1..255 visible ASCII characters, or KeySyntaxError."""
    try:
        key = parse_key(raw)
    except KeySyntaxError:
        return
    assert 1 <= len(key) <= MAX_KEY_LENGTH
    assert all("\x21" <= ch <= "\x7e" for ch in key)


def test_key_length_limit_is_255() -> None:
    """255 characters pass, 256 are refused with a message that says so."""
    assert parse_key("k" * 255) == "k" * 255
    with pytest.raises(KeySyntaxError, match="at most 255"):
        parse_key("k" * 256)


@given(
    st.tuples(st.text(min_size=1), st.text(min_size=1), visible),
    st.tuples(st.text(min_size=1), st.text(min_size=1), visible),
)
def test_derived_keys_are_stable_and_unique_per_scope(
    a: tuple[str, str, str], b: tuple[str, str, str]
) -> None:
    """The same scope always derives the same upstream key; different scopes never share one."""
    assert ScopedKey(*a).derived(SECRET) == ScopedKey(*a).derived(SECRET)
    if a != b:
        assert ScopedKey(*a).derived(SECRET) != ScopedKey(*b).derived(SECRET)


def test_derived_keys_cannot_be_computed_without_the_secret() -> None:
    """The upstream key is a keyed MAC: another secret (or a plain hash of the scope) gives another key."""
    scope = ScopedKey("grocer", "shop", "run-1:4")
    plain = hashlib.sha256()
    for part in ("grocer", "shop", "run-1:4"):
        plain.update(len(part).to_bytes(4, "big") + part.encode())
    assert scope.derived(SECRET) != scope.derived(b"another secret")
    assert scope.derived(SECRET) != "eg_" + plain.hexdigest()[:32]


SECRET = b"s" * 32

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


@given(st.dictionaries(st.text(max_size=8), JSONISH, max_size=6))
def test_json_key_order_and_spacing_do_not_change_the_fingerprint(doc: dict[str, object]) -> None:
    """Two serialisations of one JSON document are one request."""
    compact = json.dumps(doc, separators=(",", ":")).encode()
    spaced = json.dumps(dict(reversed(list(doc.items()))), indent=2).encode()
    headers = {"Content-Type": "application/json"}
    assert fingerprint("POST", "/o", "", compact, headers, ["content-type"]) == fingerprint(
        "POST", "/o", "", spaced, headers, ["content-type"]
    )


def test_fingerprint_sees_what_changes_the_effect_and_never_credentials() -> None:
    """Method, path, query, body and chosen headers count; Authorization and secrets do not."""
    base = ("POST", "/orders", "a=1", b'{"x":1}', {"Content-Type": "application/json", "Authorization": "A"})
    fp = fingerprint(*base, ["content-type", "authorization"])
    assert fingerprint("PUT", *base[1:], ["content-type"]) != fp
    assert fingerprint(base[0], "/other", *base[2:], ["content-type"]) != fp
    assert fingerprint(*base[:2], "a=2", *base[3:], ["content-type"]) != fp
    assert fingerprint(*base[:3], b'{"x":2}', base[4], ["content-type"]) != fp
    rotated = {"Content-Type": "application/json", "Authorization": "B"}
    assert fingerprint(*base[:4], rotated, ["content-type", "authorization"]) == fp
    assert fingerprint(*base[:4], {**rotated, "X-Secret": "s"}, ["x-secret"], ["x-secret"]) == fingerprint(
        *base[:4], rotated, ["x-secret"], ["x-secret"]
    )


@given(st.lists(st.tuples(st.sampled_from("abc"), st.text(max_size=3)), max_size=6))
def test_canonical_query_keeps_the_order_of_repeated_names(pairs: list[tuple[str, str]]) -> None:
    """Sorting by name must not reorder values of one name: a[]=1&a[]=2 is not a[]=2&a[]=1."""
    from urllib.parse import parse_qsl, urlencode

    canon = parse_qsl(canonical_query(urlencode(pairs)), keep_blank_values=True)
    for name in "abc":
        assert [v for k, v in canon if k == name] == [v for k, v in pairs if k == name]
