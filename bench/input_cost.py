"""What the gateway's reading of agent input costs per byte, for shapes chosen to make it slow.

Run: `make bench-input` (or `python -m bench.input_cost --repeat 30`). For each adversarial shape (an
unterminated string of escaped quotes, deep nesting, many keys, long strings of escapes, many form
fields, long query strings, many headers, nested and repeated gzip) and each check that reads it, the
table gives the time per byte at 16 KiB and at 1 MiB (the default ``max_body_bytes``), median and p99
over the repeats, and the ratio of the two medians. Work that is linear in its input costs the same per
byte at both sizes: a ratio near 1 (below 1 where a fixed cost per call is spread over more bytes). A
ratio of 64 is work that grows with the square of the input.

The row ``request`` is the whole path of a request through a real aiohttp server on loopback: read,
decode, parse, fingerprint, stamp (the gateway's own functions, without Postgres or an upstream).

Each cell runs in a child process with a time limit, so that a shape that takes hours (the reason this
benchmark exists) prints as over the limit instead of stopping the run. The figures are wall-clock
times in that child on a machine that other work may share: the conditions are printed first.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import inspect
import multiprocessing
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict, CIMultiDictProxy

from bench.harness import conditions
from gateway import codings, problems
from gateway import proxy as gateway_proxy
from gateway.body import FORM, RequestBody, read_body
from gateway.errors import FormRefused, JsonRefused, KeySyntaxError, StampError
from gateway.fingerprint import canonical_query, fingerprint
from gateway.jsonbody import MAX_DEPTH
from gateway.keys import parse_key
from gateway.policy import UpstreamPolicy, upstream_policies
from gateway.runtime import check_headers
from gateway.settings import Settings, load_settings
from gateway.stamp import reserved_use
from gateway.upstream import build_outbound

SMALL = 16 * 1024
# The default max_body_bytes: the largest body an agent can send.
LARGE = 1024 * 1024
# The derived key the stamp rows write (any value of the derived keys' shape).
DERIVED = "eg_" + "0" * 32
# A cell whose first sample has not come after this long is over the limit: linear work on a megabyte
# takes milliseconds here, and the quadratic shapes of issue 28 took seconds at 16 KiB and hours at 1 MiB.
LIMIT_SECONDS = 60.0
# "gzip, " 1,000 times fits in one header line of aiohttp's (8,190 bytes), and 128 lines (its limit on
# header lines) hold any of the shapes here.
CODINGS_PER_LINE = 1000
# How often the task that watches the event loop wakes during the whole requests.
TICK_SECONDS = 0.001
# Past this much time in a cell, no further repeats are started (a slow shape gives fewer samples).
BUDGET_SECONDS = 10.0


@dataclass(frozen=True)
class Shape:
    """A request made to be costly to read: its body as sent, and the head that goes with it."""

    name: str
    upstream: str  # which of SETTINGS' upstreams it is sent to (which stamp applies)
    body: bytes = b""
    content_type: str = "application/json"
    encodings: tuple[str, ...] = ()
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    key: str = "bench:1"
    checks: tuple[str, ...] = ("parse", "fingerprint", "stamp", "request")
    # Built lazily: the nested gzip shapes take seconds to make.
    cache: dict[str, Any] = field(default_factory=dict, compare=False)


def _fill(unit: bytes, size: int, head: bytes = b"", tail: bytes = b"") -> bytes:
    count = max(0, (size - len(head) - len(tail)) // len(unit))
    return head + unit * count + tail


def plain_bytes(size: int) -> Shape:
    # Not adversarial: an opaque body that nothing parses, the baseline of reading and hashing a body.
    body = b"x" * size
    return Shape("opaque bytes (baseline)", "ask", body, "application/octet-stream", checks=("request",))


def escaped_quotes(size: int) -> Shape:
    # A string that never ends, of escaped quotes: what the depth check's pattern retried from each quote.
    return Shape("escaped quotes, unterminated", "shop", _fill(b'\\"', size, b'{"a":"'))


def nesting_at_limit(size: int) -> Shape:
    # Arrays nested exactly MAX_DEPTH deep (the outer one and MAX_DEPTH - 1 inside it), side by side.
    unit = b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b","
    body = _fill(unit, size, b"[", b"[]]")
    return Shape(f"nesting {MAX_DEPTH} deep, repeated", "shop", body)


def nesting_past_limit(size: int) -> Shape:
    return Shape("nesting past the limit", "shop", b"[" * size)


def many_keys(size: int) -> Shape:
    count = (size - 2) // 16  # 16 bytes a member, within the braces
    members = b",".join(b'"k%010d":1' % (count - i) for i in range(count))  # in reverse order, to sort
    return Shape("many keys", "shop", b"{" + members + b"}")


def long_then_short(size: int) -> Shape:
    # One member of 5,000 characters, then short arrays: each was read in the piece that held the long
    # one, 16 Ki characters for three.
    return Shape(
        "long member, then short ones", "shop", _fill(b",[]", size, b'["' + b"a" * 5000 + b'"', b"]")
    )


def many_numbers(size: int) -> Shape:
    # Not adversarial: a long array of short members (ids, a vector), each read alone in the walk of a
    # long body until runs of short members were read in one scan.
    return Shape("many numbers", "shop", _fill(b"12345,", size, b'{"ids":[', b"0]}"))


def escape_after_each(size: int) -> Shape:
    # A number, then a string with an escape, again and again (a hostile review's shape): runs of
    # short members ended at each escape.
    return Shape("an escape after each number", "shop", _fill(b'1,"\\n",', size, b'{"a":[', b"0]}"))


def deep_siblings(size: int) -> Shape:
    # Arrays of numbers nested 126 deep, side by side (a hostile review's shape): each level tried five
    # pieces that could not hold it.
    one = b"[" * 126 + b"1," * min(8250, size // 8) + b"1" + b"]" * 126  # longer than a piece at 1 MiB
    return Shape("numbers nested 126 deep, side by side", "shop", _fill(one + b",", size, b"[", b"1]"))


def unicode_escapes(size: int) -> Shape:
    # Surrogate pairs, lone surrogates (which Python keeps) and other \u escapes.
    unit = b"\\ud83d\\ude00\\ud800\\u00e9\\u0000"
    return Shape("\\u escapes and surrogates", "shop", _fill(unit, size, b'{"s":"', b'"}'))


def short_escapes(size: int) -> Shape:
    return Shape("short escapes", "shop", _fill(b'\\"\\\\\\n\\/', size, b'{"s":"', b'"}'))


def form_fields(size: int) -> Shape:
    # Fields of 128 bytes, so that a megabyte stays below the form's limit on fields.
    field_ = b"metadata%5Bnote%5D=" + b"%FF%fe+%" * 13 + b"&"
    field_ += b"x" * (128 - len(field_))
    return Shape("form fields of escapes", "pay", _fill(field_, size), content_type=FORM)


def form_one_field_of_escapes(size: int) -> Shape:
    # Few separators: read on the event loop until "%" and "+" counted as parts.
    return Shape(
        "form field of one escape after another", "pay", _fill(b"%41+", size, b"note="), content_type=FORM
    )


def form_tiny_fields(size: int) -> Shape:
    return Shape("form of empty fields", "pay", b"&" * size, content_type=FORM)


def query_string(size: int) -> Shape:
    query = _fill(b"a=%FF&b=%&c+d=1&ref%5B=x&", size).decode()
    return Shape("long query string", "ask", b"{}", query=query, checks=("query", "fingerprint", "stamp"))


def many_headers(size: int) -> Shape:
    headers = tuple((f"X-Header-{i}", "v" * 48) for i in range(size // 64))
    return Shape("many headers", "shop", b"{}", headers=headers, checks=("headers", "fingerprint", "stamp"))


def quoted_key(size: int) -> Shape:
    return Shape("quoted key of escapes", "shop", b"{}", key='"' + '\\"' * (size // 2) + '"', checks=("key",))


def gzip_layers(size: int) -> Shape:
    # The shape: a small document under as many gzip layers as fit (about 16,000 in a megabyte;
    # the had 10,000 in 989 KB). Stored blocks (level 0) make it in seconds.
    body, layers = b"{}", 0
    while len(wrapped := gzip.compress(body, compresslevel=0, mtime=0)) <= size:
        body, layers = wrapped, layers + 1
    return Shape("gzip layers", "shop", body, encodings=("gzip",) * layers, checks=("decode", "request"))


def gzip_members(size: int) -> Shape:
    # One layer of many empty gzip members (RFC 1952 allows any number).
    body = _fill(gzip.compress(b"", mtime=0), size)
    return Shape("gzip members", "shop", body, encodings=("gzip",), checks=("decode", "request"))


SHAPES: list[Callable[[int], Shape]] = [
    plain_bytes,
    escaped_quotes,
    nesting_at_limit,
    nesting_past_limit,
    many_keys,
    long_then_short,
    many_numbers,
    escape_after_each,
    deep_siblings,
    unicode_escapes,
    short_escapes,
    form_fields,
    form_one_field_of_escapes,
    form_tiny_fields,
    query_string,
    many_headers,
    quoted_key,
    gzip_layers,
    gzip_members,
]


def settings() -> Settings:
    """One upstream per kind of stamp that reads the body or the query."""
    return load_settings(
        None,
        need_secrets=False,
        upstreams={
            "shop": {"base_url": "http://127.0.0.1:9", "stamp": {"json_field": "metadata.ref"}},
            "pay": {"base_url": "http://127.0.0.1:9", "stamp": {"form_field": "metadata[idempotency_key]"}},
            "ask": {"base_url": "http://127.0.0.1:9", "stamp": {"query_param": "ref"}},
        },
    )


# --- the checks ---------------------------------------------------------------------------------------------


class Refused(Exception):
    """The shape was refused, as a bad request should be: its time still counts."""


def _decode(shape: Shape, config: Settings) -> bytes:
    # The most layers allowed is a setting from issue 28 on; a checkout from before it has no such limit.
    most = getattr(config, "max_content_codings", None)
    extra: dict[str, Any] = {"most": most} if "most" in inspect.signature(codings.decode).parameters else {}
    try:
        return codings.decode(shape.body, list(shape.encodings), config.max_body_bytes, **extra)
    except ValueError as exc:
        raise Refused(type(exc).__name__) from None


def _parsed(shape: Shape, policy: UpstreamPolicy) -> RequestBody:
    try:
        return read_body(shape.body, shape.content_type, policy.json_stamp_path)
    except (JsonRefused, FormRefused) as exc:
        raise Refused(type(exc).__name__) from None


def _headers(shape: Shape) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict([("Content-Type", shape.content_type), *shape.headers]))


def check(name: str, shape: Shape, config: Settings) -> Callable[[], object]:
    """The work that one row of the table times, ready to run on ``shape``."""
    policy = upstream_policies(config)[shape.upstream]
    headers = _headers(shape)
    if name == "parse":
        return lambda: _parsed(shape, policy)
    if name == "decode":
        return lambda: _decode(shape, config)
    if name == "query":
        return lambda: (
            canonical_query(shape.query),
            reserved_use(policy, headers, shape.query, RequestBody(b"")),
        )
    if name == "key":

        def key() -> object:
            try:
                return parse_key(shape.key)
            except KeySyntaxError:
                raise Refused("KeySyntaxError") from None

        return key
    if name == "headers":
        request = make_mocked_request("POST", "/shop/orders", headers=headers)

        def read_headers() -> object:
            try:
                check_headers(request)
            except problems.Problem as exc:
                raise Refused(exc.type) from None
            return reserved_use(policy, headers, shape.query, RequestBody(b""))

        return read_headers
    body = _parsed(shape, policy)
    if name == "fingerprint":
        return lambda: fingerprint(
            "POST",
            "/orders",
            shape.query,
            body,
            headers,
            policy.fingerprint_headers,
            (),
            policy.fingerprint_body,
        )
    if name == "stamp":

        def stamp() -> object:
            reserved_use(policy, headers, shape.query, body)
            try:
                return build_outbound(policy, DERIVED, "POST", "/orders", shape.query, headers, body).body
            except StampError:
                raise Refused("StampError") from None

        return stamp
    raise ValueError(f"no check named {name}")


@dataclass
class Measured:
    """Seconds per run of one check, and what became of the shape (accepted, or refused and why)."""

    taken: list[float]
    outcome: str
    # For whole requests: per request, the longest the event loop went without running (seconds).
    stalls: list[float] = field(default_factory=list)


def samples(name: str, shape: Shape, config: Settings, repeat: int) -> Measured:
    """Run one check on ``shape`` ``repeat`` times (fewer past BUDGET_SECONDS)."""
    if name == "request":
        return asyncio.run(_requests(shape, config, repeat))
    try:
        work = check(name, shape, config)
    except Refused as exc:
        return Measured([], f"n/a: parse refused ({exc})")
    taken: list[float] = []
    outcome = "accepted"
    begun = time.perf_counter()
    while len(taken) < repeat and (not taken or time.perf_counter() - begun < BUDGET_SECONDS):
        start = time.perf_counter()
        try:
            work()
        except Refused as exc:
            outcome = f"refused ({exc})"
        taken.append(time.perf_counter() - start)
    return Measured(taken, outcome)


async def _requests(shape: Shape, config: Settings, repeat: int) -> Measured:
    """The whole path through a real aiohttp server on 127.0.0.1 (port 0), timed at the client.

    A task on the same event loop wakes every millisecond meanwhile: how late it wakes is how long
    reading the request held the loop (or the interpreter's lock, from another thread).
    """
    policy = upstream_policies(config)[shape.upstream]

    async def handle(request: web.Request) -> web.Response:
        try:
            check_headers(request)
            body = await gateway_proxy._body(request, config, policy)
            if reserved_use(policy, request.headers, shape.query, body) is not None:
                return web.Response(status=400)
            fingerprint("POST", "/orders", shape.query, body, request.headers, policy.fingerprint_headers)
            build_outbound(policy, DERIVED, "POST", "/orders", shape.query, request.headers, body)
        except problems.Problem as exc:
            return web.Response(status=exc.status, text=exc.type)
        except StampError:
            return web.Response(status=400, text="cannot-stamp")
        return web.Response(status=200)

    app = web.Application(client_max_size=config.max_body_bytes)
    app.router.add_post("/shop/orders", handle)
    runner = web.AppRunner(app, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    headers = CIMultiDict(
        [("Content-Type", shape.content_type), ("Idempotency-Key", shape.key), *shape.headers]
    )
    # Many codings go in several header lines, as aiohttp reads at most 8 KiB in one.
    for first in range(0, len(shape.encodings), CODINGS_PER_LINE):
        headers.add("Content-Encoding", ", ".join(shape.encodings[first : first + CODINGS_PER_LINE]))
    measured = Measured([], "")
    longest = [0.0]
    ticker = asyncio.create_task(_tick(longest))
    try:
        async with aiohttp.ClientSession() as http:
            begun = time.perf_counter()
            while len(measured.taken) < repeat and (
                not measured.taken or time.perf_counter() - begun < BUDGET_SECONDS
            ):
                longest[0] = 0.0
                start = time.perf_counter()
                async with http.post(
                    f"http://127.0.0.1:{port}/shop/orders", data=shape.body, headers=headers
                ) as resp:
                    answer = await resp.text()
                measured.taken.append(time.perf_counter() - start)
                measured.stalls.append(longest[0])
                measured.outcome = "accepted" if resp.status == 200 else f"refused ({resp.status} {answer})"
    finally:
        ticker.cancel()
        await runner.cleanup()
    return measured


async def _tick(longest: list[float]) -> None:
    """Keep in ``longest[0]`` the longest time past its due that a 1 ms sleep on this loop woke."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(TICK_SECONDS)
        longest[0] = max(longest[0], time.perf_counter() - start - TICK_SECONDS)


# --- cells in child processes -------------------------------------------------------------------------------


def _child(name: str, shape: Shape, repeat: int, conn: Connection) -> None:
    conn.send(samples(name, shape, settings(), repeat))
    conn.close()


def cell(name: str, shape: Shape, repeat: int) -> Measured:
    """``samples`` in a forked child, which is killed if its first sample takes longer than the limit."""
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(name, shape, repeat, theirs))
    child.start()
    theirs.close()
    try:
        if not ours.poll(LIMIT_SECONDS + BUDGET_SECONDS):
            return Measured([], f"over {LIMIT_SECONDS:.0f} s: stopped")
        try:
            return ours.recv()  # type: ignore[no-any-return]
        except EOFError:  # the child failed; its traceback is on stderr
            return Measured([], "failed: see the traceback above")
    finally:
        child.kill()
        child.join()


