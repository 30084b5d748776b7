"""The simulated vLLM-like OpenAI-compatible server (aiohttp).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``
(``stream`` true/false, ``stream_options.include_usage``), ``GET /metrics`` (vLLM V1 metric
names), ``GET /dcgm/metrics`` (the simulated GPUs as dcgm-exporter shows them, see
:mod:`soakd.sim.device`), ``GET /health``, ``GET /version``.

Wire format follows vLLM's OpenAI server: the first chat chunk carries
``delta.role="assistant"`` (with empty content) and is sent together with the first token;
the last content chunk carries ``finish_reason``; with ``include_usage`` a final chunk has
``choices: []`` and ``usage``; then ``data: [DONE]``.

Outputs are always exactly ``max_tokens`` (or ``max_completion_tokens``) tokens with
``finish_reason: "length"`` (``ignore_eos``/``min_tokens`` are accepted and change nothing),
except under the ``empty`` fault (0 tokens, ``"stop"``). With ``temperature: 0`` or a
request ``seed`` the output is a function of the prompt (and seed) only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import itertools
import json
import secrets
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from soakd import __version__
from soakd.config.sim import SimConfig
from soakd.sim.device import SimDevice, dcgm_exposition
from soakd.sim.model import FaultPlan, SimCollector, SimModel, SimRequest
from soakd.sim.text import (
    CODE,
    GARBLED,
    PROSE,
    chat_prompt_text,
    count_chat_tokens,
    count_tokens,
    looks_like_code,
    message_text,
    output_offset,
)

__all__ = [
    "SIM_STATE",
    "SimServer",
    "SimState",
    "add_sim_arguments",
    "build_app",
    "serve_forever",
    "sim_config_from_args",
]

log = structlog.get_logger("soakd.sim")

RECENT_MAXLEN = 10_000
RecentEntry = tuple[str, int, "int | None", int]
"""``(request_id, t_received_ns, t_first_token_ns, t_done_ns)``, all ``perf_counter_ns``."""

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"
_CHAT_ROLE = (
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
)
_CHAT_PRE = b'"delta":{"content":'
_CHAT_POST = b'},"logprobs":null,"finish_reason":null}]}\n\n'
_CHAT_POST_LAST = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
_CHAT_EMPTY_LAST = b'"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n'
_CMPL_PRE = b'"text":'
_CMPL_POST = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
_CMPL_POST_LAST = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
_CMPL_EMPTY_LAST = b'"text":"","logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n'


class SimState:
    """Per-application state: one incarnation of the simulated engine."""

    def __init__(
        self,
        config: SimConfig,
        *,
        recent: deque[RecentEntry] | None = None,
        clock: Callable[[], float] | None = None,
        device: SimDevice | None = None,
    ) -> None:
        self.config = config
        self.model = SimModel(config, clock=clock or time.monotonic)
        # the GPU(s) outlive a simulated restart: SimServer passes its own; alone, one per app
        self.device = device or SimDevice(config, lambda: self.model, clock=clock or time.monotonic)
        self.model.device = self.device
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SimCollector(lambda: self.model, config.model))
        self.recent: deque[RecentEntry] = (
            recent if recent is not None else deque(maxlen=RECENT_MAXLEN)
        )
        self.tasks: set[asyncio.Task[Any]] = set()
        self.api_key = config.api_key.get_secret_value() if config.api_key is not None else None
        self.model_json = json.dumps(config.model).encode()
        self.created = int(time.time())
        self._id_prefix = secrets.token_hex(12)
        self._ids = itertools.count(1)

    def next_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):08x}"


SIM_STATE = web.AppKey("soakd_sim_state", SimState)


# ---------------------------------------------------------------------------- errors


def error_response(
    status: int,
    message: str,
    err_type: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _bad_request(message: str, param: str | None = None) -> web.Response:
    return error_response(400, message, "invalid_request_error", param=param)


class _Invalid(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _opt_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"'{name}' must be an integer, got {value!r}", name)
    if value < minimum:
        raise _Invalid(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _Invalid(f"'{name}' must be a boolean, got {value!r}", name)


class _Parsed:
    __slots__ = (
        "chat", "code", "deterministic", "include_usage", "max_tokens", "model", "prompt_text",
        "prompt_tokens", "seed", "stream",
    )  # fmt: skip


def _parse(body: dict[str, Any], chat: bool, cfg: SimConfig) -> _Parsed:
    p = _Parsed()
    p.chat = chat
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _Invalid("'model' must be a string", "model")
    p.model = model
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _Invalid("'messages' is required and must be a non-empty list", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _Invalid(f"messages[{i}] must be an object with a string 'role'", "messages")
            try:
                message_text(message.get("content"))
            except TypeError as exc:
                raise _Invalid(f"messages[{i}]: {exc}", "messages") from None
        p.prompt_tokens = count_chat_tokens(messages)
        p.prompt_text = chat_prompt_text(messages)
        last = message_text(messages[-1].get("content"))
        p.code = looks_like_code(last)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            p.prompt_tokens = count_tokens(prompt)
            p.prompt_text = prompt
            p.code = looks_like_code(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            p.prompt_tokens = len(prompt)
            p.prompt_text = ",".join(map(str, prompt))
            p.code = False
        elif prompt is None:
            raise _Invalid("'prompt' is required", "prompt")
        else:
            raise _Invalid(
                "'prompt' must be a string or a list of token ids "
                "(the simulator takes one prompt per request)",
                "prompt",
            )
    p.stream = bool(_opt_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _Invalid("'stream_options' must be an object", "stream_options")
    p.include_usage = bool(_opt_bool(options or {}, "include_usage"))
    max_tokens = _opt_int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    _opt_int(body, "min_tokens", 0)
    _opt_bool(body, "ignore_eos")
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise _Invalid("the simulator supports n=1 only", "n")
    p.seed = _opt_int(body, "seed", -(2**63))
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or temperature < 0
    ):
        raise _Invalid("'temperature' must be a number >= 0", "temperature")
    p.deterministic = temperature == 0 or p.seed is not None
    room = cfg.max_model_len - p.prompt_tokens
    if max_tokens is None:
        max_tokens = min(cfg.default_max_tokens, room)
    if max_tokens < 1 or max_tokens > room:
        raise _Invalid(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
            f"requested {p.prompt_tokens + max(max_tokens, 0)} tokens ({p.prompt_tokens} in the "
            f"messages, {max(max_tokens, 0)} in the completion). Please reduce the length of the "
            "messages or completion.",
            "max_tokens" if room > 0 else ("messages" if chat else "prompt"),
        )
    p.max_tokens = max_tokens
    return p


# ---------------------------------------------------------------------------- generation


class _Exchange:
    """One completion request being served."""

    __slots__ = (
        "created", "head", "loop", "model", "p", "plan", "reason", "req", "request", "rid",
        "st", "t_arrival", "t_done", "t_first", "t_first_ns", "t_last", "texts", "tjson",
    )  # fmt: skip

    def __init__(self, request: web.Request, st: SimState, p: _Parsed, plan: FaultPlan) -> None:
        self.request = request
        self.st = st
        self.model = st.model
        self.loop = asyncio.get_running_loop()
        self.p = p
        self.plan = plan
        self.rid = ("chatcmpl-" if p.chat else "cmpl-") + st.next_id()
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
        self.req: SimRequest = self.model.new_request(self.rid, p.prompt_tokens, p.max_tokens)
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
        resp = web.StreamResponse(headers=_SSE_HEADERS)
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
        deadline = loop.time() + model.prefill_seconds(p.prompt_tokens, self.req.queued_ahead, mult)
        head, tjson = self.head, self.tjson
        n = len(tjson)
        if p.chat:
            pre, post, post_last = _CHAT_PRE, _CHAT_POST, _CHAT_POST_LAST
        else:
            pre, post, post_last = _CMPL_PRE, _CMPL_POST, _CMPL_POST_LAST
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
                buf.append(head + _CHAT_ROLE)
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
                buf.append(head + _CHAT_ROLE + head + _CHAT_EMPTY_LAST)
            else:
                buf.append(head + _CMPL_EMPTY_LAST)
            self.t_first = loop.time()
            self.t_first_ns = time.perf_counter_ns()
        if p.include_usage:
            usage = json.dumps(self._usage(n), separators=(",", ":")).encode()
            buf.append(head[: -len(b'[{"index":0,')] + b'[],"usage":' + usage + b"}\n\n")
        buf.append(_DONE)
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
        deadline = loop.time() + model.prefill_seconds(p.prompt_tokens, self.req.queued_ahead, mult)
        n = len(self.texts)
        stall = model.config.faults.stall_duration
        if plan.stall_at is not None and (n < 2 or plan.stall_at == 0):
            deadline += stall
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
        return web.Response(body=body, content_type="application/json")


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    delay = deadline - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


# ---------------------------------------------------------------------------- handlers


def _check_auth(st: SimState, request: web.Request) -> web.Response | None:
    if st.api_key is None:
        return None
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), st.api_key.encode()
    ):
        return None
    return error_response(
        401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key"
    )


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    st = request.app[SIM_STATE]
    t_received_ns = time.perf_counter_ns()
    denied = _check_auth(st, request)
    if denied is not None:
        return denied
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return _bad_request("The request body is not valid JSON.")
    if not isinstance(body, dict):
        return _bad_request("The request body must be a JSON object.")
    try:
        parsed = _parse(body, chat, st.config)
    except _Invalid as exc:
        return _bad_request(exc.message, exc.param)
    if parsed.model is not None and parsed.model != st.config.model:
        return error_response(
            404,
            f"The model `{parsed.model}` does not exist.",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )
    model = st.model
    plan = model.plan_faults(parsed.max_tokens)
    if plan.status == 500:
        return error_response(
            500, "Internal server error (simulated fault error_rate_500).", "server_error"
        )
    if plan.status == 429:
        return error_response(
            429,
            "Rate limit reached (simulated fault error_rate_429). Please retry after 1 second.",
            "requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    ex = _Exchange(request, st, parsed, plan)
    task = asyncio.current_task()
    if task is not None:
        st.tasks.add(task)
    try:
        if parsed.stream:
            resp = await ex.open_stream()
            await model.admit(ex.req)
            return await ex.stream(resp)
        await model.admit(ex.req)
        return await ex.respond()
    finally:
        if task is not None:
            st.tasks.discard(task)
        ttft = e2e = None
        if ex.t_first is not None:
            ttft = ex.t_first - ex.t_arrival
        if ex.t_done is not None:
            e2e = ex.t_done - ex.t_arrival
        else:
            ex.reason = "abort"
        model.finish(ex.req, ex.reason, ttft=ttft, e2e=e2e)
        st.recent.append((ex.rid, t_received_ns, ex.t_first_ns, time.perf_counter_ns()))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def list_models(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    denied = _check_auth(st, request)
    if denied is not None:
        return denied
    cfg = st.config
    card = {
        "id": cfg.model,
        "object": "model",
        "created": st.created,
        "owned_by": "soakd",
        "root": cfg.model,
        "parent": None,
        "max_model_len": cfg.max_model_len,
        "permission": [],
    }
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    return web.Response(
        body=generate_latest(st.registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
    )


async def dcgm_metrics(request: web.Request) -> web.Response:
    st = request.app[SIM_STATE]
    return web.Response(
        body=dcgm_exposition(st.device).encode(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
    )


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": f"soakd-sim {__version__}"})


def build_app(
    config: SimConfig,
    *,
    recent: deque[RecentEntry] | None = None,
    clock: Callable[[], float] | None = None,
    device: SimDevice | None = None,
) -> web.Application:
    """The simulator as an aiohttp application (state in ``app[SIM_STATE]``)."""
    app = web.Application(client_max_size=64 * 1024**2)
    app[SIM_STATE] = SimState(config, recent=recent, clock=clock, device=device)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/dcgm/metrics", dcgm_metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    return app


# ---------------------------------------------------------------------------- runner


class SimServer:
    """Runs the simulator inside the current event loop; ``async with SimServer(cfg) as sim``.

    ``port`` is the bound port (also with ``port=0``); it is kept across simulated restarts.
    ``recent`` holds the last 10,000 ``(request_id, t_received_ns, t_first_token_ns,
    t_done_ns)`` tuples (``time.perf_counter_ns``) across restarts. ``device`` is the simulated
    GPU(s), created by :meth:`start` and kept across restarts (``/dcgm/metrics``; bind it to the
    fake NVML with ``soakd.sim.fake_pynvml.bind(sim.device)``).
    """

    def __init__(
        self,
        config: SimConfig,
        *,
        clock: Callable[[], float] | None = None,
        recent_maxlen: int = RECENT_MAXLEN,
    ) -> None:
        self.config = config
        self._clock = clock
        self.recent: deque[RecentEntry] = deque(maxlen=recent_maxlen)
        self._port = config.port
        self._app: web.Application | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._started = False
        self._device: SimDevice | None = None
        self.restarts = 0

    # -- properties

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port`` (no path)."""
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://host:port/v1``."""
        return self.url + "/v1"

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    @property
    def dcgm_metrics_url(self) -> str:
        """The simulated GPUs in dcgm-exporter's format."""
        return self.url + "/dcgm/metrics"

    @property
    def device(self) -> SimDevice:
        """The simulated GPU(s) (the same object across simulated restarts)."""
        if self._device is None:
            raise RuntimeError("the simulator has not been started")
        return self._device

    @property
    def app(self) -> web.Application:
        if self._app is None:
            raise RuntimeError("the simulator has not been started")
        return self._app

    @property
    def state(self) -> SimState:
        return self.app[SIM_STATE]

    @property
    def model(self) -> SimModel:
        """The engine state of the current (or last) incarnation."""
        return self.state.model

    @property
    def is_up(self) -> bool:
        return self._site is not None

    # -- lifecycle

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("SimServer.start() called twice")
        self._started = True
        self._device = SimDevice(
            self.config,
            lambda: self._app[SIM_STATE].model if self._app is not None else None,
            clock=self._clock or time.monotonic,
        )
        await self._bring_up()
        if self.config.faults.restart_after is not None:
            self._restart_task = asyncio.create_task(self._restart_loop(), name="soakd-sim-restart")

    async def stop(self) -> None:
        task, self._restart_task = self._restart_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._take_down()

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _bring_up(self) -> None:
        app = build_app(self.config, recent=self.recent, clock=self._clock, device=self._device)
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self._port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self._port = int(address[1])
                break
        self._app, self._runner, self._site = app, runner, site

    async def _take_down(self) -> None:
        """Close the listening socket, drop every connection, discard the app's handlers."""
        runner, site, app = self._runner, self._site, self._app
        self._runner = self._site = None
        if runner is None:
            return
        if site is not None:
            with contextlib.suppress(RuntimeError):
                await site.stop()
        if app is not None:
            st = app[SIM_STATE]
            st.model.abort_all()
            for task in list(st.tasks):
                task.cancel()
        server = runner.server
        if server is not None:
            for conn in server.connections:
                transport = conn.transport
                if transport is not None:
                    transport.abort()
        await runner.cleanup()

    async def _restart_loop(self) -> None:
        faults = self.config.faults
        assert faults.restart_after is not None
        while True:
            await asyncio.sleep(faults.restart_after)
            log.info("sim.restart.down", port=self._port, downtime_s=faults.restart_downtime)
            await self._take_down()
            await asyncio.sleep(faults.restart_downtime)
            while True:
                try:
                    await self._bring_up()
                    break
                except OSError as exc:  # the port may linger briefly; keep trying
                    log.warning("sim.restart.bind_failed", port=self._port, error=str(exc))
                    await asyncio.sleep(0.2)
            self.restarts += 1
            log.info("sim.restart.up", port=self._port, restarts=self.restarts)
            if not faults.restart_repeat:
                return


