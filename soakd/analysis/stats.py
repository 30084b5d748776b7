"""Confidence intervals for window statistics (no I/O; the distributions come from scipy):
quantiles from binomial order statistics, Poisson and compound-Poisson rates, Wilson and Newcombe
intervals for error rates, and ratios of two intervals. Every tracked quantity of a window comes
with one, so that drift is flagged only when the change exceeds its threshold *with confidence*
(DESIGN.md, "Statistics before alarms").

(derivation: docs/analysis.md#derivation-statspy)
"""

from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist
from typing import Any

from scipy.special import bdtr, bdtrc
from scipy.stats import chi2

__all__ = [
    "EXACT_BINOMIAL_MAX_N",
    "QUANTILE_CI_MIN_COUNT",
    "difference_ci",
    "energy_per_token_ci",
    "order_statistic_ranks",
    "quantile_ci",
    "quantile_ci_min_count",
    "rate_ci",
    "ratio_ci",
    "tokens_rate_ci",
    "wilson_ci",
    "z_value",
]

EXACT_BINOMIAL_MAX_N = 1_000_000  # above this the normal approximation of the ranks is used as is

CI = tuple[float, float]



def as_float(v: Any) -> float | None:
    """A finite float from a window-summary value, or None (missing, boolean, NaN, infinite, junk)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None

def z_value(confidence: float) -> float:
    """Two-sided standard-normal quantile: 1.96 for 0.95."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


# ---------------------------------------------------------------------------------------------
# quantiles


def _cdf(n: int, q: float, i: int) -> float:
    """P(B <= i) for B ~ Binomial(n, q)."""
    return 0.0 if i < 0 else 1.0 if i >= n else float(bdtr(i, n, q))


def _sf(n: int, q: float, i: int) -> float:
    """P(B > i) for B ~ Binomial(n, q) (accurate in the upper tail, where 1 - cdf is not)."""
    return 1.0 if i < 0 else 0.0 if i >= n else float(bdtrc(i, n, q))


@lru_cache(maxsize=4096)
def order_statistic_ranks(n: int, q: float, confidence: float = 0.95) -> tuple[int, int] | None:
    """1-based ranks ``(j, k)`` with ``P(X(j) <= xi_q <= X(k)) >= confidence``, or None.

    None when the band does not fit in ``1..n`` (too few samples). Exact binomial widening for
    ``n <= EXACT_BINOMIAL_MAX_N`` (see the module docstring).
    """
    if n < 1 or not 0.0 < q < 1.0:
        return None
    z = z_value(confidence)
    sd = math.sqrt(n * q * (1.0 - q))
    j = math.floor(n * q - z * sd)
    k = math.ceil(n * q + z * sd) + 1
    if n <= EXACT_BINOMIAL_MAX_N:
        cov = _cdf(n, q, k - 1) - _cdf(n, q, j - 1)  # P(j <= B <= k - 1)
        while cov < confidence:
            below = _cdf(n, q, j - 1) - _cdf(n, q, j - 2)  # P(B = j - 1)
            above = _sf(n, q, k - 1) - _sf(n, q, k)  # P(B = k)
            if below <= 0.0 and above <= 0.0:
                break
            if below >= above:
                j -= 1
                cov += below
            else:
                k += 1
                cov += above
    if j < 1 or k > n:
        return None
    return j, k


