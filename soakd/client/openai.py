"""One OpenAI-compatible request -> one filled RequestRecord. Never raises (except CancelledError,
after marking the record cancelled).

Transport and parsing are split: bytes go through the incremental SSE decoder, each complete
event is parsed as JSON on its own. Every timestamp is ``perf_counter_ns`` taken when the chunk
that completed an event arrived: connections note when bytes came off the socket
(``StampedResponseHandler``), so a busy event loop delays the bookkeeping, not the timestamps
(benchmarks/client_capacity.py measures both against a server's own write times). The first
event carrying content is the first token; each later content event is one inter-token gap
(servers that pack several tokens into one event, as vLLM does under speculative decoding, show
it as fewer, longer gaps — as in ``vllm bench serve``).

The hot path is lean on purpose (the same benchmark holds it to its targets): one timer per
request (``_Deadline``), a one-split SSE path for well-formed streams, and the transport tricks
of ``soakd.client.transport`` (socket-arrival stamps, the C JSON scanner and encoder).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import orjson
from yarl import URL

from soakd.client.sse import SSEDecoder, SSETooLarge
from soakd.client.transport import StampedResponseHandler, build_connector, encode_body, request_headers
from soakd.client.validate import check_output, check_structure
from soakd.config import TargetConfig
from soakd.core.records import Outcome, RequestRecord

_perf_ns = time.perf_counter_ns
_loads = json.loads
_orjson_loads = orjson.loads


TICK = 0.05  # seconds: a request's deadline fires within this after it passes


class _Wheel:
    """The deadlines of one event loop's requests in flight, in slots of ``TICK`` seconds, under one timer (armed
    for the earliest slot): a request adds itself to a set and takes itself out, instead of arming and cancelling a
    timer of its own (uvloop's ``call_at`` and ``cancel``: 2.3 µs a request, more than the rest of its deadline)."""

    __slots__ = ("loop", "slots", "handle", "at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.slots: dict[int, set[_Deadline]] = {}
        self.handle: asyncio.TimerHandle | None = None
        self.at = 0  # the slot the timer is armed for

    def add(self, dl: "_Deadline", when: float) -> None:
        k = int(when / TICK) + 1  # the first slot boundary after ``when``
        s = self.slots.get(k)
        if s is None:
            s = self.slots[k] = set()
        s.add(dl)
        dl.slot = k
        if self.handle is None or k < self.at:
            self._arm(k)

    def remove(self, dl: "_Deadline") -> None:
        k = dl.slot
        dl.slot = None
        s = self.slots.get(k)  # type: ignore[arg-type]
        if s is not None:
            s.discard(dl)
            if not s:
                del self.slots[k]  # type: ignore[arg-type]

    def _arm(self, k: int) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.at = k
        self.handle = self.loop.call_at(k * TICK, self._tick)

    def _tick(self) -> None:
        self.handle = None
        now = self.loop.time() + 0.001  # a timer may run a clock tick early: not a reason to arm it again at once
        for k in sorted(k for k in self.slots if k * TICK <= now):
            for dl in self.slots.pop(k, ()):
                dl.slot = None
                dl.fire()  # expires it, or adds it again for its later deadline (which may arm the timer)
        if self.slots:
            k = min(self.slots)  # a deadline added again above may have armed the timer past an earlier slot
            if self.handle is None or k < self.at:
                self._arm(k)


class _Deadline:
    """One request's timeout, as ``asyncio.timeout_at`` but cheap to move and to arm.

    ``when`` (loop time) is the deadline: the first-token deadline, then, once events flow, the
    idle deadline after the latest one, capped by the total. Once streaming it only moves later,
    so moving it is a store; when its slot of the wheel comes (``_Wheel``: within ``TICK`` after the time it
    was added for) before ``when``, it is added again for ``when``. It is added no later than any deadline the
    request can get (``t0 + min(first, idle)``), so the first event never needs an earlier slot, except after a
    first-token wait longer than ``idle`` (``streaming()`` moves it then).
    """

    __slots__ = ("loop", "wheel", "slot", "when", "armed", "total_at", "idle_s", "task", "expired", "phase",
                 "_cancelling")

    def __init__(self, loop: asyncio.AbstractEventLoop, t0: float, first_s: float, idle_s: float,
                 total_s: float, wheel: _Wheel | None = None) -> None:
        self.loop = loop
        self.wheel = wheel if wheel is not None else _Wheel(loop)
        self.slot: int | None = None
        self.total_at = t0 + total_s
        self.idle_s = idle_s
        self.when = min(self.total_at, t0 + first_s)
        self.armed = min(self.when, t0 + idle_s)
        self.task: asyncio.Task[Any] | None = None
        self.expired = False
        self.phase = "first_token"  # for naming the timeout that hit: first_token, idle (total: see execute)
        self._cancelling = 0

    def __enter__(self) -> "_Deadline":
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a request deadline must be used inside a task")
        self.task = task
        self._cancelling = task.cancelling()
        self.wheel.add(self, self.armed)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.slot is not None:
            self.wheel.remove(self)
        if self.expired:  # as asyncio.Timeout: take back our cancel; only ours becomes TimeoutError
            assert self.task is not None
            if self.task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def streaming(self, lt: float) -> None:
        """The first event came at loop time ``lt``: from now on the idle deadline."""
        self.phase = "idle"
        when = min(self.total_at, lt + self.idle_s)
        self.when = when
        if when < self.armed and self.slot is not None:
            self.wheel.remove(self)
            self.armed = when
            self.wheel.add(self, when)

    def fire(self) -> None:
        """Its slot came: expired, or (moved later since) added again for ``when``."""
        when = self.when
        if self.loop.time() < when - 0.001:  # moved later since added: wait for the rest
            self.armed = when
            self.wheel.add(self, when)
            return
        self.expired = True
        assert self.task is not None
        self.task.cancel()


class UnexpectedAnswer(RuntimeError):
    """The target answered, but not with what the OpenAI API answers: a status other than 200, or
    a body that is not JSON (an HTML page: a web UI, a proxy, a URL without /v1)."""

    def __init__(self, path: str, status: int, content_type: str, body: bytes) -> None:
        self.path, self.status, self.content_type, self.body = path, status, content_type, body
        head = body[:200].decode("utf-8", "replace").strip()
        if status == 200:
            what = "HTML" if self.html else (content_type.split(";")[0] or "no content type")
            super().__init__(f"GET {path} returned {what} instead of JSON: {head[:120]!r}")
        else:
            super().__init__(f"GET {path} returned HTTP {status}: {head!r}")

    @property
    def html(self) -> bool:
        return "html" in self.content_type.lower() or self.body.lstrip()[:1] == b"<"


class OpenAIClient:
    """Shares one ClientSession/TCPConnector sized to the load."""

    def __init__(self, target: TargetConfig, api_key: str | None = None, pool_size: int = 64) -> None:
        self.target = target
        self.base = target.url.rstrip("/")
        self._chat_url = URL(self.base + "/chat/completions")  # parsed once, not per request
        self._completions_url = URL(self.base + "/completions")
        self.validation = target.validation
        self.headers = request_headers(target, api_key)
        self._pool_size = pool_size
        self._session: aiohttp.ClientSession | None = None
        self._wheel: _Wheel | None = None  # the request deadlines' wheel (of the loop it was made on)
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
                headers=self.headers,  # a User-Agent among them: aiohttp adds its own defaults only where absent
                auto_decompress=True,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    # ------------------------------------------------------------------ helpers (non-load paths)
    async def list_models(self) -> list[str]:
        """The ids ``GET /models`` lists. Raises ``UnexpectedAnswer`` for an answer that is not a
        JSON model list (a status other than 200, HTML, ...), TimeoutError, aiohttp.ClientError."""
        async with self.session.get(
            self.base + "/models", timeout=aiohttp.ClientTimeout(total=self.target.timeouts.connect + 20)
        ) as resp:
            body = await resp.read()
            ctype = resp.headers.get("Content-Type", "")
        if resp.status != 200:
            raise UnexpectedAnswer("/models", resp.status, ctype, body)
        try:
            data = json.loads(body)
        except ValueError:
            raise UnexpectedAnswer("/models", resp.status, ctype, body) from None
        if not isinstance(data, dict):
            raise UnexpectedAnswer("/models", resp.status, ctype, body)
        return [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]

    async def post_json(self, path: str, body: dict[str, Any],
                        headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
        """POST ``body`` to ``path`` (``/chat/completions``, ``/completions``, ``/embeddings``: relative
        to the base URL) without streaming, within the total timeout: (status, request id, raw body).
        Raises TimeoutError, aiohttp.ClientError or OSError; the caller classifies them."""
        timeout = aiohttp.ClientTimeout(total=self._total_s, sock_connect=self.target.timeouts.connect)
        async with self.session.post(self.base + path, data=encode_body(body), timeout=timeout,
                                     headers=headers) as resp:
            raw = await resp.read()
            rid = resp.headers.get("x-request-id") or resp.headers.get("request-id") or ""
            return resp.status, rid, raw

    # ------------------------------------------------------------------ the request
    async def execute(
        self,
        rec: RequestRecord,
        body: dict[str, Any],
        structure_check: str = "none",
    ) -> RequestRecord:
        """Send ``body`` to the record's endpoint and fill ``rec`` in place."""
        url = self._chat_url if rec.endpoint == "chat" else self._completions_url
        payload = encode_body(body)
        loop = asyncio.get_running_loop()
        rec.wall_start = time.time()
        rec.t_start_ns = _perf_ns()
        # One deadline per request on the loop's wheel: first-token deadline, then idle deadline after each
        # event, capped by the total (see _Deadline, _Wheel).
        wheel = self._wheel
        if wheel is None or wheel.loop is not loop:
            wheel = self._wheel = _Wheel(loop)
        dl = _Deadline(loop, loop.time(), self._first_s, self._idle_s, self._total_s, wheel)
        try:
            with dl:
                async with self.session.post(url, data=payload) as resp:
                    rec.http_status = resp.status
                    conn = resp.connection
                    proto = conn.protocol if conn is not None else None
                    rx = proto if type(proto) is StampedResponseHandler and proto.rx_ns else None
                    rec.t_headers_ns = rx.rx_ns if rx is not None else _perf_ns()
                    if resp.status != 200:
                        raw = await resp.read()
                        rec.t_end_ns = _perf_ns()
                        rec.fail(Outcome.HTTP_ERROR, f"http_{resp.status}", _error_message(raw))
                        return rec
                    if rec.stream and "text/event-stream" in resp.headers.get("Content-Type", ""):
                        await self._read_stream(rec, resp, dl, loop, rx)
                    else:
                        raw = await resp.read()
                        rec.t_end_ns = _perf_ns()
                        self._parse_body(rec, raw)
        except TimeoutError:
            rec.t_end_ns = _perf_ns()
            if not rec.http_status and dl.phase == "first_token":
                phase = "response"
            else:
                phase = dl.phase
            if loop.time() >= dl.total_at - 0.001:
                phase = "total"
            rec.fail(Outcome.TIMEOUT, f"{phase}_timeout")
            return rec
        except asyncio.CancelledError:
            rec.t_end_ns = _perf_ns()
            rec.fail(Outcome.CANCELLED, "cancelled")
            raise
        except aiohttp.ClientPayloadError as exc:
            rec.t_end_ns = _perf_ns()
            if _PAYLOAD_CUT in str(exc):
                # the connection closed before the body's end (chunked terminator or Content-Length):
                # the server went away mid-response (a crash, a restart, a proxy's cut), not an
                # invalid response. truncated_stream is a body that ended without [DONE]/finish.
                rec.fail(Outcome.CONNECTION_ERROR, "disconnected", str(exc))
            else:
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

    async def _read_stream(
        self,
        rec: RequestRecord,
        resp: aiohttp.ClientResponse,
        dl: _Deadline,
        loop: asyncio.AbstractEventLoop,
        rx: StampedResponseHandler | None,
    ) -> None:
        decoder = SSEDecoder()
        feed = decoder.feed_data
        parse = _loads  # parse_event's fallback (orjson is tried first, below)
        fast = _orjson_loads
        times = rec.token_times_ns
        parts: list[str] = []
        chat = rec.endpoint == "chat"
        done = False
        finish = None
        usage = None
        idle_s = self._idle_s
        total_at = dl.total_at
        ltime = loop.time
        readany = resp.content.readany
        now = rec.t_headers_ns
        while not done:
            chunk = await readany()
            # when the bytes that complete these events came off the socket (see StampedResponseHandler)
            now = rx.rx_ns if rx is not None else _perf_ns()
            if not chunk:
                now = _perf_ns()
                break
            try:
                events = feed(chunk)
            except SSETooLarge as exc:
                rec.t_end_ns = now
                rec.fail(Outcome.INVALID_RESPONSE, "response_too_large", str(exc))
                return
            if times and events:
                # the idle deadline follows the stream's events (a store; the timer catches up lazily);
                # comments (": keep-alive", ": ping") are no progress: a server that sends only those
                # after its first token is stalled, and the idle timeout says so
                dl.when = min(total_at, ltime() + idle_s)
            for data in events:
                if data == b"[DONE]":
                    done = True
                    break
                try:
                    obj = fast(data)  # orjson directly: one call less per event than parse_event
                except (ValueError, RecursionError):
                    try:  # what orjson refuses: json.loads's answer, as parse_event gives (NaN, ...) and its error
                        obj = parse(data)
                    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
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
                            rec.request_id = obj.get("id") or ""
                            dl.streaming(ltime())
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
        except (ValueError, RecursionError) as exc:
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


# aiohttp's ClientPayloadError when the connection was lost before the end of the body (its
# ResponseHandler.connection_lost); other payload errors are malformed framing
_PAYLOAD_CUT = "payload is not completed"
# aiohttp raises ClientOSError(None, "Can not write request body ...") from this when the pooled
# connection it picked was closed by the server before the request went out (the keep-alive race)
_CLOSING_TRANSPORT = getattr(aiohttp, "ClientConnectionResetError", None)


def _conn_reason(exc: BaseException) -> str:
    """The reason of a connection error before any response: the server closed the connection
    (``server_disconnected``: before answering, including a reused keep-alive connection it had
    already closed when the request was written), refused or failed the connect
    (``connect_failed``), or anything else on an established connection (``connection_reset``)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server_disconnected"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect_failed"
    if _CLOSING_TRANSPORT is not None and isinstance(exc.__cause__, _CLOSING_TRANSPORT):
        return "server_disconnected"
    return "connection_reset"
