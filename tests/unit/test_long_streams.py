"""A long stream's bookkeeping goes through numpy (the sketch's buckets, the ITL histogram, the freeze
detector's activity buckets, the gaps): each must give what the one-by-one path gives."""

from __future__ import annotations

import random

from soakd.analysis.sketch import add_many, new_sketch
from soakd.analysis.window import ClientStats
from soakd.metrics import Hist


def _keys(store) -> dict[int, float]:  # noqa: ANN001
    return {i + store.offset: c for i, c in enumerate(store.bins) if c}


def test_add_many_counts_what_add_counts_into_the_same_buckets() -> None:
    for seed in range(60):
        rnd = random.Random(seed)
        one, many = new_sketch(), new_sketch()
        for _ in range(4):
            values = [rnd.lognormvariate(-5, 1.5) for _ in range(rnd.choice((0, 3, 47, 48, 255, 300)))]
            values += [0.0, -1e-9][: rnd.randint(0, 2)]  # a zero gap, and a negative one (counted as 0)
            for v in values:
                one.add(v if v > 0 else 0.0)
            add_many(many, values)
        assert _keys(one._store) == _keys(many._store)
        assert (one.count, one._zero_count, one._min, one._max) == (many.count, many._zero_count, many._min, many._max)
        assert one.sum == many.sum
        for q in (0.0, 0.01, 0.5, 0.99, 1.0):
            assert one.get_quantile_value(q) == many.get_quantile_value(q)


def test_long_gaps_histogram_and_activity_buckets_match_the_short_path() -> None:
    rnd = random.Random(7)
    t0 = 5_000_000_000_000
    times = [t0]
    for _ in range(255):
        times.append(times[-1] + rnd.randint(1_000, 40_000_000))
    gaps = [(b - a) / 1e9 for a, b in zip(times, times[1:])]
    bounds = (0.001, 0.005, 0.01, 0.02, 0.05)
    long, short = Hist(bounds), Hist(bounds)
    long.observe_many(gaps)  # 255 values: numpy
    for g in gaps:
        short.observe(g)
    assert long.counts == short.counts and long.sum == sum(gaps)
    wide, narrow = ClientStats(0.0, 30.0), ClientStats(0.0, 30.0)
    wide.add_request_ns(t0, times[-1], times, 0, 1.0 - t0 / 1e9)  # the record's clock 1 s into the window
    for i in range(0, len(times), 40):  # the same tokens in pieces shorter than numpy's threshold
        narrow.add_request_ns(t0, times[-1], times[i:i + 40], 0, 1.0 - t0 / 1e9)
    assert bytes(wide.flags) == bytes(narrow.flags) and sum(wide.flags) > 10


def test_a_short_batch_that_collapses_the_store_keeps_every_count() -> None:
    """Values 18+ orders of magnitude apart make ddsketch's store collapse its lowest bins mid-batch: no count is
    lost (the sketch's count and its bins agree)."""
    for values in ([10.0 ** e for e in range(-200, 201, 9)], [1e-300, 1e300, 1.0, 1e-300, 1e300]):
        sk = new_sketch()
        add_many(sk, values)
        add_many(sk, values[::-1])
        assert sk.count == 2 * len(values) == sk._store.count + sk._zero_count
        assert sum(sk._store.bins) == sk._store.count


def test_edges_a_gap_on_a_bound_and_a_token_before_the_window() -> None:
    bounds = (0.001, 0.005, 0.01, 0.02, 0.05)
    gaps = [0.005, 0.01, 0.02, 0.001, 0.05, 0.0049999, 0.0100001] * 10  # on the bounds: le, as Prometheus
    long, short = Hist(bounds), Hist(bounds)
    long.observe_many(gaps)
    for g in gaps:
        short.observe(g)
    assert long.counts == short.counts == [10, 20, 10, 20, 10, 0] and long.sum == short.sum
    t0 = 5_000_000_000_000
    times = [t0 - 50_000_000 + 1_000_000 * i for i in range(60)]  # the first 50 before the window's clock start
    wide, narrow = ClientStats(0.0, 30.0), ClientStats(0.0, 30.0)
    wide.add_request_ns(t0, times[-1], times, 0, -t0 / 1e9)
    for i in range(0, len(times), 40):
        narrow.add_request_ns(t0, times[-1], times[i:i + 40], 0, -t0 / 1e9)
    assert bytes(wide.flags) == bytes(narrow.flags)
