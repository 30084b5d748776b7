"""Engine wedged and target hung: requests are in flight and no token has come from any of them for
longer than the server's own rhythm allows. A wedge is that silence while the server still answers
``GET /v1/models`` (vLLM and SGLang issues report engines that keep their HTTP front end alive after hours
or after an idle period, and generate nothing); a hung target is that silence while ``GET /models``
does not answer either (the whole process stopped: SIGSTOP, a debugger, a node that froze). The
window's freeze detector (``Analyzer._freeze``) finds the same silence when the window closes; this
finds it live, within seconds, and tells the three apart.

Checked every second (``tick``: a check unless one is under way, so a pending probe never queues the
scheduler's job). The streams' silence is the time since the newest token of any streamed request in
flight or the end of any request that got a response, bounded by the start of the oldest streamed
request in flight (so that the span had streams in flight throughout). Response headers are not
progress: a wedged vLLM or SGLang front end sends them for every new request and no token after them,
whatever metric names the server exports. A silence of the freeze threshold (``Analyzer.freeze_threshold``:
at least ``analysis.client.freeze_min`` and 3x the baseline's TTFT p95 and inter-token p99), or of half
``analysis.client.probe_interval``, with soakd's own loop punctual, is probed with ``GET /models`` on a
connection of its own, at most one probe in flight, each bounded by ``probe_interval`` of the time
soakd's loop was on time (``soakd.core.punctual``: a soakd starved of CPU is not a hung server):

- it answers and the silence has passed the threshold: a wedge, ``soakd_engine_wedged`` 1, a critical
  finding of kind ``freeze`` ('engine wedged', failing the run); the first token after it ends the episode
  (the gauge 0, an info event with its length). A healthy idle period has nothing in flight: never a wedge.
- it times out with requests in flight and no progress from any of them while it waited: 'target hung'
  (kind ``target``, critical), ``soakd_target_up`` 0 (``SoakdTargetDown``) from then until a probe answers
  or a request progresses again, its down time counted from the last progress; the window's freeze of the
  same span is not reported twice. Probed again at once after each timeout. A refused connection is the
  recorder's outage (its connects fail), not a hang.

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

from soakd.analysis.freeze import FALSE_FREEZES
from soakd.analysis.kvsat import wedge_diagnosis
from soakd.config.analysis import KvSaturationConfig
from soakd.core.punctual import within
from soakd.core.records import Outcome, RequestRecord

log = structlog.get_logger("soakd")

__all__ = ["WedgeWatch"]


class WedgeWatch:
    def __init__(self, recorder: Any, probe: Callable[[], Any], analyzer: Any, gauge: Any,
                 now_ns: Callable[[], int] = time.perf_counter_ns, wall: Callable[[], float] = time.time,
                 window_at: Callable[[float], int | None] = lambda ago: None, scrape_interval: float = 5.0,
                 tokens_per_step: Callable[[], bool] = lambda: True, kv_gauge: Any = None,
                 probe_interval: float | None = None) -> None:
        self.recorder = recorder
        # GET /models: the timeout of each probe, the time between two that answer while streams are silent
        client = getattr(getattr(analyzer, "cfg", None), "client", None)
        self.probe_interval = float(probe_interval or getattr(client, "probe_interval", None) or 5.0)
        self.hung: dict[str, Any] | None = None  # the hang in progress (the target does not answer)
        self.hangs = 0
        self.probes = 0
        self._last_end_ns: int | None = None  # the newest end of a request that got a response
        self._next_probe_ns: int | None = None  # after a probe that answered: the next one, silence going on
        self._task: asyncio.Task[None] | None = None
        if hasattr(recorder, "add_listener"):
            recorder.add_listener(self.on_finished)
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
        if quiet is not None and quiet >= need and not self._natural(quiet, now):
            sources.append("streams")
        if flat is not None and flat >= self.counter_threshold(need):
            sources.append("server_tokens")
        return sources, quiet, flat, need

    def on_finished(self, rec: RequestRecord) -> None:
        """A finished request (a recorder listener): its end is progress if a response came (not a timeout,
        a refused or dropped connection, a cancel), else its last token."""
        t = 0
        if rec.outcome in (Outcome.OK, Outcome.HTTP_ERROR, Outcome.INVALID_RESPONSE):
            t = rec.t_end_ns
        elif rec.token_times_ns:
            t = rec.token_times_ns[-1]
        if t and (self._last_end_ns is None or t > self._last_end_ns):
            self._last_end_ns = t

    def progress_ns(self) -> int | None:
        """The newest progress of any request: a token of one in flight, or the end of one that got a response."""
        newest = self._last_end_ns
        for r in self.recorder.active:
            if r.token_times_ns:
                t = r.token_times_ns[-1]
                newest = t if newest is None or t > newest else newest
        return newest

    def silence(self, now_ns: int) -> float | None:
        """Seconds without a token from any streamed request in flight (or the end of any request), since
        the oldest of those streams started (None: no stream in flight). Headers are not progress."""
        oldest = None
        for r in self.recorder.active:
            if r.stream and r.t_start_ns and (oldest is None or r.t_start_ns < oldest):
                oldest = r.t_start_ns
        if oldest is None:
            return None
        newest = self.progress_ns()
        since = oldest if newest is None or newest < oldest else newest
        return (now_ns - since) / 1e9

    def _natural(self, quiet: float, now_ns: int) -> bool:
        """Whether the baseline's inter-token tail makes silences this long, with this many streams silent, more
        often than ``FALSE_FREEZES`` a run (``soakd.analysis.freeze.natural_silences``: sparse heavy-tailed streams)."""
        natural = getattr(self.analyzer, "natural_silences", None)
        if natural is None:
            return False
        half = now_ns - int(quiet * 5e8)  # silent through at least half of it: started before its middle
        n = sum(1 for r in self.recorder.active if r.stream and r.t_start_ns and r.t_start_ns <= half)
        expected = natural(quiet, n)
        return expected is not None and expected > FALSE_FREEZES

    def _kv_cfg(self) -> KvSaturationConfig:
        cfg = getattr(self.analyzer, "cfg", None)
        return getattr(cfg, "kv_saturated", None) or KvSaturationConfig()

    def _refresh_kv_gauge(self) -> None:
        """1 during a KV-saturated episode, or while the last closed window holds a KV-saturated finding."""
        if self.kv_gauge is not None:
            live = self.episode is not None and self.episode.get("diagnosis") == "KV cache saturated"
            saturated = getattr(getattr(self.analyzer, "freeze", None), "kv_saturated_window", False)
            self.kv_gauge.value = 1.0 if live or saturated else 0.0

    async def tick(self) -> None:
        """The scheduler's job: a check, unless the last one is still under way (its probe pending)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.check())
            self._task.add_done_callback(_log_failure)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check(self) -> None:
        try:
            await self._check()
        finally:
            self._last_check_ns = self.now_ns()  # after a probe too: the next check's punctuality is its own
            self._refresh_kv_gauge()

    async def _probe(self) -> bool | None:
        """One GET /models within ``probe_interval``: True answered, False timed out, None refused or failed."""
        self._probing = True
        self.probes += 1
        try:
            await within(self.probe(), self.probe_interval)  # soakd's own stalls are not the server's silence
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - refused or failed: the recorder's connects see an outage
            return None
        finally:
            self._probing = False
        return True

    async def _check(self) -> None:
        now = self.now_ns()
        punctual = self._last_check_ns is None or (now - self._last_check_ns) / 1e9 < 2.5
        if self.hung is not None:
            await self._check_hung(now)
            return
        # a late check of soakd's own keeps a wedge in progress: its silence may be soakd's, not the server's
        sources, quiet, flat, need = self._sources(now)
        if not sources:
            self._end(quiet)
        elif self.episode is not None:
            seen = self.episode["sources_seen"]
            seen.extend(s for s in sources if s not in seen)
            return
        if self._probing or not punctual:
            return  # a probe under way, or soakd itself was late (not the server's silence)
        suspect = quiet is not None and quiet >= min(need, self.probe_interval / 2) and (
            self._next_probe_ns is None or now >= self._next_probe_ns)
        if not sources and not suspect:
            return
        answered = await self._probe()
        after = self.now_ns()
        if answered is False:
            self._hang_began(now, after)
            return
        if not answered:
            return
        self._next_probe_ns = after + int(self.probe_interval * 1e9)
        sources, quiet, flat, need = self._sources(after)
        if not sources:
            return  # tokens came while it was probed, or the silence is not yet a wedge's
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

    def _hang_began(self, probed_ns: int, now_ns: int) -> None:
        """A probe timed out: hung if requests are in flight and none progressed while it waited."""
        progress = self.progress_ns()
        if self.recorder.in_flight <= 0 or (progress is not None and progress >= probed_ns):
            return
        quiet = self.silence(now_ns)  # since the last progress, or since the oldest stream in flight began
        since = now_ns - int(quiet * 1e9) if quiet is not None else probed_ns
        ago = (now_ns - since) / 1e9
        self.hangs += 1
        self.hung = {"start_unix": self.wall() - ago, "silence_seconds": ago, "in_flight": self.recorder.in_flight,
                     "probe_timeout_seconds": self.probe_interval, "window": self.window_at(ago),
                     "since_ns": since}
        log.warning("target_hung", silence_seconds=round(ago, 1), in_flight=self.recorder.in_flight,
                    probe_timeout_seconds=self.probe_interval, window=self.hung["window"])
        set_up = getattr(self.recorder, "set_target_up", None)
        if set_up is not None and getattr(self.recorder, "target_up", True):  # not down already (its own count)
            set_up(False)
            clock, windows = getattr(self.recorder, "clock", None), getattr(self.recorder, "windows", None)
            if clock is not None and windows is not None and ago > 0:  # down since the last progress
                mono = clock.monotonic()
                windows.add_interval(mono - ago, mono, "target_down_seconds")
        self.analyzer.add_hung({k: v for k, v in self.hung.items() if k != "since_ns"})

    async def _check_hung(self, now_ns: int) -> None:
        """While hung: a request that progresses again, or a probe that answers, ends it; else probe again."""
        assert self.hung is not None
        progress = self.progress_ns()
        answered = progress is not None and progress > self.hung["since_ns"]
        if not answered and not self._probing:
            answered = bool(await self._probe())
        if not answered:
            return
        ep, self.hung = self.hung, None
        took = self.wall() - ep["start_unix"]
        set_up = getattr(self.recorder, "set_target_up", None)
        if set_up is not None:
            set_up(True)
        log.info("target_answered", hung_seconds=round(took, 1), window=ep["window"])
        self.analyzer.hung_ended({k: v for k, v in ep.items() if k != "since_ns"}, took)

    def _end(self, quiet: float | None) -> None:
        if self.episode is None:
            return
        ep, self.episode = self.episode, None
        self.gauge.value = 0.0
        took = self.wall() - ep["start_unix"] - (quiet or 0.0)
        log.info("engine_recovered", wedged_seconds=round(took, 1), window=ep["window"], sources=ep["sources_seen"])
        self.analyzer.wedge_ended(ep, took)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("wedge_check_failed", error=repr(task.exception()))
