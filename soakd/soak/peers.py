"""The targets of an A/B run after the first (``targets:``): each with its own client (its own
connection pool), client-side metrics, windows, recorder, load driver and analysis, so that one
target failing does not disturb another's measurements; the first target (the reference, or the
only one) is the runtime's own.

Every target's load driver runs on the same timeline with the same seed: in open loop each
scheduled arrival goes to every target at the same moment, in closed loop each target's workers
send the same prompts in the same order (a multi-turn conversation continues with each target's
own answers). Samplers, quiesce probes and the canary stay with the first target (soakd runs
beside it).

A window of another target goes to the store (``target_windows``), to its own analysis (its
drift against its own baseline; its events carry ``target`` in their data) and to the A/B
judge (``soakd.analysis.ab``) with the reference's window of the same index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from soakd.analysis.engine import Analyzer
from soakd.client.openai import OpenAIClient
from soakd.config import NamedTargetConfig
from soakd.core.summary import WindowSummary
from soakd.metrics import SoakMetrics
from soakd.soak.status import Load

log = structlog.get_logger("soakd")


@dataclass
class Peer:
    cfg: NamedTargetConfig
    client: OpenAIClient
    metrics: SoakMetrics
    analyzer: Analyzer
    load: Load | None = None
    model: str | None = None
    queue: list[WindowSummary] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.cfg.name


class PeerPipeline:
    """The other targets' closed windows: persisted, analysed, handed to ``on_window`` — in order."""

    def __init__(self, peers: list[Peer], save: Callable[[str, WindowSummary], Any] | None,
                 on_window: Callable[[str, WindowSummary], None]) -> None:
        self.peers = peers
        self.save = save
        self.on_window = on_window
        self._lock = asyncio.Lock()

    def submit(self, peer: Peer, windows: list[WindowSummary]) -> None:
        peer.queue.extend(windows)

    async def drain(self) -> None:
        async with self._lock:
            for peer in self.peers:
                while peer.queue:
                    w = peer.queue.pop(0)
                    if self.save is not None:
                        await self.save(peer.name, w)
                    if w.revision:
                        continue
                    peer.analyzer.add_window(w)
                    peer.metrics.windows_closed.inc(())
                    log.info("target_window_closed", target=peer.name, window=w.window, requests=w.requests,
                             e2e_p95=w.e2e_seconds.p95, requests_per_second=round(w.requests_per_second, 3))
                    self.on_window(peer.name, w)


def peers_status(peers: list[Peer], ab: Any) -> list[dict[str, Any]]:
    """/status of the targets after the first: their counters, last window, drift flags and A/B ratios."""
    out = []
    for p in peers:
        rec = p.load.recorder if p.load is not None else None
        last = p.analyzer.history.last
        ratios = {m: {"ratio": r.ratio, "ci": r.ci, "tier": r.tier, "window": r.window}
                  for (m, cand), r in sorted(ab.last.items()) if cand == p.name} if ab is not None else {}
        out.append({
            "name": p.name, "url": p.cfg.url, "model": p.model,
            "target_up": rec.target_up if rec else None, "in_flight": rec.in_flight if rec else 0,
            "requests_sent": rec.sent if rec else 0, "requests_measured": rec.measured if rec else 0,
            "outcomes": dict(rec.outcomes) if rec else {}, "last_error": (rec.last_error or None) if rec else None,
            "last_window": last.window if last is not None else None,
            "drift_detected": sorted(m for m, v in p.analyzer.drift_active.items() if v), "ab": ratios,
        })
    return out
