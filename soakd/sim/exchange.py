"""One completion request being served by the simulator: admission, the modelled time to the
first token and between tokens, faults, the streamed or whole response."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from soakd.sim.model import FaultPlan, SimRequest
from soakd.sim.protocol import ParsedRequest
from soakd.sim.state import (
    CHAT_EMPTY_LAST,
    CHAT_POST,
    CHAT_POST_LAST,
    CHAT_PRE,
    CHAT_ROLE,
    CMPL_EMPTY_LAST,
    CMPL_POST,
    CMPL_POST_LAST,
    CMPL_PRE,
    DONE,
    SSE_HEADERS,
    SimState,
)
from soakd.sim.text import (
    CODE,
    GARBLED,
    PROSE,
    output_offset,
)

# ---------------------------------------------------------------------------- generation


class Exchange:
    """One completion request being served."""

    __slots__ = (
        "created", "head", "loop", "model", "p", "plan", "reason", "req", "request", "rid",
        "st", "t_arrival", "t_done", "t_first", "t_first_ns", "t_last", "texts", "tjson",
    )  # fmt: skip

    def __init__(self, request: web.Request, st: SimState, p: ParsedRequest, plan: FaultPlan) -> None:
        self.request = request
        self.st = st
        self.model = st.model
        self.loop = asyncio.get_running_loop()
        self.p = p
        self.plan = plan
        # the client's X-Request-Id when it sends one (vLLM takes it as the request id too), echoed back
        given = request.headers.get("X-Request-Id", "")
        self.rid = given[:256] if given else ("chatcmpl-" if p.chat else "cmpl-") + st.next_id()
        self.created = int(time.time())
        self.reason = "abort"
        self.t_arrival = self.loop.time()
        self.t_first: float | None = None
        self.t_first_ns: int | None = None
        self.t_last = 0.0
        self.t_done: float | None = None
        n = 0 if plan.empty else p.max_tokens
        if plan.garbled:
            corpus, offset = GARBLED, 0
        else:
            corpus = CODE if p.code else PROSE
            if p.deterministic:
                variant = 1 if self.model.output_changed() else 0
                offset = output_offset(p.prompt_text, p.seed, corpus.size, variant)
            else:
                offset = self.model.text_rng.randrange(corpus.size)
        self.texts, self.tjson = corpus.take(offset, n)
        self.req: SimRequest = self.model.new_request(self.rid, p.prompt_tokens, p.max_tokens, p.prompt_text)
        obj = b"chat.completion.chunk" if p.chat else b"text_completion"
        self.head = (
            b'data: {"id":"' + self.rid.encode() + b'","object":"' + obj + b'","created":'
            + str(self.created).encode() + b',"model":' + st.model_json + b',"choices":[{"index":0,'
        )  # fmt: skip

    # -- helpers

    def _mark_emitted(self, generated: int, pending: int) -> None:
        """Bookkeeping after *pending* tokens reached the wire (total *generated*)."""
        now = self.loop.time()
        if pending:
            if self.t_first is None:
                self.t_first = now
                self.t_first_ns = time.perf_counter_ns()
                if pending > 1:
                    self.model.itl.observe(0.0, pending - 1)
            else:
                self.model.itl.observe(now - self.t_last)
                if pending > 1:
                    self.model.itl.observe(0.0, pending - 1)
            self.t_last = now
        self.model.grow(self.req, generated)

    def _abort_connection(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self.p.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    # -- streaming

    async def open_stream(self) -> web.StreamResponse:
        """Send the SSE response headers at once (as vLLM does), before queueing/prefill."""
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(self.request)
        return resp

    async def stream(self, resp: web.StreamResponse) -> web.StreamResponse:
        try:
            return await self._stream(resp)
        except ConnectionError:  # the client went away; finish() records an abort
            return resp

    async def _stream(self, resp: web.StreamResponse) -> web.StreamResponse:
        loop, model, p, plan = self.loop, self.model, self.p, self.plan
        mult = model.latency_multiplier()
        deadline = loop.time() + model.prefill_seconds(p.prompt_tokens - self.req.cached_tokens, self.req.queued_ahead, mult)
        head, tjson = self.head, self.tjson
        n = len(tjson)
        if p.chat:
            pre, post, post_last = CHAT_PRE, CHAT_POST, CHAT_POST_LAST
        else:
            pre, post, post_last = CMPL_PRE, CMPL_POST, CMPL_POST_LAST
        stall_at = plan.stall_at if plan.stall_at is not None else -1
        truncate_at = plan.truncate_at if plan.truncate_at is not None else -1
        malformed_at = plan.malformed_at if plan.malformed_at is not None else -1
        stall = model.config.faults.stall_duration
        buf: list[bytes] = []
        pending = 0
        for i in range(n):
            if i:
                deadline += model.tpot_seconds(mult)
            if i == stall_at:
                deadline += stall
            deadline = model.frozen_until(deadline, loop.time())
            delay = deadline - loop.time()
            if delay > 0:
                if buf:
                    await resp.write(b"".join(buf))
                    buf.clear()
                    self._mark_emitted(i, pending)
                    pending = 0
                await asyncio.sleep(delay)
            if i == truncate_at:
                if buf:
                    await resp.write(b"".join(buf))
                    self._mark_emitted(i, pending)
                self._abort_connection()
                return resp
            if i == 0 and p.chat:
                buf.append(head + CHAT_ROLE)
            chunk = head + pre + tjson[i] + (post_last if i == n - 1 else post)
            if i == malformed_at:
                chunk = chunk[: len(chunk) // 2] + b"\n\n"
            buf.append(chunk)
            pending += 1
        if n == 0:
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if p.chat:
                buf.append(head + CHAT_ROLE + head + CHAT_EMPTY_LAST)
            else:
                buf.append(head + CMPL_EMPTY_LAST)
            self.t_first = loop.time()
            self.t_first_ns = time.perf_counter_ns()
        if p.include_usage:
            usage = json.dumps(self._usage(n), separators=(",", ":")).encode()
            buf.append(head[: -len(b'[{"index":0,')] + b'[],"usage":' + usage + b"}\n\n")
        buf.append(DONE)
        await resp.write(b"".join(buf))
        self._mark_emitted(n, pending)
        self.reason = "length" if n else "stop"
        self.t_done = loop.time()
        await resp.write_eof()
        return resp

    # -- non-streaming

    async def respond(self) -> web.StreamResponse:
        loop, model, p, plan = self.loop, self.model, self.p, self.plan
        mult = model.latency_multiplier()
        deadline = loop.time() + model.prefill_seconds(p.prompt_tokens - self.req.cached_tokens, self.req.queued_ahead, mult)
        n = len(self.texts)
        stall = model.config.faults.stall_duration
        if plan.stall_at is not None and (n < 2 or plan.stall_at == 0):
            deadline += stall
        deadline = model.frozen_until(deadline, loop.time())  # the engine freeze holds every request
        await _sleep_until(loop, deadline)
        self.t_first = loop.time()
        self.t_first_ns = time.perf_counter_ns()
        self.t_last = self.t_first
        model.grow(self.req, min(1, n))
        step = max(1, n // 8)  # sleep at most ~8 times; tokens accrue in between
        last_i = 0
        for i in range(1, n):
            deadline += model.tpot_seconds(mult)
            if i == plan.stall_at:
                deadline += stall
            if i == plan.truncate_at:
                await _sleep_until(loop, deadline)
                self._abort_connection()
                return web.Response(status=500)  # never reaches the client
            if i % step == 0 or i == n - 1:
                deadline = model.frozen_until(deadline, loop.time())
                await _sleep_until(loop, deadline)
                now = loop.time()
                model.itl.observe((now - self.t_last) / (i - last_i), i - last_i)
                self.t_last, last_i = now, i
                model.grow(self.req, i + 1)
        if plan.truncate_at is not None and n < 2:
            self._abort_connection()
            return web.Response(status=500)
        text = "".join(self.texts)
        finish = "length" if n else "stop"
        if p.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            obj = "text_completion"
        body = json.dumps(
            {
                "id": self.rid,
                "object": obj,
                "created": self.created,
                "model": model.config.model,
                "choices": [choice],
                "usage": self._usage(n),
            }
        ).encode()
        if plan.malformed_at is not None:
            body = body[: len(body) // 2]
        self.reason = finish
        self.t_done = loop.time()
        return web.Response(body=body, content_type="application/json", headers={"X-Request-Id": self.rid})


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    delay = deadline - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
