"""Key syntax, scoping and derived keys. Property tests where a property is the point."""

from __future__ import annotations

import hashlib
import uuid

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import KeySyntaxError
from gateway.keys import MAX_KEY_LENGTH, LogHash, ScopedKey, looks_made_up, parse_key
from journal import StepContext
from tests.database import effect_rows
from tests.gateways import gateway_server
from tests.upstreams import Upstream

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


# --- keys made up per call ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "made_up"),
    [
        (str(uuid.uuid4()), True),
        (str(uuid.uuid4()).upper(), True),
        (f"stainless-python-retry-{uuid.uuid4()}", True),  # the OpenAI and Anthropic SDKs
        ("c0a8f3e1-9b7d-e2f4-5a6b-8c9d0e1f2a3b", True),  # stripe-python: random bits, no version digit
        (str(uuid.uuid1()), True),
        ("run-1:4", False),
        (f"{uuid.uuid4()}:4", False),  # a run id that is a UUID, and its step
        (f"{uuid.uuid4().hex}:4:2", False),
        ("order-2024-06-01", False),
        ("c0a8f3e1-9b7d-e2f4-5a6b-8c9d0e1f2a3", False),  # one digit short
    ],
    # Named, not by the keys: those are new in each process, and parallel workers must collect alike.
    ids=[
        "uuid4",
        "uuid4-upper",
        "sdk-retry",
        "stripe",
        "uuid1",
        "run-step",
        "uuid-run-step",
        "hex-run-step",
        "date",
        "one-digit-short",
    ],
)
def test_keys_that_end_in_a_uuid_look_made_up(key: str, made_up: bool) -> None:
    """A key ending in a UUID (any version, any prefix) looks made up per call; step keys do not."""
    assert looks_made_up(key) is made_up


@given(visible | st.uuids().map(str), st.integers(1, 10_000), st.integers(1, 50))
def test_no_key_the_journal_makes_looks_made_up(run_id: str, step: int, call: int) -> None:
    """Whatever the run's id, the journal's keys end in the step (and call), never in a UUID."""
    ctx = StepContext(run_id, step, "order")
    keys = [ctx.key_for(bytes([n])) for n in range(call % 3 + 1)]
    assert not any(looks_made_up(key) for key in keys)


async def test_an_upstream_that_takes_step_keys_only_refuses_a_made_up_one(
    dsn: str, upstream: Upstream
) -> None:
    """refuse_random_keys: 400 key-random, nothing recorded or sent; other upstreams take the same key."""
    upstreams = {
        "strict": {"base_url": upstream.url, "refuse_random_keys": True},
        "lenient": {"base_url": upstream.url},
    }
    key = f"stainless-python-retry-{uuid.uuid4()}"
    async with gateway_server(dsn, upstreams=upstreams) as gw, aiohttp.ClientSession() as http:
        async with http.post(f"{gw.url}/strict/orders", json={}, headers={"Idempotency-Key": key}) as resp:
            refused = resp.status, resp.content_type, await resp.json()
        assert (await effect_rows(dsn), upstream.calls) == ([], [])
        async with http.post(f"{gw.url}/lenient/orders", json={}, headers={"Idempotency-Key": key}) as resp:
            assert resp.status == 201
        async with http.post(
            f"{gw.url}/strict/orders", json={}, headers={"Idempotency-Key": "run-1:4"}
        ) as resp:
            assert resp.status == 201
    status, content_type, body = refused
    assert (status, content_type, body["type"]) == (
        400,
        "application/problem+json",
        "https://effect-gateway.dev/problems/key-random",
    )
    assert "a key made up per call is new on the agent's re-run" in body["detail"]
    assert len(upstream.effects()) == 2


@given(
    st.lists(
        st.tuples(st.sampled_from(["default", "a", "ab"]), st.sampled_from(["shop", "s", "hop"]), visible),
        min_size=2,
        max_size=2,
        unique=True,
    )
)
def test_the_logs_hash_of_a_key_tells_keys_apart_and_gives_neither_key_away(
    scopes: list[tuple[str, str, str]],
) -> None:
    """Each (tenant, upstream, key) logs as its own 16 hex digits, neither the key nor the upstream's."""
    log_hash = LogHash(b"s" * 32)
    first, second = (log_hash.of(*scope) for scope in scopes)
    assert first != second
    assert first == log_hash.of(*scopes[0])  # every retry of a key logs alike
    assert first != LogHash(b"t" * 32).of(*scopes[0])  # keyed: unknown without the gateway's secret
    assert len(first) == 16
    assert set(first) <= set("0123456789abcdef")
    derived = ScopedKey(*scopes[0]).derived(b"s" * 32)
    assert first not in derived
    assert first not in scopes[0][2]
