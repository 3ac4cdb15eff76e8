"""What the upstream receives: the stamp and native key are the gateway's alone; agent headers as sent."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import aiohttp
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from gateway import urlencoded
from gateway.body import read_body
from gateway.errors import FormRefused, JsonRefused, KeySyntaxError, StampError
from gateway.keys import parse_key
from gateway.policy import UpstreamPolicy, upstream_policy
from gateway.settings import UpstreamSettings
from gateway.stamp import reserved_use
from gateway.upstream import build_outbound
from tests.database import effect_rows
from tests.gateways import gateway_server
from tests.strategies import FORM_BYTES, KEY_VALUES, OBJECT, json_text, spelled
from tests.upstreams import STAMPED, Upstream, one_insertion, raw_exchange

PROBLEM = "application/problem+json"


def problem(body: bytes) -> str:
    return str(json.loads(body)["type"]).rsplit("/", 1)[1]


STAMPS: dict[str, dict[str, Any]] = {
    "header": {"stamp": {"header": "X-Ref"}},
    "native": {"native_key": {"header": "X-Idem"}},
    "form": {"stamp": {"form_field": "metadata[idempotency_key]"}},
    "query": {"stamp": {"query_param": "ref"}},
    "json": {"stamp": {"json_field": "metadata.ref"}},
}
# A request of the agent's that sets the name the gateway sets: (headers, query, content type, body).
PLANTED: dict[str, tuple[dict[str, str], str, str, bytes]] = {
    "header": ({"x-ref": "eg_forged"}, "", "application/json", b"{}"),
    "native": ({"X-IDEM": "eg_forged"}, "", "application/json", b"{}"),
    "form": ({}, "", "application/x-www-form-urlencoded", b"a=1&metadata%5Bidempotency_key%5D=eg_forged"),
    "query": ({}, "?a=1&r%65f=eg_forged", "application/json", b"{}"),
    "json": ({}, "", "application/json", b'{"metadata":{"a":1,"ref":"eg_forged"}}'),
}


@pytest.mark.parametrize("where", sorted(STAMPS))
@pytest.mark.parametrize("key", ["k", None], ids=["keyed", "keyless"])
async def test_an_agent_cannot_set_the_stamp_or_native_key(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, where: str, key: str | None
) -> None:
    """A header (any case), form field, query parameter or JSON field under the gateway's name: 400."""
    headers, query, content_type, body = PLANTED[where]
    cfg = {"shop": {"base_url": upstream.url, **STAMPS[where]}}
    async with (
        gateway_server(dsn, upstreams=cfg) as gw,
        http.put(
            f"{gw.url}/shop/orders{query}",
            data=body,
            headers={"Content-Type": content_type, **headers, **({"Idempotency-Key": key} if key else {})},
        ) as resp,
    ):
        assert resp.status == 400
        assert resp.content_type == PROBLEM
        assert problem(await resp.read()) == "stamp-reserved"
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


