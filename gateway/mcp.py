"""MCP tool calls as effects: the agent's JSON-RPC message and the server's answer to it. No I/O here.

An MCP server on the streamable HTTP transport takes JSON-RPC messages in POSTs to one endpoint and
answers each request in the POST's response, as one JSON document or as a stream of server-sent events
(SSE) whose ``message`` events carry JSON-RPC messages. The protocol has no idempotency of its own: a
client that lost the answer to ``tools/call`` cannot tell whether the tool ran. The gateway treats each
``tools/call`` of a tool with side effects as an effect (its key from the call, its fingerprint the
tool's name and arguments), and passes every other message through untouched (gateway.mcp_proxy).

What the gateway stores of a tool call's answer is the JSON-RPC response without its ``jsonrpc`` and
``id`` members, ``{"result":...}`` or ``{"error":...}``, the member's value byte for byte as the server
sent it. A replay puts it back under the retry's own id (:func:`envelope`), which is all that differs
between two answers to the same call.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.outcome import Ran

# Where an agent puts a tool call's key, inside the call's params._meta (MCP's place for metadata a
# server does not interpret; a name with a prefix of our own, as the protocol asks of extensions).
KEY_META = "effect-gateway/idempotency-key"
# JSON-RPC errors that say the server did not run the call: it could not read the message as JSON-RPC,
# or knows no such method. Not -32602 (invalid params), though servers answer an unknown tool with it:
# the official Python SDK passes an error a tool raises through unchanged, so a tool that placed its
# order and then raised "invalid params" would be called again. Such an answer leaves the call in
# doubt, and a probe (or an operator) tells.
NOT_RUN = frozenset({-32700, -32600, -32601})
# The HTTP statuses with which the streamable HTTP transport refuses a message before reading it as
# JSON-RPC (a bad or unknown session, an Accept or a content type it does not take, no such endpoint or
# method, no credentials), and those that say of any HTTP request that it was not acted on. Any other
# 4xx from an MCP endpoint may come from something that ran the tool: it leaves the call in doubt.
NOT_READ = frozenset({400, 401, 403, 404, 405, 406, 408, 415, 425, 429})
# The code of every error the gateway itself answers in JSON-RPC; ``data`` says which (the same problem
# types as its HTTP answers). In the range JSON-RPC leaves to implementations.
GATEWAY_ERROR = -32000

ToolKind = Literal["effect", "read_only"]
Framing = Literal["json", "sse"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A ``tools/call`` request: its JSON-RPC id as the agent wrote it, the tool, and the key it carries."""

    id_json: str
    name: str
    key: str | None


@dataclass(frozen=True, slots=True)
class Refused:
    """A message the gateway answers itself, never sent: why, and the id to answer under (JSON)."""

    id_json: str
    why: str
    code: int = -32600


@dataclass(frozen=True, slots=True)
class PassThrough:
    """Any other message: sent on as it is, recorded nowhere."""

    method: str | None


Message = ToolCall | Refused | PassThrough


def message_of(value: Any) -> Message:
    """Say what a POSTed JSON-RPC message is, as parsed by gateway.jsonbody (numbers as their text)."""
    if isinstance(value, list):
        if any(isinstance(item, dict) and item.get("method") == "tools/call" for item in value):
            return Refused(
                "null",
                "a batch holding tools/call is refused: send each tool call in a POST of its own, so that "
                "each is recorded under its own key",
            )
        return PassThrough(None)
    if not isinstance(value, dict):
        return Refused("null", "a JSON-RPC message is an object (or a batch of them)")
    method = value.get("method")
    if method != "tools/call":
        return PassThrough(method if isinstance(method, str) else None)
    if "id" not in value:
        # A notification expects no answer, so a server may run it all the same: unrecorded, and no
        # retry could ever be answered from a record.
        return Refused("null", "tools/call is a request: give it an id")
    id_json = _id_json(value["id"])
    if id_json is None:
        return Refused("null", "a JSON-RPC id is a string or a number")
    params = value.get("params")
    if not isinstance(params, dict) or not isinstance(params.get("name"), str):
        return Refused(id_json, "tools/call needs params with the tool's name", code=-32602)
    if not isinstance(params.get("arguments", {}), dict):
        return Refused(id_json, "a tool's arguments are an object", code=-32602)
    meta = params.get("_meta", {})
    if not isinstance(meta, dict):
        return Refused(id_json, "params._meta is an object", code=-32602)
    key = meta.get(KEY_META)
    if key is not None and not isinstance(key, str):
        return Refused(id_json, f"params._meta[{KEY_META!r}] is a string", code=-32602)
    return ToolCall(id_json, params["name"], key)


