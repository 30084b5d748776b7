"""``soakd check``: the OpenAI compatibility probe the validation method starts with.

Four probes, each reporting what differed from the OpenAI wire format: GET /models, chat
non-streaming, chat streaming with ``stream_options.include_usage``, completions streaming.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from soakd.client.sse import SSEDecoder
from soakd.client.transport import build_connector, request_headers
from soakd.config import TargetConfig


@dataclass
class ProbeResult:
    name: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def fail(self, msg: str) -> None:
        self.ok = False
        self.problems.append(msg)


def _need(res: ProbeResult, cond: bool, msg: str) -> bool:
    if not cond:
        res.fail(msg)
    return cond


def _err_text(status: int, raw: bytes) -> str:
    text = raw[:200].decode("utf-8", "replace").strip()
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], res: ProbeResult) -> list[Any] | None:
    async with session.post(url, json=body) as resp:
        if not _need(res, resp.status == 200, _err_text(resp.status, await resp.read()) if resp.status != 200 else ""):
            return None
        ctype = resp.headers.get("Content-Type", "")
        _need(res, "text/event-stream" in ctype, f"Content-Type is {ctype!r}, expected text/event-stream")
        dec = SSEDecoder()
        events: list[Any] = []
        done = False
        async for chunk in resp.content.iter_any():
            for ev in dec.feed(chunk):
                if ev.data == b"[DONE]":
                    done = True
                    continue
                try:
                    events.append(json.loads(ev.data))
                except ValueError:
                    res.fail(f"a stream event is not JSON: {ev.data[:80]!r}")
                    return events
        _need(res, done, "the stream did not end with 'data: [DONE]'")
        return events


async def run_checks(target: TargetConfig, api_key: str | None = None,
                     timeout: float = 60.0) -> tuple[list[ProbeResult], str | None]:
    """The four probes against ``target`` (its URL, model, headers), with the same request
    headers and connection pool as ``soakd run`` (``soakd.client.transport``)."""
    base = target.url.rstrip("/")
    model = target.model
    results: list[ProbeResult] = []
    to = aiohttp.ClientTimeout(total=timeout, sock_connect=min(target.timeouts.connect, timeout))
    # One connection per probe: the probes check the API, not connection reuse (a server that
    # closes kept-alive connections after streamed responses, as llama.cpp's does, would otherwise
    # fail whichever probe reuses one; `soakd run` records that as connection_error).
    connector = build_connector(target, 1, force_close=True)
    async with aiohttp.ClientSession(timeout=to, headers=request_headers(target, api_key),
                                     connector=connector) as session:
        # 1. models
        res = ProbeResult("GET /models")
        t0 = time.perf_counter()
        try:
            async with session.get(base + "/models") as resp:
                raw = await resp.read()
                if _need(res, resp.status == 200, _err_text(resp.status, raw) if resp.status != 200 else ""):
                    data = json.loads(raw)
                    _need(res, data.get("object") == "list", f"object is {data.get('object')!r}, expected 'list'")
                    ids = [m.get("id") for m in data.get("data") or [] if isinstance(m, dict)]
                    if _need(res, bool(ids) and all(isinstance(i, str) for i in ids), "data[] lists no model ids"):
                        res.notes.append(f"models: {', '.join(ids[:5])}")
                        if model is None:
                            model = ids[0]
                        elif model not in ids:
                            res.notes.append(f"{model!r} is not listed")
        except Exception as exc:  # noqa: BLE001
            res.fail(_exc(exc))
        res.seconds = time.perf_counter() - t0
        results.append(res)
        if model is None:
            for name in ("chat (non-streaming)", "chat (streaming, include_usage)", "completions (streaming)"):
                r = ProbeResult(name)
                r.fail("skipped: no model (GET /models failed and --model not given)")
                results.append(r)
            return results, None
        msgs = [{"role": "user", "content": "Say hello in five words."}]

        # 2. chat non-streaming
        res = ProbeResult("chat (non-streaming)")
        t0 = time.perf_counter()
        try:
            body = {"model": model, "messages": msgs, "max_tokens": 16, "temperature": 0}
            async with session.post(base + "/chat/completions", json=body) as resp:
                raw = await resp.read()
                if _need(res, resp.status == 200, _err_text(resp.status, raw) if resp.status != 200 else ""):
                    obj = json.loads(raw)
                    _need(res, obj.get("object") == "chat.completion",
                          f"object is {obj.get('object')!r}, expected 'chat.completion'")
                    ch = (obj.get("choices") or [{}])[0]
                    msg = ch.get("message") or {}
                    _need(res, msg.get("role") == "assistant", f"message.role is {msg.get('role')!r}")
                    _need(res, isinstance(msg.get("content"), str) and msg["content"] != "",
                          "message.content is empty or missing")
                    _need(res, ch.get("finish_reason") is not None, "finish_reason missing")
                    _check_usage(res, obj.get("usage"))
        except Exception as exc:  # noqa: BLE001
            res.fail(_exc(exc))
        res.seconds = time.perf_counter() - t0
        results.append(res)

        # 3. chat streaming with usage
        res = ProbeResult("chat (streaming, include_usage)")
        t0 = time.perf_counter()
        try:
            body = {"model": model, "messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            events = await _stream(session, base + "/chat/completions", body, res)
            if events is not None:
                _check_stream(res, events, chat=True)
        except Exception as exc:  # noqa: BLE001
            res.fail(_exc(exc))
        res.seconds = time.perf_counter() - t0
        results.append(res)

        # 4. completions streaming
        res = ProbeResult("completions (streaming)")
        t0 = time.perf_counter()
        try:
            body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            events = await _stream(session, base + "/completions", body, res)
            if events is not None:
                _check_stream(res, events, chat=False)
        except Exception as exc:  # noqa: BLE001
            res.fail(_exc(exc))
        res.seconds = time.perf_counter() - t0
        results.append(res)
    return results, model


def _check_usage(res: ProbeResult, usage: Any) -> None:
    if not _need(res, isinstance(usage, dict), "usage is missing"):
        return
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        _need(res, isinstance(usage.get(key), int), f"usage.{key} is missing or not an integer")
    if all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens")):
        _need(res, usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"],
              "usage.total_tokens != prompt_tokens + completion_tokens")


def _check_stream(res: ProbeResult, events: list[Any], chat: bool) -> None:
    want = "chat.completion.chunk" if chat else "text_completion"
    pieces = 0
    finish = None
    usage = None
    for ev in events:
        if not isinstance(ev, dict):
            res.fail("a stream event is not a JSON object")
            return
        if ev.get("object") not in (want, None):
            res.fail(f"chunk object is {ev.get('object')!r}, expected {want!r}")
            return
        for ch in ev.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            if piece:
                pieces += 1
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
        if ev.get("usage"):
            usage = ev["usage"]
    _need(res, pieces > 0, "no content in any chunk")
    _need(res, finish is not None, "no chunk carries a finish_reason")
    if _need(res, usage is not None, "no usage in the stream although stream_options.include_usage was sent"):
        _check_usage(res, usage)
    res.notes.append(f"{pieces} content chunks, finish_reason={finish}")


def _exc(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {exc.os_error or exc}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def format_table(results: list[ProbeResult], base_url: str, model: str | None) -> str:
    lines = [f"soakd check {base_url}" + (f" (model {model})" if model else ""), ""]
    w = max(len(r.name) for r in results)
    lines.append(f"{'probe'.ljust(w)}  result  time     details")
    lines.append(f"{'-' * w}  ------  -------  -------")
    for r in results:
        detail = "; ".join(r.problems) if r.problems else "; ".join(r.notes)
        lines.append(f"{r.name.ljust(w)}  {'PASS' if r.ok else 'FAIL':6}  {r.seconds * 1000:5.0f}ms  {detail}")
    passed = sum(r.ok for r in results)
    lines.append("")
    lines.append(f"{passed}/{len(results)} probes passed")
    return "\n".join(lines)
