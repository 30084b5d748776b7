"""Mergeable quantile sketches with a known relative error (DDSketch, from the ``ddsketch`` package).

A sketch holds log-spaced bucket counts, not samples: memory is bounded by the value range,
whatever the number of requests, and any quantile is within ``RELATIVE_ACCURACY`` of the true
value (relative error, e.g. 1% of 200 ms = 2 ms). Sketches of different windows or scenarios
merge exactly.
"""

from __future__ import annotations

import math

import numpy as np
from ddsketch import LogCollapsingLowestDenseDDSketch
from ddsketch.mapping import LogarithmicMapping

RELATIVE_ACCURACY = 0.0025
"""0.25%: well inside the 1% the method allows, and small next to the sampling intervals it widens (a
p50 of 3,000 lognormal requests has a ±3.6% interval; 0.25% adds ~0.01% in quadrature). At 1% the
bucket width itself would be a fifth of the 5% drift threshold."""
BIN_LIMIT = 8192  # 8192 log buckets at 0.25% cover ~18 orders of magnitude: never collapses for latencies


def new_sketch() -> LogCollapsingLowestDenseDDSketch:
    return LogCollapsingLowestDenseDDSketch(relative_accuracy=RELATIVE_ACCURACY, bin_limit=BIN_LIMIT)


def add_many(sketch, values) -> None:  # noqa: ANN001
    """``sketch.add(v if v > 0 else 0.0)`` for every value (a list or a numpy array), in one pass: the same buckets,
    count, sum, min and max (a batch's inter-token gaps in a fraction of the time of adds one by one). A negative
    value counts as 0 (a gap between two timestamps: never negative on CLOCK_MONOTONIC)."""
    mp = sketch._mapping
    n = len(values)
    if not n:
        return
    if type(mp) is not LogarithmicMapping:
        for v in values:
            sketch.add(v if v > 0 else 0.0)
        return
    if n < 48:  # numpy's call overhead beats a short loop: the mapping and the store's add, inlined
        _add_short(sketch, mp, values.tolist() if isinstance(values, np.ndarray) else values)
        return
    a = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
    pos = a[a > mp.min_possible]
    scaled = np.log2(pos) * mp._multiplier
    raw = np.ceil(scaled)
    near = np.abs(scaled - np.rint(scaled)) < 1e-9  # at a bucket's edge numpy's log2 and math.log(v, 2) may differ
    if near.any():  # there, the mapping's own key (an ulp decides the bucket; the sketch's is the reference)
        idx = np.flatnonzero(near)
        raw[idx] = [mp.key(v) - mp._offset for v in pos[idx].tolist()]
    store = sketch._store
    if len(raw):
        ki = (raw + mp._offset).astype(np.int64)  # the keys (LogarithmicMapping.key)
        k0 = int(ki.min())
        per_key = np.bincount(ki - k0)  # the batch's keys span a few hundred buckets: counted, not sorted
        at = np.flatnonzero(per_key)
        kl = (at + k0).tolist()
        cl = per_key[at].astype(np.float64).tolist()
        store.add(kl[0], 0.0)  # extend the range to both ends, then count into the bins directly
        store.add(kl[-1], 0.0)
        if getattr(store, "is_collapsed", False):
            for k, c in zip(kl, cl, strict=True):
                store.add(k, c)
        else:
            bins, o = store.bins, store.offset
            for k, c in zip(kl, cl, strict=True):
                bins[k - o] += c
            store.count += float(len(pos))
    sketch._zero_count += float(n - len(pos))
    sketch._count += float(n)
    total = sketch._sum
    for v in a.tolist():  # in order, as add() sums: numpy's pairwise sum differs in the last bit, by machine
        total += v
    sketch._sum = total
    low, high = float(a.min()), float(a.max())
    if low < sketch._min:
        sketch._min = low
    if high > sketch._max:
        sketch._max = high


def _add_short(sketch, mp: LogarithmicMapping, values) -> None:  # noqa: ANN001
    mult, off, lo = mp._multiplier, mp._offset, mp.min_possible
    log, ceil = math.log, math.ceil
    store = sketch._store
    bins, o, kmin, kmax = store.bins, store.offset, store.min_key, store.max_key
    total, low, high, zero, inside = sketch._sum, sketch._min, sketch._max, 0, 0
    for v in values:
        if v > lo:
            k = int(ceil(log(v, 2) * mult) + off)  # LogarithmicMapping.key, to the bit
            if kmin <= k <= kmax:
                bins[k - o] += 1.0
                inside += 1
            else:  # outside the store's range: its add extends it (and may collapse: the count first)
                store.count += float(inside)
                inside = 0
                store.add(k, 1.0)
                bins, o, kmin, kmax = store.bins, store.offset, store.min_key, store.max_key
        else:
            zero += 1
            v = 0.0
        total += v
        if v < low:
            low = v
        if v > high:
            high = v
    store.count += float(inside)
    sketch._zero_count += float(zero)
    sketch._count += float(len(values))
    sketch._sum, sketch._min, sketch._max = total, low, high


def quantile(sketch, q: float) -> float | None:  # noqa: ANN001
    if sketch is None or sketch.count == 0:
        return None
    return sketch.get_quantile_value(q)


def merged(sketches) -> LogCollapsingLowestDenseDDSketch:  # noqa: ANN001
    out = new_sketch()
    for s in sketches:
        if s is not None and s.count:
            out.merge(s)
    return out
