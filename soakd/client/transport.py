"""The client's transport tricks, in one place, each with a check that says whether it is on.

soakd's load generator must not be the bottleneck nor the noise (benchmarks/client_capacity.py
holds it to 1.3x a bare aiohttp client and sub-millisecond timing error). Three things get it
there, and each leans on an implementation detail of aiohttp or CPython:

1. **Socket-arrival timestamps** (``StampedResponseHandler``): aiohttp builds each connection's
   protocol with ``TCPConnector._factory``, a ``functools.partial`` of ``ResponseHandler``; soakd
   swaps in a subclass that notes, in ``data_received``, when bytes came off the socket. Event
   times are then the arrival of the data, not the moment the request's task next ran (on a
   busy loop the latter is later by the work of every callback ahead of it).
2. **One JSON encoder** (``dumps``): ``json.dumps`` builds a C encoder and a circular-reference
   table per call; soakd builds ``json.encoder.c_make_encoder`` once, checked against
   ``json.dumps`` at import.
3. **The C scanner** (``parse_event``): ``json.scanner.make_scanner`` without ``json.loads``'s
   Python-level wrappers in the common case (valid UTF-8, one value from the first byte to the
   last).

When aiohttp or CPython changes one of these, soakd falls back to the documented path (slower,
or events stamped when read) — and ``tests/unit/test_transport.py`` fails, naming what changed,
so the fallback is never silent. ``status()`` says which tricks are on.
"""

from __future__ import annotations

import functools
import json
import json.encoder
import json.scanner
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

from soakd.config import TargetConfig

__all__ = [
    "FAST_DUMPS",
    "FAST_SCAN",
    "StampedResponseHandler",
    "build_connector",
    "dumps",
    "parse_event",
    "request_headers",
    "stamping_supported",
    "status",
]

_perf_ns = time.perf_counter_ns
_loads = json.loads


def _make_dumps() -> tuple[Callable[[Any], str], bool]:
    """``json.dumps(obj, separators=(",", ":"))`` for request bodies through one C encoder built
    once; (the function, whether it is the C encoder)."""
    slow = json.JSONEncoder(separators=(",", ":")).encode
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return slow, False
    try:
        enc = make(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",",
                   False, False, True)
        sample = {"model": "m", "messages": [{"role": "user", "content": "h\u00e9 \"x\"\n"}], "max_tokens": 16,
                  "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}, "n": None}
        if "".join(enc(sample, 0)) != slow(sample):
            return slow, False
    except Exception:  # noqa: BLE001 - any surprise: the documented path
        return slow, False
    return (lambda obj: "".join(enc(obj, 0))), True


dumps, FAST_DUMPS = _make_dumps()

try:
    _scan = json.scanner.make_scanner(json.JSONDecoder())  # the C scanner behind json.loads
    FAST_SCAN = getattr(json.scanner, "c_make_scanner", None) is not None and \
        type(_scan) is getattr(json.scanner, "c_make_scanner")  # noqa: E721
except Exception:  # noqa: BLE001
    _scan = None
    FAST_SCAN = False


def parse_event(data: bytes) -> Any:
    """``json.loads(data)`` for one SSE event, without its Python-level wrappers in the common case.
    Anything else goes through ``json.loads`` itself: same result, same exceptions (ValueError,
    UnicodeDecodeError)."""
    if _scan is not None:
        try:
            text = data.decode()
            obj, end = _scan(text, 0)
            if end == len(text):
                return obj
        except (ValueError, StopIteration):
            pass
    return _loads(data)


class StampedResponseHandler(ResponseHandler):
    """aiohttp's connection protocol, noting when bytes last came off the socket (``rx_ns``)."""

    __slots__ = ("rx_ns",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rx_ns = 0

    def data_received(self, data: bytes) -> None:
        if data:  # aiohttp calls it with b"" itself when it resumes reading
            self.rx_ns = _perf_ns()
        super().data_received(data)


def _stamp(conn: aiohttp.TCPConnector) -> bool:
    factory = getattr(conn, "_factory", None)
    if isinstance(factory, functools.partial) and factory.func is ResponseHandler:
        conn._factory = functools.partial(StampedResponseHandler, *factory.args, **factory.keywords)  # noqa: SLF001
        return True
    return False


KEEPALIVE_IDLE = 4.0  # seconds an idle pooled connection is kept (servers close theirs after 5 s)


def build_connector(target: TargetConfig, limit: int, *, force_close: bool | None = None) -> aiohttp.TCPConnector:
    """The connection pool for a target: ``limit`` connections (``target.max_connections``
    overrides), keep-alive per ``target.keep_alive`` unless ``force_close`` says otherwise, and
    connections whose protocol stamps socket arrival. An idle connection is kept ``KEEPALIVE_IDLE``
    seconds, under the 5 s after which uvicorn (vLLM, SGLang) and llama.cpp's server close theirs:
    reusing one the server is closing loses the request ("Can not write request body", counted as
    a connection error with the target up; seen in the vLLM e2e test after quiesce pauses)."""
    close = (not target.keep_alive) if force_close is None else force_close
    conn = aiohttp.TCPConnector(
        limit=target.max_connections or max(limit, 1),
        limit_per_host=0,
        force_close=close,
        enable_cleanup_closed=False,
        ttl_dns_cache=300,
        keepalive_timeout=None if close else KEEPALIVE_IDLE,
    )
    _stamp(conn)
    return conn


async def stamping_supported() -> bool:
    """Whether this aiohttp builds connections the way the stamping expects."""
    conn = aiohttp.TCPConnector()
    try:
        return _stamp(conn)
    finally:
        await conn.close()


def request_headers(target: TargetConfig, api_key: str | None) -> dict[str, str]:
    """The headers of every request to a target: JSON in, SSE or JSON out, the target's extra
    headers, the API key as ``Authorization: Bearer``. ``soakd run`` and ``soakd check`` share them."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
    headers.update(target.header_values())
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def status() -> dict[str, bool]:
    return {"socket_stamps": await stamping_supported(), "c_encoder": FAST_DUMPS, "c_scanner": FAST_SCAN}