async def test_a_native_key_named_idempotency_key_is_no_conflict(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The agent's Idempotency-Key is the gateway's input: the upstream gets only the derived one."""
    cfg = {"shop": {"base_url": upstream.url, "native_key": {"header": "Idempotency-Key"}}}
    async with (
        gateway_server(dsn, upstreams=cfg) as gw,
        http.post(f"{gw.url}/shop/orders", data=b"{}", headers={"Idempotency-Key": "mine"}) as r,
    ):
        assert r.status == 201
    sent = [v for k, v in upstream.calls[0].header_list if k.lower() == "idempotency-key"]
    assert sent == [(await effect_rows(dsn))[0]["derived_key"]]


async def test_a_fragment_in_the_target_is_refused(dsn: str, upstream: Upstream) -> None:
    """'#' would hide a query stamp added after it, so the target is refused and nothing is sent."""
    cfg = {"shop": {"base_url": upstream.url, "stamp": {"query_param": "ref"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        raw = await raw_exchange(
            gw.url, b"POST /shop/orders?a=1#frag HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: h\r\n"
        )
        assert raw.split(b" ", 2)[1] == b"400"
        assert b"problems/path-refused" in raw
        raw = await raw_exchange(
            gw.url, b"POST /shop/caf\xc3\xa9 HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: u\r\n"
        )
        assert raw.split(b" ", 2)[1] == b"400"
    assert upstream.calls == []


async def test_headers_reach_the_upstream_as_the_agent_sent_them(
    dsn: str, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeated headers stay repeated; hop-by-hop and Connection-named ones stop here; credentials win."""
    monkeypatch.setenv("SHOP_SECRET", "Bearer sk_injected")
    cfg = {"shop": {"base_url": upstream.url, "inject_headers": {"Authorization": "env:SHOP_SECRET"}}}
    async with gateway_server(dsn, upstreams=cfg) as gw:
        raw = await raw_exchange(
            gw.url,
            b"POST /shop/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: hh\r\n"
            b"X-Tag: a\r\nX-Tag: b\r\n"
            b"Connection: keep-alive, X-Hop\r\nX-Hop: secret\r\nKeep-Alive: timeout=5\r\n"
            b"authorization: Bearer agent\r\nAUTHORIZATION: Bearer agent2\r\n",
        )
        assert raw.split(b" ", 2)[1] == b"201", raw
    sent = upstream.calls[0].header_list
    assert [v for k, v in sent if k == "X-Tag"] == ["a", "b"]
    assert not [k for k, _ in sent if k.lower() in ("x-hop", "keep-alive")]
    assert "X-Hop" not in " ".join(v for k, v in sent if k.lower() == "connection")
    assert [v for k, v in sent if k.lower() == "authorization"] == ["Bearer sk_injected"]


# --- properties ------------------------------------------------------------------------------------------

HEADER_NAMES = st.sampled_from(["X-Tag", "X-Order", "Accept", "Content-Language", "X-Hop", "Keep-Alive"])
HEADER_VALUE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=8)
STAMP_KINDS = st.sampled_from([None, "header", "query_param", "form_field", "json_field"])


@st.composite
def agent_request(draw: st.DrawFn) -> tuple[str, list[tuple[str, str]], str, bytes]:
    """(query, headers, content type, body) as an agent might send them."""
    query = b"&".join(
        draw(spelled(n)) + b"=" + draw(spelled(v))
        for n, v in draw(st.lists(st.tuples(FORM_BYTES, FORM_BYTES), max_size=3))
    )
    headers = draw(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUE), max_size=5))
    if draw(st.booleans()):
        headers.append(("Connection", "X-Hop"))
    kind = draw(st.sampled_from(["json", "form", "opaque"]))
    if kind == "json":
        return query.decode(), headers, "application/json", draw(json_text(draw(OBJECT))).encode()
    if kind == "form":
        form = b"&".join(
            draw(spelled(n)) + b"=" + draw(spelled(v))
            for n, v in draw(st.lists(st.tuples(FORM_BYTES, FORM_BYTES), max_size=3))
        )
        return query.decode(), headers, "application/x-www-form-urlencoded", form
    return query.decode(), headers, "application/octet-stream", draw(st.binary(max_size=20))


def policy_for(stamp: str | None, native: bool) -> UpstreamPolicy:
    names = {"header": "X-Ref", "query_param": "ref", "form_field": "metadata[ref]", "json_field": "meta.ref"}
    cfg = UpstreamSettings.model_validate(
        {
            "base_url": "http://upstream.invalid",
            "stamp": {stamp: names[stamp]} if stamp else None,
            "native_key": {"header": "X-Idem"} if native else None,
        }
    )
    return upstream_policy("shop", cfg, timedelta(seconds=1))


