"""One OpenAI-compatible request -> one filled RequestRecord. Never raises (except CancelledError,
after marking the record cancelled).

Transport and parsing are split: bytes go through the incremental SSE decoder, each complete
event is parsed as JSON on its own. Every timestamp is ``perf_counter_ns`` taken when the chunk
that completed an event arrived. The first event carrying content is the first token; each later
content event is one inter-token gap (servers that pack several tokens into one event, as vLLM
does under speculative decoding, show it as fewer, longer gaps — as in ``vllm bench serve``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from soakd.client.records import Outcome, RequestRecord
from soakd.client.sse import SSEDecoder
from soakd.client.validate import check_output, check_structure
from soakd.config import TargetConfig

_perf_ns = time.perf_counter_ns
_loads = json.loads


class _Phase:
    """Where a request is, for naming the timeout that hit it."""

    __slots__ = ("phase", "total_at", "cm")

    def __init__(self, total_at: float) -> None:
        self.phase = "first_token"
        self.total_at = total_at
        self.cm: Any = None


def build_connector(target: TargetConfig, limit: int) -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(
        limit=target.max_connections or max(limit, 1),
        limit_per_host=0,
        force_close=not target.keep_alive,
        enable_cleanup_closed=False,
        ttl_dns_cache=300,
        keepalive_timeout=30.0 if target.keep_alive else None,
    )


class OpenAIClient:
    """Shares one ClientSession/TCPConnector sized to the load."""

    def __init__(self, target: TargetConfig, api_key: str | None = None, pool_size: int = 64) -> None:
        self.target = target
        self.base = target.url.rstrip("/")
        self.validation = target.validation
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        self.headers.update(target.headers)
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        to = target.timeouts
        self._timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=to.connect, sock_read=None)
        self._first_s = to.first_token
        self._idle_s = to.idle
        self._total_s = to.total

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=build_connector(self.target, self._pool_size),
                timeout=self._timeout,
                headers=self.headers,
                skip_auto_headers=("User-Agent",),
                auto_decompress=True,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    # ------------------------------------------------------------------ helpers (non-load paths)
    async def list_models(self) -> list[str]:
        async with self.session.get(
            self.base + "/models", timeout=aiohttp.ClientTimeout(total=self.target.timeouts.connect + 20)
        ) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET /models returned HTTP {resp.status}: {body[:200]!r}")
        data = json.loads(body)
        return [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]

    # ------------------------------------------------------------------ the request
    async def execute(
        self,
        rec: RequestRecord,
        body: dict[str, Any],
        structure_check: str = "none",
    ) -> RequestRecord:
        """Send ``body`` to the record's endpoint and fill ``rec`` in place."""
        path = "/chat/completions" if rec.endpoint == "chat" else "/completions"
        payload = json.dumps(body, separators=(",", ":")).encode()
        loop = asyncio.get_running_loop()
        rec.wall_start = time.time()
        rec.t_start_ns = _perf_ns()
        t0 = loop.time()
        state = _Phase(t0 + self._total_s)
        # One asyncio.timeout per request, moved as the request progresses:
        # first-token deadline, then idle deadline after each event, capped by the total.
        try:
            async with asyncio.timeout(min(state.total_at, t0 + self._first_s)) as cm:
                state.cm = cm
                async with self.session.post(self.base + path, data=payload) as resp:
                    rec.http_status = resp.status
                    rec.t_headers_ns = _perf_ns()
                    if resp.status != 200:
                        raw = await resp.read()
                        rec.t_end_ns = _perf_ns()
                        rec.fail(Outcome.HTTP_ERROR, f"http_{resp.status}", _error_message(raw))
                        return rec
                    if rec.stream and "text/event-stream" in resp.headers.get("Content-Type", ""):
                        await self._read_stream(rec, resp, state, loop)
                    else:
                        raw = await resp.read()
                        rec.t_end_ns = _perf_ns()
                        self._parse_body(rec, raw)
        except TimeoutError:
            rec.t_end_ns = _perf_ns()
            if not rec.http_status and state.phase == "first_token":
                phase = "response"
            else:
                phase = state.phase
            if loop.time() >= state.total_at - 0.001:
                phase = "total"
            rec.fail(Outcome.TIMEOUT, f"{phase}_timeout")
            return rec
        except asyncio.CancelledError:
            rec.t_end_ns = _perf_ns()
            rec.fail(Outcome.CANCELLED, "cancelled")
            raise
        except aiohttp.ClientPayloadError as exc:
            rec.t_end_ns = _perf_ns()
            rec.fail(Outcome.INVALID_RESPONSE, "truncated_stream", str(exc))
            return rec
        except aiohttp.ClientResponseError as exc:
            rec.t_end_ns = _perf_ns()
            rec.fail(Outcome.INVALID_RESPONSE, "bad_http_response", str(exc))
            return rec
        except (aiohttp.ClientConnectionError, OSError) as exc:
            rec.t_end_ns = _perf_ns()
            reason = "disconnected" if rec.http_status else _conn_reason(exc)
            rec.fail(Outcome.CONNECTION_ERROR, reason, f"{type(exc).__name__}: {exc}")
            return rec
        except Exception as exc:  # noqa: BLE001 - errors are data: the load loop never dies
            rec.t_end_ns = _perf_ns()
            rec.fail(Outcome.INVALID_RESPONSE, "client_exception", f"{type(exc).__name__}: {exc}")
            return rec
        if rec.outcome is Outcome.OK:
            reason = check_output(rec.text, self.validation)
            if not reason and structure_check != "none":
                reason = check_structure(rec.text, structure_check)
            if reason:
                rec.fail(Outcome.INVALID_RESPONSE, reason)
        return rec

    async def _read_stream(self, rec: RequestRecord, resp: aiohttp.ClientResponse, state: "_Phase", loop) -> None:  # noqa: ANN001
        decoder = SSEDecoder()
        feed = decoder.feed
        times = rec.token_times_ns
        parts: list[str] = []
        chat = rec.endpoint == "chat"
        done = False
        finish = None
        usage = None
        idle_s = self._idle_s
        total_at = state.total_at
        cm = state.cm
        next_move = 0.0
        readany = resp.content.readany
        now = rec.t_headers_ns
        while not done:
            chunk = await readany()
            now = _perf_ns()
            if not chunk:
                break
            if times:
                # the idle deadline follows the stream; moved at most every 10 ms (cheap)
                lt = loop.time()
                if lt >= next_move:
                    cm.reschedule(min(total_at, lt + idle_s))
                    next_move = lt + 0.01
            for ev in feed(chunk):
                data = ev.data
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    obj = _loads(data)
                except ValueError as exc:
                    rec.t_end_ns = now
                    reason = "invalid_utf8" if isinstance(exc, UnicodeDecodeError) else "malformed_chunk"
                    rec.fail(Outcome.INVALID_RESPONSE, reason, f"{exc}: {data[:120]!r}")
                    return
                if type(obj) is not dict:
                    rec.t_end_ns = now
                    rec.fail(Outcome.INVALID_RESPONSE, "malformed_chunk", f"not a JSON object: {data[:120]!r}")
                    return
                choices = obj.get("choices")
                if choices:
                    c0 = choices[0]
                    if chat:
                        delta = c0.get("delta") or {}
                        piece = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    else:
                        piece = c0.get("text")
                    if piece:
                        if not times:
                            state.phase = "idle"
                            lt = loop.time()
                            cm.reschedule(min(total_at, lt + idle_s))
                            next_move = lt + 0.01
                        times.append(now)
                        parts.append(piece)
                    fr = c0.get("finish_reason")
                    if fr:
                        finish = fr
                elif "error" in obj:
                    rec.t_end_ns = now
                    rec.fail(Outcome.INVALID_RESPONSE, "error_in_stream", _error_message(data))
                    return
                u = obj.get("usage")
                if u:
                    usage = u
        rec.t_end_ns = now
        rec.text = "".join(parts)
        rec.finish_reason = finish
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            rec.completion_tokens = int(usage.get("completion_tokens") or 0)
            rec.usage_from_server = True
        else:
            rec.completion_tokens = len(times)
        if not done:
            if any(ev.data == b"[DONE]" for ev in decoder.close()):
                return
            rec.fail(Outcome.INVALID_RESPONSE, "truncated_stream", "stream ended without data: [DONE]")

    def _parse_body(self, rec: RequestRecord, raw: bytes) -> None:
        try:
            obj = _loads(raw)
        except ValueError as exc:
            rec.fail(Outcome.INVALID_RESPONSE, "malformed_body" if not isinstance(exc, UnicodeDecodeError) else "invalid_utf8", str(exc))
            return
        if not isinstance(obj, dict) or not obj.get("choices"):
            rec.fail(Outcome.INVALID_RESPONSE, "no_choices", f"{raw[:160]!r}")
            return
        c0 = obj["choices"][0]
        if rec.endpoint == "chat":
            msg = c0.get("message") or {}
            text = msg.get("content") or ""
        else:
            text = c0.get("text") or ""
        rec.text = text
        rec.finish_reason = c0.get("finish_reason")
        if text:
            rec.token_times_ns.append(rec.t_end_ns)
        usage = obj.get("usage") or {}
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            rec.completion_tokens = int(usage.get("completion_tokens") or 0)
            rec.usage_from_server = True
        else:
            rec.completion_tokens = len(text.split())


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        return str(err)[:300]
    except (ValueError, AttributeError):
        return raw[:300].decode("utf-8", "replace")


def _conn_reason(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server_disconnected"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect_failed"
    return "connection_reset"