async def serve_forever(config: SimConfig) -> None:
    """Run the simulator until SIGINT/SIGTERM (or cancellation); for ``soakd sim``."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    try:
        async with SimServer(config) as sim:
            log.info(
                "sim.listening",
                base_url=sim.base_url,
                metrics_url=sim.metrics_url,
                dcgm_metrics_url=sim.dcgm_metrics_url,
                gpus=config.device.gpus,
                model=config.model,
                config=config.model_dump(mode="json", exclude={"api_key"}),
                auth=config.api_key is not None,
            )
            await stop.wait()
            log.info("sim.stopping")
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


# ---------------------------------------------------------------------------- CLI helpers

# flag dest -> (section, SimConfig field); section None = top level, "faults" = SimFaults.
_FLAG_FIELDS: dict[str, tuple[str | None, str]] = {
    "host": (None, "host"),
    "port": (None, "port"),
    "model": (None, "model"),
    "seed": (None, "seed"),
    "ttft": (None, "ttft_base"),
    "tpot": (None, "tpot_base"),
    "jitter": (None, "jitter"),
    "max_batch": (None, "max_batch"),
    "latency_drift_pct_per_hour": ("faults", "latency_drift_pct_per_hour"),
    "latency_step_at": ("faults", "latency_step_at"),
    "latency_step_pct": ("faults", "latency_step_pct"),
    "output_change_at": ("faults", "output_change_at"),
    "kv_leak_blocks": ("faults", "kv_leak_blocks_per_n_requests"),
    "kv_leak_every": ("faults", "kv_leak_every_n_requests"),
    "error_rate_500": ("faults", "error_rate_500"),
    "error_rate_429": ("faults", "error_rate_429"),
    "stall_rate": ("faults", "stall_rate"),
    "stall_duration": ("faults", "stall_duration"),
    "truncate_rate": ("faults", "truncate_rate"),
    "malformed_rate": ("faults", "malformed_rate"),
    "garbled_rate": ("faults", "garbled_rate"),
    "empty_rate": ("faults", "empty_rate"),
    "restart_after": ("faults", "restart_after"),
    "restart_downtime": ("faults", "restart_downtime"),
    "gpus": ("device", "gpus"),
    "thermal_time_constant": ("device", "thermal_time_constant"),
    "thermal_throttle_at": ("faults", "thermal_throttle_at"),
    "thermal_throttle_duration": ("faults", "thermal_throttle_duration"),
    "thermal_throttle_clock_ratio": ("faults", "thermal_throttle_clock_ratio"),
    "power_cap_at": ("faults", "power_cap_at"),
    "power_cap_duration": ("faults", "power_cap_duration"),
    "power_cap_watts": ("faults", "power_cap_watts"),
    "device_memory_leak_per_hour": ("faults", "device_memory_leak_bytes_per_hour"),
}


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``soakd sim`` flags (all default to None = keep the configured value)."""
    g = parser.add_argument_group("simulator")
    g.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    g.add_argument(
        "--port", type=int, default=None, help="listen port, 0 = any free (default 8000)"
    )
    g.add_argument("--model", default=None, help="served model name (default soakd-sim)")
    g.add_argument("--seed", type=int, default=None, help="RNG seed for faults, jitter and output")
    g.add_argument("--ttft", default=None, help="base time to first token, e.g. 50ms")
    g.add_argument("--tpot", default=None, help="time per output token at batch 1, e.g. 5ms")
    g.add_argument("--jitter", type=float, default=None, help="relative latency noise, e.g. 0.1")
    g.add_argument("--max-batch", type=int, default=None, help="running slots before queueing")
    g.add_argument(
        "--latency-drift-pct-per-hour", type=float, default=None, help="latency growth in %%/hour"
    )
    g.add_argument(
        "--latency-step-at",
        default=None,
        help="from this uptime on every delay is --latency-step-pct longer, e.g. 10m "
        "(default never)",
    )
    g.add_argument(
        "--latency-step-pct", type=float, default=None, help="size of that step in %% (default 10)"
    )
    g.add_argument(
        "--output-change-at",
        default=None,
        help="from this uptime on deterministic outputs change (the canary sees a mismatch), "
        "e.g. 10m (default never)",
    )
    g.add_argument("--kv-leak-blocks", type=int, default=None, help="KV blocks leaked per leak")
    g.add_argument("--kv-leak-every", type=int, default=None, help="finished requests per leak")
    g.add_argument("--error-rate-500", type=float, default=None, help="probability of a 500")
    g.add_argument("--error-rate-429", type=float, default=None, help="probability of a 429")
    g.add_argument(
        "--stall-rate", type=float, default=None, help="probability of a mid-stream stall"
    )
    g.add_argument("--stall-duration", default=None, help="stall length, e.g. 5s")
    g.add_argument("--truncate-rate", type=float, default=None, help="probability of a cut stream")
    g.add_argument("--malformed-rate", type=float, default=None, help="probability of a bad chunk")
    g.add_argument("--garbled-rate", type=float, default=None, help="probability of garbage text")
    g.add_argument("--empty-rate", type=float, default=None, help="probability of an empty output")
    g.add_argument("--restart-after", default=None, help="restart the server after this uptime")
    g.add_argument("--restart-downtime", default=None, help="how long a restart keeps it down")
    d = parser.add_argument_group("simulated GPU (GET /dcgm/metrics; the fake NVML of soakd demo)")
    d.add_argument("--gpus", type=int, default=None, help="number of simulated GPUs (default 1)")
    d.add_argument(
        "--thermal-time-constant", default=None, help="thermal lag of the GPU, e.g. 30s (default)"
    )
    d.add_argument(
        "--thermal-throttle-at",
        default=None,
        help="start a thermal-throttling episode at this uptime, e.g. 10m (default never)",
    )
    d.add_argument(
        "--thermal-throttle-duration", default=None, help="its length, e.g. 60s (default)"
    )
    d.add_argument(
        "--thermal-throttle-clock-ratio",
        type=float,
        default=None,
        help="SM clock during it as a fraction of max; latency grows by 1/ratio (default 0.6)",
    )
    d.add_argument(
        "--power-cap-at",
        default=None,
        help="start a power-capping episode at this uptime, e.g. 20m (default never)",
    )
    d.add_argument("--power-cap-duration", default=None, help="its length, e.g. 60s (default)")
    d.add_argument(
        "--power-cap-watts", type=float, default=None, help="enforced limit during it (default 300)"
    )
    d.add_argument(
        "--device-memory-leak-per-hour",
        default=None,
        help="device memory leaked per hour of uptime, e.g. 2GiB (default 0)",
    )


def sim_config_from_args(args: argparse.Namespace, base: SimConfig | None = None) -> SimConfig:
    """*base* (or defaults) with every non-None flag of *args* applied, validated again."""
    data = (base or SimConfig()).model_dump()
    if base is not None and base.api_key is not None:
        data["api_key"] = base.api_key.get_secret_value()
    for dest, (section, field) in _FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if section is None:
            data[field] = value
        else:
            data[section][field] = value
    return SimConfig.model_validate(data)