@given(agent_request(), STAMP_KINDS, st.booleans(), st.booleans())
def test_the_upstream_gets_the_agents_request_plus_the_stamp_and_native_key(
    request: tuple[str, list[tuple[str, str]], str, bytes], stamp: str | None, native: bool, keyed: bool
) -> None:
    """Headers (repeats, order), query and body go on as sent, plus the key where configured; nothing else."""
    query, headers, content_type, raw = request
    headers = [("Content-Type", content_type), *headers]
    policy = policy_for(stamp, native)
    try:
        body = read_body(raw, content_type, policy.json_stamp_path)
    except JsonRefused:
        assume(False)
        raise
    agent_headers = CIMultiDict(headers)
    assume(reserved_use(policy, agent_headers, query, body) is None)
    try:
        out = build_outbound(policy, "eg_k" if keyed else None, "POST", "/p", query, agent_headers, body)
    except StampError:
        assume(False)
        raise
    hop = (
        {"x-hop", "keep-alive", "connection"}
        if ("Connection", "X-Hop") in headers
        else {"keep-alive", "connection"}
    )
    expected = [(k, v) for k, v in headers if k.lower() not in hop]
    added = {"x-idem": native and keyed, "x-ref": stamp == "header" and keyed}
    assert [(k, v) for k, v in out.headers.items() if k.lower() not in added] == expected
    assert [k.lower() for k, _ in out.headers.items() if k.lower() in added] == [
        n for n, on in added.items() if on
    ]
    sent_query = out.url.raw_query_string
    if keyed and stamp == "query_param":
        assert sent_query == (query + "&" if query else "") + "ref=eg_k"
    else:
        assert sent_query == query
    if keyed and stamp == "form_field":  # into a form, or an empty body
        assert out.body == (raw + b"&" if raw else b"") + b"metadata%5Bref%5D=eg_k"
    elif keyed and stamp == "json_field":
        assert json.loads(out.body)["meta"]["ref"] == "eg_k"
        assert len(out.body) > len(raw)
    else:
        assert out.body == raw


