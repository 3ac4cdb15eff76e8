"""Writing a relayed or replayed response's head with exactly the bytes the upstream sent.

Stored header names and values are the upstream's bytes decoded 'utf-8' with 'surrogateescape', which
loses nothing (see :func:`gateway.upstream.storable_headers`). aiohttp's own head writer cannot put them
back: it encodes every character as UTF-8, and its C version silently drops lone surrogates, so a value
``caf\\xe9`` would reach the agent as ``caf`` (its Python version raises instead). So the response
below writes its own head, and refuses what would end or split it: CR, LF and NUL.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter

from gateway.errors import HeaderRefused

# RFC 9110 section 5.6.2.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# What ends or splits a head (RFC 9110 section 5.5 has a recipient refuse them). Other control bytes are
# not valid in a field value either, but aiohttp's client accepts them from an upstream, and refusing one
# here would leave an effect that happened with no answer the agent can ever read: they are relayed.
_SPLITS_HEAD = re.compile(r"[\x00\r\n]")


def header_line(name: str, value: str) -> bytes:
    """``name: value`` and CRLF, as the bytes the (surrogate-escaped) text stands for."""
    if not _TOKEN.fullmatch(name):
        raise HeaderRefused(f"{name!r} is not a header name")
    if _SPLITS_HEAD.search(value):
        raise HeaderRefused(f"the value of {name} holds CR, LF or NUL")
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that stands for no byte (only an operator can send one)
        raise HeaderRefused(f"the value of {name} is not text nor escaped bytes") from None
    return name.encode("ascii") + b": " + raw + b"\r\n"


def head_bytes(status_line: str, headers: Iterable[tuple[str, str]]) -> bytes:
    return status_line.encode("ascii") + b"\r\n" + b"".join(header_line(n, v) for n, v in headers) + b"\r\n"


# aiohttp fills these in when a response has none; an answer relayed from an upstream keeps what the
# upstream sent (an invented Content-Type would change how the agent reads the body). Date is still
# added when missing, as RFC 9110 section 6.6.1 asks of a server that forwards a response.
_NOT_INVENTED = ("Content-Type", "Server")


class RawHeadResponse(web.Response):
    """A response whose head is written byte for byte from the given (surrogate-escaped) headers.

    Raises :class:`HeaderRefused` at once for a header that cannot be written, so that it becomes a
    problem+json answer of the handler's own instead of a failure while aiohttp sends the response.
    """

    def __init__(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> None:
        super().__init__(status=status, body=body)
        # Given headers replace aiohttp's defaults (Content-Type, Date, Server) so a replay is identical.
        self.headers.clear()
        # Each given header's line, checked now and kept to write the head with: built once, not again
        # when aiohttp has added its own (Content-Length, Date) and the head goes out.
        self._lines: dict[tuple[str, str], bytes] = {}
        for name, value in headers:
            self.headers.add(name, value)
            self._lines[name, value] = header_line(name, value)
        self._not_invented = {name for name in _NOT_INVENTED if name not in self.headers}

    async def _write_headers(self) -> None:
        # aiohttp calls this once the headers are final (Content-Length, Date added); the status line
        # is built as aiohttp builds it.
        request = self._req
        writer = self._payload_writer
        assert request is not None
        assert writer is not None
        version = request.version
        status_line = f"HTTP/{version.major}.{version.minor} {self.status} {self.reason}"
        lines = self._lines
        head = [status_line.encode("ascii"), b"\r\n"]
        for name, value in self.headers.items():
            if name not in self._not_invented:
                line = lines.get((name, value))
                head.append(line if line is not None else header_line(name, value))
        head.append(b"\r\n")
        put_head(writer, b"".join(head))


def put_head(writer: AbstractStreamWriter, head: bytes) -> None:
    """Hand the head to aiohttp's writer, to go out with the body in one write.

    aiohttp's private API is used in this module only: ``RawHeadResponse._write_headers`` overrides
    StreamResponse's and reads its ``_req`` and ``_payload_writer`` (the public writer only takes text
    that it encodes itself), and the head is buffered in the writer's ``_headers_buf`` exactly as its own
    ``write_headers()`` buffers the head it makes: the first write of the body then sends both in one
    system call (a head written on its own cost a second send for every response).
    tests/test_wire.py reads the exact bytes from a socket, so a change in aiohttp fails it loudly.
    """
    if not isinstance(writer, StreamWriter):  # pragma: no cover - aiohttp's only payload writer
        raise TypeError(f"cannot write a head through {type(writer).__name__}")
    transport = writer.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the agent went away before the response could be written")
    writer._headers_buf = head
    writer._headers_written = False


# Fail at import, not silently on the wire, if aiohttp stops calling the method overridden above.
if not callable(getattr(web.StreamResponse, "_write_headers", None)) or not {
    "_headers_buf",
    "_headers_written",
} <= set(StreamWriter.__init__.__code__.co_names):  # pragma: no cover
    raise ImportError("aiohttp's response writer changed; see gateway/wire.py")
