"""Key syntax, scoping and derived keys. Property tests where a property is the point."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
