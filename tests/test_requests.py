"""Requests the gateway cannot read unambiguously: a 400 each, never a 500, never logged as our error."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway import problems
from tests.database import effect_rows
from tests.gateways import Gateway, gateway_server
from tests.upstreams import Upstream, raw_exchange

TENANTS = {"a": {"token": "env:TOKEN_A"}}


@pytest.fixture
async def gateway(dsn: str, upstream: Upstream, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv("TOKEN_A", "secret-a")
    monkeypatch.setenv("ADMIN", "adm-1")
    async with gateway_server(
        dsn, upstreams={"shop": {"base_url": upstream.url}}, tenants=TENANTS, admin={"token": "env:ADMIN"}
    ) as gw:
        yield gw


async def raw(gw: Gateway, head: bytes, body: bytes = b"{}") -> bytes:
    return await raw_exchange(gw.url, head, body)


def status_and_type(answer: bytes) -> tuple[int, str | None]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    kind = json.loads(body)["type"].rsplit("/", 1)[1] if b"problem+json" in head else None
    return status, kind


POST = b"POST /shop/orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
TOKEN = b"Effect-Gateway-Token: secret-a\r\n"
KEY = b"Idempotency-Key: k1\r\n"


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        (KEY + b"Idempotency-Key: k2\r\n" + TOKEN, "key-malformed"),
        (KEY + TOKEN + b"Effect-Gateway-Token: other\r\n", "bad-request"),
        (KEY + TOKEN + b"Effect-Gateway-Run: r1\r\nEffect-Gateway-Run: r2\r\n", "bad-request"),
        (KEY + TOKEN + b"Effect-Gateway-Step: 1\r\nEffect-Gateway-Step: 2\r\n", "bad-request"),
        # aiohttp's parser refuses this one itself (a plain 400) before the gateway sees it.
        (KEY + TOKEN + b"Content-Type: text/plain\r\n", None),
    ],
    ids=["key", "token", "run", "step", "content-type"],
)
async def test_a_header_read_as_one_value_sent_twice_is_refused(
    gateway: Gateway, upstream: Upstream, dsn: str, extra: bytes, kind: str | None
) -> None:
    """Two Idempotency-Keys, tokens, runs, steps or content types: 400, not the first one silently."""
    assert status_and_type(await raw(gateway, POST + extra)) == (400, kind)
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


BIDI = "a bidi control, which reorders the text around it"
SELECTOR = (
    "a variation selector, kept only in a sequence Unicode lists (an emoji's style, a standardized variant)"
)
JOINER = "a joiner, kept only where it changes how the letters or emoji beside it are drawn"
SPACE = "a space other than U+0020, which passes for it"


@pytest.mark.parametrize(
    ("header", "value", "why"),
    [
        (b"Effect-Gateway-Run", "run-\u202e7", f"U+202E, {BIDI}"),
        (b"Effect-Gateway-Run", "run-\u20667\u2069", f"U+2066, {BIDI}"),
        (b"Effect-Gateway-Step", "pl\u200bace", "U+200B, an invisible character"),
        (b"Effect-Gateway-Step", "4\u0085", "U+0085, a control character"),
        (b"Effect-Gateway-Run", "run-7\u2028", "U+2028, a line or paragraph separator"),
        # Invisible, and not format characters: each made a run that looks like "run-1" and is not.
        (b"Effect-Gateway-Run", "run-1\u3164", "U+3164, an invisible character"),
        (b"Effect-Gateway-Run", "run-1\u115f", "U+115F, an invisible character"),
        (b"Effect-Gateway-Run", "run-1\u034f", "U+034F, an invisible character"),
        (b"Effect-Gateway-Step", "place\u17b4", "U+17B4, an invisible character"),
        (b"Effect-Gateway-Run", "run-1\ufe00", f"U+FE00, {SELECTOR}"),
        (b"Effect-Gateway-Run", "run-1\U000e0100", f"U+E0100, {SELECTOR}"),
        # Each passed for "run-1", "run 1" or the text without its joiner or selector.
        (b"Effect-Gateway-Run", "run-1\u00a0", f"U+00A0, {SPACE}"),
        (b"Effect-Gateway-Run", "run\u202f1", f"U+202F, {SPACE}"),
        (b"Effect-Gateway-Run", "run-1\u2800", "U+2800, a character drawn as blank"),
        (b"Effect-Gateway-Step", "\u6ce8\u200d\u6587", f"U+200D, {JOINER}"),
        (b"Effect-Gateway-Step", "\u6ce8\u6587\ufe00", f"U+FE00, {SELECTOR}"),
        (b"Effect-Gateway-Run", "Zo\u00eb\ufe0f", f"U+FE0F, {SELECTOR}"),
    ],
    ids=[
        "override", "isolate", "zero-width-space", "c1-control", "line-separator", "hangul-filler",
        "choseong-filler", "grapheme-joiner", "khmer-inherent-vowel", "selector", "ideographic-selector",
        "no-break-space", "narrow-no-break-space", "braille-blank", "joiner-between-ideographs",
        "selector-on-an-ideograph", "emoji-style-on-a-letter",
    ],
)  # fmt: skip
async def test_a_run_or_step_label_an_operator_name_could_not_hold_is_refused(
    gateway: Gateway, upstream: Upstream, dsn: str, header: bytes, value: str, why: str
) -> None:
    """Run and step labels follow the operator names' rule (nothing a screen would obey, hide or
    reorder): a 400 naming the header and the character, and nothing is sent or recorded. (Bytes that
    are not UTF-8 are refused before.)"""
    answer = await raw(gateway, POST + KEY + TOKEN + header + b": " + value.encode() + b"\r\n")
    assert status_and_type(answer) == (400, "bad-request")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["detail"] == f"{header.decode()} may not hold {why}"
    assert upstream.calls == []
    assert await effect_rows(dsn) == []


@pytest.mark.parametrize(
    "run",
    [
        "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",  # Persian: a non-joiner inside the word
        "\U0001f468\u200d\U0001f469\u200d\U0001f467 weekly shop",  # an emoji joined with joiners
        "\u2764\ufe0f order",  # an emoji's colour form
        "\u0dc1\u0dca\u200d\u0dbb\u0dd3 \u0dbd\u0d82\u0d9a\u0dcf",  # Sinhala: joined after a virama
        "\u0d05\u0d35\u0d28\u0d4d\u200d",  # Malayalam's "he" as written before Unicode 5.1
    ],
    ids=["persian", "emoji-sequence", "emoji-selector", "sinhala", "malayalam-of-old"],
)
async def test_a_label_in_real_text_that_needs_a_joiner_goes_through_as_sent(
    gateway: Gateway, upstream: Upstream, dsn: str, run: str
) -> None:
    """A run label with a joiner or a selector where the text needs it: the effect is sent and the label
    recorded as sent. Refused (400) before, the agent's effect did not go through."""
    answer = await raw(gateway, POST + KEY + TOKEN + b"Effect-Gateway-Run: " + run.encode() + b"\r\n")
    assert status_and_type(answer) == (201, None)
    assert len(upstream.calls) == 1
    assert [row["run_id"] for row in await effect_rows(dsn)] == [run]


