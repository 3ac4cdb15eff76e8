"""Upstreams for tests: real HTTP servers on loopback (port 0) that record what reached them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.proxy import PROXY_ROUTE

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# The probe of Upstream.serve_search's order search, which finds the orders (POST /orders) by their stamp.
ORDER_SEARCH = {
    "method": "GET",
    "path": "/orders/search?ref={key}",
    "found": "items.0",
    "status": 201,
    "routes": ["POST /orders"],
}


@dataclass
class Call:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    # Every header as received, repeats and all (headers above keeps one value per name).
    header_list: list[tuple[str, str]] = field(default_factory=list)
    # The request target as it came, still percent-encoded (path above is decoded).
    target: str = ""


@dataclass
class Upstream:
    """An HTTP server that records every request it receives and answers as a test scripts it.

    By default it creates an "order" (201, JSON with a sequence number), so that a duplicate effect
    is visible as a second call and a second id.
    """

    calls: list[Call] = field(default_factory=list)
    routes: dict[str, Handler] = field(default_factory=dict)
    url: str = ""
    received: asyncio.Event = field(default_factory=asyncio.Event)
    # When set, behaves like an API that honours keys in this header: a repeat gets the first answer.
    key_header: str | None = None
    remembered: dict[str, web.Response] = field(default_factory=dict)

    def effects(self, path: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.method not in ("GET", "HEAD") and (path is None or c.path == path)]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.calls.append(
            Call(
                request.method,
                request.path,
                request.raw_path.partition("?")[2],
                dict(request.headers),
                body,
                list(request.headers.items()),
                request.raw_path,
            )
        )
        self.received.set()
        key = request.headers.get(self.key_header) if self.key_header else None
        if key is not None and key in self.remembered:
            first = self.remembered[key]
            assert first.body is not None
            return web.Response(status=first.status, body=first.body, content_type=first.content_type)
        handler = self.routes.get(request.path)
        if handler is not None:
            resp = await handler(request)
        else:
            resp = web.json_response(
                {"id": len(self.calls), "echo": body.decode(errors="replace")}, status=201
            )
        if key is not None and isinstance(resp, web.Response):
            self.remembered[key] = resp
        return resp

    def stamped(self, field_name: str, value: str) -> list[Any]:
        """The orders created with ``field_name == value`` in their JSON body (what a probe searches)."""
        found = []
        for call in self.effects():
            try:
                doc = json.loads(call.body)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get(field_name) == value:
                found.append({"order": call.body.decode(), "reference": value})
        return found

    def serve_search(self, path: str = "/orders/search", field_name: str = "client_reference") -> None:
        """Answer ``GET path?ref=KEY`` with ``{"items": [...]}``, as a shop's order search would."""

        async def search(request: web.Request) -> web.Response:
            return web.json_response({"items": self.stamped(field_name, request.query.get("ref", ""))})

        self.routes[path] = search

    def effects_created(self) -> int:
        """Effects that really happened: repeats of a remembered key are not new effects."""
        seen: set[str] = set()
        count = 0
        for call in self.effects():
            key = call.headers.get(self.key_header) if self.key_header else None
            if key is None or key not in seen:
                count += 1
            if key is not None:
                seen.add(key)
        return count


@asynccontextmanager
async def upstream_server() -> AsyncIterator[Upstream]:
    upstream = Upstream()
    app = web.Application()
    app.router.add_route("*", PROXY_ROUTE, upstream.handle)  # every path, as the gateway's
    async with serving(app) as upstream.url:
        yield upstream


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` (a demo upstream, say) on 127.0.0.1, port 0; yields its URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def raw_exchange(url: str, head: bytes, body: bytes = b"{}") -> bytes:
    """Send ``head`` (request line and headers, each ending in CRLF) and ``body`` over a plain socket to
    ``url``; the answer's bytes exactly as they came, once the server closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


@dataclass
class RawUpstream:
    """An HTTP/1.1 server that answers every request with the same raw bytes (headers any bytes at all)."""

    answer: bytes
    url: str = ""
    requests: list[bytes] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.requests.append(head + await reader.readexactly(length))
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def raw_upstream(answer: bytes) -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream(answer)
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    upstream.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield upstream
    finally:
        server.close()
        await server.wait_closed()


# One upstream per place a key can go (tests/test_outbound.py, tests/test_schemathesis.py).
STAMPED: dict[str, dict[str, Any]] = {
    "plain": {},
    "native": {"native_key": {"header": "X-Idem"}},
    "header": {"stamp": {"header": "X-Ref"}},
    "query": {"stamp": {"query_param": "ref"}},
    "form": {"stamp": {"form_field": "metadata[ref]"}},
    "json": {"stamp": {"json_field": "meta.ref"}},
}


def one_insertion(before: bytes, after: bytes) -> bytes | None:
    """The bytes added, when ``after`` is ``before`` with one contiguous run inserted; else None."""
    added = len(after) - len(before)
    if added < 0:
        return None
    same = 0
    while same < len(before) and before[same] == after[same]:
        same += 1
    return after[same : same + added] if after[same + added :] == before[same:] else None
