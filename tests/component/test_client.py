"""The OpenAI-compatible client against the simulator's configured truth and its faults: timings,
usage, and every outcome class produced by the fault that should produce it."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

import soakd

from soakd.client.openai import OpenAIClient
from soakd.core.records import Outcome, RequestRecord
from soakd.config import TargetConfig
from soakd.sim import count_chat_tokens, count_tokens
from soakd.config.sim import SimFaults
from helpers import FAST_SIM, LoopLag, free_port, serving, sim_server, wait_until

pytestmark = pytest.mark.timeout(30)

MESSAGES = [{"role": "user", "content": "Describe a long river in a few words, please."}]
TRUTH = {"ttft_base": 0.050, "tpot_base": 0.005, "tpot_per_batch": 0, "ttft_per_prompt_token": 0, "jitter": 0}


def chat_body(max_tokens: int = 16, stream: bool = True, usage: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "soakd-sim", "messages": MESSAGES, "max_tokens": max_tokens, **extra}
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    return body


async def execute(url: str, body: dict[str, Any], endpoint: str = "chat", api_key: str | None = None,
                  structure_check: str = "none", **target: Any) -> RequestRecord:
    client = OpenAIClient(TargetConfig(url=url, **target), api_key)
    rec = RequestRecord("test", endpoint, bool(body.get("stream")))
    try:
        result = await client.execute(rec, body, structure_check)
    finally:
        await client.close()
    assert result is rec
    return rec


# ---- timings and usage against the simulator's truth -----------------------------------------------


async def test_streaming_timings_match_the_simulator() -> None:
    """Simulator truth: TTFT 50 ms, 5 ms per further token, no jitter, 64 tokens, on absolute deadlines from
    when the request was admitted (lateness does not add up).

    Every token the client times is at or after its schedule from the client's own start (the client starts
    its clock before the server does), and late by at most 15 ms (loopback, connection set-up) plus what
    this process's loop was held up (``LoopLag``: on a busy machine a token due during a stall is read with
    the ones after it); the median TTFT over 5 requests <= 50 + 15 ms, on the same terms."""
    n = 64
    async with sim_server(**TRUTH) as sim, LoopLag() as lag:
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        recs = []
        try:
            for _ in range(5):
                rec = RequestRecord("test")
                await client.execute(rec, chat_body(n))
                recs.append(rec)
        finally:
            await client.close()
    for rec in recs:
        assert rec.ok, rec
        assert rec.ttft_seconds is not None and rec.ttft_seconds >= 0.050
        assert len(rec.token_times_ns) == n  # one content event per token
        late = [(t - rec.t_start_ns) / 1e9 - (0.050 + i * 0.005) for i, t in enumerate(rec.token_times_ns)]
        assert all(-0.0005 <= x <= 0.015 + lag.stalled for x in late), (max(late), min(late), lag.stalled)
    assert statistics.median(r.ttft_seconds for r in recs) <= 0.050 + 0.015 + lag.stalled


async def test_usage_is_parsed_from_the_stream() -> None:
    async with sim_server(**FAST_SIM) as sim:
        rec = await execute(sim.base_url, chat_body(24))
    assert rec.ok and rec.usage_from_server
    assert rec.prompt_tokens == count_chat_tokens(MESSAGES)
    assert rec.completion_tokens == 24
    assert rec.finish_reason == "length"
    assert rec.text and count_tokens(rec.text) >= 24 // 2


async def test_fallback_token_count_without_usage() -> None:
    """``include_usage`` off: no usage block; completion tokens are the counted content events and
    the record says the count is not the server's."""
    async with sim_server(**FAST_SIM) as sim:
        rec = await execute(sim.base_url, chat_body(19, usage=False))
    assert rec.ok and not rec.usage_from_server
    assert rec.completion_tokens == 19 == len(rec.token_times_ns)
    assert rec.prompt_tokens == 0