@lru_cache(maxsize=256)
def quantile_ci_min_count(q: float, confidence: float = 0.95) -> int:
    """Smallest sample count for which ``quantile_ci`` returns an interval (and does for every
    count up to 4x it, checked)."""
    n = 1
    while n < 10_000_000:
        if order_statistic_ranks(n, q, confidence) is not None and all(
            order_statistic_ranks(m, q, confidence) is not None for m in range(n, 4 * n + 1, max(1, n // 64))
        ):
            return n
        n += 1
    raise ValueError(f"no sample count up to 10,000,000 supports a {confidence} interval for q={q}")


QUANTILE_CI_MIN_COUNT: dict[str, int] = {
    "p50": quantile_ci_min_count(0.50),
    "p95": quantile_ci_min_count(0.95),
    "p99": quantile_ci_min_count(0.99),
}


def _widen(lo: float, hi: float, a: float) -> CI:
    """Widen by a relative accuracy ``a`` (a sketch value v stands for [v/(1+a), v/(1-a)])."""
    lo = lo / (1.0 + a) if lo >= 0 else lo / (1.0 - a)
    hi = hi / (1.0 - a) if hi >= 0 else hi / (1.0 + a)
    return lo, hi


def quantile_ci(
    sketch: Any,
    q: float,
    confidence: float = 0.95,
    relative_accuracy: float = 0.01,
    n_effective: int | None = None,
) -> CI | None:
    """Distribution-free ``confidence`` interval for the ``q``-quantile held in a DDSketch.

    ``n_effective`` (< the sketch count) treats the data as that many independent observations
    (e.g. the number of streamed requests for inter-token gaps): the band of quantile levels
    ``q +- z sqrt(q (1-q) / n_effective)`` is read from the sketch. None when the sketch (or
    ``n_effective``) has fewer samples than ``quantile_ci_min_count(q, confidence)``.
    """
    if sketch is None:
        return None
    n = int(round(sketch.count))
    if n < 2:
        return None
    if n_effective is not None and 0 < n_effective < n:
        ranks = order_statistic_ranks(int(n_effective), q, confidence)
        if ranks is None:
            return None
        m = int(n_effective)
        # the same quantile levels as the ranks j and k of m observations, in this sketch's ranks
        j = max(1, math.floor((ranks[0] - 0.5) / m * n + 0.5))
        k = min(n, math.ceil((ranks[1] - 0.5) / m * n + 0.5))
    else:
        ranks = order_statistic_ranks(n, q, confidence)
        if ranks is None:
            return None
        j, k = ranks
    lo = sketch.get_quantile_value(min(1.0, (j - 0.5) / (n - 1)))
    hi = sketch.get_quantile_value(min(1.0, (k - 0.5) / (n - 1)))
    if lo is None or hi is None:
        return None
    return _widen(float(lo), float(hi), relative_accuracy)


# ---------------------------------------------------------------------------------------------
# counts and rates


def poisson_count_ci(count: float, confidence: float = 0.95) -> CI:
    """Garwood interval for a Poisson mean given one observed count: the exact chi-square bounds
    ``chi2(alpha/2; 2n)/2`` and ``chi2(1 - alpha/2; 2n + 2)/2`` (the lower bound is 0 at a count of 0)."""
    alpha = 1.0 - confidence
    n = max(0.0, float(count))
    lo = 0.0 if n <= 0 else float(chi2.ppf(alpha / 2.0, 2.0 * n)) / 2.0
    hi = float(chi2.ppf(1.0 - alpha / 2.0, 2.0 * n + 2.0)) / 2.0
    return lo, hi


def rate_ci(count: float, seconds: float, confidence: float = 0.95) -> CI | None:
    """Interval for an event rate (requests/s) from a count over ``seconds`` (Poisson)."""
    if seconds is None or seconds <= 0 or count is None:
        return None
    lo, hi = poisson_count_ci(count, confidence)
    return lo / seconds, hi / seconds


def tokens_rate_ci(
    total_tokens: float,
    seconds: float,
    sumsq: float | None = None,
    requests: int | None = None,
    confidence: float = 0.95,
) -> CI | None:
    """Interval for tokens/s: compound Poisson, ``Var(S) ~ sum T_i^2``.

    Without ``sumsq`` (older reports), every request is assumed to carry the mean token count
    (``sum T_i^2 ~ S^2 / requests``), which length-controlled outputs make nearly true; None
    when neither is known.
    """
    if seconds is None or seconds <= 0 or total_tokens is None:
        return None
    s = float(total_tokens)
    if sumsq is None:
        if not requests:
            return None
        sumsq = s * s / requests
    if s <= 0:
        return 0.0, (0.0 if sumsq <= 0 else z_value(confidence) * math.sqrt(sumsq) / seconds)
    sd = math.sqrt(max(0.0, float(sumsq)))
    z = z_value(confidence)
    return max(0.0, (s - z * sd) / seconds), (s + z * sd) / seconds


def wilson_ci(events: float, n: float, confidence: float = 0.95) -> CI | None:
    """Wilson score interval for a proportion ``events / n``.

    The closed form of ``scipy.stats.binomtest(k, n).proportion_ci(method="wilson")`` (the same
    numbers, tested), written out because binomtest also runs an exact test per call (about 1 ms,
    a few hundred calls per judged run) whose p-value is not used here."""
    if not n or n <= 0:
        return None
    z = z_value(confidence)
    p = min(1.0, max(0.0, events / n))
    z2n = z * z / n
    centre = (p + z2n / 2.0) / (1.0 + z2n)
    half = z * math.sqrt(p * (1.0 - p) / n + z2n / (4.0 * n)) / (1.0 + z2n)
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_ci(p1: float, ci1: CI, p2: float, ci2: CI) -> CI:
    """Interval for ``p1 - p2`` from two independent intervals (Newcombe's hybrid score method
    when they are Wilson intervals)."""
    d = p1 - p2
    lo = d - math.sqrt((p1 - ci1[0]) ** 2 + (ci2[1] - p2) ** 2)
    hi = d + math.sqrt((ci1[1] - p1) ** 2 + (p2 - ci2[0]) ** 2)
    return lo, hi


def energy_per_token_ci(
    joules_per_token: float,
    completion_tokens: float,
    sumsq: float | None = None,
    requests: int | None = None,
    power_stdev: float | None = None,
    power_mean: float | None = None,
    power_count: int | None = None,
    confidence: float = 0.95,
) -> CI | None:
    """Interval for J/token = energy / tokens (log-normal form, always positive).

    Relative variance = token-count part (``sum T_i^2 / S^2``, as in ``tokens_rate_ci``) + power
    part (``(stdev/mean)^2 / samples``; power samples a few seconds apart are autocorrelated, so
    this part is optimistic, but it is small next to the token part in practice).
    """
    if joules_per_token is None or joules_per_token <= 0 or not completion_tokens or completion_tokens <= 0:
        return None
    s = float(completion_tokens)
    if sumsq is None:
        if not requests:
            return None
        sumsq = s * s / requests
    rel_var = float(sumsq) / (s * s)
    if power_stdev is not None and power_mean and power_count and power_mean > 0 and power_count > 0:
        rel_var += (power_stdev / power_mean) ** 2 / power_count
    h = z_value(confidence) * math.sqrt(rel_var)
    return joules_per_token * math.exp(-h), joules_per_token * math.exp(h)


# ---------------------------------------------------------------------------------------------
# ratios


def ratio_ci(
    num_ci: CI | None,
    den_ci: CI | None,
    num: float | None = None,
    den: float | None = None,
    method: str = "quadrature",
) -> CI | None:
    """Interval for ``num / den`` from independent intervals of each (see the module docstring).

    ``num``/``den`` are the point estimates (default: geometric centres of the intervals). The
    upper bound is ``inf`` when the denominator's interval reaches 0. None when an input is
    missing or a point estimate is not positive.
    """
    if num_ci is None or den_ci is None:
        return None
    nlo, nhi = num_ci
    dlo, dhi = den_ci
    if method not in ("quadrature", "interval"):
        raise ValueError(f"method must be 'quadrature' or 'interval', got {method!r}")
    if dhi <= 0 or nhi < 0:
        return None
    if method == "interval" or nlo <= 0 or dlo <= 0:
        lo = max(0.0, nlo) / dhi
        hi = math.inf if dlo <= 0 else nhi / dlo
        return lo, hi
    if num is None:
        num = math.sqrt(nlo * nhi)
    if den is None:
        den = math.sqrt(dlo * dhi)
    if num <= 0 or den <= 0:
        return None
    # log-space half-widths of each side (asymmetric intervals stay asymmetric)
    n_down, n_up = math.log(num) - math.log(nlo), math.log(nhi) - math.log(num)
    d_down, d_up = math.log(den) - math.log(dlo), math.log(dhi) - math.log(den)
    r = num / den
    down = math.hypot(max(0.0, n_down), max(0.0, d_up))
    up = math.hypot(max(0.0, n_up), max(0.0, d_down))
    return r * math.exp(-down), r * math.exp(up)
