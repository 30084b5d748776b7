"""Scrape a Prometheus ``/metrics`` endpoint and read it by candidate metric names.

Shared by the inference-server and dcgm-exporter samplers:

- ``Scraper`` GETs a URL over an aiohttp session (its own, or a shared one from a factory), with
  explicit timeouts and a body-size cap, and turns every failure into a ``ScrapeError`` whose message
  names the URL (credentials removed) and what went wrong: connection refused, HTTP status, an HTML
  page, JSON, binary data, or text that is not a Prometheus exposition. The sampler raises it; the
  ``SamplerRunner`` records it.
- ``parse_exposition`` parses with ``prometheus_client``'s parsers (text format 0.0.4, or OpenMetrics
  when the server says so), which accept the colon names servers use (``vllm:...``). Parsing runs in
  a worker thread so a large exposition never stalls the event loop that timestamps streamed tokens.
- ``Exposition`` indexes samples by name. Counters match with or without ``_total``: a candidate
  ``vllm:num_preemptions`` finds ``vllm:num_preemptions_total`` and a bare ``tgi_request_count``
  alike (the parser strips ``_total`` from counter *family* names and keeps or adds it on samples;
  we look at samples). ``Ref`` adds a label selector for servers that put several signals in one
  family (Triton's ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"}``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from yarl import URL

from soakd import __version__

MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_TIMEOUT = aiohttp.ClientTimeout(total=10.0, sock_connect=5.0)
# Prefer the classic text format: every server speaks it, and it keeps _created lines out of counters.
ACCEPT = "text/plain;version=0.0.4;q=0.9, application/openmetrics-text;version=1.0.0;q=0.5, */*;q=0.1"

SessionFactory = Callable[[], aiohttp.ClientSession]


class ScrapeError(Exception):
    """A scrape failed (unreachable, HTTP error, not a Prometheus exposition); the message says why."""


def redact_url(url: str | URL) -> str:
    """The URL without user and password (safe for logs, errors and /status)."""
    try:
        u = URL(str(url))
    except (TypeError, ValueError):
        return "<invalid url>"
    if u.user is not None or u.password is not None:
        u = u.with_user(None)
    return str(u)


# ---------------------------------------------------------------------------------------------
# Reading an exposition


@dataclass(frozen=True, slots=True)
class Child:
    """One sample: its labels and value."""

    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Ref:
    """A metric name plus an optional label selector (exact values)."""

    name: str
    match: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        if not self.match:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in self.match)
        return f"{self.name}{{{inner}}}"

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match)


def ref(name: str, **match: str) -> Ref:
    return Ref(name, tuple(match.items()))


def as_ref(r: Ref | str) -> Ref:
    return r if isinstance(r, Ref) else Ref(r)


class Exposition:
    """Samples of one scrape, by sample name, with each family's HELP and TYPE."""

    def __init__(self, families: Iterable[object]) -> None:
        self.samples: dict[str, list[Child]] = {}
        self.help: dict[str, str] = {}
        self.type: dict[str, str] = {}
        for fam in families:
            fname = getattr(fam, "name")
            self.help.setdefault(fname, getattr(fam, "documentation", "") or "")
            self.type.setdefault(fname, getattr(fam, "type", "unknown") or "unknown")
            for s in getattr(fam, "samples"):
                value = float(s.value)
                if math.isnan(value):
                    continue
                self.samples.setdefault(s.name, []).append(Child(dict(s.labels), value))
                if s.name != fname:
                    self.help.setdefault(s.name, self.help[fname])
                    self.type.setdefault(s.name, self.type[fname])

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def names(self) -> set[str]:
        return set(self.samples)

    def children(self, r: Ref | str, counter: bool = False) -> list[Child] | None:
        """The children of ``r`` (selector applied), or None when absent. ``counter``: accept the
        name with or without ``_total``."""
        r = as_ref(r)
        for name in counter_names(r.name) if counter else (r.name,):
            found = self.samples.get(name)
            if found is None:
                continue
            chosen = [c for c in found if r.selects(c.labels)] if r.match else list(found)
            if chosen:
                return chosen
        return None

    def first(self, candidates: Sequence[Ref | str], counter: bool = False) -> tuple[Ref, list[Child]] | None:
        """The first candidate present, with its children (fallbacks across server versions)."""
        for c in candidates:
            r = as_ref(c)
            found = self.children(r, counter)
            if found is not None:
                return r, found
        return None

    def has(self, r: Ref | str, counter: bool = False) -> bool:
        return self.children(r, counter) is not None

    def help_for(self, name: str) -> str:
        return self.help.get(name, "")


def counter_names(name: str) -> tuple[str, str]:
    """Exposition names a counter may carry: ``x_total`` (the convention) and bare ``x`` (TGI,
    dcgm-exporter, llama.cpp's ``n_tokens_max``)."""
    base = name.removesuffix("_total")
    return (base + "_total", base)


# ---------------------------------------------------------------------------------------------
# Aggregation across children (engines, models, ranks)


def collapse(children: Iterable[Child], replica_labels: Iterable[str] = (), drop: Iterable[str] = ()) -> list[Child]:
    """Merge children that differ only in ``replica_labels`` (copies of one value, e.g. tensor-parallel
    ranks) by taking the max; ``drop`` labels are removed first (selector labels). Other labels
    (engine, model, data-parallel rank) keep their children apart."""
    skip = set(replica_labels) | set(drop)
    groups: dict[tuple[tuple[str, str], ...], float] = {}
    for c in children:
        key = tuple(sorted((k, v) for k, v in c.labels.items() if k not in skip))
        prev = groups.get(key)
        groups[key] = c.value if prev is None else max(prev, c.value)
    return [Child(dict(k), v) for k, v in groups.items()]


