"""One target of a run, ``TargetRun``: its client (its own connection pool), client-side metrics, windows,
recorder, load driver, window pipeline and analysis — the same parts for the only target of a soak and
for every target of an A/B run (``targets:``), so that one target failing does not disturb another's
measurements and the runtime holds a list of them.

The first target is the reference: the samplers, quiesce probes, the canary and the wedge watch follow
it (soakd runs beside it), its windows are the run's (the windows table's target ''), its analysis
holds the A/B detector that judges every other target's windows against its own. Every target's load
driver runs on the same timeline with the same seed: in open loop each scheduled arrival goes to every
target at the same moment, in closed loop each target's workers send the same prompts in the same
order (a multi-turn conversation continues with each target's own answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from soakd.analysis.engine import Analyzer
from soakd.client.openai import OpenAIClient
from soakd.config import NamedTargetConfig
from soakd.metrics import SoakMetrics
from soakd.soak.pipeline import WindowPipeline
from soakd.soak.status import Load

__all__ = ["TargetRun"]


@dataclass
class TargetRun:
    cfg: NamedTargetConfig
    client: OpenAIClient
    metrics: SoakMetrics
    analyzer: Analyzer
    pipeline: WindowPipeline
    reference: bool
    load: Load | None = None
    model: str | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def has_key(self) -> bool:
        return bool(self.client.headers.get("Authorization"))

    def status(self) -> dict[str, Any]:
        """/status of a target after the first: its counters, last window, drift flags and A/B ratios."""
        rec = self.load.recorder if self.load is not None else None
        last = self.analyzer.history.last
        return {
            "name": self.name, "url": self.cfg.display_url, "model": self.model,
            "target_up": rec.target_up if rec else None, "in_flight": rec.in_flight if rec else 0,
            "requests_sent": rec.sent if rec else 0, "requests_measured": rec.measured if rec else 0,
            "outcomes": dict(rec.outcomes) if rec else {}, "last_error": (rec.last_error or None) if rec else None,
            "last_window": last.window if last is not None else None,
            "drift_detected": sorted(m for m, v in self.analyzer.states()["drift"].active.items() if v),
        }
