"""The test helpers' own checks: the synthetic window builder."""

from __future__ import annotations

import random

from helpers.windows import make_window


def test_builder_shape() -> None:
    w = make_window(0, random.Random(1), 400)
    assert w.requests == sum(w.outcomes.values())
    assert w.e2e_seconds.p50_ci[0] <= w.e2e_seconds.p50 <= w.e2e_seconds.p50_ci[1]
    assert w.completion_tokens_sumsq >= w.completion_tokens ** 2 / w.requests
    assert set(w.scenarios) == {"short_chat"}
