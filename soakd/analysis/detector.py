"""The detectors a closed window goes through, behind one protocol, and what they share.

``soakd.analysis.engine.Analyzer`` is a loop over its detectors (``Analyzer.detectors``, in order):
each gets the window and the window's ``WindowContext`` — what the detectors before it found (the
drift comparisons, throttle results, leak judgements) and the window's findings so far — adds its own
findings and info events to it, and keeps a live state (``state()``, a typed object) that the
exporter and ``/status`` read. A window cut short by the end of the run goes only to the detectors
whose ``partial`` is true. After every detector has seen the window, each ``close``s it. At the end
of the run each may add run-level findings (``finish``); on resume each is primed with the earlier
segments' windows (``restore``), making no findings.

The detectors here are the small ones; the drift detector (the baseline pool, live comparisons and
the end-of-run change points) is ``soakd.analysis.drift_watch``.

Longer than 500 lines: one small detector a finding family (throttle, leak, GPU errors, diagnosis,
freeze, restarts, client, errors) beside the protocol they share; each is a few dozen lines, and
splitting them would scatter the one loop's contract over as many modules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from soakd.analysis import leak as leak_mod
from soakd.analysis import throttle as throttle_mod
from soakd.analysis.diagnosis import diagnose, performance_drift, performance_steady
from soakd.analysis.drift import DriftResult
from soakd.analysis.freeze import freeze_finding, freeze_threshold, hung_finding, wedge_finding
from soakd.analysis.gpu_errors import GpuErrors
from soakd.analysis.kvsat import kv_saturated_finding
from soakd.analysis.leak_page import LIVE_LEAK_DIAGNOSES, live_confidence, paged_from, withdrawn_finding
from soakd.analysis.restarts import ServerRestarts
from soakd.config.analysis import AnalysisConfig
from soakd.core.findings import Finding
from soakd.core.summary import ClientSummary, WindowSummary

__all__ = [
    "AbDetector",
    "AbState",
    "ClientDetector",
    "Detector",
    "DiagnosisDetector",
    "FreezeDetector",
    "FreezeState",
    "GpuErrorDetector",
    "LeakDetector",
    "LeakState",
    "PowerCapDetector",
    "RestartDetector",
    "RunContext",
    "ThrottleDetector",
    "ThrottleState",
    "WindowContext",
    "lagged",
    "own_delay",
    "own_delay_span",
]

Window = WindowSummary
EventSink = Callable[[str, str, str, dict[str, Any], int | None], None]  # kind, severity, message, data, window


@dataclass
class WindowContext:
    """One closed window on its way through the detectors."""

    window: Window
    full: list[Window]  # every full window of the run so far (this one included when full)
    emit: EventSink  # info events (a leak judgement revised, another memory step)
    baseline: Window | None = None  # the run's baseline window (the drift detector's)
    pool: list[Window] = field(default_factory=list)  # the baseline pool's windows (the drift detector's)
    drift: list[DriftResult] = field(default_factory=list)  # this window's live comparisons
    throttles: list[throttle_mod.ThrottleResult] = field(default_factory=list)
    leaks: list[leak_mod.LeakResult] = field(default_factory=list)  # the run's leak judgements now
    new_leaks: list[leak_mod.LeakResult] = field(default_factory=list)  # suspected since the last window
    new_steps: list[leak_mod.LeakResult] = field(default_factory=list)  # a staircase named at this window
    findings: list[Finding] = field(default_factory=list)  # the window's findings so far

    @property
    def partial(self) -> bool:
        return self.window.partial


@dataclass
class RunContext:
    """The end of the run."""

    full: list[Window]
    emit: EventSink


class Detector(Protocol):
    """One detector: a closed window in (its findings into ``ctx.findings``), its live state out."""

    name: str
    partial: bool  # whether a partial window (cut short by the end of the run) goes to it

    def add(self, w: Window, ctx: WindowContext) -> None: ...

    def close(self, w: Window, ctx: WindowContext) -> None: ...

    def restore(self, windows: list[Window], baseline: Window | None = None) -> None: ...

    def finish(self, ctx: RunContext) -> list[Finding]: ...

    def state(self) -> Any: ...


class _Quiet:
    """Defaults: full windows only, nothing after a window, nothing to restore, nothing at the end."""

    partial = False

    def close(self, w: Window, ctx: WindowContext) -> None:
        return None

    def restore(self, windows: list[Window], baseline: Window | None = None) -> None:
        return None

    def finish(self, ctx: RunContext) -> list[Finding]:
        return []


# ---------------------------------------------------------------------------------------------
# throttling


@dataclass(frozen=True)
class ThrottleState:
    detected: bool = False
    results: tuple[throttle_mod.ThrottleResult, ...] = ()
    gpus: tuple[str, ...] = ()  # the GPUs the judged window reported clocks-event reasons for


class ThrottleDetector(_Quiet):
    """Clocks-event reasons against the SM clock (its reference and noise from the drift detector's baseline
    ``pool``, the windows in a row beyond that noise) and latency (``soakd.analysis.throttle``)."""

    name = "throttle"
    partial = True

    def __init__(self, cfg: AnalysisConfig, pool: Callable[[], list[Window]] | None = None) -> None:
        self.cfg = cfg
        self.pool = pool or (lambda: [])
        self._state = ThrottleState()
        self.beyond = 0  # consecutive full windows, up to the last, whose clock was beyond its noise

    def add(self, w: Window, ctx: WindowContext) -> None:
        perf = bool(performance_drift(ctx.drift))
        pool = self.pool()
        in_pool = any(p.window == w.window for p in pool)
        ref = throttle_mod.clock_reference(pool, self.cfg.throttle) if pool and not in_pool else None
        results = throttle_mod.evaluate(w, None if in_pool else ctx.baseline, self.cfg.throttle, latency_drift=perf,
                                        reference=ref, beyond_before=self.beyond)
        results = throttle_mod.charge_gpus(results, w, pool, self.cfg.throttle)
        self.beyond = self.beyond if w.partial else max((t.beyond_windows for t in results), default=0)
        self._state = ThrottleState(any(t.detected for t in results), tuple(results),
                                    tuple(sorted(w.device.throttle_share_by_gpu or ())))
        ctx.throttles = results

    def state(self) -> ThrottleState:
        return self._state


class PowerCapDetector(_Quiet):
    """A power or thermal reason active without an impact (the SM clock within its noise of the baseline
    pool's, or latency and throughput where they were): a GPU at its limit under full load, named as
    healthy (after the diagnosis, which names throttling) once, and once more the first time its clock
    is beyond its noise with latency steady. Only in a window whose latency and throughput were judged and
    none is worse than the baseline by more than its threshold (a throttled window too thin to judge, or
    one whose latency rose without a page, says nothing). Never fails the run."""

    name = "power_cap"

    def __init__(self) -> None:
        self.reported = False
        self.reported_low = False  # the clock beyond its noise, latency steady: said once too

    def add(self, w: Window, ctx: WindowContext) -> None:
        if not performance_steady(ctx.drift):
            return  # latency or throughput not judged, or worse beyond the threshold: 'healthy' cannot be said
        capped = [t for t in ctx.throttles if t.active and not t.impact and t.sm_clock_reference_kind == "baseline"]
        low = [t for t in capped if t.beyond_noise]
        if capped and not low and not self.reported:
            self.reported = True
            ctx.findings.append(Finding(
                kind="throttle", diagnosis="power-capped, healthy", severity="info",
                message="; ".join(t.message() for t in capped) + ": the SM clock is within its noise of the "
                "baseline's, so this is a GPU running at its limit under full load, not throttling",
                evidence={"throttle": [t.to_dict() for t in capped]}, window=w.window))  # fmt: skip
        elif low and not self.reported_low:
            self.reported = self.reported_low = True
            ctx.findings.append(Finding(
                kind="throttle", diagnosis="power-capped, healthy", severity="info",
                message="; ".join(t.message() for t in low) + ": the SM clock is below the baseline's but latency "
                "and throughput have not moved, so the GPU's limit costs nothing measurable: not throttling",
                evidence={"throttle": [t.to_dict() for t in low]}, window=w.window))  # fmt: skip

    def state(self) -> bool:
        return self.reported


# ---------------------------------------------------------------------------------------------
# memory


@dataclass(frozen=True)
class LeakState:
    leaks: dict[str, leak_mod.LeakResult] = field(default_factory=dict)


class LeakDetector(_Quiet):
    """The run's leak judgement of every memory source after each window (``soakd.analysis.leak``):
    what became suspected (named once), what was revised, a staircase and its later steps.

    The judgement after each window is one of many looks at a growing series: it is made at
    ``live_confidence`` (by default the run's ``1 - confidence`` spread over its planned looks), and
    the run's last judgement (``finish``) once more at ``confidence``. A source paged live that the
    last judgement clears is said: a 'leak page withdrawn' warning with the rate it was paged at."""

    name = "leak"
    partial = True  # judged after a partial window too (its findings wait for a full one)

    def __init__(self, cfg: AnalysisConfig, planned_windows: int = 48) -> None:
        self.cfg = cfg
        self.leaks: dict[str, leak_mod.LeakResult] = {}
        self.paged: dict[str, tuple[int | None, leak_mod.LeakResult]] = {}  # source -> (window, first suspected)
        self.named: set[str] = set()  # sources a window's finding named (once: a later flip back is an info event)
        self.live_cfg = cfg.leak.model_copy(update={"confidence": live_confidence(cfg.leak, planned_windows)})
        self.finished = False

    def add(self, w: Window, ctx: WindowContext) -> None:
        before = self.leaks
        leaks = leak_mod.evaluate(ctx.full, self.live_cfg, live=True)
        for lk in leaks:
            if lk.suspected and lk.source not in self.paged:
                self.paged[lk.source] = (None if ctx.partial else w.window, lk)
        # named once, in the first full window that suspects it: a judgement near its bound that clears and
        # suspects again is one leak (seen: 52 of 240 noisy 30-80 MiB/h runs named twice or three times, and a
        # 1 GiB/s leak under load named at the 8th probe and again at the 10th)
        ctx.new_leaks = [] if ctx.partial else [lk for lk in leaks if lk.suspected and lk.source not in self.named]
        self.named |= {lk.source for lk in ctx.new_leaks}
        revised = [lk for lk in leaks if not lk.suspected and before.get(lk.source) is not None
                   and before[lk.source].suspected]
        again = [lk for lk in leaks if lk.suspected and lk not in ctx.new_leaks and before.get(lk.source) is not None
                 and not before[lk.source].suspected]
        # a staircase is named once (a 'memory steps' finding); its later steps are info events
        ctx.new_steps = [lk for lk in leaks if lk.memory_steps and not (before.get(lk.source)
                                                                        and before[lk.source].memory_steps)]
        more_steps = [lk for lk in leaks if lk.memory_steps and lk not in ctx.new_steps
                      and lk.steps > before[lk.source].steps]
        self.leaks = {lk.source: lk for lk in leaks}
        ctx.leaks = leaks
        if ctx.partial:
            return
        for lk in revised:
            ctx.emit("leak", "info", f"leak finding revised: {lk.message()}", lk.to_dict(), w.window)
        for lk in again:
            ctx.emit("leak", "info", f"leak suspected again: {lk.message()}", lk.to_dict(), w.window)
        for lk in more_steps:
            ctx.emit("leak", "info", f"memory steps: another step: {lk.message()}", lk.to_dict(), w.window)

    def restore_page(self, f: Finding) -> None:  # resume: a page an earlier segment raised (its finding)
        page = paged_from(f)
        if page is not None and page[1].source not in self.paged:
            self.paged[page[1].source] = page
        # named by a window of an earlier segment, even where an earlier release's evidence lacks the fields
        # of a judgement to withdraw (paged_from: None): not named a second time
        source = f.evidence.get("source")
        if f.kind == "leak" and f.diagnosis in LIVE_LEAK_DIAGNOSES and f.window is not None and source:
            self.named.add(source)

    def finish(self, ctx: RunContext) -> list[Finding]:
        """The run's last judgement, one look at ``confidence``: a leak it finds that no window named is a
        finding now; a source paged during the run that it clears is a 'leak page withdrawn' warning."""
        if self.finished or not ctx.full:
            return []
        self.finished, leaks = True, leak_mod.evaluate(ctx.full, self.cfg.leak)
        self.leaks = {lk.source: lk for lk in leaks}
        out: list[Finding] = []
        for lk in leaks:
            if not lk.suspected or lk.source in self.named:
                continue
            diag = "KV cache not released" if lk.source in ("kv_cache", "kv_residue") else "memory leak"
            out.append(Finding(kind="leak", diagnosis=diag, severity="critical",
                               message=f"the run's last leak judgement: {lk.message()}", evidence=lk.to_dict()))
        out += [withdrawn_finding(window, paged, self.leaks[source]) for source, (window, paged) in self.paged.items()
                if source in self.leaks and not self.leaks[source].suspected]
        return out

    def state(self) -> LeakState:
        return LeakState(dict(self.leaks))


# ---------------------------------------------------------------------------------------------
# the GPU and the server


class GpuErrorDetector(_Quiet):
    """New Xid events and uncorrected ECC errors (``soakd.analysis.gpu_errors``): critical at once, in a
    partial window too."""

    name = "gpu"
    partial = True

    def __init__(self) -> None:
        self.errors = GpuErrors()

    def add(self, w: Window, ctx: WindowContext) -> None:
        ctx.findings += self.errors.add(w)

    def restore(self, windows: list[Window], baseline: Window | None = None) -> None:
        for w in windows:  # partial ones too: their counters are the latest of their segment
            self.errors.prime(w)

    def state(self) -> dict[str, dict[str, float]]:
        return {gpu: dict(v) for gpu, v in self.errors.prev.items()}


class RestartDetector(_Quiet):
    """Server restarts recognised in its own metrics (``soakd.analysis.restarts``), said in the window's
    'target restarted' finding or in one of their own."""

    name = "restarts"
    partial = True

    def __init__(self) -> None:
        self.restarts = ServerRestarts()
        self.total = 0

    def add(self, w: Window, ctx: WindowContext) -> None:
        n = self.restarts.count(w)
        self.total += n
        if n:
            self.restarts.report(w, n, ctx.findings)

    def restore(self, windows: list[Window], baseline: Window | None = None) -> None:
        for w in windows:
            self.total += self.restarts.count(w)

    def state(self) -> int:
        return self.total


# ---------------------------------------------------------------------------------------------
# the method's troubleshooting table


class DiagnosisDetector(_Quiet):
    """What the detectors before it found, in the window, mapped onto the troubleshooting table
    (``soakd.analysis.diagnosis``): outages, errors, throttling, a falling prefix-cache hit rate, bandwidth
    pressure, leaks, SLO, performance drift."""

    name = "diagnosis"

    def __init__(self, cfg: AnalysisConfig) -> None:
        self.cfg = cfg

    def add(self, w: Window, ctx: WindowContext) -> None:
        kv_res = next((lk for lk in ctx.leaks if lk.source == "kv_residue"), None)
        ctx.findings += diagnose(
            w, ctx.drift, ctx.throttles,
            [lk for lk in ctx.leaks if lk.source != "kv_residue" and (lk in ctx.new_leaks or lk in ctx.new_steps)],
            kv_res if kv_res is not None and kv_res in ctx.new_leaks else None,
            baseline=ctx.baseline, pool=ctx.pool, drift_cfg=self.cfg.drift, cfg=self.cfg.diagnosis,
        )  # fmt: skip

    def state(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# silence: freezes, wedges, a saturated KV cache


@dataclass(frozen=True)
class FreezeState:
    wedged_windows: frozenset[int] = frozenset()
    kv_saturated_window: bool = False  # the last full window closed with a KV-saturated finding


class FreezeDetector(_Quiet):
    """The window's longest silence with requests in flight (``soakd.analysis.freeze``), unless a live
    wedge finding of the window already reported it, and its KV-saturated-and-stuck span
    (``soakd.analysis.kvsat``), unless a live wedge episode overlapped the window (one fault, one
    finding). The live wedges themselves (``soakd.soak.wedge``) come in through ``add_wedge``. Partial windows
    too (a freeze in the run's last, cut-short window is one). Before there is a baseline the threshold comes
    from the quietest full window so far (``w`` included): a freeze inflates its own window's TTFT p95 (every
    request waiting through it), so ``w`` alone could set the bar above the very freeze it measured."""

    name = "freeze"
    partial = True

    def __init__(self, cfg: AnalysisConfig) -> None:
        self.cfg = cfg
        self.wedged_windows: set[int] = set()  # windows a live 'engine wedged' finding was made in
        # live wedge episodes (start unix, end unix or None while it lasts)
        self.live_episodes: deque[list[float | None]] = deque(maxlen=100)
        self.kv_saturated_window = False
        self.baseline: Window | None = None
        self.planned = 48  # the run's windows (the Analyzer's planned_windows): natural silences per run
        self.quietest: Window | None = None  # before a baseline: the full window with the lowest threshold

    def threshold(self, w: Window | None, baseline: Window | None = None) -> float:
        """The silence a freeze must outlast, from the baseline (the run's, or the one this detector saw
        last), else from ``w``."""
        ref = baseline if baseline is not None else self.baseline
        if ref is not None:
            return freeze_threshold(self.cfg, ref)
        own = freeze_threshold(self.cfg, w)
        return own if self.quietest is None else min(own, freeze_threshold(self.cfg, self.quietest))

    def add(self, w: Window, ctx: WindowContext) -> None:
        self.baseline = ctx.baseline
        if w.window not in self.wedged_windows:
            ref = self.baseline if self.baseline is not None and self.baseline.window != w.window else w
            f = freeze_finding(w, self.threshold(w), ref, self.planned)
            if f is not None:
                ctx.findings.append(f)
        if not w.partial and (self.quietest is None or freeze_threshold(self.cfg, w) < freeze_threshold(
                self.cfg, self.quietest)):
            self.quietest = w
        if w.partial:
            return  # its KV span: full windows only, as before
        kv = self._kv_saturated(w, ctx.baseline)
        self.kv_saturated_window = kv is not None
        if kv is not None:
            ctx.findings.append(kv)

    def _kv_saturated(self, w: Window, baseline: Window | None) -> Finding | None:
        if w.server.kv_saturated is None:
            return None
        start = w.start_unix
        end = None if start is None else start + (w.wall_duration_seconds or w.duration_seconds)
        for s, e in self.live_episodes:
            if start is None or s is None or ((e is None or e >= start) and end is not None and s <= end):
                return None
        ref = baseline if baseline is not None and baseline.window != w.window else None
        return kv_saturated_finding(w, ref, self.cfg.kv_saturated)

    def wedge(self, ep: dict[str, Any]) -> Finding:
        """A live wedge: requests in flight, no byte, the server answering."""
        if ep.get("window") is not None:
            self.wedged_windows.add(ep["window"])
        self.live_episodes.append([ep.get("start_unix"), None])
        return wedge_finding(ep)

    def hung(self, ep: dict[str, Any]) -> Finding:
        """A live hang: requests in flight, no progress, GET /models timed out (its window's freeze is this)."""
        if ep.get("window") is not None:
            self.wedged_windows.add(ep["window"])
        self.live_episodes.append([ep.get("start_unix"), None])
        return hung_finding(ep)

    def wedge_ended(self, ep: dict[str, Any], seconds: float) -> None:
        for span in self.live_episodes:
            if span[0] == ep.get("start_unix") and span[1] is None and span[0] is not None:
                span[1] = span[0] + seconds

    def state(self) -> FreezeState:
        return FreezeState(frozenset(self.wedged_windows), self.kv_saturated_window)


# ---------------------------------------------------------------------------------------------
# soakd itself


class ClientDetector(_Quiet):
    """A window in which soakd itself stalled through too much of it (``ClientSummary.impaired``): shown,
    not judged on latency; said as a finding. (Requests a stall overlapped in other windows are counted
    in their window's client summary, and left out of its latency.)

    A window judged while soakd's loop lagged at its p99 beyond ``analysis.client.timing_lag_p99`` (soakd
    short of CPU all window long, e.g. at its cgroup limit: no single stall beyond ``request_max_lag``, so
    no request impaired) is 'client lagging': its latencies carry up to that lag of soakd's own, and
    inter-token gaps shorter than it are not resolved (tokens read together). Measured: at a half-core
    quota and ~29,000 streamed tokens/s soakd's loop lagged 52-66 ms at p99, its TTFT mean was 46.6 ms
    against the server's own 21.9 ms and its ITL p50 read 0 (``benchmarks/busy_node.py --high-rate``)."""

    name = "client"

    def __init__(self, config: AnalysisConfig) -> None:
        self.impaired = 0
        self.cfg = config

    def add(self, w: Window, ctx: WindowContext) -> None:
        c = w.client
        if c is not None and c.impaired:
            self.impaired += 1
            ctx.findings.append(Finding(kind="client", diagnosis="client-impaired", severity="info",
                                        message=f"window {w.window} is client-impaired (shown, not judged on "
                                                f"latency): "
                                                f"{c.impaired_reason}",
                                        evidence=c.model_dump(), window=w.window))
        elif c is not None and lagged(w, self.cfg):
            ctx.findings.append(lagging_finding(w, c))

    def state(self) -> int:
        return self.impaired


def lagging_finding(w: Window, c: ClientSummary) -> Finding:
    """'client lagging' for window ``w`` (see ``ClientDetector``), with the server's own TTFT and ITL means
    beside soakd's where the server exports them."""
    p99 = c.loop_lag_p99_seconds or 0.0
    ev: dict[str, Any] = {"loop_lag_p99_seconds": p99, "loop_lag_max_seconds": c.loop_lag_max_seconds,
                          "cpu_share": c.cpu_share, "cgroup_throttled_seconds": c.cgroup_throttled_seconds}
    cpu = f", soakd using {c.cpu_share:.2f} of a core" if c.cpu_share is not None else ""
    seen = []
    for metric, ours, theirs in w.beside_server():
        ev[f"{metric}_mean_seconds"], ev[f"server_{metric}_mean_seconds"] = ours, theirs
        seen.append(f"{metric.upper()} mean {ours * 1000:.1f} ms, the server's own {theirs * 1000:.1f} ms")
    also = f" ({'; '.join(seen)})" if seen else ""
    return Finding(kind="client", diagnosis="client lagging", severity="info",
                   message=f"window {w.window}: soakd's event loop lagged {p99 * 1000:.0f} ms at p99 (longest "
                           f"{(c.loop_lag_max_seconds or p99) * 1000:.0f} ms){cpu}: the latencies it measured "
                           f"include up to that much of its own delay, and inter-token gaps shorter than it are "
                           f"not resolved{also}; judged all the same (no single stall reached "
                           f"analysis.client.request_max_lag)",
                   evidence=ev, window=w.window)


def lag_of(w: Window) -> float | None:
    """soakd's own loop lag p99 in the window (its heartbeat), or None."""
    return w.client.loop_lag_p99_seconds if w.client is not None else None


def lagged(w: Window, cfg: AnalysisConfig) -> bool:
    """soakd's loop lagged beyond ``analysis.client.timing_lag_p99`` at its p99 in the window ('client lagging'):
    its own latencies there carry its own queueing; the server's own means are what is judged
    (``soakd.core.tracked``)."""
    lag, bound = lag_of(w), cfg.client.timing_lag_p99
    return bound is not None and lag is not None and lag >= bound


def own_delay(f: Finding, closed: list[Window], pool: list[Window], cfg: AnalysisConfig) -> str | None:
    """Why a latency drift is soakd's own delay and not the server's, or None: in its windows (``closed``: the
    run's full windows) soakd's loop lagged beyond ``analysis.client.timing_lag_p99`` at its p99 ('client
    lagging': soakd short of CPU, its latencies carry its own queueing, which moves with its backlog), and the
    server's own TTFT and ITL means over the same windows (its histograms; those its metrics need: e2e both)
    are within the drift threshold of the baseline ``pool``'s. Seen at a half-core quota and ~29,000 streamed
    tokens/s: soakd's TTFT p50 37 -> 45-55 ms, e2e p50 +5.6%, the server's own TTFT mean 21.7-22.8 ms
    throughout (``benchmarks/busy_node.py --high-rate``). Where the server exports no such histograms, or soakd
    was punctual, the drift is judged as any other."""
    if f.window is None:
        return None
    return own_delay_span(f.metrics, f.window, f.last_window or f.window, closed, pool, cfg)


def own_delay_span(metrics: list[str], first: int, last: int, closed: list[Window], pool: list[Window],
                   cfg: AnalysisConfig) -> str | None:
    """``own_delay`` for a drift of ``metrics`` over windows ``first``-``last`` (the live page asks it too)."""
    bound = cfg.client.timing_lag_p99
    families = {m.split("_", 1)[0] for m in metrics}
    if bound is None or not families or not families <= {"ttft", "itl", "e2e"}:
        return None
    by = {w.window: w for w in closed}
    span = [by[i] for i in range(first, max(first, last) + 1) if i in by]
    lags = [lag for lag in map(lag_of, span) if lag is not None]
    if not span or not pool or not any(lagged(w, cfg) for w in span):
        return None
    moved = []
    for family in ("ttft", "itl"):
        if family not in families and "e2e" not in families:
            continue
        key = f"{family}_mean_seconds"
        now = [getattr(w.server, key) for w in span]
        ref = [getattr(w.server, key) for w in pool]
        if any(v is None or not v > 0 for v in (*now, *ref)):
            return None
        change = (sum(now) / len(now)) / (sum(ref) / len(ref)) - 1.0
        if abs(change) >= cfg.drift.threshold:
            return None
        moved.append(f"{family.upper()} mean {change:+.1%}")
    where = f"window {first}" if len(span) == 1 else f"windows {span[0].window}-{span[-1].window}"
    return (f"soakd's own delay, not the server's: soakd's loop lagged up to {max(lags) * 1000:.0f} ms at p99 in "
            f"{where} (client lagging) while the server's own {' and '.join(moved)} against the baseline pool "
            f"(its histograms): reported, not failing")


# ---------------------------------------------------------------------------------------------
# A/B: every target's windows


@dataclass(frozen=True)
class AbState:
    last: dict[tuple[str, str], Any] = field(default_factory=dict)  # (metric, candidate) -> the newest AbResult
    run: tuple[Any, ...] | None = None  # the run-level comparisons, once the run ended


class AbDetector(_Quiet):
    """An A/B run's judge over every target's windows (``soakd.analysis.ab``), in the reference target's
    analysis: each comparison of a tier is a finding of kind ``ab`` (a *confident* worse one critical,
    failing the run by default; likely or better ones info); the run-level comparison at the end."""

    name = "ab"
    partial = True  # a partial window pairs with nothing (not eligible), as before

    def __init__(self, judge: Any) -> None:
        self.judge = judge
        self.run: list[Any] | None = None

    @staticmethod
    def findings(results: list[Any]) -> list[Finding]:
        out = []
        for r in results:
            if r.tier is None:
                continue
            worse = r.tier == "confident" and r.direction == "worse"
            out.append(Finding(kind="ab", diagnosis=f"{r.tier} A/B {'regression' if r.direction == 'worse' else 'difference'}",
                               severity="critical" if worse else "info", message=r.message(),
                               evidence={"tier": r.tier, **r.to_dict()}, window=r.window))
        return out

    def add(self, w: Window, ctx: WindowContext) -> None:
        """The reference target's own window."""
        ctx.findings += self.findings(self.judge.add(self.judge.reference, w))

    def add_target(self, target: str, w: Window) -> list[Finding]:
        """Another target's window: the comparisons it completes."""
        return self.findings(self.judge.add(target, w))

    def restore(self, windows: list[Window], baseline: Window | None = None) -> None:
        for w in windows:
            self.judge.windows[self.judge.reference][w.window] = w

    def restore_target(self, target: str, windows: list[Window]) -> None:
        for w in windows:
            self.judge.windows[target][w.window] = w

    def finish(self, ctx: RunContext) -> list[Finding]:
        if self.run is not None:
            return []
        self.run = self.judge.run_results()
        return self.findings(self.run)

    def state(self) -> AbState:
        return AbState(dict(self.judge.last), tuple(self.run) if self.run is not None else None)
