"""The gateway's log: a JSON line per decision from a real gateway process, never a secret or a key."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import pty
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.logs import JsonLines, Lines, Text, resolve_format
from tests.database import runtime_url
from tests.gateways import start_gateway_process
from tests.support import PORT_ZERO
from tests.upstreams import Upstream

# Values the log must never hold: each is distinctive, so a search for it cannot miss.
SECRETS = {
    "GROCER_TOKEN": "tenant-token-SEKRIT-1",
    "ADMIN_TOKEN": "admin-token-SEKRIT-2",
    "SHOP_SECRET": "Bearer injected-SEKRIT-3",
}
AGENT_SECRETS = ["x-api-key-SEKRIT-4", "Bearer agent-SEKRIT-5", "wrong-token-SEKRIT-6"]
KEY = "run-SEKRIT-7:4"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


def _config(tmp_path: Path, dsn: str, upstream: Upstream) -> Path:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\n'
        '[tenants.grocer]\ntoken = "env:GROCER_TOKEN"\n[admin]\ntoken = "env:ADMIN_TOKEN"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\n'
        'inject_headers = { Authorization = "env:SHOP_SECRET" }\n'
        'secret_headers = ["X-Api-Key"]\n'
        '[upstreams.down]\nbase_url = "http://127.0.0.1:9"\nconnect_timeout = "1s"\n'
    )
    return config


async def _order(http: aiohttp.ClientSession, url: str, token: str, key: str = KEY, **headers: str) -> int:
    sent = {
        "Idempotency-Key": key,
        "Content-Type": "application/json",
        "Effect-Gateway-Token": token,
        "X-Api-Key": AGENT_SECRETS[0],
        "Authorization": AGENT_SECRETS[1],
        **headers,
    }
    async with http.post(url, data=b'{"items":["atta"]}', headers=sent) as resp:
        await resp.read()
        return resp.status


async def test_a_real_gateway_logs_a_json_line_per_decision_and_no_secret(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Every line on stderr is JSON; one per decision, with its fields; no token, secret or key in clear."""
    token = SECRETS["GROCER_TOKEN"]
    # No log_format: with stderr a pipe, as under a supervisor, the default is JSON.
    gateway = start_gateway_process(_config(tmp_path, dsn, upstream), SECRETS)
    assert gateway.stderr is not None
    log = gateway.stderr
    try:
        shop = f"{gateway.url}/shop/orders"
        assert await _order(http, shop, token, traceparent=TRACEPARENT) == 201
        assert await _order(http, shop, token) == 201  # its replay
        assert await _order(http, shop, AGENT_SECRETS[2]) == 401
        assert await _order(http, f"{gateway.url}/down/x", token) == 502
        headers = {"Authorization": f"Bearer {SECRETS['ADMIN_TOKEN']}"}
        async with http.get(f"{gateway.admin_url}/_gateway/metrics", headers=headers) as resp:
            assert resp.status == 200
    finally:
        gateway.stop()
    lines = log.whole()
    docs = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    assert upstream.calls[0].headers["Authorization"] == SECRETS["SHOP_SECRET"]  # it was there to leak
    for line in lines:
        for secret in [*SECRETS.values(), *AGENT_SECRETS, KEY, "SEKRIT"]:
            assert secret not in line
    assert {doc["level"] for doc in docs} <= {"debug", "info", "warning", "error"}
    assert all(doc["time"].endswith("+00:00") for doc in docs)
    decisions = [doc for doc in docs if doc["logger"] == "effect_gateway.decision"]
    assert [(d["upstream"], d["outcome"], d["status"], d["problem"]) for d in decisions] == [
        ("shop", "sent", 201, None),
        ("shop", "replayed", 201, None),
        ("shop", "refused", 401, "token-required"),
        ("down", "failed", 502, "upstream-unreachable"),
    ]
    sent, replayed, refused, failed = decisions
    assert sent["effect_id"] == replayed["effect_id"] == 1
    assert (sent["tenant"], sent["method"], sent["path"]) == ("grocer", "POST", "/orders")
    assert (sent["state_before"], sent["state_after"], sent["attempt"]) == (None, "completed", 1)
    assert (replayed["state_before"], replayed["state_after"]) == ("completed", "completed")
    assert sent["recovered_by"] is None
    assert sent["duration_ms"] > 0
    assert len(sent["key_hash"]) == 16
    assert sent["key_hash"] == replayed["key_hash"] != failed["key_hash"]  # one key, another upstream
    assert refused["tenant"] is None
    assert refused["key_hash"] is None
    assert sent["trace_id"] == TRACE
    assert "trace_id" not in replayed  # none came in with it
    assert (failed["state_after"], failed["effect_id"]) == ("retryable", 2)


