"""Confidence intervals of soakd.analysis.stats: coverage by simulation, known values, edges."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import pytest
from scipy.stats import binomtest

from soakd.analysis.sketch import new_sketch
from soakd.analysis.stats import (
    QUANTILE_CI_MIN_COUNT,
    difference_ci,
    energy_per_token_ci,
    order_statistic_ranks,
    poisson_count_ci,
    quantile_ci,
    quantile_ci_min_count,
    rate_ci,
    ratio_ci,
    tokens_rate_ci,
    wilson_ci,
    z_value,
)


def _sketch(values):  # noqa: ANN001, ANN202
    sk = new_sketch()
    for v in values:
        sk.add(v)
    return sk


@pytest.mark.parametrize(("q", "n"), [(0.5, 300), (0.95, 500), (0.99, 1500)])
def test_quantile_ci_coverage_lognormal(q: float, n: int) -> None:
    """Many windows of lognormal latencies: the 95% interval covers the true quantile >= 93%."""
    mu, sigma = math.log(0.8), 0.6
    true_q = math.exp(mu + sigma * NormalDist().inv_cdf(q))
    rng = random.Random(12345 + n)
    trials, covered, widths = 300, 0, []
    for _ in range(trials):
        sk = _sketch(rng.lognormvariate(mu, sigma) for _ in range(n))
        ci = quantile_ci(sk, q)
        assert ci is not None
        covered += ci[0] <= true_q <= ci[1]
        widths.append((ci[1] - ci[0]) / true_q)
    assert covered / trials >= 0.93
    # and not trivially wide: the asymptotic full width is 2 z se(log q) plus 2% for the sketch
    se_log = sigma * math.sqrt(q * (1 - q) / n) / NormalDist().pdf(NormalDist().inv_cdf(q))
    assert sorted(widths)[trials // 2] < 2.2 * (2 * 1.96 * se_log + 0.02)


def test_quantile_ci_minimum_counts() -> None:
    assert QUANTILE_CI_MIN_COUNT == {"p50": 8, "p95": 110, "p99": 563}
    rng = random.Random(3)
    for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        m = QUANTILE_CI_MIN_COUNT[name]
        assert quantile_ci(_sketch(rng.random() + 0.1 for _ in range(m - 1)), q) is None
        assert quantile_ci(_sketch(rng.random() + 0.1 for _ in range(m)), q) is not None
    assert quantile_ci(new_sketch(), 0.5) is None
    assert quantile_ci(None, 0.5) is None
    assert quantile_ci_min_count(0.95, 0.99) > quantile_ci_min_count(0.95, 0.95)


def test_order_statistic_ranks_exact_coverage() -> None:
    # small n: the exact binomial probability of the band reaches the confidence
    for n, q in ((20, 0.5), (150, 0.95), (700, 0.99), (5000, 0.95)):
        j, k = order_statistic_ranks(n, q, 0.95)
        lg = math.lgamma
        cov = sum(
            math.exp(lg(n + 1) - lg(i + 1) - lg(n - i + 1) + i * math.log(q) + (n - i) * math.log1p(-q))
            for i in range(j, k)
        )
        assert cov >= 0.95
        assert 1 <= j < k <= n
    assert order_statistic_ranks(0, 0.5) is None
    assert order_statistic_ranks(100, 1.0) is None


def test_quantile_ci_widened_by_sketch_accuracy_and_brackets_estimate() -> None:
    sk = _sketch([1.0] * 1000)  # every value identical: only the sketch error remains
    lo, hi = quantile_ci(sk, 0.5)
    v = sk.get_quantile_value(0.5)
    assert lo == pytest.approx(v / 1.01)
    assert hi == pytest.approx(v / 0.99)
    assert lo <= 1.0 <= hi


def test_quantile_ci_n_effective_widens() -> None:
    rng = random.Random(5)
    sk = _sketch(rng.lognormvariate(0, 0.3) for _ in range(20000))
    narrow = quantile_ci(sk, 0.95)
    wide = quantile_ci(sk, 0.95, n_effective=500)
    assert wide[0] < narrow[0] and wide[1] > narrow[1]
    assert quantile_ci(sk, 0.95, n_effective=50) is None  # 50 independent observations: no p95 interval


def test_poisson_and_rate_ci_known_values() -> None:
    # exact Garwood 95% (chi-square quantiles, no approximation): a count of 1: (0.02532, 5.5716);
    # of 10: (4.7954, 18.3904); of 100: (81.3640, 121.6268); of 0: (0, -ln 0.025)
    lo, hi = poisson_count_ci(1)
    assert lo == pytest.approx(0.025318, rel=1e-4) and hi == pytest.approx(5.571643, rel=1e-6)
    lo, hi = poisson_count_ci(10)
    assert lo == pytest.approx(4.795389, rel=1e-6) and hi == pytest.approx(18.390356, rel=1e-6)
    lo, hi = poisson_count_ci(100)
    assert lo == pytest.approx(81.363991, rel=1e-6) and hi == pytest.approx(121.626794, rel=1e-6)
    assert poisson_count_ci(0) == (0.0, pytest.approx(-math.log(0.025), rel=1e-12))
    lo, hi = rate_ci(100, 50.0)
    assert lo == pytest.approx(81.363991 / 50, rel=1e-6)
    assert rate_ci(10, 0) is None


def test_rate_ci_coverage_poisson() -> None:
    rng = random.Random(7)
    true_rate, seconds, covered, trials = 4.0, 60.0, 0, 1000
    for _ in range(trials):
        t, count = rng.expovariate(true_rate), 0
        while t < seconds:
            count += 1
            t += rng.expovariate(true_rate)
        lo, hi = rate_ci(count, seconds)
        covered += lo <= true_rate <= hi
    assert covered / trials >= 0.93


def test_tokens_rate_ci_compound_poisson() -> None:
    lo, hi = tokens_rate_ci(1000.0, 10.0, sumsq=10000.0)  # sd of the sum = 100 tokens
    assert lo == pytest.approx((1000 - z_value(0.95) * 100) / 10)
    assert hi == pytest.approx((1000 + z_value(0.95) * 100) / 10)
    # without the sum of squares: constant tokens per request assumed
    assert tokens_rate_ci(1000.0, 10.0, requests=100) == tokens_rate_ci(1000.0, 10.0, sumsq=10000.0)
    assert tokens_rate_ci(1000.0, 10.0) is None
    assert tokens_rate_ci(0.0, 10.0, sumsq=0.0) == (0.0, 0.0)


def test_tokens_rate_ci_coverage() -> None:
    """Simulated compound Poisson windows (Poisson arrivals, 50-250 tokens each)."""
    rng = random.Random(11)
    rate, seconds, trials, covered = 2.0, 100.0, 800, 0
    true = rate * 150.0
    for _ in range(trials):
        t, s, ss = rng.expovariate(rate), 0, 0
        while t < seconds:
            k = rng.randint(50, 250)
            s, ss = s + k, ss + k * k
            t += rng.expovariate(rate)
        lo, hi = tokens_rate_ci(s, seconds, ss)
        covered += lo <= true <= hi
    assert covered / trials >= 0.93


def test_wilson_known_values() -> None:
    lo, hi = wilson_ci(0, 100)
    assert lo == 0.0 and hi == pytest.approx(0.0370, abs=2e-4)
    lo, hi = wilson_ci(5, 100)
    assert lo == pytest.approx(0.0215, abs=2e-4) and hi == pytest.approx(0.1118, abs=2e-4)
    assert wilson_ci(1, 0) is None


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_wilson_is_scipys(confidence: float) -> None:
    """The closed form is scipy's Wilson interval (binomtest's proportion_ci), to rounding."""
    for n in (1, 2, 7, 30, 100, 1000, 25_000):
        for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
            ref = binomtest(k, n).proportion_ci(confidence, method="wilson")
            lo, hi = wilson_ci(k, n, confidence)
            assert lo == pytest.approx(ref.low, abs=1e-12) and hi == pytest.approx(ref.high, abs=1e-12)


def test_difference_ci_newcombe() -> None:
    # Newcombe (1998) example: 56/70 vs 48/80 -> difference 0.2, 95% CI (0.0524, 0.3339)
    p1, p2 = 56 / 70, 48 / 80
    lo, hi = difference_ci(p1, wilson_ci(56, 70), p2, wilson_ci(48, 80))
    assert lo == pytest.approx(0.0524, abs=1e-3) and hi == pytest.approx(0.3339, abs=1e-3)


def test_ratio_ci_quadrature_and_interval() -> None:
    q = ratio_ci((0.9, 1.1), (0.95, 1.05), 1.0, 1.0)
    i = ratio_ci((0.9, 1.1), (0.95, 1.05), 1.0, 1.0, method="interval")
    assert q[0] < 1.0 < q[1]
    assert i[0] < q[0] and q[1] < i[1]  # quadrature is narrower than interval arithmetic
    assert ratio_ci((1.0, 2.0), (0.0, 1.0))[1] == math.inf
    assert ratio_ci(None, (1.0, 2.0)) is None
    with pytest.raises(ValueError):
        ratio_ci((1.0, 2.0), (1.0, 2.0), method="bogus")


def test_ratio_ci_coverage_of_median_ratio() -> None:
    """The ratio interval of two windows' medians covers the true ratio (1.1) >= 93% of the time."""
    rng = random.Random(21)
    trials, covered = 200, 0
    for _ in range(trials):
        a = _sketch(1.1 * rng.lognormvariate(0, 0.5) for _ in range(400))
        b = _sketch(rng.lognormvariate(0, 0.5) for _ in range(400))
        ci = ratio_ci(quantile_ci(a, 0.5), quantile_ci(b, 0.5), a.get_quantile_value(0.5), b.get_quantile_value(0.5))
        covered += ci[0] <= 1.1 <= ci[1]
    assert covered / trials >= 0.93


def test_energy_per_token_ci() -> None:
    lo, hi = energy_per_token_ci(2.0, 10000, sumsq=1_000_000, power_stdev=50, power_mean=500, power_count=100)
    assert lo < 2.0 < hi
    rel = math.sqrt(1_000_000 / 1e8 + (0.1**2) / 100)
    assert hi == pytest.approx(2.0 * math.exp(z_value(0.95) * rel))
    assert energy_per_token_ci(None, 100) is None
    assert energy_per_token_ci(2.0, 0) is None


def test_z_value_rejects_bad_confidence() -> None:
    with pytest.raises(ValueError):
        z_value(1.0)
