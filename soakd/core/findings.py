"""Findings and the one registry of their kinds.

A finding is what a detector says about the run (a window, a span of windows, or the whole run): its
kind (what ``analysis.verdict.fail_on`` names), its diagnosis (the troubleshooting row it is), its
severity, message and evidence. Every output — the report's formats, the terminal summary, the log
lines, JUnit, ``/status``, ``soakd compare`` — renders findings through this registry: the title, the
report section, the runbook anchor, what is seen and what to check, and the evidence to show. A
finding of a diagnosis that is not registered cannot be built (a test also checks every diagnosis
the code names), so no output can leave one out.

Longer than 500 lines: the registry is one table, one entry per kind with its words for people
(title, what is seen, what to check, evidence); it is data, kept in one place on purpose.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DIAGNOSES",
    "KINDS",
    "SECTIONS",
    "Diagnosis",
    "Finding",
    "FindingKind",
    "Severity",
    "evidence_pairs",
    "evidence_text",
    "failing_reason",
    "finding_log",
    "fmt_bytes",
]

Severity = Literal["info", "warning", "critical"]
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
RUNBOOK_BASE = "https://github.com/soakd/soakd/blob/main/docs/runbooks.md"

# the report's sections, in the order it shows them
SECTIONS: dict[str, str] = {
    "gpu": "GPU health",
    "performance": "Latency and throughput",
    "memory": "Memory",
    "engine": "Server and engine",
    "errors": "Errors and output",
    "ab": "A/B",
    "client": "soakd itself",
}


@dataclass(frozen=True)
class FindingKind:
    """A kind of finding: what ``analysis.verdict.fail_on`` names (each diagnosis is of one kind)."""

    name: str
    title: str
    severity: Severity  # its findings' usual severity (each diagnosis has its own)
    fail_on: bool  # whether analysis.verdict.fail_on may name it
    default_fail: bool  # in the default fail_on
    section: str  # where the report shows its findings (each diagnosis may say otherwise)
    runbook: str  # its main alert's section in docs/runbooks.md


KINDS: dict[str, FindingKind] = {k.name: k for k in (
    FindingKind("gpu", "GPU errors", "critical", True, True, "gpu", "soakdgpuxiderrors"),
    FindingKind("drift", "Drift", "critical", True, True, "performance", "soakddriftdetected"),
    FindingKind("slo", "SLO", "warning", True, True, "performance", "soakdslobroken"),
    FindingKind("leak", "Memory leaks", "critical", True, True, "memory", "soakdmemoryleaksuspected"),
    FindingKind("throttle", "Throttling", "critical", True, True, "gpu", "soakdgputhrottling"),
    FindingKind("canary", "Canary", "critical", True, True, "errors", "soakdcanarymismatch"),
    FindingKind("errors", "Errors", "critical", True, True, "errors", "soakderrorrateabovebudget"),
    FindingKind("freeze", "Freezes", "critical", True, True, "engine", "soakdenginewedged"),
    FindingKind("target", "Target", "critical", True, False, "engine", "soakdtargetdown"),
    FindingKind("ab", "A/B", "critical", True, True, "ab", "soakdabregression"),
    FindingKind("client", "soakd itself", "info", False, False, "client", "soakdclientimpaired"),
)}


@dataclass(frozen=True)
class Diagnosis:
    """One row of the method's troubleshooting table: a diagnosis a finding can carry."""

    name: str
    kind: str
    title: str
    severity: Severity  # its usual severity (a finding may be milder: a warning before it is critical)
    fails: bool  # whether a finding of it can fail the run at all (memory steps, power-capped: never)
    section: str
    runbook: str  # the anchor of its section in docs/runbooks.md
    seen: str  # what is seen
    check: str  # what to check
    evidence: tuple[str, ...] = ()  # the evidence keys every output shows, in this order
    end_of_run: bool = False  # made at the end of a run, over all of it (a resumed run makes it again)

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_BASE}#{self.runbook}"


