"""The leak page: the judgement after each window is one of many looks at a growing series, so it is made
at a run-level confidence (``live_confidence``); a source paged during the run that the run's last
judgement clears is said, never dropped silently (``withdrawn_finding``: a warning that does not fail).
``soakd.analysis.detector.LeakDetector`` uses both.

(derivation: docs/analysis.md#the-leak-page)
"""

from __future__ import annotations

from soakd.analysis import leak as leak_mod
from soakd.config.analysis import LeakConfig
from soakd.core.findings import Finding

__all__ = ["LIVE_LEAK_DIAGNOSES", "live_confidence", "paged_from", "withdrawn_finding"]


def live_confidence(cfg: LeakConfig, planned_windows: int) -> float:
    """``cfg.live_confidence`` when set, else ``1 - (1 - confidence) / looks`` (Bonferroni over the run's
    planned judgements, ``looks = planned_windows - min_windows + 1``); never below ``confidence``."""
    looks = max(1, planned_windows - cfg.min_windows + 1)
    live = cfg.live_confidence if cfg.live_confidence is not None else 1.0 - (1.0 - cfg.confidence) / looks
    return max(cfg.confidence, live)


LIVE_LEAK_DIAGNOSES = ("memory leak", "KV cache not released")  # what a leak page's finding is named


def paged_from(f: Finding) -> tuple[int | None, leak_mod.LeakResult] | None:
    """A leak page as a stored finding shows it (resume): (its window, the judgement it was made on)."""
    if f.kind != "leak" or f.diagnosis not in LIVE_LEAK_DIAGNOSES or not f.evidence.get("source"):
        return None
    fields = leak_mod.LeakResult.__dataclass_fields__
    try:
        lk = leak_mod.LeakResult(**{k: v for k, v in f.evidence.items() if k in fields})
    except TypeError:  # an earlier release's evidence without every field
        return None
    return f.window, lk


def withdrawn_finding(window: int | None, paged: leak_mod.LeakResult, last: leak_mod.LeakResult) -> Finding:
    """A leak page raised during the run (``paged``, first suspected after ``window``) that the run's last
    judgement (``last``) withdrew: said as a warning that never fails, with both rates."""
    unit = "MiB/h" if paged.unit == "bytes" else "pts/h"
    scale = 2**20 if paged.unit == "bytes" else 0.01

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v / scale:+.1f} {unit}"

    where = f"after window {window}" if window is not None else "during the run"
    return Finding(
        kind="leak", diagnosis="leak page withdrawn", severity="warning",
        message=f"{paged.source}: the leak page raised {where} ({rate(paged.growth_per_hour)}) was withdrawn by the "
                f"run's last judgement ({rate(last.growth_per_hour)}, {last.pattern or last.status}): "
                f"{last.message()}",
        evidence={"source": paged.source, "paged_window": window, "withdrawn_growth_per_hour": paged.growth_per_hour,
                  "withdrawn_ci": list(paged.ci) if paged.ci else None, "withdrawn_interval": paged.interval,
                  "growth_per_hour": last.growth_per_hour,
                  "ci": list(last.ci) if last.ci else None, "unit": paged.unit, "pattern": last.pattern,
                  "n_windows": last.n_windows, "fails": False},
    )  # fmt: skip
