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


def test_stalls_impair_a_window_only_beyond_the_share_of_its_requests_or_time() -> None:
    c = ClientStats(0.0, 60.0)
    for _ in range(5000):
        c.add_lag(0.001, 0.0001)
    ok = c.summary(60.0, ClientConfig(), requests=100)
    assert not ok.impaired and ok.heartbeats == 5000 and ok.stall_seconds == 0.0 and ok.impaired_share == 0.0
    assert abs(ok.loop_lag_p50_seconds - 0.001) < 1e-5 and abs(ok.cpu_share - 0.5 / 60) < 1e-9
    for _ in range(3):  # 3 x 300 ms in a minute: charged to the requests they overlap, not the window
        c.add_lag(0.3)
    c.impaired_requests = 20
    busy = c.summary(60.0, ClientConfig(), requests=100)
    assert not busy.impaired and busy.requests_impaired == 20 and busy.impaired_share == 0.2
    assert abs(busy.request_stall_seconds - 0.9) < 1e-9 and busy.loop_lag_max_seconds == 0.3
    c.impaired_requests = 21  # more than max_impaired_share (0.2) of the requests
    bad = c.summary(60.0, ClientConfig(), requests=100)
    assert bad.impaired and bad.impaired_reason == (
        "21 of 100 requests (21.0%) overlapped a stall of soakd's event loop beyond 100 ms")
    # the window rules of earlier releases, where a configuration sets them
    old = ClientConfig(max_stall_share=0.005, max_lag=0.25, max_throttled_share=0.01)
    c.impaired_requests = 0
    legacy = c.summary(60.0, old, requests=100)
    assert legacy.impaired and "stalled 0.90 s" in legacy.impaired_reason and "300 ms" in legacy.impaired_reason
    t = ClientStats(0.0, 60.0)
    t.add_throttling(1.2, 12)
    assert not t.summary(60.0, ClientConfig()).impaired  # throttling shows in the lags it causes
    assert t.summary(60.0, old).impaired_reason == "soakd's cgroup was CPU-throttled 1.20 s (2.0%)"
    stopped = ClientStats(0.0, 60.0)  # soakd stopped 15 s of a 60 s window, whatever it sent
    stopped.add_lag(15.0)
    s = stopped.summary(60.0, ClientConfig(), requests=0)
    assert s.impaired and s.impaired_share is None
    assert s.impaired_reason == "soakd's event loop stalled beyond 100 ms for 15.00 s (25.0% of the window)"


def test_the_freeze_is_the_longest_silence_with_requests_in_flight() -> None:
    c = ClientStats(100.0, 60.0)
    c.add_request(101.0, 105.0, [101.5, 102.0, 105.0])  # 3 s without a byte (102..105)
    c.add_request(110.0, 130.0, [110.2, 111.0, 130.0])  # 19 s without a byte (111..130)
    c.add_request(140.0, 141.0, [140.1 + i * 0.1 for i in range(9)])
    span, at = c.freeze()
    assert abs(span - 19.0) < 0.15 and abs(at - 11.0) < 0.15
    idle = ClientStats(0.0, 60.0)  # nothing in flight is no freeze, however quiet
    assert idle.freeze() is None