def _d(name: str, kind: str, severity: Severity, section: str, runbook: str, seen: str, check: str,
       evidence: tuple[str, ...] = (), *, fails: bool = True, title: str | None = None,
       end_of_run: bool = False) -> Diagnosis:
    return Diagnosis(name, kind, title or name[:1].upper() + name[1:], severity, fails, section, runbook, seen, check,
                     evidence, end_of_run)


_DRIFT = ("drift",)
DIAGNOSES: dict[str, Diagnosis] = {d.name: d for d in (
    _d("GPU Xid error", "gpu", "critical", "gpu", "soakdgpuxiderrors",
       "the GPU driver reported a critical Xid event (NVML): the GPU faulted, whatever latency did",
       "the Xid code's meaning and action (docs/analysis.md#gpu-errors), dmesg/journalctl -k, nvidia-smi -q, nvidia-bug-report.sh",
       ("gpu", "xid", "name", "events", "action")),
    _d("uncorrectable ECC error", "gpu", "critical", "gpu", "soakdgpuuncorrectedecc",
       "new uncorrected (double-bit) ECC errors in device memory during the run",
       "nvidia-smi -q -d ECC,ROW_REMAPPER (remapping pending: reset the GPU); repeated errors: replace the GPU",
       ("gpu", "ecc_uncorrected", "total"), title="Uncorrectable ECC error"),
    _d("throttling", "throttle", "critical", "gpu", "soakdgputhrottling",
       "latency or throughput drift while a power or thermal clocks-event reason is active",
       "cooling (airflow, inlet temperature), power cap and power-brake settings, SM clock history",
       ("throttle", "drift")),
    _d("power-capped, healthy", "throttle", "info", "gpu", "soakdgpupowercapped",
       "a power or thermal clocks-event reason active without an impact: the SM clock within its noise of the "
       "baseline pool's, or latency and throughput where they were",
       "nothing: the GPU runs at its limit under full load", ("throttle",), fails=False),
    _d("KV cache not released", "leak", "critical", "memory", "soakdkvcachenotreleased",
       "memory that keeps rising: idle KV usage that does not return to its first idle value",
       "request cancellation and abort paths, prefix-cache eviction, server version",
       ("source", "growth_per_hour", "ci", "unit", "pattern", "n_windows", "hours_to_exhaustion")),
    _d("memory leak", "leak", "critical", "memory", "soakdmemoryleaksuspected",
       "device or process memory that keeps rising at the same load",
       "allocator caching, CUDA graphs per new shape, host-side buffers, server version",
       ("source", "growth_per_hour", "ci", "unit", "pattern", "n_windows", "hours_to_exhaustion")),
    _d("leak page withdrawn", "leak", "warning", "memory", "soakdmemoryleaksuspected",
       "a leak page raised during the run (soakd_memory_leak_suspected 1 after some window) that the run's last "
       "judgement withdrew: the series that looked like a climb settled, or was a cycle the probes caught at "
       "moving phases",
       "the source's series on the Memory dashboard around the window it was paged at, the rate it was paged at "
       "against the last judgement's, the quiesce probes' times (analysis.quiesce.jitter)",
       ("source", "withdrawn_growth_per_hour", "growth_per_hour", "paged_window", "pattern", "unit"), fails=False,
       title="Leak page withdrawn", end_of_run=True),
    _d("memory steps", "leak", "warning", "memory", "soakdmemorysteps",
       "device or process memory that grew in discrete steps with flat plateaus between them while KV-cache usage "
       "stayed flat: allocator growth or a CUDA graph captured per new batch shape or sequence length, not a linear "
       "leak",
       "the server's graph-capture sizes (vLLM cudagraph_capture_sizes, --enforce-eager to compare), the allocator "
       "(PYTORCH_CUDA_ALLOC_CONF expandable_segments), new max prompt/batch shapes at each step; if the steps keep "
       "coming, cap the shapes or leave the headroom",
       ("source", "steps", "steps_bytes", "last_step_window", "growth_per_hour", "unit"), fails=False),
    _d("engine wedged", "freeze", "critical", "engine", "soakdenginewedged",
       "requests in flight and not a byte from any of them (or the server's token counter still while it runs "
       "requests) while the server still answers /health and /v1/models",
       "the engine's logs and stack (py-spy dump of the engine core), a scheduler or collective deadlock, GPU hangs "
       "(Xid); restart the server and note the uptime it wedged at",
       ("silence_seconds", "in_flight", "sources", "server_tokens_flat_seconds", "server_requests_running",
        "threshold_seconds")),
    _d("KV cache saturated", "freeze", "critical", "engine", "soakdkvcachesaturated",
       "KV-cache usage pinned near 100% while the server runs requests and generates (almost) no tokens: out of KV "
       "blocks, not deadlocked (soakd.analysis.kvsat)",
       "preemptions (vllm:num_preemptions_total), leaked blocks (idle usage after a quiesce), admission and "
       "max_num_seqs / max_num_batched_tokens against gpu_memory_utilization, prompt + output lengths vs the cache; "
       "restart the server to free it",
       ("server_kv_cache_usage_ratio", "kv_cache_usage_min", "seconds", "silence_seconds", "server_requests_running",
        "requests_running_max", "tokens_per_second", "reference_tokens_per_second")),
    _d("server froze", "freeze", "critical", "engine", "soakdenginewedged",
       "requests in flight and not a byte from any of them for seconds, while soakd's own loop was punctual",
       "the server's logs and stack (py-spy dump), GPU hangs (Xid), a scheduler deadlock, a stuck collective",
       ("freeze_seconds", "threshold_seconds", "loop_lag_max_seconds")),
    _d("target hung", "target", "critical", "engine", "soakdtargetdown",
       "requests in flight, not a token or an answer from any of them, and GET /models timing out too: the whole "
       "server stopped answering (a stopped process, a blocked front end, a frozen node), not only its engine",
       "the server process's state (ps: T = stopped; py-spy dump of the API server), the node (kubectl describe "
       "node, dmesg: hung tasks, OOM), a debugger or checkpoint that paused it; soakd_target_up is 0 until it answers",
       ("silence_seconds", "in_flight", "probe_timeout_seconds", "start_unix")),
    _d("target restarted", "target", "critical", "engine", "soakdserverrestarted",
       "an error burst while the target was down, or a new server process (its start time, counters that went down)",
       "server logs and exit codes, OOM kills, liveness-probe restarts",
       ("target_down_seconds", "restarts", "requests", "outcomes")),
    _d("overload", "errors", "critical", "errors", "soakderrorrateabovebudget",
       "requests timing out while the server stays up",
       "concurrency vs the knee, server queue depth, max batch settings, timeouts",
       ("timeout_share", "timeouts", "requests", "requests_waiting")),
    _d("garbled output", "errors", "critical", "errors", "soakderrorrateabovebudget",
       "invalid responses (replacement characters, empty output, degenerate repetition)",
       "weights and quantisation, tokenizer, kernels of the new stack",
       ("invalid_share", "invalid_responses", "requests")),
    _d("output changed", "canary", "critical", "errors", "soakdcanarymismatch",
       "the canary prompt (greedy, fixed seed) answered differently from its reference output",
       "weights and quantisation, tokenizer, kernels of the new stack; batch-variant kernels when it changes only "
       "under load",
       ("digest", "reference", "idle", "text")),
    _d("server errors", "errors", "warning", "errors", "soakderrorrateabovebudget",
       "HTTP or connection errors while the target is up",
       "API format differences, request limits (context length, max_tokens), server logs",
       ("error_share", "requests", "outcomes")),
    _d("error budget exceeded", "errors", "critical", "errors", "soakderrorrateabovebudget",
       "more requests failed over the run than its error budget allows",
       "the windows with errors (the table's errors column) and their findings; server logs",
       ("error_rate", "budget", "failed", "requests", "burst_windows"), end_of_run=True),
    _d("error burst", "errors", "critical", "errors", "soakderrorrateabovebudget",
       "a window whose requests failed beyond the run budget's share with confidence (a burst): critical and failing "
       "beyond the window budget (analysis.errors.window_budget), a warning within it",
       "the failures by reason (http_429: rate limits or admission; http_5xx: server logs; timeout: load vs the knee); "
       "the server's logs at that time",
       ("failed", "requests", "share", "failures", "outcomes", "window_budget", "run_budget", "burst_windows")),
    _d("prefix cache hit rate fell", "drift", "warning", "performance", "soakdlatencyp95drift",
       "latency or throughput drift while the server's prefix-cache hit rate in the window is well below the baseline "
       "pool's: prompts it had cached are prefilled again (eviction under fragmentation, a cache squeezed by leaked "
       "or pinned blocks, a changed workload)",
       "soakd_window_prefix_cache_hit_ratio against the pool's, KV-cache usage and preemptions (blocks the cache "
       "loses to running requests), leaked KV blocks (idle usage after a quiesce), the server's prefix-caching "
       "settings and version; a restart that emptied the cache",
       ("prefix_cache_hit_ratio", "reference_hit_ratio", "drop", "drift")),
    _d("bandwidth or cache pressure", "drift", "warning", "performance", "soakdlatencyp95drift",
       "long generations and long contexts slowing down faster than short chat",
       "memory bandwidth, KV-cache evictions and recomputation, prefix-cache hit rate", ("comparisons",)),
    _d("SLO goodput dropped", "slo", "warning", "performance", "soakdslobroken",
       "the share of requests meeting their scenario's SLO fell beyond its threshold against the baseline, with "
       "confidence",
       "which bound of the SLO the requests miss (TTFT, inter-token, e2e: the latency charts), load vs the knee",
       _DRIFT),
    _d("performance drift", "drift", "warning", "performance", "soakddriftdetected",
       "a tracked metric moved beyond its threshold with confidence, without a recognised cause",
       "compare the window's device, server and error evidence with the baseline", _DRIFT),
    _d("confident drift", "drift", "critical", "performance", "soakddriftdetected",
       "at the end of the run: a level that differs from the baseline beyond the threshold, with confidence, from "
       "some window on",
       "what changed at that time: a deploy, the driver, the thermal state, other tenants of the machine",
       ("changes", "metric", "ratio", "ci"), end_of_run=True),
    _d("likely drift", "drift", "info", "performance", "soakddriftdetected",
       "at the end of the run: a level beyond the threshold whose change is significant but whose interval reaches "
       "inside the threshold (reported, not failing)",
       "a longer run or more requests per window would settle it", ("changes", "metric", "ratio", "ci"),
       fails=False, end_of_run=True),
    _d("creep", "drift", "critical", "performance", "soakddriftdetected",
       "a level that moves steadily over the run (Mann-Kendall with autocorrelation, Sen's slope)",
       "fragmentation, growing caches or queues, rising temperature",
       ("metric", "total_ratio", "total_ci", "p_value", "windows"), end_of_run=True),
    _d("periodic drops", "drift", "warning", "performance", "soakddriftdetected",
       "latency that rises at a steady period (minutes to hours)",
       "cooling cycles (fan curves, inlet temperature), power management, a periodic job on the host or cluster",
       ("period_seconds", "depth_ratio", "fap", "points"), fails=False, end_of_run=True),
    _d("confident A/B regression", "ab", "critical", "ab", "soakdabregression",
       "a candidate target confidently worse than the reference beyond the threshold",
       "what differs between the two systems (build, driver, settings); the per-window A/B rows",
       ("target", "metric", "ratio", "ci", "windows"), title="Confident A/B regression"),
    _d("likely A/B regression", "ab", "info", "ab", "soakdabregression",
       "a candidate target worse than the reference beyond the threshold, significant but not confidently so",
       "a longer run or more requests per window would settle it", ("target", "metric", "ratio", "ci", "windows"),
       fails=False, title="Likely A/B regression"),
    _d("confident A/B difference", "ab", "info", "ab", "soakdabregression",
       "a candidate target confidently better than the reference beyond the threshold",
       "nothing to fix: note what the candidate changed", ("target", "metric", "ratio", "ci", "windows"),
       fails=False, title="Confident A/B difference"),
    _d("likely A/B difference", "ab", "info", "ab", "soakdabregression",
       "a candidate target better than the reference beyond the threshold, significant but not confidently so",
       "nothing to fix", ("target", "metric", "ratio", "ci", "windows"), fails=False, title="Likely A/B difference"),
    _d("client-impaired", "client", "info", "client", "soakdclientimpaired",
       "soakd itself stalled in a window (its event-loop lag, CPU time or cgroup throttling): the window is shown, "
       "not judged",
       "soakd's CPU request and limit, other work on the node, the load soakd drives (more worker processes)",
       ("impaired_reason", "loop_lag_max_seconds", "stall_seconds", "cpu_share", "cgroup_throttled_seconds"),
       fails=False, title="Client-impaired"),
    _d("client lagging", "client", "info", "client", "soakdclientimpaired",
       "soakd's event loop lagged beyond analysis.client.timing_lag_p99 (20 ms) at its p99 through a judged window "
       "(short of CPU, e.g. at its cgroup limit): its latencies carry up to that lag, inter-token gaps below it are "
       "not resolved",
       "soakd's CPU request and limit (cpu_share), other work on the node, the load soakd drives; the server's own "
       "TTFT and ITL means beside soakd's",
       ("loop_lag_p99_seconds", "cpu_share", "ttft_mean_seconds", "server_ttft_mean_seconds"),
       fails=False, title="Client lagging"),
)}


