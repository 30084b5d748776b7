"""The incremental SSE decoder (soakd/client/sse.py) against the WHATWG event-stream rules.

The decoder is fed bytes exactly as they come off a socket, so a realistic stream is cut at
every single position and every pair of positions, with each line-ending style, and must
always give the same events as the hand-written expectation.
"""

from __future__ import annotations

import itertools
import json

import pytest

from soakd.client.sse import SSEDecoder, SSEEvent, SSETooLarge

pytestmark = pytest.mark.timeout(60)

# A realistic chat stream: role chunk, content with multi-byte UTF-8 (2, 3 and 4 bytes),
# a keep-alive comment, a named event with an id, a multi-line data event, usage, [DONE].
_CHUNK1 = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
_CHUNK2 = {"choices": [{"index": 0, "delta": {"content": "Grüße 世界 🎉"}}]}
_USAGE = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}

LINES: list[str] = [
    "data: " + json.dumps(_CHUNK1, separators=(",", ":")),
    "",
    ": keep-alive",
    "data: " + json.dumps(_CHUNK2, ensure_ascii=False, separators=(",", ":")),
    "",
    "event: note",
    "id: 7",
    "data:first line",
    "data: second ✓ line",
    "",
    ": another comment",
    "",
    "data: " + json.dumps(_USAGE, separators=(",", ":")),
    "",
    "data: [DONE]",
    "",
]

EXPECTED: list[SSEEvent] = [
    SSEEvent(json.dumps(_CHUNK1, separators=(",", ":")).encode()),
    SSEEvent(json.dumps(_CHUNK2, ensure_ascii=False, separators=(",", ":")).encode()),
    SSEEvent("first line\nsecond ✓ line".encode(), "note", "7"),
    SSEEvent(json.dumps(_USAGE, separators=(",", ":")).encode(), "", "7"),  # the last event id persists
    SSEEvent(b"[DONE]", "", "7"),
]


def stream(eol: str) -> bytes:
    return "".join(line + eol for line in LINES).encode()


def decode(chunks: list[bytes], close: bool = True) -> list[SSEEvent]:
    dec = SSEDecoder()
    out: list[SSEEvent] = []
    for c in chunks:
        out.extend(dec.feed(c))
    if close:
        out.extend(dec.close())
    return out


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_whole_stream(eol: str) -> None:
    assert decode([stream(eol)]) == EXPECTED
    # and the multi-byte content survives as valid UTF-8 once decoded by the caller
    assert json.loads(EXPECTED[1].data)["choices"][0]["delta"]["content"] == "Grüße 世界 🎉"


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_every_one_and_two_cut_split(eol: str) -> None:
    """All 1-cut and 2-cut splits (including empty pieces at the ends) give the same events.
    This covers multi-byte characters cut between their bytes and, for CRLF, every ``\\r`` that
    ends a chunk with its ``\\n`` in the next one."""
    data = stream(eol)
    n = len(data)
    for i in range(n + 1):
        got = decode([data[:i], data[i:]])
        assert got == EXPECTED, f"1-cut at {i}"
    failures = []
    for i, j in itertools.combinations(range(1, n), 2):
        got = decode([data[:i], data[i:j], data[j:]])
        if got != EXPECTED:
            failures.append((i, j))
    assert not failures, f"{len(failures)} 2-cut splits differ, e.g. {failures[:5]}"


def decode_data(chunks: list[bytes]) -> list[bytes]:
    """The client's hot path: ``feed_data`` returns only each event's data."""
    dec = SSEDecoder()
    out: list[bytes] = []
    for c in chunks:
        out.extend(dec.feed_data(c))
    out.extend(ev.data for ev in dec.close())
    return out


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"], ids=["LF", "CRLF", "CR"])
def test_feed_data_agrees_with_feed_on_every_split(eol: str) -> None:
    data = stream(eol)
    want = [e.data for e in EXPECTED]
    n = len(data)
    assert decode_data([data]) == want
    for i in range(n + 1):
        assert decode_data([data[:i], data[i:]]) == want, f"1-cut at {i}"
    bad = [(i, j) for i, j in itertools.combinations(range(1, n), 2)
           if decode_data([data[:i], data[i:j], data[j:]]) != want]
    assert not bad, f"{len(bad)} 2-cut splits differ, e.g. {bad[:5]}"


def test_feed_data_fast_path_edge_cases() -> None:
    cases = [
        b"data:x\n\ndata: y\n\n",
        b"event: ping\n\ndata: a\n\n",
        b": keep-alive\n\ndata: a\n\n",
        b"data: a\ndata: b\n\ndata\n\n",
        b"\ndata: a\n\n\n\ndata: b\n\n",
        b"id: 1\ndata: a\n\ndata: [DONE]\n\n",
        b"data: partial",
    ]
    for raw in cases:
        assert decode_data([raw]) == [e.data for e in decode([raw])], raw


def test_byte_by_byte_with_mixed_line_endings() -> None:
    data = b"data: a\r\ndata: b\r\rdata: c\n\ndata: d\r\n\r\n"
    got = decode([bytes([b]) for b in data])
    assert got == [SSEEvent(b"a\nb"), SSEEvent(b"c"), SSEEvent(b"d")]


