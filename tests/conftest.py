"""Fixtures every test gets. Helpers live in ``tests/helpers`` (``from helpers import ...``)."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _no_soakd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test depends on the developer's SOAKD_* environment."""
    for key in list(os.environ):
        if key.startswith("SOAKD_"):
            monkeypatch.delenv(key)


# `make test` runs the suite on two pytest-xdist workers (``-n 2 --dist loadscope --no-loadscope-reorder``): most
# tests wait on a soak in wall time, so two at once nearly halve the suite's time on two cores. A module runs whole on
# one worker (its module fixtures are built once); both real-server modules (tests/e2e: vLLM and llama-server, each
# of which takes every core while it starts) run on the same worker, one after the other. The modules that take
# minutes are handed out first (their sums measured with --durations=0), so that neither worker is left with one at
# the end. (xdist's own ``loadgroup`` marks cannot do the grouping: they rename ``item._nodeid``, which pytest 9.2 no
# longer reads.)
_FIRST = ("tests/e2e/", "tests/component/test_detection.py", "tests/unit/test_verdict_quality.py",
          "tests/component/test_alertmanager.py", "tests/component/test_sweep.py", "tests/component/test_prometheus.py")


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "tests/e2e/" if path.startswith("tests/e2e/") else path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, p in enumerate(_FIRST) if item.nodeid.startswith(p)), len(_FIRST))

    items.sort(key=rank)  # stable: collection order within a rank
