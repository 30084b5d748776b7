"""Engine wedged: requests are in flight and no byte has come from any of them for longer than the
server's own rhythm allows, while the server still answers ``GET /v1/models`` (vLLM and SGLang
issues report engines that keep their HTTP front end alive after hours or after an idle period, and
generate nothing). The window's freeze detector (``Analyzer._freeze``) finds the same silence when
the window closes; this finds it live, within seconds, and tells a wedged engine (the front end
answers) from a server that is gone or frozen whole (it does not: the outage and freeze findings).

Checked every second: the newest byte of any streamed request in flight (its last token, else its
headers, else its start) against the freeze threshold (``Analyzer.freeze_threshold``: at least
``analysis.client.freeze_min`` and 3x the baseline's TTFT p95 and inter-token p99). A silence that
long with soakd's own loop punctual (the check itself ran on time) is probed once with
``GET /models``; an answer makes it a wedge: ``soakd_engine_wedged`` 1, a critical finding of kind
``freeze`` ('engine wedged', failing the run). The first byte after it ends the episode (the gauge
0, an info event with its length). A healthy idle period has nothing in flight: never a wedge.

The server's side (``on_server_sample``, each scrape of the server sampler): its generated-token
counter (``soakd_server_generation_tokens_total``) has not moved while it reports requests running
(``soakd_server_requests_running`` > 0) in every scrape of the span. The span is measured between
scrapes — from the first scrape that showed the counter's value (or the first of the running ones)
to the latest — so it needs at least two scrapes and is at most a scrape interval short of the
truth. It catches a wedge that soakd's own streams do not show (non-streamed requests, other
clients' requests) and confirms one they do. Its threshold is the freeze threshold where the counter
moves every engine step (vLLM); where the server adds a request's tokens only when it ends (SGLang,
TensorRT-LLM, llama.cpp) a working engine can leave it flat as long as a request takes, so the span
must also pass 3x the baseline's e2e p99. The same GET /models probe decides; the evidence names
the sources that saw it (``streams``, ``server_tokens``). Not a wedge: an idle server (nothing
running), a flat counter that is not fresh (scrapes failing: the server is gone), a counter that went
down or a new process start time (a restart: counted from there).

A wedge whose latest fresh scrape shows the KV cache pinned full (``soakd_server_kv_cache_usage_ratio``
at or above ``analysis.kv_saturated.ratio``) with requests running is the engine out of KV blocks, not a
deadlock: the finding is named ``KV cache saturated`` (``soakd.analysis.kvsat``) with the usage and the
running and waiting requests as evidence, and ``soakd_kv_cache_saturated`` is 1 during it (and while the
last closed window holds a KV-saturated finding), so its alert pages instead of SoakdEngineWedged's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from soakd.analysis.kvsat import wedge_diagnosis
from soakd.config.analysis import KvSaturationConfig

log = structlog.get_logger("soakd")

__all__ = ["WedgeWatch"]


class WedgeWatch:
    def __init__(self, recorder: Any, probe: Callable[[], Any], analyzer: Any, gauge: Any,
                 now_ns: Callable[[], int] = time.perf_counter_ns, wall: Callable[[], float] = time.time,
                 window_at: Callable[[float], int | None] = lambda ago: None, scrape_interval: float = 5.0,
                 tokens_per_step: Callable[[], bool] = lambda: True, kv_gauge: Any = None) -> None:
        self.recorder = recorder
        self.kv_gauge = kv_gauge  # soakd_kv_cache_saturated (None: not exported)
        self.probe = probe  # async: GET /models (raises when the server does not answer)
        self.analyzer = analyzer
        self.gauge = gauge
        self.now_ns = now_ns
        self.wall = wall
        self.window_at = window_at  # the window of the moment ``ago`` seconds before now
        self.episode: dict[str, Any] | None = None  # the wedge in progress
        self.episodes = 0
        self._last_check_ns: int | None = None
        self._probing = False
        # the server's side: its token counter, from the server sampler's scrapes
        self.scrape_interval = scrape_interval
        self.tokens_per_step = tokens_per_step  # the counter moves every engine step (else when requests end)
        self._tokens: float | None = None  # the counter at the last scrape
        self._start_time: float | None = None  # the server's process start time at the last scrape
        self._flat_since_ns: int | None = None  # the first scrape that showed the counter's value, running
        self._last_scrape_ns: int | None = None
        self._running: float | None = None
        self._kv: float | None = None  # the KV-cache usage and waiting requests at the last scrape
        self._waiting: float | None = None

    def follow(self, server: Any) -> None:
        """Read the server sampler's scrapes (its runner: ``interval``, ``sampler.table``, ``listeners``)."""
        self.scrape_interval = server.interval
        self.tokens_per_step = lambda: bool(getattr(getattr(server.sampler, "table", None), "tokens_per_step", False))
        server.listeners.append(self.on_server_sample)

    def on_server_sample(self, _sampler: str, snap: Any) -> None:
        """A scrape of the server sampler (a ``SamplerRunner`` listener): its token counter and running count."""
        values = {s.name: s.value for s in snap.series}
        tokens = values.get("soakd_server_generation_tokens_total")
        running = values.get("soakd_server_requests_running")
        start = values.get("soakd_server_process_start_time_seconds")
        self._kv = values.get("soakd_server_kv_cache_usage_ratio")
        self._waiting = values.get("soakd_server_requests_waiting")
        now = self.now_ns()
        restarted = start is not None and self._start_time is not None and start != self._start_time
        if tokens is None or running is None or running <= 0:
            self._flat_since_ns = None  # idle, or nothing to judge
        elif (self._flat_since_ns is None or restarted or self._tokens is None or tokens != self._tokens):
            self._flat_since_ns = now  # moved (or went down: a restart, counted from here), or running again
        self._tokens, self._running, self._start_time = tokens, running, start
        self._last_scrape_ns = now

    def _fresh(self, now_ns: int) -> bool:
        return (self._last_scrape_ns is not None
                and (now_ns - self._last_scrape_ns) / 1e9 <= 2.5 * self.scrape_interval + 1.0)

    def counter_flat(self, now_ns: int) -> float | None:
        """Seconds the server's token counter has stood still with requests running, between the first and
        the latest scrape that showed it (None: nothing running, no counter, or no fresh scrape)."""
        if self._flat_since_ns is None or self._last_scrape_ns is None:
            return None
        if not self._fresh(now_ns):
            return None  # scrapes failing: the server is gone or its metrics are, not a wedge
        return (self._last_scrape_ns - self._flat_since_ns) / 1e9

    def counter_threshold(self, need: float) -> float:
        """The freeze threshold; for a counter that moves only when requests end, also 3x the baseline's e2e p99."""
        if self.tokens_per_step():
            return need
        ref = self.analyzer.baseline if self.analyzer.baseline is not None else self.analyzer.history.last
        e2e = ref.e2e_seconds.p99 if ref is not None else None
        return max(need, 3.0 * (e2e or 0.0))

    def _sources(self, now: int) -> tuple[list[str], float | None, float | None, float]:
        """Which sources see a wedge now (``streams``, ``server_tokens``), the silence, the flat span, the threshold."""
        need = self.analyzer.freeze_threshold()
        quiet, flat = self.silence(now), self.counter_flat(now)
        sources = []
        if quiet is not None and quiet >= need:
            sources.append("streams")
        if flat is not None and flat >= self.counter_threshold(need):
            sources.append("server_tokens")
        return sources, quiet, flat, need

    def silence(self, now_ns: int) -> float | None:
        """Seconds since the newest byte of any streamed request in flight (None: nothing in flight)."""
        newest = None
        for r in self.recorder.active:
            if not r.stream or not r.t_start_ns:
                continue
            t = r.token_times_ns[-1] if r.token_times_ns else (r.t_headers_ns or r.t_start_ns)
            newest = t if newest is None or t > newest else newest
        return None if newest is None else (now_ns - newest) / 1e9

    def _kv_cfg(self) -> KvSaturationConfig:
        cfg = getattr(self.analyzer, "cfg", None)
        return getattr(cfg, "kv_saturated", None) or KvSaturationConfig()

    def _refresh_kv_gauge(self) -> None:
        """1 during a KV-saturated episode, or while the last closed window holds a KV-saturated finding."""
        if self.kv_gauge is not None:
            live = self.episode is not None and self.episode.get("diagnosis") == "KV cache saturated"
            saturated = getattr(getattr(self.analyzer, "freeze", None), "kv_saturated_window", False)
            self.kv_gauge.value = 1.0 if live or saturated else 0.0

    async def check(self) -> None:
        try:
            await self._check()
        finally:
            self._refresh_kv_gauge()

    async def _check(self) -> None:
        now = self.now_ns()
        punctual = self._last_check_ns is None or (now - self._last_check_ns) / 1e9 < 2.5
        self._last_check_ns = now
        # a late check of soakd's own keeps a wedge in progress: its silence may be soakd's, not the server's
        sources, quiet, flat, need = self._sources(now)
        if not sources:
            self._end(quiet)
            return
        if self.episode is not None:
            seen = self.episode["sources_seen"]
            seen.extend(s for s in sources if s not in seen)
            return
        if self._probing or not punctual:
            return  # a probe under way, or soakd itself was late (not the server's silence)
        self._probing = True
        try:
            await asyncio.wait_for(self.probe(), timeout=max(1.0, min(10.0, need)))
        except Exception:  # noqa: BLE001 - the server does not answer: an outage or a whole-server freeze
            return
        finally:
            self._probing = False
        sources, quiet, flat, need = self._sources(self.now_ns())
        if not sources:
            return  # bytes or tokens came while it was probed
        self.episodes += 1
        ago = max(quiet if "streams" in sources and quiet is not None else 0.0,
                  flat if "server_tokens" in sources and flat is not None else 0.0)
        window = self.window_at(ago)  # where the silence began: that window's freeze, reported once
        self.episode = {"start_unix": self.wall() - ago, "silence_seconds": quiet, "threshold_seconds": need,
                        "in_flight": self.recorder.in_flight, "window": window, "sources": list(sources)}
        if self._tokens is not None:  # the server's side, whether or not it has passed its threshold yet
            self.episode.update(server_tokens_flat_seconds=flat, server_requests_running=self._running,
                                server_generation_tokens_total=self._tokens,
                                server_tokens_threshold_seconds=self.counter_threshold(need))
        fresh = self._fresh(self.now_ns())
        if fresh and self._kv is not None:  # the cache as the server last reported it: full, it is out of blocks
            kv_cfg = self._kv_cfg()
            self.episode.update(server_kv_cache_usage_ratio=self._kv, server_requests_running=self._running,
                                server_requests_waiting=self._waiting, kv_saturated_ratio=kv_cfg.ratio)
            diagnosis = wedge_diagnosis(self._kv, self._running, kv_cfg)
            if diagnosis is not None:
                self.episode["diagnosis"] = diagnosis
        self.gauge.value = 1.0
        self.analyzer.add_wedge(self.episode)
        self.episode = {**self.episode, "sources_seen": list(sources)}

    def _end(self, quiet: float | None) -> None:
        if self.episode is None:
            return
        ep, self.episode = self.episode, None
        self.gauge.value = 0.0
        took = self.wall() - ep["start_unix"] - (quiet or 0.0)
        log.info("engine_recovered", wedged_seconds=round(took, 1), window=ep["window"], sources=ep["sources_seen"])
        self.analyzer.wedge_ended(ep, took)
