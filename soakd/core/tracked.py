"""The quantities soakd tracks per window (drift, stability, the report's charts): names,
how each is read from a window summary, which way is worse, a label for people.

Pure data: the configuration validates metric names against it, the analysis reads windows
with it, the report labels its tables with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["quantile", "requests_rate", "tokens_rate", "error_rate", "goodput", "energy", "server_mean"]


@dataclass(frozen=True)
class TrackedMetric:
    name: str
    kind: Kind
    higher_is_worse: bool
    field: str | None = None  # the window summary's latency field, e.g. "e2e_seconds"
    q: str | None = None  # the quantile, e.g. "p95"
    unit: str = ""
    label: str = ""  # for tables and charts, e.g. "e2e p95"

    @property
    def absolute(self) -> bool:
        """error_rate and goodput_ratio changes are differences of ratios, not relative changes."""
        return self.kind in ("error_rate", "goodput")


def _quantiles() -> dict[str, TrackedMetric]:
    out = {}
    for short, fld, label in (("e2e", "e2e_seconds", "e2e"), ("ttft", "ttft_seconds", "TTFT"),
                              ("itl", "itl_seconds", "inter-token")):
        for q in ("p50", "p95", "p99"):
            out[f"{short}_{q}"] = TrackedMetric(f"{short}_{q}", "quantile", True, fld, q, "seconds", f"{label} {q}")
    return out


METRICS: dict[str, TrackedMetric] = {
    **_quantiles(),
    "output_tokens_per_second": TrackedMetric("output_tokens_per_second", "tokens_rate", False, unit="tokens/s",
                                              label="output tokens/s"),
    "requests_per_second": TrackedMetric("requests_per_second", "requests_rate", False, unit="requests/s",
                                         label="requests/s"),
    "error_rate": TrackedMetric("error_rate", "error_rate", True, unit="ratio", label="error rate"),
    "goodput_ratio": TrackedMetric("goodput_ratio", "goodput", False, unit="ratio", label="goodput"),
    "energy_per_token": TrackedMetric("energy_per_token", "energy", True, unit="J/token", label="J/token"),
    "server_ttft_mean": TrackedMetric("server_ttft_mean", "server_mean", True, "ttft_mean_seconds", unit="seconds",
                                      label="server's TTFT mean"),
    "server_itl_mean": TrackedMetric("server_itl_mean", "server_mean", True, "itl_mean_seconds", unit="seconds",
                                     label="server's inter-token mean"),
}
"""``goodput_ratio``: the share of a window's requests that met every SLO of their scenario
(``scenarios.<name>.slo``). Tracked only where a scenario has an SLO: the configuration adds it
to ``analysis.drift.metrics`` then (unless that list is given explicitly).

``server_ttft_mean`` and ``server_itl_mean``: the server's own TTFT and inter-token means, from its histograms
(those soakd reads: vLLM's and SGLang's, trtllm-serve's TTFT, llama.cpp's generation-time counters;
``soakd.samplers.server``, ``ServerSummary``), with their standard errors over the window's scrape
intervals. Where soakd is short of CPU its own latencies carry its queueing ("client lagging"): a change of the
server's own means is judged only in the windows where soakd lagged (``soakd.analysis.drift_watch``); elsewhere
they are tracked and shown, never paged on or failing."""

SERVER_MEANS: frozenset[str] = frozenset(m for m, s in METRICS.items() if s.kind == "server_mean")
"""The server's own means: judged only in the windows where soakd lagged (``soakd.analysis.drift_watch``)."""

THROUGHPUT: frozenset[str] = frozenset(m for m, s in METRICS.items() if s.kind in ("requests_rate", "tokens_rate"))
"""The throughputs (requests/s, tokens/s): a page is for their fall, their level takes the waves of completions
(``soakd.analysis.page.rate_extra``)."""

DEFAULT_METRICS: tuple[str, ...] = (
    "e2e_p50",
    "e2e_p95",
    "ttft_p50",
    "ttft_p95",
    "itl_p50",
    "itl_p95",
    "output_tokens_per_second",
    "requests_per_second",
    "energy_per_token",
    # issue 21 item 5: the tails, judged wherever a window has the samples for them (563 for a p99 interval
    # at 95%; fewer: the window is "insufficient" for them, never judged), in the same run-level family
    "e2e_p99",
    "ttft_p99",
    # the server's own means, judged where soakd lagged (its own latencies carry its queueing there)
    "server_ttft_mean",
    "server_itl_mean",
)
"""Not ``error_rate``: errors are judged against their budgets (``soakd.analysis.errors``), not as drift."""