def _id_json(value: Any) -> str | None:
    """The id as JSON text, to answer under exactly the id the agent sent."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bytes):  # a number, kept as its literal text by gateway.jsonbody
        return value.decode()
    return None


def kind_of(name: str, configured: Mapping[str, ToolKind], hints: Mapping[str, ToolKind]) -> ToolKind:
    """Whether a tool has side effects: the operator's word first, then the server's annotations; a tool
    neither names is an effect (MCP's own default: a tool is assumed to write unless it says otherwise)."""
    return configured.get(name) or hints.get(name) or "effect"


def hints_of(result: Any) -> dict[str, ToolKind]:
    """What a ``tools/list`` result's annotations say of each tool: read-only ones, and the others.

    Annotations are hints from a server the gateway does not control; the configuration overrides them.
    """
    hints: dict[str, ToolKind] = {}
    tools = result.get("tools") if isinstance(result, dict) else None
    for tool in tools if isinstance(tools, list) else ():
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            continue
        notes = tool.get("annotations")
        read_only = isinstance(notes, dict) and notes.get("readOnlyHint") is True
        hints[tool["name"]] = "read_only" if read_only else "effect"
    return hints


def id_of(value: Any) -> str | None:
    """The JSON-RPC id of the tools/call ``value`` (a parsed message, as in message_of), as JSON text."""
    return _id_json(value.get("id")) if isinstance(value, dict) else None


# --- the server's answer ----------------------------------------------------------------------------

# The headers of a stored answer: its body is JSON (gateway.mcp's {"result"|"error": ...}), whatever
# framing the server used.
STORED_HEADERS = (("Content-Type", "application/json"),)


def media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


@dataclass(frozen=True, slots=True)
class ToolAnswer:
    """The server's answer to one call: whether the tool ran, and ``{"result"|"error": ...}`` to store."""

    ran: Ran
    stored: bytes


def answer_of(status: int, content_type: str, body: bytes, id_json: str) -> ToolAnswer | None:
    """Read the server's HTTP answer to the call ``id_json``; None when it holds no answer to it (a
    stream that ended first, or garbage), which leaves the call in doubt.

    A status in :data:`NOT_READ` refused the message before it reached the tool (an unknown session is
    404, as the transport says); any other 4xx or 5xx may come after the tool ran. A JSON-RPC result,
    with ``isError`` or not, is the tool's answer; an error in :data:`NOT_RUN` says the tool never ran,
    any other may come after it did.
    """
    if status >= 400:
        said = _error(GATEWAY_ERROR, f"the MCP server answered HTTP {status}", {"status": status})
        return ToolAnswer("no" if status in NOT_READ else "maybe", said)
    return first_answer(messages_in(content_type, body), id_json)


def messages_in(content_type: str, body: bytes) -> list[str]:
    """The JSON-RPC messages (as text) in a whole answer: one JSON document, or an event stream's."""
    media = media_type(content_type)
    if media == "text/event-stream":
        return SseReader().feed(body, final=True)
    if media == "application/json":
        try:
            return [body.decode("utf-8")]
        except UnicodeDecodeError:
            return []
    return []


def first_answer(texts: list[str], id_json: str) -> ToolAnswer | None:
    """The first of ``texts`` that answers the call ``id_json``, if one does."""
    return next(filter(None, (response_in(text, id_json) for text in texts)), None)


def response_in(text: str, id_json: str) -> ToolAnswer | None:
    """The answer in one JSON-RPC message to the call ``id_json``, if it is one."""
    try:
        spans = _members(text)
    except (ValueError, RecursionError):  # not JSON, or nested too deep for the standard library's parser
        return None
    if spans is None:
        return None
    found = spans.get("id")
    if found is None or not _same_id(found[0], text[found[1] : found[2]], id_json):
        return None
    for member in ("result", "error"):
        if member in spans:
            value, start, end = spans[member]
            raw = text[start:end]
            if member == "result":
                return ToolAnswer("yes", ('{"result":' + raw + "}").encode())
            code = value.get("code") if isinstance(value, dict) else None
            ran: Literal["no", "maybe"] = "no" if code in NOT_RUN else "maybe"
            return ToolAnswer(ran, ('{"error":' + raw + "}").encode())
    return None


def _same_id(value: Any, raw: str, id_json: str) -> bool:
    """Whether the server's id (``value`` as json reads it, ``raw`` as written) is the call's: strings by
    value, numbers by value (1 and 1.0 are one id), or as written where Python cannot read them."""
    if raw == id_json:
        return True
    try:
        sent = json.loads(id_json)
    except ValueError:  # a number of more digits than Python converts
        return False
    if isinstance(value, bool) or isinstance(sent, bool):
        return False
    if isinstance(value, str) or isinstance(sent, str):
        return type(value) is type(sent) and value == sent
    return isinstance(value, int | float) and isinstance(sent, int | float) and value == sent


class _LongNumber(str):
    """An integer of more digits than Python converts (4,300), kept as its text."""


def _integer(text: str) -> int | str:
    return int(text) if len(text) < 4000 else _LongNumber(text)


_DECODER = json.JSONDecoder(strict=True, parse_int=_integer)
_SPACE = " \t\n\r"


def _members(text: str) -> dict[str, tuple[Any, int, int]] | None:
    """The members of the JSON object ``text``: name -> (value, where its text starts, where it ends);
    None when ``text`` is not one object or names a member twice."""
    i = _skip(text, 0)
    if not text.startswith("{", i):
        return None
    i = _skip(text, i + 1)
    found: dict[str, tuple[Any, int, int]] = {}
    if text.startswith("}", i):
        return found if _skip(text, i + 1) == len(text) else None
    while True:
        if not text.startswith('"', i):
            return None
        name, i = _DECODER.raw_decode(text, i)
        i = _skip(text, i)
        if not text.startswith(":", i):
            return None
        start = _skip(text, i + 1)
        value, end = _DECODER.raw_decode(text, start)
        if name in found:
            return None
        found[name] = (value, start, end)
        i = _skip(text, end)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
            continue
        if text.startswith("}", i) and _skip(text, i + 1) == len(text):
            return found
        return None


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _error(code: int, message: str, data: Mapping[str, Any] | None = None) -> bytes:
    """A stored ``{"error": ...}`` of the gateway's own making (the form :func:`envelope` takes)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = dict(data)
    return json.dumps({"error": error}, separators=(",", ":")).encode()


class SseReader:
    """Server-sent events, read as they arrive: the data of each ``message`` event, once it is whole."""

    def __init__(self) -> None:
        # A character split between two chunks is decoded once both have come.
        self._decode = codecs.getincrementaldecoder("utf-8")().decode
        self._pending = ""
        self._data: list[str] = []
        self._event = ""
        self._started = False
        # Once bytes that are not UTF-8 came, nothing after them is read: an answer stored as read must
        # be the server's bytes, and one spelt with replacement characters would not be.
        self.broken = False

    def feed(self, chunk: bytes, *, final: bool = False) -> list[str]:
        """The data of the message events that ``chunk`` completes (``final``: and of one left open)."""
        if self.broken:
            return []
        try:
            text = self._pending + self._decode(chunk, final)
        except UnicodeDecodeError:
            self.broken = True
            return []
        if not self._started and text:
            # A byte order mark may open the stream, and is no part of it (the SSE standard).
            self._started = True
            text = text.removeprefix("\ufeff")
        # A CR at the end may be the first half of a CRLF: one line end, not two.
        held = "\r" if text.endswith("\r") and not final else ""
        lines = text.removesuffix(held).replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._pending = lines.pop() + held
        if final and self._pending:
            lines.append(self._pending)
            self._pending = ""
        done: list[str] = []
        for line in [*lines, ""] if final else lines:
            if line == "":
                if self._data and self._event in ("", "message"):
                    done.append("\n".join(self._data))
                self._data, self._event = [], ""
            elif line.startswith(":"):
                continue
            else:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "data":
                    self._data.append(value)
                elif field == "event":
                    self._event = value
        return done


# --- the probe: a read-only tool call of the gateway's own -----------------------------------------

# The protocol version the probe asks for; the server answers with the one it speaks.
PROBE_PROTOCOL = "2025-06-18"


# The ids of the probe's two requests, to read their answers by.
INITIALIZE_ID, PROBE_CALL_ID = "0", "1"


def initialize_message() -> bytes:
    """The probe's initialize request (id INITIALIZE_ID)."""
    params = {
        "protocolVersion": PROBE_PROTOCOL,
        "capabilities": {},
        "clientInfo": {"name": "effect-gateway", "version": "probe"},
    }
    message = {"jsonrpc": "2.0", "id": int(INITIALIZE_ID), "method": "initialize", "params": params}
    return json.dumps(message).encode()


INITIALIZED = b'{"jsonrpc":"2.0","method":"notifications/initialized"}'


def probe_call(tool: str, arguments: Mapping[str, Any], key: str) -> bytes:
    """The probe's tools/call (id PROBE_CALL_ID), with the derived key wherever "{key}" stands in
    ``arguments``."""
    params = {"name": tool, "arguments": _with_key(dict(arguments), key)}
    message = {"jsonrpc": "2.0", "id": int(PROBE_CALL_ID), "method": "tools/call", "params": params}
    return json.dumps(message).encode()


def _with_key(value: Any, key: str) -> Any:
    if isinstance(value, str):
        return value.replace("{key}", key)
    if isinstance(value, dict):
        return {name: _with_key(item, key) for name, item in value.items()}
    if isinstance(value, list):
        return [_with_key(item, key) for item in value]
    return value


def found_as_result(found_json: str) -> bytes:
    """What a probe's find is stored as, to replay to the call it recovers: a tool result whose
    structured content is the item found (an object), and whose text is the same JSON."""
    content = [{"type": "text", "text": found_json}]
    result = '{"content":' + json.dumps(content, separators=(",", ":"))
    if found_json.startswith("{"):
        result += ',"structuredContent":' + found_json
    return ('{"result":' + result + ',"isError":false}}').encode()


# --- the gateway's answer to the agent --------------------------------------------------------------


def framing(accept: str) -> Framing:
    """JSON when the agent takes it (MCP clients take both), else server-sent events."""
    kinds = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    if kinds & {"application/json", "application/*", "*/*"} or not accept.strip():
        return "json"
    return "sse"


def envelope(stored: bytes, id_json: str) -> bytes:
    """The JSON-RPC response for the stored ``{"result"|"error": ...}``, under the id ``id_json``."""
    return b'{"jsonrpc":"2.0","id":' + id_json.encode() + b"," + stored[1:]


def framed(message: bytes, how: Framing) -> tuple[str, bytes]:
    """The content type and body that carry one JSON-RPC message as ``how`` asks."""
    if how == "json":
        return "application/json", message
    return "text/event-stream", b"event: message\ndata: " + message + b"\n\n"


def gateway_error(id_json: str, message: str, data: Mapping[str, Any]) -> bytes:
    """A JSON-RPC error answered by the gateway itself (a refusal, a wait, an operator's turn)."""
    return envelope(_error(GATEWAY_ERROR, message, data), id_json)


def refused(message: Refused) -> bytes:
    """The JSON-RPC error for a message the gateway refuses to send on."""
    return envelope(_error(message.code, message.why), message.id_json)
