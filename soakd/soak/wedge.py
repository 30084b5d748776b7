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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger("soakd")

__all__ = ["WedgeWatch"]


class WedgeWatch:
    def __init__(self, recorder: Any, probe: Callable[[], Any], analyzer: Any, gauge: Any,
                 now_ns: Callable[[], int] = time.perf_counter_ns, wall: Callable[[], float] = time.time,
                 window_at: Callable[[float], int | None] = lambda ago: None) -> None:
        self.recorder = recorder
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

    def silence(self, now_ns: int) -> float | None:
        """Seconds since the newest byte of any streamed request in flight (None: nothing in flight)."""
        newest = None
        for r in self.recorder.active:
            if not r.stream or not r.t_start_ns:
                continue
            t = r.token_times_ns[-1] if r.token_times_ns else (r.t_headers_ns or r.t_start_ns)
            newest = t if newest is None or t > newest else newest
        return None if newest is None else (now_ns - newest) / 1e9

    async def check(self) -> None:
        now = self.now_ns()
        punctual = self._last_check_ns is None or (now - self._last_check_ns) / 1e9 < 2.5
        self._last_check_ns = now
        quiet = self.silence(now)
        need = self.analyzer.freeze_threshold()
        if quiet is None or quiet < need:
            self._end(quiet)
            return
        if self.episode is not None or self._probing or not punctual:
            return  # a wedge in progress, a probe under way, or soakd itself was late (not the server's silence)
        self._probing = True
        try:
            await asyncio.wait_for(self.probe(), timeout=max(1.0, min(10.0, need)))
        except Exception:  # noqa: BLE001 - the server does not answer: an outage or a whole-server freeze
            return
        finally:
            self._probing = False
        quiet = self.silence(self.now_ns())
        if quiet is None or quiet < need:
            return  # bytes came while it was probed
        self.episodes += 1
        window = self.window_at(quiet)  # where the silence began: that window's freeze, reported once
        self.episode = {"start_unix": self.wall() - quiet, "silence_seconds": quiet, "threshold_seconds": need,
                        "in_flight": self.recorder.in_flight, "window": window}
        self.gauge.value = 1.0
        self.analyzer.add_wedge(self.episode)

    def _end(self, quiet: float | None) -> None:
        if self.episode is None:
            return
        ep, self.episode = self.episode, None
        self.gauge.value = 0.0
        took = self.wall() - ep["start_unix"] - (quiet or 0.0)
        log.info("engine_recovered", wedged_seconds=round(took, 1), window=ep["window"])
        self.analyzer.wedge_ended(ep, took)