def total(children: Iterable[Child]) -> float:
    return math.fsum(c.value for c in children)


def mean(children: Sequence[Child]) -> float:
    return total(children) / len(children) if children else math.nan


# ---------------------------------------------------------------------------------------------
# Parsing and fetching


def _looks_like(text: str, content_type: str) -> str | None:
    """A name for bodies that are clearly not a Prometheus exposition, else None."""
    ctype = content_type.lower()
    head = text.lstrip()[:512].lower()
    if "html" in ctype or head.startswith(("<!doctype", "<html", "<?xml", "<")):
        return "an HTML page"
    if "json" in ctype or head.startswith(("{", "[")):
        return "JSON"
    if "\x00" in text[:65536]:
        return "binary data"
    return None


def parse_exposition(text: str, content_type: str = "", source: str = "") -> Exposition:
    """Parse a scrape body; ``ScrapeError`` if it is not a Prometheus (or OpenMetrics) exposition."""
    where = f"{redact_url(source)} returned " if source else "the body is "
    kind = _looks_like(text, content_type)
    if kind is not None:
        raise ScrapeError(f"{where}{kind}, not a Prometheus exposition (Content-Type {content_type or 'none'})")
    openmetrics = "openmetrics" in content_type.lower() or text.rstrip().endswith("# EOF")
    try:
        if openmetrics:
            from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

            families = list(om_parse(text))
        else:
            from prometheus_client.parser import text_string_to_metric_families as parse

            families = list(parse(text))
    except Exception as exc:  # noqa: BLE001 - the parsers raise ValueError, IndexError, TypeError...
        raise ScrapeError(f"{where}text that is not a Prometheus exposition: {str(exc)[:200]}") from exc
    return Exposition(families)


def new_session(timeout: aiohttp.ClientTimeout = DEFAULT_TIMEOUT) -> aiohttp.ClientSession:
    """A session for scrapes (used when no shared one is injected)."""
    return aiohttp.ClientSession(timeout=timeout, headers={"User-Agent": f"soakd/{__version__}"})


async def _read_limited(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    length = resp.content_length
    if length is not None and length > limit:
        raise ScrapeError(f"{redact_url(resp.url)} returned {length} bytes (limit {limit})")
    buf = bytearray()
    async for chunk in resp.content.iter_chunked(65536):
        buf.extend(chunk)
        if len(buf) > limit:
            raise ScrapeError(f"{redact_url(resp.url)} returned more than {limit} bytes")
    return bytes(buf)


async def fetch(
    session: aiohttp.ClientSession,
    url: str,
    timeout: aiohttp.ClientTimeout = DEFAULT_TIMEOUT,
    limit: int = MAX_BODY_BYTES,
) -> tuple[str, str]:
    """GET ``url``: (decoded body, Content-Type). Raises ``ScrapeError`` on any failure."""
    safe = redact_url(url)
    try:
        async with session.get(url, headers={"Accept": ACCEPT}, timeout=timeout) as resp:
            if resp.status != 200:
                raise ScrapeError(f"GET {safe} returned HTTP {resp.status} {resp.reason or ''}".rstrip())
            body = await _read_limited(resp, limit)
            ctype = resp.headers.get("Content-Type", "")
    except ScrapeError:
        raise
    except aiohttp.ClientConnectorError as exc:
        reason = exc.os_error.strerror if exc.os_error is not None and exc.os_error.strerror else str(exc)
        raise ScrapeError(f"cannot connect to {safe}: {reason}") from exc
    except TimeoutError as exc:  # aiohttp's ServerTimeoutError is both a TimeoutError and a ClientError
        raise ScrapeError(f"GET {safe} timed out (limit {timeout.total}s)") from exc
    except aiohttp.ClientError as exc:
        raise ScrapeError(f"GET {safe} failed: {type(exc).__name__}: {exc}") from exc
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScrapeError(f"{safe} returned binary data, not a Prometheus exposition") from exc
    return text, ctype


class Scraper:
    """Fetch and parse one URL at a time over a shared or owned session.

    ``session_factory``: a zero-argument callable returning the shared scrape session; it is called
    for every scrape (so the owner may replace a closed session) and never closed here. Without
    one, the scraper creates its own session on first use and closes it in ``aclose()``.
    """

    def __init__(
        self,
        session_factory: SessionFactory | None = None,
        timeout: aiohttp.ClientTimeout = DEFAULT_TIMEOUT,
        limit: int = MAX_BODY_BYTES,
    ) -> None:
        self._factory = session_factory
        self._own: aiohttp.ClientSession | None = None
        self.timeout = timeout
        self.limit = limit

    def session(self) -> aiohttp.ClientSession:
        """The session scrapes go over (for other GETs to the same server)."""
        return self._session()

    def _session(self) -> aiohttp.ClientSession:
        if self._factory is not None:
            return self._factory()
        if self._own is None or self._own.closed:
            self._own = new_session(self.timeout)
        return self._own

    async def fetch(self, url: str) -> tuple[str, str]:
        return await fetch(self._session(), url, self.timeout, self.limit)

    async def scrape(self, url: str) -> Exposition:
        text, ctype = await self.fetch(url)
        return await asyncio.to_thread(parse_exposition, text, ctype, url)

    async def aclose(self) -> None:
        if self._own is not None and not self._own.closed:
            await self._own.close()
        self._own = None