@dataclass
class Row:
    shape: str
    check: str
    per_byte: dict[int, tuple[float, float] | None]
    outcome: str
    stall: float | None = None  # milliseconds, the median of the requests' longest, at 1 MiB


def per_byte(taken: list[float], size: int) -> tuple[float, float] | None:
    """Median and p99 in nanoseconds per byte."""
    if not taken:
        return None
    ns = [t * 1e9 / size for t in taken]
    p99 = statistics.quantiles(ns, n=100)[98] if len(ns) > 1 else ns[0]
    return statistics.median(ns), p99


def size_of(shape: Shape) -> int:
    """The bytes the agent sends for the shape: the body, or the part of the head that is the shape."""
    if shape.query:
        return len(shape.query)
    if shape.headers:
        return sum(len(n) + len(v) + 4 for n, v in shape.headers)
    if "key" in shape.checks:
        return len(shape.key)
    return len(shape.body)


def table(rows: list[Row]) -> str:
    head = (
        f"{'shape':<30} {'check':<12} {'16 KiB p50':>11} {'p99':>9} {'1 MiB p50':>11} {'p99':>9} "
        f"{'1M/16K':>7} {'stall':>7}  outcome (at 1 MiB)"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = []
        for size in (SMALL, LARGE):
            got = row.per_byte.get(size)
            cells += [f"{got[0]:>11.1f}", f"{got[1]:>9.1f}"] if got else [f"{'-':>11}", f"{'-':>9}"]
        small, large = row.per_byte.get(SMALL), row.per_byte.get(LARGE)
        ratio = f"{large[0] / small[0]:>7.2f}" if small and large else f"{'-':>7}"
        stall = f"{row.stall:>7.1f}" if row.stall is not None else f"{'-':>7}"
        lines.append(f"{row.shape:<30} {row.check:<12} {' '.join(cells)} {ratio} {stall}  {row.outcome}")
    lines.append("times in ns per byte of the shape; 1M/16K: ratio of the medians (linear: about 1 or less);")
    lines.append("stall: ms the event loop did not run in one request at 1 MiB (median over the requests)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=30, help="runs per cell (fewer when slow)")
    parser.add_argument("--only", default="", help="only the shapes whose name contains this")
    args = parser.parse_args()
    print(conditions({"repeat": str(args.repeat), "limit per cell": f"{LIMIT_SECONDS:.0f} s"}), flush=True)
    rows: list[Row] = []
    for make in SHAPES:
        shapes = {size: make(size) for size in (SMALL, LARGE)}
        first = shapes[SMALL]
        if args.only not in first.name:
            continue
        for name in first.checks:
            row = Row(first.name, name, {}, "")
            for size, shape in shapes.items():
                measured = cell(name, shape, args.repeat)
                row.per_byte[size] = per_byte(measured.taken, size_of(shape))
                row.outcome = measured.outcome
                if measured.stalls and size == LARGE:
                    row.stall = statistics.median(measured.stalls) * 1000
            rows.append(row)
            print(f"  {row.shape}, {row.check}: {row.outcome}", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
