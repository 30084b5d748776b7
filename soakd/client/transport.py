"""The client's transport: what it takes for soakd's load generator to be neither the bottleneck nor the
noise (benchmarks/client_capacity.py holds it to a bare aiohttp client and sub-millisecond timing error).

1. **Socket-arrival timestamps** (``StampedResponseHandler``): aiohttp builds each connection's
   protocol with ``TCPConnector._factory``, a ``functools.partial`` of ``ResponseHandler``; soakd
   swaps in a subclass that notes, in ``data_received``, when bytes came off the socket. Event
   times are then the arrival of the data, not the moment the request's task next ran (on a
   busy loop the latter is later by the work of every callback ahead of it). This leans on an
   implementation detail of aiohttp: when it changes, events are stamped when read, and
   ``tests/unit/test_transport.py`` fails, naming what changed, so the fallback is never silent.
2. **JSON through orjson** (``encode_body``, ``parse_event``): request bodies and SSE events are
   encoded and decoded by orjson (Rust; about 13 times ``json.dumps`` on a request body and 1.5 times
   the C scanner on a chunk, the per-request cost that a 16-token stream pays seventeen times).
   Whatever orjson refuses goes through the standard library, so the result is ``json.loads``'s, with
   its exceptions (NaN and Infinity literals, lone surrogates, a byte-order mark, invalid UTF-8 raise
   or parse exactly as ``json.loads`` does), and a body orjson cannot encode (an integer beyond 64
   bits) is ``json.dumps``'s; non-string keys (a ``logit_bias`` of token ids) are written as
   ``json.dumps`` writes them. What differs: an integer beyond 64 bits in an event is a float (no
   server counts that far); a NaN or infinite float in a body (an ``extra_body`` of the user's) is
   ``null``, not ``NaN``, which no server accepts; non-ASCII text goes as UTF-8, not ``\\u`` escapes
   (the same JSON, other bytes); and values ``json.dumps`` refuses but orjson encodes (dates, UUIDs,
   enums, dataclasses) are encoded, where a body could only get them from code, not configuration.

``status()`` says which are on.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import aiohttp
import orjson
from aiohttp.client_proto import ResponseHandler

from soakd import __version__
from soakd.config import TargetConfig

__all__ = [
    "StampedResponseHandler",
    "build_connector",
    "encode_body",
    "parse_event",
    "request_headers",
    "stamping_supported",
    "status",
]

_perf_ns = time.perf_counter_ns
_loads = json.loads
_orjson_loads = orjson.loads
_orjson_dumps = orjson.dumps
_NON_STR_KEYS = orjson.OPT_NON_STR_KEYS  # {50256: -100} (a logit_bias from YAML) as json.dumps writes it
_OrjsonDecodeError = orjson.JSONDecodeError
_slow_dumps = json.JSONEncoder(separators=(",", ":")).encode


def encode_body(obj: Any) -> bytes:
    """A request body as compact JSON (orjson; ``json.dumps`` for what orjson cannot encode)."""
    try:
        return _orjson_dumps(obj, option=_NON_STR_KEYS)
    except TypeError:
        return _slow_dumps(obj).encode()


def parse_event(data: bytes) -> Any:
    """``json.loads(data)`` for one SSE event: orjson, and ``json.loads`` itself for whatever orjson
    refuses (same result, same exceptions: ValueError, UnicodeDecodeError)."""
    try:
        return _orjson_loads(data)
    except _OrjsonDecodeError:
        return _loads(data)


_received = ResponseHandler.data_received


class StampedResponseHandler(ResponseHandler):
    """aiohttp's connection protocol, noting when bytes last came off the socket (``rx_ns``)."""

    __slots__ = ("rx_ns",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rx_ns = 0

    def data_received(self, data: bytes) -> None:
        if data:  # aiohttp calls it with b"" itself when it resumes reading
            self.rx_ns = _perf_ns()
        _received(self, data)  # the parent's, bound once (no super() lookup on every chunk)


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
    """The headers of every request to a target: JSON in, SSE or JSON out, ``User-Agent: soakd/<version>``
    (what a server's access log names; aiohttp's own is never sent), the target's extra headers (one of them
    may name another User-Agent), the API key as ``Authorization: Bearer``. ``soakd run`` and ``soakd check``
    share them."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json",
               "User-Agent": f"soakd/{__version__}"}
    extra = target.header_values()
    if any(k.lower() == "user-agent" for k in extra):
        del headers["User-Agent"]
    headers.update(extra)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def status() -> dict[str, bool]:
    return {"socket_stamps": await stamping_supported(), "orjson": True}
