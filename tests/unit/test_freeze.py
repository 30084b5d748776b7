"""The window's freeze rule (soakd.analysis.freeze and the FreezeDetector): a freeze is raised as measured -- before
a baseline against the quietest window so far (a freeze inflates its own window's TTFT p95), in a partial window
too -- and a long silence that the server's own heavy inter-token tail makes routinely (sparse streams: one or two
streams silent) is not a freeze, while the same span with every stream silent is."""

from __future__ import annotations

import random

from helpers.windows import make_window

from soakd.analysis.engine import Analyzer
from soakd.analysis.freeze import FALSE_FREEZES, natural_silences
from soakd.config import AnalysisConfig
from soakd.core.summary import ClientSummary, Quantiles


def _frozen(index: int, span: float, requests: int, *, ttft_scale: float = 1.0, partial: bool = False):  # noqa: ANN202
    w = make_window(index, random.Random(index), ttft_scale=ttft_scale, partial=partial)
    return w.model_copy(update={"client": ClientSummary(heartbeats=100, loop_lag_max_seconds=0.002,
                                                        freeze_max_seconds=span, freeze_start_offset_seconds=60.0,
                                                        freeze_requests=requests)})


def test_a_freeze_that_inflated_its_own_windows_ttft_is_raised_as_measured() -> None:
    """Window 1 froze 14.8 s with 16 requests silent; every request waiting through it made its TTFT p95 6 s
    (3x: an 18-s bar, above the freeze itself). Before a baseline the bar comes from the quietest window so far
    (window 0's TTFT p95 ~0.2 s: the 5-s freeze_min): the freeze is a finding."""
    an = Analyzer(AnalysisConfig())
    assert not [f for f in an.add_window(_frozen(0, 0.4, 2)) if f.kind == "freeze"]
    w1 = _frozen(1, 14.8, 16, ttft_scale=30.0)
    assert w1.ttft_seconds.p95 * 3 > 14.8  # its own bar would hide it
    (f,) = [f for f in an.add_window(w1) if f.kind == "freeze"]
    assert f.diagnosis == "server froze" and f.evidence["freeze_seconds"] == 14.8 and f.window == 1
    assert f.evidence["threshold_seconds"] == 5.0 and f.evidence["silent_requests"] == 16


def test_a_freeze_in_the_runs_cut_short_last_window_is_raised() -> None:
    an = Analyzer(AnalysisConfig())
    an.add_window(_frozen(0, 0.4, 2))
    (f,) = [f for f in an.add_window(_frozen(1, 12.0, 9, partial=True)) if f.kind == "freeze"]
    assert f.window == 1 and f.evidence["freeze_seconds"] == 12.0


def test_a_sparse_heavy_tailed_servers_long_gap_is_its_rhythm_and_a_silence_of_every_stream_is_a_freeze() -> None:
    """A reference of 6,000 gaps a window, Pareto(2.5) (p95 1.99 s, p99 3.79 s, mean 1 s), 24 windows: a 12-s silence
    of one stream is expected dozens of times a run, of two about once; of six streams silent, never."""
    ref = make_window(0, random.Random(0)).model_copy(update={"itl_seconds": Quantiles(
        p50=0.79, p95=1.99, p99=3.79, mean=1.0, count=6000)})
    one, two, six = (natural_silences(12.0, n, ref, 24) for n in (1, 2, 6))
    assert one is not None and two is not None and six is not None
    assert one > 10 and two > FALSE_FREEZES and six < 1e-6
    assert natural_silences(3.0, 20, ref, 24) == float("inf")  # within the bulk of the gaps: never a freeze
    # a light-tailed server (the freeze cell's: gaps lognormal, p95 0.68 s, p99 0.96 s): a 10-s silence of one
    # stream is rare but not rare enough at the tail index's bound (0.16 a run), of two streams a freeze
    light = ref.model_copy(update={"itl_seconds": Quantiles(p50=0.3, p95=0.68, p99=0.96, mean=0.34, count=9000)})
    one_light = natural_silences(10.0, 1, light, 24)
    assert one_light is not None and 0.01 < one_light < 1 and natural_silences(10.0, 2, light, 24) < FALSE_FREEZES
