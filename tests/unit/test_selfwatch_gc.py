"""soakd's own garbage collector does not walk the startup heap during the load (soakd.soak.selfwatch)."""

from __future__ import annotations

import gc
import weakref


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_the_startup_heap_is_frozen_during_the_load_and_given_back_after() -> None:
    from soakd.soak.selfwatch import frozen_startup_heap

    node = _Node()
    alive = weakref.ref(node)
    with frozen_startup_heap() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000  # the imports' objects and ours
        del node  # garbage the startup heap leaves during the run: a full collection does not walk it
        gc.collect()
        assert alive() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()  # given back: collected as before
    assert alive() is None


def test_the_benchmark_runs_and_reports_both_ways(capsys) -> None:  # noqa: ANN001
    """benchmarks/own_gc.py (the measurement behind the freeze; no timing asserted here)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "own_gc.py"
    spec = importlib.util.spec_from_file_location("own_gc", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--records", "50", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "startup heap tracked" in out and "frozen / tracked = " in out
    assert gc.get_freeze_count() == 0
