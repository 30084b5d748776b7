"""soakd watching itself: the cgroup's CFS throttling (v1 and v2 ``cpu.stat``), the window's
client-health record (event-loop lag, stalls, CPU) with the client-impaired rule, and the freeze
detector (requests in flight, no byte from any)."""

from __future__ import annotations

from pathlib import Path

from soakd.analysis.window import ClientStats
from soakd.config.analysis import ClientConfig
from soakd.soak.selfwatch import CgroupCpu, parse_cpu_stat

V2 = "usage_usec 912345\nuser_usec 800000\nsystem_usec 112345\nnr_periods 120\nnr_throttled 7\nthrottled_usec 350000\n"
V1 = "nr_periods 120\nnr_throttled 9\nthrottled_time 420000000\n"


def test_cpu_stat_of_both_cgroup_versions() -> None:
    assert parse_cpu_stat(V2, "v2") == (0.35, 7)
    assert parse_cpu_stat(V1, "v1") == (0.42, 9)
    assert parse_cpu_stat("usage_usec 5\n", "v2") is None  # no CPU controller counters


def test_the_throttling_counter_delta(tmp_path: Path) -> None:
    f = tmp_path / "cpu.stat"
    f.write_text(V2)
    cg = CgroupCpu(((tmp_path / "missing", "v2"), (f, "v2")))
    assert cg.available and cg.path == f
    assert cg.delta() == (0.0, 0)
    f.write_text(V2.replace("nr_throttled 7", "nr_throttled 10").replace("throttled_usec 350000", "throttled_usec 1350000"))
    assert cg.delta() == (1.0, 3)
    assert not CgroupCpu(((tmp_path / "none", "v1"),)).available


def test_a_stalled_loop_makes_the_window_client_impaired() -> None:
    c = ClientStats(0.0, 60.0)
    for _ in range(5000):
        c.add_lag(0.001, 0.0001)
    ok = c.summary(60.0, ClientConfig())
    assert not ok.impaired and ok.heartbeats == 5000 and ok.stall_seconds == 0.0
    assert abs(ok.loop_lag_p50_seconds - 0.001) < 1e-5 and abs(ok.cpu_share - 0.5 / 60) < 1e-9
    for _ in range(3):  # 3 x 300 ms in a minute: 1.5% of the window, and stalls beyond max_lag
        c.add_lag(0.3)
    bad = c.summary(60.0, ClientConfig())
    assert bad.impaired and "stalled 0.90 s" in bad.impaired_reason and "300 ms" in bad.impaired_reason
    t = ClientStats(0.0, 60.0)
    t.add_throttling(1.2, 12)
    assert t.summary(60.0, ClientConfig()).impaired_reason == "soakd's cgroup was CPU-throttled 1.20 s (2.0%)"


def test_the_freeze_is_the_longest_silence_with_requests_in_flight() -> None:
    c = ClientStats(100.0, 60.0)
    c.add_request(101.0, 105.0, [101.5, 102.0, 105.0])  # 3 s without a byte (102..105)
    c.add_request(110.0, 130.0, [110.2, 111.0, 130.0])  # 19 s without a byte (111..130)
    c.add_request(140.0, 141.0, [140.1 + i * 0.1 for i in range(9)])
    span, at = c.freeze()
    assert abs(span - 19.0) < 0.15 and abs(at - 11.0) < 0.15
    idle = ClientStats(0.0, 60.0)  # nothing in flight is no freeze, however quiet
    assert idle.freeze() is None
