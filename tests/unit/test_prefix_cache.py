"""The prefix cache end to end but for the server: the simulator's cache (``soakd.sim.prefix``: chained block
hashes, LRU, vLLM's token counters), its counters through the server sampler into a window's own hit rate
(``soakd.analysis.telemetry``), and the simulator's shrink fault."""

from __future__ import annotations

import pytest

from soakd.analysis.telemetry import TelemetryStats
from soakd.config.sim import SimConfig
from soakd.core.series import series
from soakd.sim.model import SimModel
from soakd.sim.prefix import PrefixCache
from soakd.sim.text import count_tokens


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_leading_blocks_hit_and_a_changed_block_breaks_the_chain() -> None:
    cache = PrefixCache(block_size=4, capacity=100)
    doc = words(40, "d")  # 10 full blocks
    a = doc + " " + words(6, "a")
    assert cache.lookup(a, count_tokens(a)) == 0  # cold
    b = doc + " " + words(6, "b")
    assert cache.lookup(b, count_tokens(b)) == 40  # the document's 10 blocks; the tail's block differs
    assert (cache.queries, cache.hits) == (92, 40)
    # the same words after a changed first block: nothing hits (each block's hash chains its parent's)
    c = "x " + doc
    assert cache.lookup(c, count_tokens(c)) == 0
    # a prompt seen in full: the whole blocks before its last token (always computed, as in vLLM)
    assert cache.lookup(doc, 40) == 36
    assert cache.lookup(doc + " d40", 41) == 40
    # TensorRT-LLM's unit: each prompt's blocks, its last partial one included
    sizes = [count_tokens(a), count_tokens(b), count_tokens(c), 40, 41]
    assert cache.query_blocks == sum(-(-n // 4) for n in sizes) and cache.hits % 4 == 0


def test_least_recently_used_blocks_are_evicted_and_resize_evicts_at_once() -> None:
    cache = PrefixCache(block_size=2, capacity=6)
    p1, p2 = words(6, "p"), words(6, "q")  # 3 blocks each
    cache.lookup(p1, 6)
    cache.lookup(p2, 6)
    assert len(cache) == 6
    cache.lookup(p1, 6)  # p1 touched: p2 is the least recently used
    r = words(4, "r")
    cache.lookup(r, 4)  # 2 new blocks evict 2 of p2's: its leaf and the block before it, not its root
    assert len(cache) == 6 and cache.lookup(p1, 6) == 4
    assert cache.lookup(p2, 6) == 2  # p2's first block still hits (a root evicted first strands its chain)
    cache.resize(0)
    assert len(cache) == 0 and cache.lookup(p1, 6) == 0 and len(cache) == 0


def test_the_model_prefills_only_uncached_tokens_and_the_shrink_fault_empties_the_cache() -> None:
    now = [0.0]
    cfg = SimConfig(kv_block_size=16, faults={"prefix_cache_shrink_at": 60.0, "prefix_cache_shrink_ratio": 0.0})
    model = SimModel(cfg, clock=lambda: now[0])
    shared = words(320, "s")
    hits = []
    for i in range(20):
        now[0] = i * 6.0  # the fault at 60 s: requests 10..19
        text = shared + " " + words(20, f"u{i}x")
        req = model.new_request(str(i), count_tokens(text), 8, text)
        hits.append(req.cached_tokens)
    assert hits[0] == 0 and all(h == 320 for h in hits[1:10]) and all(h == 0 for h in hits[10:])
    assert model.prefix_cache.hits == 9 * 320 and model.prefix_cache.queries == 20 * 340
    off = SimModel(SimConfig(prefix_caching=False), clock=lambda: 0.0)
    assert off.new_request("a", 320, 8, shared).cached_tokens == 0
    assert off.new_request("b", 320, 8, shared).cached_tokens == 0 and off.prefix_cache.queries == 0


def _scrapes(tel: TelemetryStats, points: list[tuple[float, float, float]]) -> None:
    for t, hits, queries in points:
        tel.add([series("soakd_server_prefix_cache_hits_total", hits),
                 series("soakd_server_prefix_cache_queries_total", queries)], t)


def test_a_windows_hit_rate_is_its_own_not_the_servers_since_it_started() -> None:
    tel = TelemetryStats()
    # a server up for days at 80% cumulative; in this window 1,000 queried tokens, 100 hit
    _scrapes(tel, [(0.0, 800_000.0, 1_000_000.0), (5.0, 800_050.0, 1_000_500.0), (10.0, 800_100.0, 1_001_000.0)])
    assert tel.server().prefix_cache_hit_ratio == pytest.approx(0.1)
    # counters that went down (a restart): no rate across it
    tel = TelemetryStats()
    _scrapes(tel, [(0.0, 800.0, 1000.0), (5.0, 10.0, 20.0)])
    assert tel.server().prefix_cache_hit_ratio is None
    # a restart inside the window whose counters grew back past where they were (seen: a hit rate of 1.4)
    tel = TelemetryStats()
    _scrapes(tel, [(0.0, 800.0, 1000.0), (5.0, 10.0, 20.0), (10.0, 900.0, 1050.0)])
    assert tel.server().prefix_cache_hit_ratio is None
    # ... or one soakd recognised (a new process start time) between two scrapes whose counters both grew
    tel = TelemetryStats()
    for t, hits, queries, restarts in [(0.0, 800.0, 1000.0, 0), (5.0, 850.0, 1010.0, 1), (10.0, 900.0, 1050.0, 1)]:
        tel.add([series("soakd_server_prefix_cache_hits_total", hits),
                 series("soakd_server_prefix_cache_queries_total", queries),
                 series("soakd_server_restarts_total", restarts)], t)
    assert tel.server().prefix_cache_hit_ratio is None and tel.server().ttft_mean_seconds is None
    # nothing queried, or one scrape: none
    tel = TelemetryStats()
    _scrapes(tel, [(0.0, 5.0, 10.0), (5.0, 5.0, 10.0)])
    assert tel.server().prefix_cache_hit_ratio is None
    tel = TelemetryStats()
    _scrapes(tel, [(0.0, 5.0, 10.0)])
    assert tel.server().prefix_cache_hit_ratio is None