@given(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUE), max_size=5))
@settings(max_examples=max(5, settings.default.max_examples // 5))
async def test_the_upstream_gets_no_header_the_agent_did_not_send(
    dsn: str, upstream: Upstream, headers: list[tuple[str, str]]
) -> None:
    """End to end, the upstream's headers are the agent's (less hop-by-hop), plus Host and Content-Length."""
    upstream.calls.clear()
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        head = b"PUT /shop/doc HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"".join(
            f"{name}: {value}\r\n".encode() for name, value in headers
        )
        assert (await raw_exchange(gw.url, head)).split(b" ", 2)[1] == b"201"
    received = [(k, v) for k, v in upstream.calls[0].header_list if k not in ("Host", "Content-Length")]
    assert received == [(k, v) for k, v in headers if k.lower() not in ("keep-alive", "connection")]


# The stamp's or native key's name as another parser reads it: (stamps' entry, headers, query, type, body).
SPELLED_OTHERWISE: dict[str, tuple[str, dict[str, str], str, str, bytes]] = {
    # CGI and WSGI servers read X_Ref as X-Ref
    "header-underscore": ("header", {"X_Ref": "eg_forged"}, "", "application/json", b"{}"),
    "native-underscore": ("native", {"x_idem": "eg_forged"}, "", "application/json", b"{}"),
    # Rack 2 and Python before 3.9.2 split pairs on ';' as well as '&'
    "query-semicolon": ("query", {}, "a=1;ref=eg_forged", "application/json", b"{}"),
    "form-semicolon": (
        "form",
        {},
        "",
        "application/x-www-form-urlencoded",
        b"a=1;metadata[idempotency_key]=eg_forged",
    ),
    # Rack reads a POST body without a Content-Type as a form
    "form-untyped": ("form", {}, "", "", b"metadata[idempotency_key]=eg_forged"),
    "form-multipart": (
        "form",
        {},
        "",
        "multipart/form-data; boundary=B",
        b'--B\r\nContent-Disposition: form-data; name="metadata[idempotency_key]"\r\n\r\n'
        b"eg_forged\r\n--B--\r\n",
    ),
    # Rails' params and PHP's $_REQUEST merge the query into the body's fields (in Rails the query wins)
    "json-in-query": ("json", {}, "a=1&metadata[ref]=eg_forged", "application/json", b"{}"),
    "form-in-query": ("form", {}, "metadata%5Bidempotency_key%5D=eg_forged", "", b"a=1"),
    # ... and shallowly: a query's metadata[...] replaces the body's whole metadata, the stamp with it
    "json-parent-in-query": ("json", {}, "metadata[a]=1", "application/json", b"{}"),
    "form-parent-in-query": ("form", {}, "metadata=1", "application/x-www-form-urlencoded", b"a=1"),
}


@pytest.mark.parametrize("case", sorted(SPELLED_OTHERWISE))
def test_the_stamps_name_spelled_as_another_parser_reads_it_is_reserved_too(case: str) -> None:
    """`_` for `-` in a header name, pairs after `;`, an untyped or multipart form: stamp-reserved.

    Each reached the upstream beside (or, without a key, instead of) the gateway's own value.
    """
    where, headers, query, content_type, body = SPELLED_OTHERWISE[case]
    policy = _policy(STAMPS[where])
    read = read_body(body, content_type, policy.json_stamp_path)
    assert reserved_use(policy, CIMultiDict(headers), query, read) is not None


@pytest.mark.parametrize("where", ["json", "form"])
@pytest.mark.parametrize("key", ["k", None], ids=["keyed", "keyless"])
async def test_a_body_stamps_name_in_the_query_is_refused(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, where: str, key: str | None
) -> None:
    """`PUT /shop/orders?client_reference=X` to a JSON-stamped shop: 400 stamp-reserved, nothing sent.

    Frameworks that merge the query into the body's fields (Rails' params, PHP's $_REQUEST) would read
    the agent's value as the stamp; it was forwarded.
    """
    stamp = {"json_field": "client_reference"} if where == "json" else {"form_field": "client_reference"}
    content_type = "application/json" if where == "json" else "application/x-www-form-urlencoded"
    cfg = {"shop": {"base_url": upstream.url, "stamp": stamp}}
    async with (
        gateway_server(dsn, upstreams=cfg) as gw,
        http.put(
            f"{gw.url}/shop/orders?client_reference=eg_forged",
            data=b"{}" if where == "json" else b"a=1",
            headers={"Content-Type": content_type, **({"Idempotency-Key": key} if key else {})},
        ) as resp,
    ):
        assert resp.status == 400
        assert problem(await resp.read()) == "stamp-reserved"
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


def test_a_query_name_that_only_begins_like_a_body_stamps_is_not_reserved() -> None:
    """`metadata_x` or `metadatax[ref]` in the query is another name than a JSON stamp at metadata.ref."""
    policy = _policy(STAMPS["json"])
    body = read_body(b"{}", "application/json", policy.json_stamp_path)
    for query in ("metadata_x=1", "metadatax[ref]=1", "x=metadata[ref]", "ref=1"):
        assert reserved_use(policy, CIMultiDict(), query, body) is None, query


def test_an_injected_credential_replaces_the_agents_under_an_underscore_spelling_too() -> None:
    """An agent's X_Api_Key (read by WSGI as X-Api-Key) never reaches the upstream beside the injected."""
    policy = _policy({"inject_headers": {"X-Api-Key": "secret"}})
    out = build_outbound(
        policy, None, "GET", "/x", "", CIMultiDict({"X_Api_Key": "mine"}), read_body(b"", "")
    )
    assert list(out.headers.items()) == [("X-Api-Key", "secret")]


def _policy(settings: dict[str, Any]) -> UpstreamPolicy:
    cfg = UpstreamSettings.model_validate({"base_url": "http://upstream.invalid", **settings})
    return upstream_policy("shop", cfg, timedelta(seconds=1))


NAMES = st.sampled_from(["ref", "metadata[idempotency_key]", "a b", "%", "x;y", "é"])


@given(NAMES, st.lists(st.tuples(FORM_BYTES, st.booleans()), max_size=5), st.data())
def test_a_pair_is_found_by_its_decoded_name_in_any_spelling(
    name: str, pieces: list[tuple[bytes, bool]], data: st.DataObject
) -> None:
    """sets_name() finds a pair whose name decodes to the stamp's, split on & or ;, and nothing else.

    With ``nested``, a name that decodes to the stamp's followed by ``[`` (``metadata[a]``) counts too.
    """
    raw = b""
    for piece, named in pieces:
        segment = data.draw(spelled(name.encode())) + b"=1" if named else piece
        if named and data.draw(st.booleans()):
            segment = data.draw(spelled(name.encode())) + data.draw(spelled(b"[a]")) + b"=1"
        raw += (data.draw(st.sampled_from([b"&", b";"])) if raw else b"") + segment
    names = {urlencoded._decode(seg.partition(b"=")[0]) for seg in re.split(rb"[&;]", raw)}
    assert urlencoded.sets_name(raw, name) == (name.encode() in names)
    under = any(n == name.encode() or n.startswith(name.encode() + b"[") for n in names)
    assert urlencoded.sets_name(raw, name, nested=True) == under


@given(NAMES, st.lists(st.tuples(FORM_BYTES, st.booleans()), max_size=8), st.data(), st.integers(1, 12))
def test_a_pair_is_found_however_the_search_is_cut_into_windows(
    name: str, pieces: list[tuple[bytes, bool]], data: st.DataObject, window: int
) -> None:
    """sets_name() searching a few bytes at a time finds the pairs that one search of the text finds."""
    raw = b"&".join(data.draw(spelled(name.encode())) + b"=1" if named else piece for piece, named in pieces)
    whole = {nested: urlencoded.sets_name(raw, name, nested=nested) for nested in (False, True)}
    kept = urlencoded._WINDOW
    urlencoded._WINDOW = window
    try:
        assert {nested: urlencoded.sets_name(raw, name, nested=nested) for nested in (False, True)} == whole
    finally:
        urlencoded._WINDOW = kept


def test_no_search_of_a_megabyte_for_a_name_reads_more_than_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each search for the stamp's name (it holds the interpreter's lock) reads at most 64 KiB and a name."""
    spans: list[int] = []
    patterns = urlencoded._spellings

    class Counted:
        def __init__(self, pattern: re.Pattern[bytes]) -> None:
            self.pattern = pattern

        def match(self, raw: bytes) -> re.Match[bytes] | None:
            found = self.pattern.match(raw)
            spans.append(found.end() if found else 1 + 3 * len("metadata[idempotency_key]"))
            return found

        def search(self, raw: bytes, start: int, end: int) -> re.Match[bytes] | None:
            spans.append(min(end, len(raw)) - start)
            return self.pattern.search(raw, start, end)

    def counted(name: str, nested: bool = False) -> tuple[Counted, Counted, int]:
        first, after_separator, longest = patterns(name, nested)
        return Counted(first), Counted(after_separator), longest

    monkeypatch.setattr(urlencoded, "_spellings", counted)
    raw = b"amount=1&" + b"%FF&" * 262_144 + b"metadata%5Bidempotency_key%5D=x"
    assert urlencoded.sets_name(raw, "metadata[idempotency_key]")
    assert max(spans) <= 64 * 1024 + 80, "one search read more than a window"


def test_a_form_of_too_many_fields_is_refused() -> None:
    """More than 10,000 fields is a 400: read as pairs, a megabyte of "&" held a core for seconds."""
    with pytest.raises(FormRefused):
        read_body(b"&" * (1024 * 1024), "application/x-www-form-urlencoded")
    read_body(b"a=1&" * 9_000, "application/x-www-form-urlencoded")


# Path segments as agents and attackers write them: dots, encoded slashes and dots, non-ASCII, odd bytes.
SEGMENT = st.sampled_from(
    [
        "a",
        "orders",
        ".",
        "..",
        "%2F",
        "%2f",
        "%5C",
        "%2E",
        "%00",
        "%0A",
        "%20",
        "~",
        "x.y",
        "%41",
        "é",
        ";p=1",
        "@:",
    ]
)
KEY_TEXT = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
# Refusals that come before anything is sent, for a request the generator may make.
REFUSED = {"path-refused", "stamp-reserved", "cannot-stamp", "body-malformed"}
_RUNS = iter(range(10**9))


def _refused_path(path: str) -> bool:
    segments = path.split("/")
    return (
        not path.isascii()
        or any(s in (".", "..") for s in segments)
        or any(t in path.lower() for t in ("%2f", "%5c", "%2e", "%00"))
    )


@pytest.fixture
async def stamped_gateway(dsn: str, upstream: Upstream) -> AsyncIterator[str]:
    cfg = {name: {"base_url": upstream.url, **more} for name, more in STAMPED.items()}
    async with gateway_server(dsn, upstreams=cfg, replay_cache_bytes=0) as gw:
        yield gw.url


@given(
    agent_request(),
    st.sampled_from(sorted(STAMPED)),
    st.lists(SEGMENT, max_size=3).map(lambda segments: "/" + "/".join(segments)),
    KEY_TEXT,
)
@settings(max_examples=max(5, settings.default.max_examples // 5))
async def test_a_keyed_request_reaches_the_upstream_as_sent_plus_the_key_and_replays(
    stamped_gateway: str,
    upstream: Upstream,
    dsn: str,
    request: tuple[str, list[tuple[str, str]], str, bytes],
    where: str,
    path: str,
    key: str,
) -> None:
    """End to end: refused before sending, or sent once as the agent sent it plus the key, then replayed."""
    query, headers, content_type, raw = request
    key = f"{next(_RUNS)}:{key}"  # each example its own effect
    target = f"/{where}{path}" + (f"?{query}" if query else "")
    head = (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n".encode()
        + b"".join(f"{name}: {value}\r\n".encode() for name, value in headers)
        + f"Idempotency-Key: {key}\r\n".encode()
    )
    calls = len(upstream.calls)
    first = await raw_exchange(stamped_gateway, head, raw)
    first_head, _, first_body = first.partition(b"\r\n\r\n")
    rows = [r for r in await effect_rows(dsn) if r["key"] == key]
    if first_head.split(b" ", 2)[1] == b"400":
        # A problem; or, for a target that is not ASCII, the HTTP server's own plain 400 before any route.
        unparsable = b"\r\nContent-Type: text/plain" in first_head and not path.isascii()
        refusal = "path-refused" if unparsable else problem(first_body)
        assert refusal in REFUSED
        assert (len(upstream.calls), rows) == (calls, []), "a refused request sends and records nothing"
        assert (refusal == "path-refused") == _refused_path(path)
        return
    assert not _refused_path(path)
    assert first_head.split(b" ", 2)[1] == b"201", first
    assert len(upstream.calls) == calls + 1
    call = upstream.calls[-1]
    [row] = rows
    derived = row["derived_key"]
    assert row["state"] == "completed"
    stamp = STAMPED[where].get("stamp", {})
    # The target: the path as sent, the query as sent plus a query stamp.
    sent_query = (query + "&" if query else "") + f"ref={derived}" if "query_param" in stamp else query
    assert call.target == path + (f"?{sent_query}" if sent_query else "")
    # Headers: the agent's (less hop-by-hop and the gateway's own), then the native key or header stamp.
    hop = {"x-hop"} if ("Connection", "X-Hop") in headers else set()
    added = {"x-idem"} if where == "native" else {"x-ref"} if where == "header" else set()
    received = [(k, v) for k, v in call.header_list if k.lower() not in ("host", "content-length")]
    assert [(k, v) for k, v in received if k.lower() not in added] == [
        (k, v)
        for k, v in [("Content-Type", content_type), *headers]
        if k.lower() not in hop | {"connection", "keep-alive"}
    ]
    assert [(k.lower(), v) for k, v in received if k.lower() in added] == [(n, derived) for n in added]
    # The body: the agent's bytes, plus the stamp spliced into a form or a JSON body and nothing else.
    if where in ("form", "json"):
        inserted = one_insertion(raw, call.body)
        assert inserted is not None, (raw, call.body)
        assert derived.encode() in inserted
        if where == "json":
            assert json.loads(call.body)["meta"]["ref"] == derived
    else:
        assert call.body == raw
    # A retry is the first answer again, byte for byte, and nothing more reaches the upstream.
    again = await raw_exchange(stamped_gateway, head, raw)
    again_head, _, again_body = again.partition(b"\r\n\r\n")
    assert len(upstream.calls) == calls + 1
    assert b"\r\nIdempotent-Replayed: true" in again_head
    assert again_body == first_body


@given(KEY_VALUES.filter(lambda value: "\x7f" not in value and value.isascii()))
@settings(max_examples=max(5, settings.default.max_examples // 5))
async def test_any_key_header_is_refused_or_names_the_effect_the_parser_reads(
    stamped_gateway: str, upstream: Upstream, dsn: str, value: str
) -> None:
    """Any Idempotency-Key: 400 key-malformed and nothing sent, or sent once and recorded under its key."""
    try:
        key: str | None = parse_key(value)
    except KeySyntaxError:
        key = None
    head = f"POST /plain/orders HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: {value}\r\n".encode()
    calls = len(upstream.calls)
    answer = await raw_exchange(stamped_gateway, head)
    status, _, body = answer.partition(b"\r\n\r\n")
    if key is None:
        assert status.split(b" ", 2)[1] == b"400", answer
        assert problem(body) == "key-malformed"
        assert len(upstream.calls) == calls
        return
    rows = [r for r in await effect_rows(dsn) if r["key"] == key]
    assert [r["state"] for r in rows] == ["completed"], answer
    replayed = b"\r\nIdempotent-Replayed: true" in status
    assert len(upstream.calls) == calls + (0 if replayed else 1)  # a key drawn twice is one effect