def failing_reason(kind: str, diagnosis: str, window: int | None, last_window: int | None = None,
                   metrics: list[str] | None = None) -> str:
    """The verdict's reason line for a finding that fails the run: ``throttle: throttling (window 5)``,
    ``drift: confident drift (windows 5-9: e2e_p50, ttft_p50)``, ``ab: confident A/B regression (run)``."""
    if window is None:
        return f"{kind}: {diagnosis} (run)"
    if last_window is None or last_window <= window:
        return f"{kind}: {diagnosis} (window {window})"
    named = f": {', '.join(metrics[:6])}{', …' if len(metrics) > 6 else ''}" if metrics else ""
    return f"{kind}: {diagnosis} (windows {window}-{last_window}{named})"


def _drift_metrics(evidence: dict[str, Any]) -> list[str]:
    out = [d["metric"] for d in evidence.get("drift") or [] if isinstance(d, dict) and d.get("metric")
           and d.get("status", "drift") == "drift"]
    for c in evidence.get("changes") or []:
        if isinstance(c, dict) and c.get("metric"):
            out.append(c["metric"])
    if isinstance(evidence.get("metric"), str):
        out.append(evidence["metric"])
    return list(dict.fromkeys(out))


class Finding(BaseModel):
    """One finding. ``window`` is where it was seen (the first window of its span), ``last_window`` the
    span's last (None: the window alone); ``metrics`` the tracked metrics it names (from the evidence
    when not given). ``fails`` and ``why`` are the verdict's: whether it fails the run and why (or why
    not); None until judged."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: str
    diagnosis: str
    severity: Severity
    message: str
    evidence: dict[str, Any] = Field(default_factory=dict)
    window: int | None = None
    last_window: int | None = None
    metrics: list[str] = Field(default_factory=list)
    fails: bool | None = None
    why: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("metrics") and isinstance(data.get("evidence"), dict):
            data = {**data, "metrics": _drift_metrics(data["evidence"])}
        return data

    @model_validator(mode="after")
    def _registered(self) -> Finding:
        spec = DIAGNOSES.get(self.diagnosis)
        if spec is None:
            raise ValueError(f"diagnosis {self.diagnosis!r} is not registered in soakd.core.findings.DIAGNOSES")
        if spec.kind != self.kind:
            raise ValueError(f"diagnosis {self.diagnosis!r} is of kind {spec.kind!r}, not {self.kind!r}")
        return self

    @property
    def spec(self) -> Diagnosis:
        return DIAGNOSES[self.diagnosis]

    @property
    def title(self) -> str:
        return self.spec.title

    @property
    def section(self) -> str:
        return self.spec.section

    @property
    def runbook(self) -> str:
        return self.spec.runbook_url

    @property
    def target(self) -> str | None:
        """The target it is about, in an A/B run (another target's finding, or the candidate of an A/B one)."""
        t = self.evidence.get("target")
        return str(t) if t else None

    @property
    def label(self) -> str:
        """Its title, after the target it is about in an A/B run: ``[cand] Performance drift``."""
        return f"[{self.target}] {self.title}" if self.target else self.title

    @property
    def span(self) -> tuple[int, int] | None:
        if self.window is None:
            return None
        return self.window, max(self.window, self.last_window if self.last_window is not None else self.window)

    @property
    def windows(self) -> list[int]:
        s = self.span
        return list(range(s[0], s[1] + 1)) if s is not None else []

    def where(self) -> str:
        s = self.span
        if s is None:
            return "run"
        return f"window {s[0]}" if s[0] == s[1] else f"windows {s[0]}-{s[1]}"

    @property
    def reason(self) -> str:
        """The verdict's reason line when it fails the run (``why`` once judged)."""
        if self.fails and self.why:
            return self.why
        return failing_reason(self.kind, self.diagnosis, self.window, self.last_window, self.metrics)

    @classmethod
    def from_event(cls, data: Any) -> Finding | None:
        """An event's data as the finding it is (findings carry their diagnosis), or None; another
        target's (an A/B run: ``target`` in the event's data) carries ``target`` in its evidence."""
        if not isinstance(data, dict) or "diagnosis" not in data or "kind" not in data:
            return None
        try:
            f = cls.model_validate(data)
        except ValueError:
            return None
        if data.get("target") and "target" not in f.evidence:
            f = f.model_copy(update={"evidence": {**f.evidence, "target": data["target"]}})
        return f

    def judged(self, fails: bool, why: str | None) -> Finding:
        return self.model_copy(update={"fails": fails, "why": why})

    def to_dict(self) -> dict[str, Any]:
        """The finding as an event's data (the store, the log), with its judgement when it was made
        (whether it fails the run as things stand then; the verdict has the last word)."""
        return self.model_dump(mode="json")


# ---------------------------------------------------------------------------------------------
# evidence as people read it


def _num(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e6:
        return f"{v:.4g}"
    return f"{v:.3e}"


def _pct(metric: str | None, v: float) -> str:
    return f"{v * 100:+.1f}{'pp' if metric in ('error_rate', 'goodput_ratio') else '%'}"


def _value(key: str, v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _num(v)
    if isinstance(v, str):
        return v
    if isinstance(v, list | tuple) and v and all(isinstance(x, dict) for x in v):
        parts = []
        for x in v[:8]:
            if "metric" in x and isinstance(x.get("ratio"), int | float):
                ci = x.get("ratio_ci") or x.get("ci")
                s = f"{x['metric']} {_pct(x['metric'], x['ratio'])}"
                if isinstance(ci, list | tuple) and len(ci) == 2 and all(isinstance(c, int | float) for c in ci):
                    s += f" [{_pct(x['metric'], ci[0])}..{_pct(x['metric'], ci[1])}]"
                if x.get("reference"):
                    s += f" vs {x['reference']}"
                parts.append(s)
            elif "reason" in x:  # a throttle result
                share = x.get("share")
                drop = x.get("sm_clock_drop_ratio")
                gpus = x.get("gpus")
                parts.append(f"{x['reason']}" + (f" {share:.0%} of the window" if isinstance(share, int | float) else "")
                             + (f" on GPU {', '.join(map(str, gpus))}" if isinstance(gpus, list | tuple) and gpus else "")
                             + (f", SM clock -{drop:.1%}" if isinstance(drop, int | float) else ""))
            else:
                parts.append(json.dumps(x, sort_keys=True, default=str)[:120])
        return "; ".join(parts) + (f"; +{len(v) - 8} more" if len(v) > 8 else "")
    if isinstance(v, list | tuple):
        if all(isinstance(x, int | float) and not isinstance(x, bool) for x in v):
            if key.endswith(("ci", "_ci")) and len(v) == 2:
                return f"{_num(float(v[0]))}..{_num(float(v[1]))}"
            return ", ".join(_num(float(x)) if isinstance(x, float) else str(x) for x in v[:12])
        return ", ".join(str(x) for x in v[:12])
    return json.dumps(v, sort_keys=True, default=str)[:200]


_BYTES = ("growth_per_hour", "budget", "projected", "ci", "withdrawn_growth_per_hour",
          "withdrawn_ci")  # in bytes when the evidence's unit is bytes


def fmt_bytes(v: Any, sign: bool = False) -> str | None:
    """Bytes as people read them (MiB, or GiB from one GiB on); ``sign``: a change (+/-)."""
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        s = "+" if sign else ""
        return f"{v / 2**30:{s}.2f} GiB" if abs(v) >= 2**30 else f"{v / 2**20:{s}.1f} MiB"
    return None


def _pair(f: Finding, key: str, v: Any) -> str:
    in_bytes = key.endswith("_bytes") or (key in _BYTES and f.evidence.get("unit") == "bytes")
    if in_bytes:
        if isinstance(v, list | tuple) and len(v) == 2:
            lo, hi = fmt_bytes(v[0], True), fmt_bytes(v[1], True)
            if lo and hi:
                return f"{lo}..{hi}" + ("/h" if key in ("ci", "withdrawn_ci") else "")
        rate = key.endswith("growth_per_hour")
        b = fmt_bytes(v, sign=rate)
        if b is not None:
            return b + ("/h" if rate else "")
    return _value(key, v)


def evidence_pairs(f: Finding) -> list[tuple[str, str]]:
    """The finding's headline evidence (its diagnosis's keys, those it has) as (key, text)."""
    out = []
    for key in f.spec.evidence:
        if key in f.evidence and f.evidence[key] not in (None, "", [], {}):
            out.append((key, _pair(f, key, f.evidence[key])))
    if not out:  # a diagnosis whose evidence keys this finding lacks: its first few keys
        for key, v in list(f.evidence.items())[:4]:
            if v not in (None, "", [], {}):
                out.append((key, _value(key, v)))
    return out


def evidence_text(f: Finding, limit: int = 400) -> str:
    """The headline evidence on one line: ``key value; key value``."""
    text = "; ".join(f"{k} {v}" for k, v in evidence_pairs(f))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def finding_log(f: Finding) -> dict[str, Any]:
    """The finding as a log line's fields: what a person tailing ``kubectl logs`` needs."""
    out: dict[str, Any] = {"kind": f.kind, "diagnosis": f.diagnosis, "severity": f.severity, "where": f.where(),
                           "message": f.message, "evidence": evidence_text(f), "runbook": f.runbook}
    if f.target:
        out["target"] = f.target
    if f.metrics:
        out["metrics"] = f.metrics
    if f.fails is not None:
        out["fails"] = f.fails
    if f.why:
        out["why"] = f.why
    return out