@pytest.mark.parametrize(
    "head",
    [
        POST + KEY + b"Effect-Gateway-Token: secret-\xff\r\n",
        b"GET /_gateway/effects HTTP/1.1\r\nHost: x\r\nEffect-Gateway-Token: \xfe\xff\r\n",
        b"GET /_gateway/effects HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer adm-\xff\r\n",
    ],
    ids=["proxy-token", "admin-token", "admin-bearer"],
)
async def test_token_headers_that_are_not_utf8_are_a_400(
    gateway: Gateway, upstream: Upstream, head: bytes
) -> None:
    """Bytes that are not UTF-8 in a token header are refused, never a 500 from the token compare."""
    assert status_and_type(await raw(gateway, head)) == (400, "bad-request")
    assert upstream.calls == []


async def test_malformed_requests_and_clients_that_go_away_are_not_logged_as_our_errors(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer's bad request or hang-up is one line at INFO at most; ERROR and tracebacks are for our bugs."""
    caplog.set_level(logging.DEBUG)
    for bad in (
        b"POST /shop/x HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: \x00\r\n\r\n",
    ):
        assert (await raw(gateway, bad, b"")).startswith(b"HTTP/1.")
    host, port = gateway.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(POST + KEY + TOKEN + b"Content-Length: 100\r\n\r\n{")  # and then hangs up mid-body
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    for _ in range(100):  # the server notices the hang-up when it next reads, on its own schedule
        if any("went away" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.05)
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
    assert any("malformed request" in r.getMessage() for r in caplog.records)
    assert any("went away" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "head",
    [
        POST.replace(b"/shop/orders", b"/shop/orders?t=" + b"SECRET" * 1400),
        POST + KEY + b"Effect-Gateway-Token: " + b"SECRET" * 1400 + b"\r\n",
        POST + KEY + TOKEN + b"Authorization: Bearer " + b"SECRET" * 1400 + b"\r\n",
        POST + KEY + TOKEN + b"X-" + b"SECRET" * 10 + b"\x01: y\r\n",
    ],
    ids=["request-line", "token", "authorization", "header-name"],
)
async def test_a_malformed_request_is_logged_without_the_bytes_it_carried(
    gateway: Gateway, caplog: pytest.LogCaptureFixture, head: bytes
) -> None:
    """A header or request line too long for the parser, or a bad header name, is logged as the kind of
    mistake alone: none of what the peer sent (a token, an Authorization header) reaches the log.

    The log line quoted aiohttp's message, which for a line too long holds its first 100 bytes.
    """
    caplog.set_level(logging.DEBUG)
    assert (await raw(gateway, head)).startswith(b"HTTP/1.")
    [line] = [r.getMessage() for r in caplog.records if "malformed request" in r.getMessage()]
    assert "SECRET" not in "\n".join(r.getMessage() for r in caplog.records), line
    assert line.startswith("refused a malformed request (400 "), line


def test_the_readme_lists_every_problem_type() -> None:
    """Clients branch on problem types, so the README's list of them is kept whole and true."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    listed = readme[
        readme.index("Errors of the gateway's own") : readme.index("Admin, on a listener of its own")
    ]
    names = set(re.findall(r"`([a-z]+(?:-[a-z]+)*)`", listed)) - {"type"}
    assert names == set(problems.problem_types()) | {"internal"}


@pytest.mark.parametrize(
    "host", [b"rebound.example:8787", b"127.0.0.1.nip.io", b"[::1].example", b"10.0.0.7:8787"]
)
async def test_an_open_gateway_answers_only_requests_addressed_to_loopback(
    dsn: str, upstream: Upstream, host: bytes
) -> None:
    """Without tenants, a Host that is not a loopback name is a 400 and nothing is sent or read.

    Such a gateway trusts whatever can reach it; a web page on a name that its DNS points at 127.0.0.1
    (DNS rebinding) is same-origin with it in the person's browser, and could place orders through it
    with the injected credentials, read the audit and resolve effects.
    """
    async with gateway_server(dsn, upstreams={"shop": {"base_url": upstream.url}}) as gw:
        order = await raw(gw, b"POST /shop/orders HTTP/1.1\r\nHost: " + host + b"\r\n" + KEY)
        audit = await raw_exchange(gw.admin_url, b"GET /_gateway/effects HTTP/1.1\r\nHost: " + host + b"\r\n")
        served = [
            await raw(
                gw, b"POST /shop/orders HTTP/1.1\r\nHost: " + name + b"\r\nIdempotency-Key: " + name + b"\r\n"
            )
            for name in (b"127.0.0.1:1", b"localhost", b"LOCALHOST:8787", b"[::1]:8787", b"127.9.9.9")
        ]
        # A request line naming a whole URL names its host, whatever Host says.
        whole = await raw_exchange(
            gw.admin_url, b"GET http://" + host + b"/_gateway/effects HTTP/1.1\r\nHost: localhost\r\n"
        )
        whole_local = await raw_exchange(
            gw.admin_url, b"GET http://localhost/_gateway/effects HTTP/1.1\r\nHost: localhost\r\n"
        )
    assert status_and_type(order) == (400, "bad-request")
    assert status_and_type(audit) == (400, "bad-request")
    # http://[::1].example/ is not a URL aiohttp can parse: its parser's own 400, before any handler.
    assert status_and_type(whole) == (400, None if host == b"[::1].example" else "bad-request")
    assert status_and_type(whole_local)[0] == 200
    assert [status_and_type(answer)[0] for answer in served] == [201] * 5
    assert len(upstream.calls) == 5


async def test_a_gateway_with_tenants_answers_any_host(gateway: Gateway, upstream: Upstream) -> None:
    """With tenants and an admin token, tokens say who may use either listener, whatever name it is
    reached by."""
    answer = await raw(gateway, b"POST /shop/orders HTTP/1.1\r\nHost: gateway.internal\r\n" + KEY + TOKEN)
    assert status_and_type(answer)[0] == 201
    # The admin listener asks for a token too: a reverse proxy in front of it may pass its own name on.
    head = b"GET /_gateway/effects HTTP/1.1\r\nHost: audit.internal\r\nAuthorization: Bearer adm-1\r\n"
    assert status_and_type(await raw_exchange(gateway.admin_url, head))[0] == 200