async def _busy(request: web.Request) -> web.Response:
    return web.json_response({"error": "try later"}, status=503)


async def test_routine_decisions_at_debug_leave_only_the_unusual_ones_in_the_log(
    dsn: str, upstream: Upstream, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """With routine_decisions = "debug", a request sent and one replayed log nothing; a refusal, a
    failure and an upstream's 5xx still log their lines."""
    config = _config(tmp_path, dsn, upstream)
    config.write_text('routine_decisions = "debug"\n' + config.read_text())
    gateway = start_gateway_process(config, SECRETS)
    assert gateway.stderr is not None
    log = gateway.stderr
    token = SECRETS["GROCER_TOKEN"]
    try:
        shop = f"{gateway.url}/shop/orders"
        assert await _order(http, shop, token) == 201
        assert await _order(http, shop, token) == 201  # its replay
        assert await _order(http, shop, AGENT_SECRETS[2]) == 401
        assert await _order(http, f"{gateway.url}/down/x", token) == 502
        upstream.routes["/busy"] = _busy
        assert await _order(http, f"{gateway.url}/shop/busy", token, key="run-2:1") == 503
    finally:
        gateway.stop()
    docs = [json.loads(line) for line in log.whole()]
    decisions = [doc for doc in docs if doc["logger"] == "effect_gateway.decision"]
    outcomes = [(d["outcome"], d["status"]) for d in decisions]
    assert outcomes == [("refused", 401), ("failed", 502), ("sent", 503)]
    assert len(upstream.calls) == 2  # the first was sent, all the same


def test_serve_announces_its_addresses_in_its_json_log_and_prints_nothing_else(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """serve says where it listens in one JSON record of its log, both addresses as fields and a
    sentence a person reads, and writes nothing on stdout: a log pipeline reading its output meets no
    line that is not JSON."""
    gateway = start_gateway_process(_config(tmp_path, dsn, upstream), SECRETS)
    assert gateway.stderr is not None
    assert gateway.stdout is not None
    gateway.stop()
    assert gateway.stdout.whole() == []
    lines = gateway.stderr.whole()
    docs = [json.loads(line) for line in lines]  # every line is JSON
    (said,) = [doc for doc in docs if doc.get("event") == "listening"]
    assert (said["proxy_url"], said["admin_url"]) == (gateway.url, gateway.admin_url)
    assert said["level"] == "info"
    assert said["logger"] == "effect_gateway"
    assert said["message"] == (
        f"effect-gateway listening on {gateway.url} (agents) and on {gateway.admin_url} "
        "(admin: audit, effects, metrics)"
    )


def test_auto_writes_text_to_a_terminal_and_json_otherwise() -> None:
    """log_format = "auto": text for a person at a terminal, JSON lines into a pipe or a file."""
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            assert resolve_format("auto", terminal) == "text"
    finally:
        os.close(leader)
        os.close(follower)
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("text", io.StringIO()) == "text"


# What a terminal obeys rather than shows: ESC (escape sequences), BEL (ends one), a C1 CSI, a carriage
# return (overwrites the line), a right-to-left override.
OBEYED = ("\x1b", "\x07", "\x9b", "\r", "\u202e")


async def _hang_up_mid_body(url: str, target: str) -> None:
    """Send a request head whose body never arrives whole, and hang up."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nIdempotency-Key: k1\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
    )
    await writer.drain()
    await asyncio.sleep(0.3)
    writer.close()
    await writer.wait_closed()


async def test_the_text_log_shows_what_a_terminal_would_obey_escaped(
    dsn: str, upstream: Upstream, tmp_path: Path
) -> None:
    """A path that percent-encodes escape sequences (set the window's title, clear the screen, red) is
    logged with them escaped, on both listeners: the log line reads ``\\x1b]0;...`` and the terminal
    that shows serve's text log obeys none of it. It obeyed: aiohttp decodes ``%1b`` to a real ESC."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'database_url = "{runtime_url(dsn)}"\n{PORT_ZERO}workers = 1\nlog_format = "text"\n'
        f'[upstreams.shop]\nbase_url = "{upstream.url}"\n'
    )
    gateway = start_gateway_process(config)
    assert gateway.stderr is not None
    assert gateway.admin_url is not None
    log = gateway.stderr
    try:
        await _hang_up_mid_body(gateway.url, "/shop/orders%1b%5d0;PWNED%07%1b%5b2J%c2%9b31m%0dRED%e2%80%ae")
        await _hang_up_mid_body(gateway.admin_url, "/_gateway/audit/%1b%5b2J%1b%5b5mBLINK/resolve")
        # The lines are written as each connection closes; stopping the gateway flushes stderr.
        await asyncio.sleep(0.5)
    finally:
        gateway.stop()
    lines = log.whole()
    went = [line for line in lines if "went away" in line]
    assert len(went) == 2, lines
    for line in lines:
        assert not any(char in line for char in OBEYED), line
    assert "/shop/orders\\x1b]0;PWNED\\x07\\x1b[2J\\x9b31m\\rRED\\u202e: the client went away" in went[0]
    assert "/_gateway/audit/\\x1b[2J\\x1b[5mBLINK/resolve: the client went away" in went[1]


def test_a_text_lines_message_is_one_line_and_its_traceback_keeps_its_lines() -> None:
    """An error quoting an upstream (escape sequences, a line break) is one line of message, escaped; the
    traceback under it still breaks into its lines, with what a terminal would obey escaped."""
    try:
        raise RuntimeError("the shop said: \x1b[2J\rcleared")
    except RuntimeError:
        record = logging.LogRecord(
            "effect_gateway",
            logging.ERROR,
            __file__,
            1,
            "probe failed: %s",
            ("\x1b]0;owned\x07\n2026-12-07 08:00:00,000 INFO effect_gateway: all fine",),
            sys.exc_info(),
        )
    text = Text().format(record)
    first, *traceback = text.split("\n")
    forged = "2026-12-07 08:00:00,000 INFO effect_gateway: all fine"
    assert first.endswith(f"ERROR effect_gateway: probe failed: \\x1b]0;owned\\x07\\n{forged}")
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "RuntimeError: the shop said: \\x1b[2J\\rcleared"
    assert not any(char in text for char in OBEYED)


class _Counted(io.StringIO):
    """A stream that counts its writes: each is a system call on a real stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[str] = []

    @property
    def writes(self) -> int:
        return len(self.written)

    def write(self, text: str) -> int:
        self.written.append(text)
        return super().write(text)


async def test_lines_logged_in_one_turn_of_the_loop_are_written_together_and_none_is_lost() -> None:
    """A busy loop's lines go out in one write per turn; a line outside the loop goes out at once."""
    stream = _Counted()
    handler = Lines(stream)
    handler.setFormatter(JsonLines())
    log = logging.getLogger("effect_gateway.test_lines")
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:

        async def request(n: int) -> None:
            log.info("decision %d", n)

        await asyncio.gather(*(request(n) for n in range(50)))
        await asyncio.sleep(0)  # the turn after: what the last one logged is written by now
        lines = [json.loads(line) for line in stream.getvalue().splitlines()]
        assert [line["message"] for line in lines] == [f"decision {n}" for n in range(50)]
        assert stream.writes <= 3
        # Each write small enough that a pipe never splits it (workers share stderr), and whole lines.
        assert all(len(text) <= 4096 and text.endswith("\n") for text in stream.written)
        assert lines[0]["time"].endswith("+00:00")
        assert len(lines[0]["time"]) == len("2026-12-07T16:22:53.123+00:00")

        written = stream.writes
        await asyncio.to_thread(log.info, "from a thread")
        assert json.loads(stream.getvalue().splitlines()[-1])["message"] == "from a thread"
        assert stream.writes == written + 1
    finally:
        log.removeHandler(handler)


class _RawWrites(io.BytesIO):
    """The bytes under a text stream, as the system calls would carry them."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.sizes.append(len(data))
        return super().write(data)


def test_a_write_stays_within_a_pipes_atomic_size_in_the_streams_own_encoding() -> None:
    """Lines of accented text on an ASCII stderr (each é written as four bytes) still go out in writes
    of at most 4 KiB, each ending with a line, so another worker's write never lands inside one."""
    raw = _RawWrites()
    stream = io.TextIOWrapper(raw, encoding="ascii", errors="backslashreplace", write_through=True)
    handler = Lines(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("effect_gateway.test_ascii_lines")
    log.propagate = False
    log.addHandler(handler)
    try:

        async def turn() -> None:
            for n in range(20):
                log.warning("%d %s", n, "é" * 300)
            await asyncio.sleep(0)

        asyncio.run(turn())
    finally:
        log.removeHandler(handler)
    written = raw.getvalue().decode("ascii")
    assert written.splitlines() == [f"{n} " + "\\xe9" * 300 for n in range(20)]
    assert max(raw.sizes) <= 4096
    assert len(raw.sizes) >= 6  # 20 lines of 1.2 KB each, at most three to a write


def test_a_records_fields_never_stand_in_for_its_own() -> None:
    """Fields logged beside a message add to the line, and never replace its level or its message."""
    record = logging.LogRecord("effect_gateway", logging.INFO, "", 0, "listening", (), None)
    record.fields = {"message": "forged", "level": "debug", "proxy_url": "http://127.0.0.1:1"}
    doc = json.loads(JsonLines().format(record))
    assert (doc["message"], doc["level"], doc["proxy_url"]) == ("listening", "info", "http://127.0.0.1:1")