async def test_completions_streaming() -> None:
    body = {"model": "soakd-sim", "prompt": "The capital of France is", "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}}
    async with sim_server(**FAST_SIM) as sim:
        rec = await execute(sim.base_url, body, endpoint="completions")
    assert rec.ok, rec
    assert rec.prompt_tokens == count_tokens("The capital of France is")
    assert rec.completion_tokens == 12 == len(rec.token_times_ns)
    assert rec.text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_non_streaming(endpoint: str) -> None:
    if endpoint == "chat":
        body = chat_body(10, stream=False)
    else:
        body = {"model": "soakd-sim", "prompt": "Once upon a time", "max_tokens": 10}
    async with sim_server(**TRUTH) as sim:
        rec = await execute(sim.base_url, body, endpoint=endpoint)
    assert rec.ok, rec
    assert not rec.stream
    assert rec.text and rec.finish_reason == "length"
    assert rec.usage_from_server and rec.completion_tokens == 10
    assert rec.prompt_tokens == (count_chat_tokens(MESSAGES) if endpoint == "chat" else count_tokens("Once upon a time"))
    assert rec.token_times_ns == [rec.t_end_ns]  # the whole body is the first "token"
    assert rec.e2e_seconds >= 0.050 + 9 * 0.005


# ---- outcome classes from simulator faults -----------------------------------------------------------


@pytest.mark.parametrize(
    ("faults", "stream", "outcome", "reason"),
    [
        ({"error_rate_500": 1.0}, True, Outcome.HTTP_ERROR, "http_500"),
        ({"error_rate_500": 1.0}, False, Outcome.HTTP_ERROR, "http_500"),
        ({"error_rate_429": 1.0}, True, Outcome.HTTP_ERROR, "http_429"),
        ({"malformed_rate": 1.0}, True, Outcome.INVALID_RESPONSE, "malformed_chunk"),
        ({"malformed_rate": 1.0}, False, Outcome.INVALID_RESPONSE, "malformed_body"),
        # a stream cut by the connection closing mid-body: the server went away mid-response
        ({"truncate_rate": 1.0}, True, Outcome.CONNECTION_ERROR, "disconnected"),
        # a non-streamed body cut before its headers: the server hung up on the request
        ({"truncate_rate": 1.0}, False, Outcome.CONNECTION_ERROR, "server_disconnected"),
        ({"garbled_rate": 1.0}, True, Outcome.INVALID_RESPONSE, "garbled_output"),
        ({"garbled_rate": 1.0}, False, Outcome.INVALID_RESPONSE, "garbled_output"),
        ({"empty_rate": 1.0}, True, Outcome.INVALID_RESPONSE, "empty_output"),
        ({"empty_rate": 1.0}, False, Outcome.INVALID_RESPONSE, "empty_output"),
    ],
)
async def test_fault_gives_outcome(faults: dict[str, float], stream: bool, outcome: Outcome, reason: str) -> None:
    async with sim_server(faults=SimFaults(**faults), **FAST_SIM) as sim:
        rec = await execute(sim.base_url, chat_body(32, stream=stream))
    assert (rec.outcome, rec.reason) == (outcome, reason), rec
    assert rec.t_end_ns >= rec.t_start_ns > 0
    if outcome is Outcome.HTTP_ERROR:
        assert rec.http_status == int(reason[5:]) and "simulated fault" in rec.error


async def test_garbled_output_is_ok_when_replacement_chars_are_allowed() -> None:
    """Random-weight models emit U+FFFD legitimately: validation.replacement_chars off accepts them."""
    async with sim_server(faults=SimFaults(garbled_rate=1.0), **FAST_SIM) as sim:
        rec = await execute(sim.base_url, chat_body(32), validation={"replacement_chars": False})
        assert rec.ok, rec
        assert "\ufffd" in rec.text
        # the same garbage at length trips the repetition check unless that is off too
        long = await execute(sim.base_url, chat_body(200), validation={"replacement_chars": False})
        assert (long.outcome, long.reason) == (Outcome.INVALID_RESPONSE, "degenerate_repetition")
        off = await execute(sim.base_url, chat_body(200), validation={"replacement_chars": False, "max_repeats": 0})
        assert off.ok, off


async def test_stall_longer_than_idle_timeout() -> None:
    faults = SimFaults(stall_rate=1.0, stall_duration=3.0)
    async with sim_server(faults=faults, **FAST_SIM) as sim:
        rec = await execute(sim.base_url, chat_body(32), timeouts={"idle": 0.3})
    assert (rec.outcome, rec.reason) == (Outcome.TIMEOUT, "idle_timeout"), rec
    assert rec.http_status == 200 and rec.token_times_ns  # it had started streaming
    assert 0.3 <= rec.e2e_seconds < 2.7  # the timeout, not the 3 s stall's end (room for a busy machine)


async def test_stall_shorter_than_idle_timeout_is_ok() -> None:
    faults = SimFaults(stall_rate=1.0, stall_duration=0.2)
    async with sim_server(faults=faults, **FAST_SIM) as sim:
        rec = await execute(sim.base_url, chat_body(32), timeouts={"idle": 1.0})
    assert rec.ok, rec
    # the server sleeps 0.2 s between two tokens: the request lasts that long, and the stall is the
    # stream's one long gap. The gap itself can read a little short: on a busy machine the client may read
    # the token before the stall late (it read 0.193 s beside another test suite), never the one after early
    assert rec.e2e_seconds >= 0.2, rec
    assert max(rec.gaps_seconds()) >= 0.1, rec.gaps_seconds()


async def test_first_token_timeout() -> None:
    async with sim_server(**dict(TRUTH, ttft_base=2.0)) as sim:
        streamed = await execute(sim.base_url, chat_body(8), timeouts={"first_token": 0.2})
        plain = await execute(sim.base_url, chat_body(8, stream=False), timeouts={"first_token": 0.2})
        total = await execute(sim.base_url, chat_body(8), timeouts={"total": 0.2})
    assert (streamed.outcome, streamed.reason) == (Outcome.TIMEOUT, "first_token_timeout"), streamed
    # a non-streamed request gets no headers until the body is ready
    assert (plain.outcome, plain.reason) == (Outcome.TIMEOUT, "response_timeout"), plain
    assert (total.outcome, total.reason) == (Outcome.TIMEOUT, "total_timeout"), total
    for rec in (streamed, plain, total):
        assert 0.2 <= rec.e2e_seconds < 1.8, rec  # the deadline fired, not the server's answer at 2 s


async def test_total_timeout_caps_a_healthy_stream() -> None:
    async with sim_server(**dict(TRUTH, tpot_base=0.02)) as sim:
        rec = await execute(sim.base_url, chat_body(100), timeouts={"total": 0.4, "idle": 5})
    assert (rec.outcome, rec.reason) == (Outcome.TIMEOUT, "total_timeout"), rec
    assert rec.token_times_ns and 0.4 <= rec.e2e_seconds < 1.8  # not the stream's end at 2 s


async def test_dead_port_is_a_connection_error() -> None:
    rec = await execute(f"http://127.0.0.1:{free_port()}/v1", chat_body())
    assert (rec.outcome, rec.reason) == (Outcome.CONNECTION_ERROR, "connect_failed"), rec
    assert rec.http_status == 0 and "Connect" in rec.error


async def test_simulator_restart() -> None:
    """One client (one connection pool) across a restart: the stream in flight when the server
    goes down is cut (connection_error/disconnected: the connection closed mid-response), requests
    during the downtime are connection errors, and afterwards it works again."""
    faults = SimFaults(restart_after=0.6, restart_downtime=0.6)
    async with sim_server(faults=faults, **dict(TRUTH, ttft_base=0.0, tpot_base=0.01)) as sim:
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        try:
            before = RequestRecord("test")
            await client.execute(before, chat_body(4))
            assert before.ok, before
            cut = RequestRecord("test")
            in_flight = asyncio.create_task(client.execute(cut, chat_body(300)))  # ~3 s of stream
            await wait_until(lambda: not sim.is_up, timeout=5, what="the simulator going down")
            down = RequestRecord("test")
            await client.execute(down, chat_body(4))
            await in_flight
            await wait_until(lambda: sim.restarts == 1 and sim.is_up, timeout=5, what="the simulator back up")
            after = RequestRecord("test")
            await client.execute(after, chat_body(4))
        finally:
            await client.close()
    assert (down.outcome, down.reason) == (Outcome.CONNECTION_ERROR, "connect_failed"), down
    assert cut.outcome in (Outcome.INVALID_RESPONSE, Outcome.CONNECTION_ERROR), cut
    assert cut.reason in ("truncated_stream", "disconnected", "server_disconnected", "connection_reset"), cut
    assert after.ok, after


async def test_cancel_mid_stream() -> None:
    async with sim_server(**TRUTH) as sim:
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        rec = RequestRecord("test")
        task = asyncio.create_task(client.execute(rec, chat_body(200)))
        try:
            await wait_until(lambda: len(rec.token_times_ns) >= 3, timeout=5, what="a few tokens")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await client.close()
    assert (rec.outcome, rec.reason) == (Outcome.CANCELLED, "cancelled")
    assert rec.t_end_ns > rec.token_times_ns[-1] > rec.t_start_ns


async def test_cancel_before_headers() -> None:
    async with sim_server(**dict(TRUTH, ttft_base=1.0)) as sim:
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        rec = RequestRecord("test", stream=False)
        task = asyncio.create_task(client.execute(rec, chat_body(4, stream=False)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()
    assert rec.outcome is Outcome.CANCELLED and not rec.token_times_ns


# ---- authentication ---------------------------------------------------------------------------------


async def test_api_key_is_sent_as_bearer() -> None:
    async with sim_server(api_key="sk-right", **FAST_SIM) as sim:
        good = await execute(sim.base_url, chat_body(4), api_key="sk-right")
        wrong = await execute(sim.base_url, chat_body(4), api_key="sk-wrong")
        missing = await execute(sim.base_url, chat_body(4))
        client = OpenAIClient(TargetConfig(url=sim.base_url), "sk-right")
        try:
            assert await client.list_models() == ["soakd-sim"]
        finally:
            await client.close()
        client = OpenAIClient(TargetConfig(url=sim.base_url), "sk-wrong")
        try:
            with pytest.raises(RuntimeError, match="HTTP 401"):
                await client.list_models()
        finally:
            await client.close()
    assert good.ok, good
    for rec in (wrong, missing):
        assert (rec.outcome, rec.reason, rec.http_status) == (Outcome.HTTP_ERROR, "http_401", 401), rec
        assert "API key" in rec.error and "sk-" not in rec.error


async def test_extra_headers_are_sent() -> None:
    seen: dict[str, str] = {}

    async def handler(request: web.Request) -> web.Response:
        seen.update(request.headers)
        return web.json_response({"choices": [{"message": {"content": "hi there"}, "finish_reason": "stop"}]})

    async with serve(handler) as url:
        rec = await execute(url, chat_body(stream=False), headers={"X-Team": "qa"})
    assert rec.ok and seen.get("X-Team") == "qa"
    assert not rec.usage_from_server and rec.completion_tokens == 2  # fallback: words of the body
    assert seen.get("User-Agent") == f"soakd/{soakd.__version__}"  # what the server's access log names

    seen.clear()  # a User-Agent among the target's headers (in any case) is the one sent, alone
    async with serve(handler) as url:
        rec = await execute(url, chat_body(stream=False), headers={"user-agent": "team-canary/2"})
    assert rec.ok and seen.get("User-Agent") == "team-canary/2"


# ---- wire-format edge cases from a hand-written server ------------------------------------------------


@asynccontextmanager
async def serve(handler: Any) -> AsyncIterator[str]:
    """``handler`` as the chat completions endpoint of a hand-written server: yields its /v1 URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}/v1"


def sse_handler(*chunks: bytes) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
        await resp.write_eof()
        return resp

    return handler


def delta(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"' + text.encode() + b'"}}]}\n\n'


@pytest.mark.parametrize(
    ("chunks", "outcome", "reason"),
    [
        ((delta("Hello"), b"event: ping\n\n", b": keep-alive\n\n", delta(" world"), b"data: [DONE]\n\n"),
         Outcome.OK, ""),
        ((delta("Hello"), b"data: [DONE]"), Outcome.OK, ""),  # last event without its blank line
        ((delta("Hello"), delta(" world")), Outcome.INVALID_RESPONSE, "truncated_stream"),  # clean close, no [DONE]
        ((delta("Hello"), b'data: {"error": {"message": "engine died"}}\n\n'),
         Outcome.INVALID_RESPONSE, "error_in_stream"),
        ((delta("Hello"), b"data: [1, 2]\n\n", b"data: [DONE]\n\n"), Outcome.INVALID_RESPONSE, "malformed_chunk"),
        # nested past the JSON parser's depth (RecursionError in json.loads): garbage, not a client exception
        ((delta("Hello"), b"data: " + b"[" * 100_000 + b"\n\n", b"data: [DONE]\n\n"), Outcome.INVALID_RESPONSE,
         "malformed_chunk"),
        ((b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n', b"data: [DONE]\n\n"),
         Outcome.INVALID_RESPONSE, "invalid_utf8"),
        ((b"data: [DONE]\n\n",), Outcome.INVALID_RESPONSE, "empty_output"),
        # what orjson refuses and json.loads takes (NaN): the standard library's answer, as json.loads would give
        ((delta("Hello"), b'data: {"choices":[{"index":0,"delta":{"content":" world"}}],"x": NaN}\n\n',
          b"data: [DONE]\n\n"), Outcome.OK, ""),
        ((delta("loop " * 40), b"data: [DONE]\n\n"), Outcome.INVALID_RESPONSE, "degenerate_repetition"),
        # a reasoning model streams reasoning before content: that is the first token too
        ((b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"Let me think"}}]}\n\n', delta(" ok"),
          b"data: [DONE]\n\n"), Outcome.OK, ""),
    ],
)
async def test_stream_edge_cases(chunks: tuple[bytes, ...], outcome: Outcome, reason: str) -> None:
    async with serve(sse_handler(*chunks)) as url:
        rec = await execute(url, chat_body())
    assert (rec.outcome, rec.reason) == (outcome, reason), rec


async def test_an_oversized_sse_line_is_response_too_large() -> None:
    """17 MiB without a line break after a first token (a server streaming garbage, a proxy's
    page): a response error, not a client exception."""
    async with serve(sse_handler(delta("Hello"), b"data: " + b"x" * (17 << 20), b"\n\ndata: [DONE]\n\n")) as url:
        rec = await execute(url, chat_body())
    assert (rec.outcome, rec.reason) == (Outcome.INVALID_RESPONSE, "response_too_large"), rec
    assert "longer than 16777216 bytes" in rec.error


async def test_keep_alive_comments_are_no_progress_for_the_idle_timeout() -> None:
    """After its first token the server sends only SSE comments (a stalled engine behind a
    front end that pings): the idle timeout ends the request, not the total one."""
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(delta("Hello"))
        for _ in range(200):  # 20 s of pings, bounded: the test's request gives up long before
            await asyncio.sleep(0.1)
            await resp.write(b": ping\n\n")
        await resp.write_eof()
        return resp

    async with serve(handler) as url:
        rec = await execute(url, chat_body(), timeouts={"idle": 0.5, "total": 20})
    assert (rec.outcome, rec.reason) == (Outcome.TIMEOUT, "idle_timeout"), rec
    assert rec.e2e_seconds < 15, rec  # the idle timeout, far from the total one (not a timing claim)


async def test_server_that_ignores_stream_true() -> None:
    """A server answering a streamed request with one JSON body is measured as non-streamed."""

    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": "whole answer"}, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})

    async with serve(handler) as url:
        rec = await execute(url, chat_body())
    assert rec.ok and rec.text == "whole answer" and rec.completion_tokens == 2 and len(rec.token_times_ns) == 1


@pytest.mark.parametrize(("kind", "text", "ok"), [
    ("brackets", "def f(x): return [x, {1: (2)}]", True),
    ("brackets", "def f(x): return [x, {1: (2]}", False),
    ("fenced_block", "```python\nprint(1)\n```", True),
    ("fenced_block", "print(1)", False),
])
async def test_structure_check(kind: str, text: str, ok: bool) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": text}, "finish_reason": "stop"}]})

    async with serve(handler) as url:
        rec = await execute(url, chat_body(stream=False), structure_check=kind)
    assert rec.ok is ok, rec


def test_target_up_survives_dropped_connections_but_not_failed_connects() -> None:
    """A connection error while the target answers others (a reused keep-alive connection the
    server closed) is counted but leaves soakd_target_up at 1; a failed connect, or connection
    errors after 5 s without any answer, take it down (llama.cpp's llama-server, tests/e2e)."""
    from soakd.core.timeline import Timeline
    from soakd.metrics import SoakMetrics
    from soakd.soak.recorder import Recorder
    from soakd.soak.windows import WindowSet

    rec_ = Recorder(SoakMetrics(("a",)), WindowSet(Timeline(0.0, 0.0, 60.0, 600.0)))
    changes: list[bool] = []
    dropped: list[str] = []
    rec_.on_target_change(changes.append)
    rec_.on_connection_dropped(lambda r: dropped.append(r.reason))
    rec_.set_target_up(True)

    def finish(at_s: float, outcome: Outcome = Outcome.OK, reason: str = "", status: int = 200) -> None:
        r = RequestRecord("a")
        r.window = 0
        r.t_start_ns = r.t_end_ns = int(at_s * 1e9)
        r.http_status = status
        if outcome is not Outcome.OK:
            r.fail(outcome, reason)
        rec_.started(r)
        rec_.finished(r)

    finish(1.0)
    finish(1.1, Outcome.CONNECTION_ERROR, "server_disconnected", status=0)
    finish(1.2, Outcome.CONNECTION_ERROR, "server_disconnected", status=0)
    finish(2.0, Outcome.CONNECTION_ERROR, "disconnected")
    assert rec_.metrics.target_up.value == 1.0 and changes == [True]
    assert rec_.connections_dropped_while_up == 3 and dropped == ["server_disconnected"]  # said once
    finish(2.1, Outcome.CONNECTION_ERROR, "connect_failed", status=0)
    assert rec_.metrics.target_up.value == 0.0 and changes == [True, False]
    finish(3.0)
    assert rec_.metrics.target_up.value == 1.0
    finish(9.0, Outcome.CONNECTION_ERROR, "server_disconnected", status=0)  # nothing answered for 6 s
    assert rec_.metrics.target_up.value == 0.0 and changes == [True, False, True, False]


async def test_keep_alive_connection_closed_by_the_server_is_server_disconnected() -> None:
    """A server that closes the connection after each streamed response without `Connection:
    close` (llama.cpp's llama-server): the next request on the pooled connection fails with
    server_disconnected, and a fresh connection (keep_alive false) does not."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(delta("Hello") + b"data: [DONE]\n\n")
        await resp.write_eof()
        assert request.transport is not None
        request.transport.close()  # after the response, like llama-server
        return resp

    async with serve(handler) as url:
        for keep_alive in (True, False):
            client = OpenAIClient(TargetConfig(url=url, keep_alive=keep_alive),
                                  pool_size=1)  # fmt: skip
            recs = []
            try:
                for _ in range(4):
                    recs.append(await client.execute(RequestRecord("test"), chat_body(4)))
            finally:
                await client.close()
            reasons = [(r.outcome, r.reason) for r in recs]
            if keep_alive:
                assert (Outcome.OK, "") in reasons and (Outcome.CONNECTION_ERROR, "server_disconnected") in reasons, reasons
                assert all(r in ((Outcome.OK, ""), (Outcome.CONNECTION_ERROR, "server_disconnected")) for r in reasons)
            else:
                assert reasons == [(Outcome.OK, "")] * 4, reasons
