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

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from soakd import __version__
from soakd.config.sim import SimConfig
from soakd.sim.device import SimDevice, dcgm_exposition
from soakd.sim.exchange import Exchange
from soakd.sim.model import SimModel
from soakd.sim.protocol import InvalidRequest, bad_request, error_response, parse_request
from soakd.sim.state import RECENT_MAXLEN, SIM_STATE, RecentEntry, SimState

__all__ = [
    "SIM_STATE",
    "SimServer",
    "SimState",
    "build_app",
    "serve_forever",
]

log = structlog.get_logger("soakd.sim")


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


async def _json_object(request: web.Request) -> dict[str, Any] | web.Response:
    """The request's body as a JSON object, or the 400 that says why it is not one."""
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return bad_request("The request body is not valid JSON.")
    if not isinstance(body, dict):
        return bad_request("The request body must be a JSON object.")
    return body


async def _generate(request: web.Request, chat: bool, body: Any = None) -> web.StreamResponse:
    """A chat or text completion; ``body``: already read (the Responses API's, translated)."""
    st = request.app[SIM_STATE]
    t_received_ns = time.perf_counter_ns()
    denied = _check_auth(st, request)
    if denied is not None:
        return denied
    if body is None:
        body = await _json_object(request)
        if isinstance(body, web.Response):
            return body
    try:
        parsed = parse_request(body, chat, st.config)
    except InvalidRequest as exc:
        return bad_request(exc.message, exc.param)
    if parsed.model is not None and parsed.model != st.config.model:
        return error_response(404, f"The model `{parsed.model}` does not exist.", "invalid_request_error",
                              param="model", code="model_not_found")
    model = st.model
    plan = model.plan_faults(parsed.max_tokens)
    if plan.status == 500:
        return error_response(500, "Internal server error (simulated fault error_rate_500).", "server_error")
    if plan.status == 429:
        return error_response(
            429,
            "Rate limit reached (simulated fault error_rate_429). Please retry after 1 second.",
            "requests",
            code="rate_limit_exceeded",
            headers={"Retry-After": "1"},
        )
    ex = Exchange(request, st, parsed, plan)
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


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI's Responses API, as vLLM serves it), not streamed: ``input`` (a
    string or a list of messages), ``instructions``, ``max_output_tokens``, ``temperature``; generated
    as the chat completion of the same messages, answered as a response object."""
    body = await _json_object(request)
    if isinstance(body, web.Response):
        return body
    if body.get("stream"):
        return bad_request("stream is not supported by this simulator's /v1/responses.", "stream")
    inp = body.get("input")
    if isinstance(inp, str):
        messages: list[Any] = [{"role": "user", "content": inp}]
    elif isinstance(inp, list) and inp and all(isinstance(m, dict) for m in inp):
        messages = [{"role": m.get("role", "user"), "content": m.get("content", "")} for m in inp]
    else:
        return bad_request("'input' must be a string or a non-empty list of messages.", "input")
    if isinstance(body.get("instructions"), str):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat = {"messages": messages, **{k: body[k] for k in ("model", "temperature", "top_p", "seed") if k in body}}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    resp = await _generate(request, True, chat)
    if resp.status != 200 or not isinstance(resp, web.Response) or resp.body is None:
        return resp
    done = json.loads(resp.body)  # type: ignore[arg-type]
    c0 = done["choices"][0]
    usage = done.get("usage") or {}
    incomplete = c0.get("finish_reason") == "length"
    return web.json_response({
        "id": "resp_" + str(done.get("id", "")).removeprefix("chatcmpl-"), "object": "response",
        "created_at": done.get("created"), "model": done.get("model"),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": [{"type": "message", "id": "msg_" + str(done.get("id", "")), "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": c0["message"].get("content") or "",
                                 "annotations": []}]}],
        "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
                  "total_tokens": usage.get("total_tokens", 0)},
    }, headers={k: v for k, v in resp.headers.items() if k.lower() == "x-request-id"})


EMBEDDING_DIM = 16


async def embeddings(request: web.Request) -> web.Response:
    """``POST /v1/embeddings``: a deterministic unit vector per input (from its hash), usage by words."""
    t_received_ns = time.perf_counter_ns()
    st = request.app[SIM_STATE]
    rid = request.headers.get("X-Request-Id", "")[:256] or "embd-" + st.next_id()
    st.recent.append((rid, t_received_ns, None, t_received_ns))
    denied = _check_auth(st, request)
    if denied is not None:
        return denied
    body = await _json_object(request)
    if isinstance(body, web.Response):
        return body
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) for x in inputs):
        return error_response(400, "'input' must be a string or a list of strings", "invalid_request_error")
    data, words = [], 0
    for i, text in enumerate(inputs):
        digest = hashlib.sha256(text.encode()).digest()
        vec = [(b - 127.5) / 127.5 for b in digest[:EMBEDDING_DIM]]
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        data.append({"object": "embedding", "index": i, "embedding": [v / norm for v in vec]})
        words += len(text.split())
    return web.json_response({"object": "list", "data": data, "model": st.config.model,
                              "usage": {"prompt_tokens": words, "total_tokens": words}},
                             headers={"X-Request-Id": rid})


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
    if st.config.metric_names == "none":  # a server without metrics
        raise web.HTTPNotFound()
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
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/responses", responses)
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