def test_cr_at_chunk_end_then_lf_is_one_line_ending() -> None:
    """``\\r`` | ``\\n`` across chunks is one CRLF; treating it as two endings would dispatch early."""
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"\ndata: b\r\n\r") == []
    assert dec.feed(b"\n") == [SSEEvent(b"a\nb")]
    assert not dec.pending


def test_bare_cr_at_chunk_end_followed_by_more_data() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\r") == []
    assert dec.feed(b"data: b\r") == []  # the held \r was a line end on its own
    assert dec.feed(b"\r") == []  # may still be the first half of \r\n
    assert dec.feed(b"x") == [SSEEvent(b"a\nb")]  # ...it was not: blank line, dispatch
    assert dec.close() == []  # "x" is a line with an unknown field, not an event


def test_utf8_split_between_every_byte() -> None:
    text = "€𝄞é日本"  # 3, 4, 2, 3, 3 bytes
    data = ("data: " + text + "\n\n").encode()
    for i in range(len(data) + 1):
        got = decode([data[:i], data[i:]])
        assert got == [SSEEvent(text.encode())]
        assert got[0].data.decode("utf-8") == text


def test_invalid_utf8_is_kept_as_bytes() -> None:
    """The decoder does not repair bytes: the client reports invalid UTF-8 instead of hiding it."""
    assert decode([b"data: \xff\xfe ok\n\n"]) == [SSEEvent(b"\xff\xfe ok")]


def test_comments_and_unknown_fields_are_ignored() -> None:
    data = b":hello\n: keep-alive\nretry: 1000\nfoo: bar\ndata: x\n:mid-event comment\n\n"
    assert decode([data]) == [SSEEvent(b"x")]


def test_field_parsing_rules() -> None:
    # no space after the colon; only one leading space is removed; a bare field name is empty data
    assert decode([b"data:x\n\n"]) == [SSEEvent(b"x")]
    assert decode([b"data:  two spaces\n\n"]) == [SSEEvent(b" two spaces")]
    assert decode([b"data\n\n"]) == [SSEEvent(b"")]
    assert decode([b"data: a:b: c\n\n"]) == [SSEEvent(b"a:b: c")]


def test_multi_line_data_and_empty_data_lines() -> None:
    assert decode([b"data: one\ndata:\ndata: three\n\n"]) == [SSEEvent(b"one\n\nthree")]


def test_event_without_data_is_not_dispatched() -> None:
    """WHATWG: a blank line with an empty data buffer dispatches nothing and resets the type.
    (A server's ``event: ping`` keep-alive must not become an empty, unparsable event.)"""
    assert decode([b"event: ping\n\n"]) == []
    assert decode([b"event: ping\n\ndata: x\n\n"]) == [SSEEvent(b"x")]  # type reset, not carried over
    assert decode([b"\n\n\n"]) == []


def test_close_dispatches_an_unterminated_last_event() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: [DONE]") == []
    assert dec.pending
    assert dec.close() == [SSEEvent(b"[DONE]")]
    assert not dec.pending
    assert dec.close() == []  # idempotent


def test_close_with_data_line_ended_but_no_blank_line() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\ndata: b\n") == []
    assert dec.close() == [SSEEvent(b"a\nb")]


def test_close_with_held_carriage_return() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: last\r") == []
    assert dec.close() == [SSEEvent(b"last")]


def test_close_on_clean_end_returns_nothing() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: x\n\n") == [SSEEvent(b"x")]
    assert not dec.pending
    assert dec.close() == []


def test_close_of_a_comment_only_tail_returns_nothing() -> None:
    dec = SSEDecoder()
    dec.feed(b"data: x\n\n: bye")
    assert dec.close() == []


def test_decoder_is_reusable_after_close() -> None:
    dec = SSEDecoder()
    dec.feed(b"data: partial")
    dec.close()
    assert dec.feed(b"data: next\n\n") == [SSEEvent(b"next")]


@pytest.mark.parametrize("chunk", [
    b"data: " + b"x" * 100,  # an unterminated tail
    b"data: " + b"x" * 100 + b"\n\n",  # a whole line in one chunk (the fast path)
    b"data: ok\n\n: " + b"c" * 100 + b"\n\ndata: ok\n\n",  # a whole line among others
    b"".join(b"data: %s\n" % (b"y" * 20) for _ in range(4)) + b"\n",  # many data lines of one event
])
def test_oversized_line_or_event_is_refused(chunk: bytes) -> None:
    with pytest.raises(SSETooLarge, match="longer than 64 bytes"):
        SSEDecoder(max_event_bytes=64).feed(chunk)
    with pytest.raises(SSETooLarge, match="longer than 64 bytes"):
        SSEDecoder(max_event_bytes=64).feed_data(chunk)


def test_events_up_to_the_limit_pass() -> None:
    dec = SSEDecoder(max_event_bytes=64)
    assert dec.feed_data(b"data: " + b"x" * 58 + b"\n\n") == [b"x" * 58]
    assert dec.feed_data(b"data: " + b"x" * 20 + b"\ndata: " + b"y" * 20 + b"\n\n") == [b"x" * 20 + b"\n" + b"y" * 20]


def test_many_events_in_one_chunk_keep_order() -> None:
    data = b"".join(b"data: %d\n\n" % i for i in range(500))
    assert [e.data for e in decode([data])] == [str(i).encode() for i in range(500)]
