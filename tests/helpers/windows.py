"""Synthetic window summaries for the analysis tests: typed ``WindowSummary`` objects, their
latency statistics built through real DDSketches and ``stats.quantile_ci``.

Imported by the analysis tests (``from helpers.windows import make_window``); tests/unit/test_helpers.py checks it.
"""

from __future__ import annotations

import math
import random
from typing import Any

from soakd.analysis.sketch import RELATIVE_ACCURACY, merged, new_sketch, quantile
from soakd.analysis.stats import quantile_ci
from soakd.core.summary import WindowSummary

OUTCOMES = ("ok", "http_error", "timeout", "connection_error", "invalid_response", "cancelled")


def q_summary(sk: Any, confidence: float = 0.95, n_effective: int | None = None) -> dict[str, Any]:
    if sk.count == 0:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0,
                "p50_ci": None, "p95_ci": None, "p99_ci": None}  # fmt: skip
    out: dict[str, Any] = {
        "p50": quantile(sk, 0.5), "p95": quantile(sk, 0.95), "p99": quantile(sk, 0.99),
        "mean": sk.avg, "count": int(sk.count),
    }  # fmt: skip
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        ci = quantile_ci(sk, q, confidence, RELATIVE_ACCURACY, n_effective=n_effective)
        out[f"{name}_ci"] = list(ci) if ci else None
    return out


def _scenario(rng: random.Random, n: int, scale: float, ttft_scale: float, error_rate: float,
              outcome: str, tokens: tuple[int, int], gaps: int) -> dict[str, Any]:  # fmt: skip
    e2e, ttft, itl = new_sketch(), new_sketch(), new_sketch()
    oc = dict.fromkeys(OUTCOMES, 0)
    ctoks = 0
    sumsq = 0.0
    for _ in range(n):
        if error_rate and rng.random() < error_rate:
            oc[outcome] += 1
            continue
        oc["ok"] += 1
        e2e.add(scale * rng.lognormvariate(0.0, 0.5))
        ttft.add(ttft_scale * 0.1 * rng.lognormvariate(0.0, 0.4))
        for _ in range(gaps):
            itl.add(scale * 0.02 * rng.lognormvariate(0.0, 0.3))
        t = rng.randint(*tokens)
        ctoks += t
        sumsq += t * t
    return {"n": n, "oc": oc, "e2e": e2e, "ttft": ttft, "itl": itl, "ctoks": ctoks, "sumsq": sumsq}


def make_window(
    index: int,
    rng: random.Random,
    n: int = 1000,
    *,
    scale: float = 1.0,
    ttft_scale: float | None = None,
    duration: float = 1800.0,
    error_rate: float = 0.0,
    error_outcome: str = "http_error",
    partial: bool = False,
    poisson_n: bool = True,
    scenarios: dict[str, dict[str, Any]] | None = None,
    tokens: tuple[int, int] = (100, 140),
    gaps: int = 4,
    device: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    host: dict[str, Any] | None = None,
    quiesce: dict[str, Any] | None = None,
    target_down_seconds: float = 0.0,
    start_unix: float = 1_700_000_000.0,
) -> WindowSummary:
    """A window summary. ``scenarios`` maps name -> overrides of (n, scale, ttft_scale,
    error_rate); without it, one scenario ``short_chat`` carries everything. ``n`` varies by
    about sqrt(n) between windows when ``poisson_n`` (open-loop arrivals)."""
    if scenarios is None:
        scenarios = {"short_chat": {}}
    per: dict[str, Any] = {}
    raw = {}
    for name, ov in scenarios.items():
        sn = int(ov.get("n", n // len(scenarios)))
        if poisson_n:
            sn = max(0, round(rng.gauss(sn, math.sqrt(sn))))
        s_scale = ov.get("scale", scale)
        s_ttft = ov.get("ttft_scale", ttft_scale if ttft_scale is not None else s_scale)
        r = _scenario(rng, sn, s_scale, s_ttft, ov.get("error_rate", error_rate),
                      ov.get("error_outcome", error_outcome), tokens, gaps)  # fmt: skip
        raw[name] = r
        per[name] = {
            "requests": sn,
            "outcomes": r["oc"],
            "error_rate": (1 - r["oc"]["ok"] / sn) if sn else None,
            "e2e_seconds": q_summary(r["e2e"]),
            "ttft_seconds": q_summary(r["ttft"]),
            "itl_seconds": q_summary(r["itl"], n_effective=int(r["ttft"].count) or None),
            "requests_per_second": sn / duration,
            "output_tokens_per_second": r["ctoks"] / duration,
            "completion_tokens": r["ctoks"],
            "completion_tokens_sumsq": r["sumsq"],
        }
    total = sum(r["n"] for r in raw.values())
    oc = dict.fromkeys(OUTCOMES, 0)
    for r in raw.values():
        for k, v in r["oc"].items():
            oc[k] += v
    ctoks = sum(r["ctoks"] for r in raw.values())
    ttft_all = merged(r["ttft"] for r in raw.values())
    w: dict[str, Any] = {
        "window": index,
        "start_unix": start_unix + index * duration,
        "duration_seconds": duration,
        "partial": partial,
        "requests": total,
        "outcomes": oc,
        "error_rate": (1 - oc["ok"] / total) if total else None,
        "e2e_seconds": q_summary(merged(r["e2e"] for r in raw.values())),
        "ttft_seconds": q_summary(ttft_all),
        "itl_seconds": q_summary(merged(r["itl"] for r in raw.values()), n_effective=int(ttft_all.count) or None),
        "requests_per_second": total / duration,
        "output_tokens_per_second": ctoks / duration,
        "completion_tokens": ctoks,
        "completion_tokens_sumsq": sum(r["sumsq"] for r in raw.values()),
        "target_down_seconds": target_down_seconds,
        "device": device or {},
        "server": server or {},
        "host": host or {},
        "quiesce": quiesce,
        "scenarios": per,
    }
    return WindowSummary.load(w)


def simple_window(index: int, value: float, *, metric_field: str = "e2e_seconds", q: str = "p50",
                  rel_ci: float = 0.02, n: int = 1000, duration: float = 1800.0, partial: bool = False,
                  tokens_per_second: float | None = None, **extra: Any) -> WindowSummary:  # fmt: skip
    """A hand-made window whose one quantile is ``value`` with a +-``rel_ci`` interval."""
    qd = {"p50": None, "p95": None, "p99": None, "mean": None, "count": n,
          "p50_ci": None, "p95_ci": None, "p99_ci": None}  # fmt: skip
    qd[q] = value
    qd[f"{q}_ci"] = [value * (1 - rel_ci), value * (1 + rel_ci)]
    w = {
        "window": index, "start_unix": 1_700_000_000.0 + index * duration, "duration_seconds": duration,
        "partial": partial, "requests": n, "outcomes": {"ok": n}, "error_rate": 0.0,
        metric_field: qd, "requests_per_second": n / duration,
        "output_tokens_per_second": tokens_per_second if tokens_per_second is not None else 120 * n / duration,
        "completion_tokens": round((tokens_per_second if tokens_per_second is not None else 120 * n / duration)
                                   * duration),
        "completion_tokens_sumsq": None, "scenarios": {},
    }  # fmt: skip
    if metric_field != "e2e_seconds":
        w["e2e_seconds"] = {"count": n}
    w.update(extra)
    return WindowSummary.load(w)
