"""What the gateway makes of an MCP server's answer to a tool call: whether the tool ran, and what is
stored, from JSON and from event streams however they are cut (gateway.mcp, no I/O)."""

from __future__ import annotations

import pytest

from gateway.mcp import SseReader, answer_of, envelope

RESULT = b'{"content":[{"type":"text","text":"ok"}],"isError":false}'


@pytest.mark.parametrize(
    ("status", "body", "ran"),
    [
        (200, b'{"jsonrpc":"2.0","id":7,"result":' + RESULT + b"}", "yes"),
        (200, b'{"jsonrpc":"2.0","id":7,"result":{"isError":true,"content":[]}}', "yes"),
        (200, b'{"jsonrpc":"2.0","id":7,"error":{"code":-32601,"message":"Method not found"}}', "no"),
        # invalid params may come from a tool that ran and then raised it (the SDK passes it through)
        (200, b'{"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"Unknown tool"}}', "maybe"),
        (200, b'{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"boom"}}', "maybe"),
        (404, b"session not found", "no"),
        (409, b"conflict", "maybe"),
        (503, b"", "maybe"),
    ],
)
def test_what_an_answer_says_of_the_call(status: int, body: bytes, ran: str) -> None:
    """A result says the tool ran; a 'never ran' error or a 4xx that it did not; anything else, maybe."""
    answer = answer_of(status, "application/json", body, "7")
    assert answer is not None
    assert answer.ran == ran


def test_an_answer_to_another_id_or_garbage_is_no_answer() -> None:
    """The call stays in doubt: its own answer never came."""
    assert answer_of(200, "application/json", b'{"jsonrpc":"2.0","id":8,"result":{}}', "7") is None
    assert answer_of(200, "application/json", b'{"jsonrpc":"2.0","id":"7","result":{}}', "7") is None
    assert answer_of(200, "application/json", b"{not json", "7") is None
    assert answer_of(200, "text/plain", b'{"jsonrpc":"2.0","id":7,"result":{}}', "7") is None


def test_the_result_is_stored_byte_for_byte_and_replayed_under_any_id() -> None:
    """Whatever the spacing and order of the server's members, the result's own bytes are kept."""
    body = b'{ "jsonrpc" : "2.0", "result" :  ' + RESULT + b' , "id": 7 }'
    answer = answer_of(200, "application/json; charset=utf-8", body, "7")
    assert answer is not None
    assert answer.stored == b'{"result":' + RESULT + b"}"
    assert envelope(answer.stored, '"abc"') == b'{"jsonrpc":"2.0","id":"abc","result":' + RESULT + b"}"


@pytest.mark.parametrize("cut", [1, 2, 5, 17, 1000])
def test_an_event_stream_is_read_however_it_is_cut(cut: int) -> None:
    """Progress notifications first, CRLF line ends, a comment, data over two lines: one answer."""
    stream = (
        b": keep-alive\r\n\r\n"
        b'event: message\r\ndata: {"jsonrpc":"2.0","method":"notifications/progress","params":{}}\r\n\r\n'
        b'event: message\r\ndata: {"jsonrpc":"2.0","id":7,\r\ndata: "result":' + RESULT + b"}\r\n\r\n"
    )
    reader, messages = SseReader(), []
    for i in range(0, len(stream), cut):
        messages += reader.feed(stream[i : i + cut])
    messages += reader.feed(b"", final=True)
    assert len(messages) == 2
    answer = answer_of(200, "text/event-stream", stream, "7")
    assert answer is not None
    assert answer.stored == b'{"result":' + RESULT + b"}"


def test_a_stream_of_bytes_that_are_not_utf8_holds_no_answer_and_a_byte_order_mark_is_skipped() -> None:
    """An answer stored as read must be the server's bytes: after invalid UTF-8 nothing is read (the call
    stays in doubt); a byte order mark that opens the stream is no part of it."""
    answer = b'data: {"jsonrpc":"2.0","id":7,"result":{"t":"\xff"}}\n\n'
    assert answer_of(200, "text/event-stream", answer, "7") is None
    marked = "\ufeff".encode() + b'data: {"jsonrpc":"2.0","id":7,"result":{}}\n\n'
    found = answer_of(200, "text/event-stream", marked, "7")
    assert found is not None
    assert found.stored == b'{"result":{}}'


def test_ids_compare_by_value_and_very_long_ones_as_written() -> None:
    """1 and 1.0 are one id; an id of 5,000 digits, more than Python converts, matches itself."""
    assert answer_of(200, "application/json", b'{"jsonrpc":"2.0","id":1.0,"result":{}}', "1") is not None
    long = "7" * 5000
    body = ('{"jsonrpc":"2.0","id":' + long + ',"result":{}}').encode()
    assert answer_of(200, "application/json", body, long) is not None


def test_an_answer_nested_too_deep_to_read_holds_none() -> None:
    """Nested past what the standard library's parser follows: no answer (in doubt), never an error."""
    deep = b'{"jsonrpc":"2.0","id":7,"result":' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert answer_of(200, "application/json", deep, "7") is None
