"""What soakd sends: the stratified mix, seeded prompts, scenarios, dataset sources, arrivals."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from soakd.core.timeline import Timeline
from soakd.client.openai import OpenAIClient
from soakd.core.records import RequestRecord
from soakd.config import ConfigError, LoadConfig, TargetConfig, load_config
from soakd.metrics import SoakMetrics
from soakd.soak.driver import LoadDriver
from soakd.soak.recorder import Recorder
from soakd.soak.windows import WindowSet
from soakd.workload.arrivals import arrivals, constant, poisson
from soakd.workload.corpus import Corpus
from soakd.workload.mix import StratifiedMix
from soakd.workload.scenarios import BUILTIN, CHAT_MESSAGE_OVERHEAD, load_dataset, resolve, resolve_all
from soakd.workload.workload import Workload
from helpers import FAST_SIM, sim_server

pytestmark = pytest.mark.timeout(60)

SMALL_CORPUS = Corpus(0, size=20_000)


def workload(names: dict[str, float], seed: int = 0, **scenario_updates: dict) -> Workload:
    scenarios = {n: replace(BUILTIN[n], **scenario_updates.get(n, {})) for n in names}
    return Workload(scenarios, names, "m", seed, corpus=SMALL_CORPUS)


def drain_turns(wl: Workload, units: list) -> None:
    for p in units:
        if p.conversation is not None:
            wl.finish_turn(p, True, "a reply")


# ---- the stratified mix ----------------------------------------------------------------------


def test_mix_every_window_prefix_within_one_pick() -> None:
    """Property: for random weights, seeds and window lengths, after every pick of every window
    each scenario's count is within one of its exact share (|count - n*w/W| < 1)."""
    for seed in range(40):
        rng = random.Random(seed)
        k = rng.randint(1, 7)
        weights = {f"s{i}": rng.choice([rng.randint(1, 12), round(rng.uniform(0.05, 9.0), 3)]) for i in range(k)}
        total = sum(weights.values())
        mix = StratifiedMix(weights, seed)
        for window in range(4):
            length = rng.randint(1, 300)
            counts = dict.fromkeys(weights, 0)
            for n in range(1, length + 1):
                counts[mix.next(window)] += 1
                for name, w in weights.items():
                    assert abs(counts[name] - n * w / total) < 1.0, (seed, weights, window, n, name, counts)
            assert mix.counts == counts  # the mix restarted at the window boundary


def test_mix_zero_weight_is_never_picked_and_empty_mix_is_refused() -> None:
    mix = StratifiedMix({"a": 1, "b": 0, "c": 2}, 3)
    assert "b" not in {mix.next() for _ in range(100)}
    with pytest.raises(ValueError):
        StratifiedMix({"a": 0})


def test_mix_seed_rotates_the_order_but_not_the_shares() -> None:
    weights = {"a": 4, "b": 1, "c": 2, "d": 1, "e": 1}

    def seq(seed: int) -> list[str]:
        mix = StratifiedMix(weights, seed)
        return [mix.next() for _ in range(9)]

    seqs = {seed: seq(seed) for seed in range(12)}
    assert len({tuple(s) for s in seqs.values()}) > 1
    for s in seqs.values():
        assert {n: s.count(n) for n in weights} == weights
    assert seqs[0] == seq(0)


def test_workload_window_proportions_with_bursts() -> None:
    """Per window, whatever its length: batch_burst gets its request share within one burst,
    every other scenario within one request plus its share of one burst (a burst lands at once,
    so right after one the others are necessarily behind by share x burst_size).
    In picks (a burst is one pick) every scenario is within one pick of its share."""
    names = list(BUILTIN)
    for seed in range(12):
        rng = random.Random(100 + seed)
        chosen = rng.sample(names, rng.randint(1, 4))
        if "batch_burst" not in chosen:
            chosen.append("batch_burst")
        burst = rng.choice([2, 4, 8, 16])
        weights = {n: float(rng.randint(1, 8)) for n in chosen}
        wl = workload(weights, seed, batch_burst={"burst_size": burst})
        total = sum(weights.values())
        pick_w = {n: w / (burst if n == "batch_burst" else 1) for n, w in weights.items()}
        pick_total = sum(pick_w.values())
        for window in range(3):
            counts = dict.fromkeys(chosen, 0)
            picks = dict.fromkeys(chosen, 0)
            sent = 0
            for n_picks in range(1, rng.randint(20, 150)):
                unit = wl.next_unit(window)
                name = unit[0].scenario.name
                assert all(p.scenario.name == name for p in unit)
                assert len(unit) == (burst if name == "batch_burst" else 1)
                drain_turns(wl, unit)
                counts[name] += len(unit)
                picks[name] += 1
                sent += len(unit)
                for s, w in weights.items():
                    share = w / total
                    limit = burst if s == "batch_burst" else 1 + share * burst
                    assert abs(counts[s] - sent * share) <= limit + 1e-9, (seed, window, s, counts, sent)
                    assert abs(picks[s] - n_picks * pick_w[s] / pick_total) < 1.0


def test_warmup_has_its_own_stratum() -> None:
    """The warm-up (window -1) does not eat into window 0's proportions."""
    wl = workload({"short_chat": 1, "code_completion": 1})
    first = [wl.next_unit(-1)[0].scenario.name for _ in range(3)]
    window0 = [wl.next_unit(0)[0].scenario.name for _ in range(2)]
    assert sorted(window0) == ["code_completion", "short_chat"], (first, window0)


async def test_driver_keeps_warmup_out_of_window_zero_stratum() -> None:
    """The driver asks the workload for warm-up units as window -1 (not 0), so window 0 starts its
    own stratified sequence."""
    async with sim_server(**FAST_SIM) as sim:
        load = LoadConfig(concurrency=1, mix={"short_chat": 1})
        scenarios = {"short_chat": replace(BUILTIN["short_chat"], max_tokens=(2, 2))}
        loop = asyncio.get_running_loop()
        tl = Timeline(loop.time(), 100.0, 10.0, 200.0)  # all of this test is warm-up
        recorder = Recorder(SoakMetrics(tuple(scenarios)), WindowSet(tl))
        wl = Workload(scenarios, load.mix, "soakd-sim", 0, SMALL_CORPUS)
        asked: list[int] = []
        next_unit = wl.next_unit

        def spy(window: int = 0, arrival: object = None) -> list:
            asked.append(window)
            return next_unit(window, arrival)

        wl.next_unit = spy  # type: ignore[method-assign]
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        driver = LoadDriver(load, client, wl, recorder, tl, max_requests=3)
        try:
            await asyncio.wait_for(driver.run(grace=5), 10)
        finally:
            await client.close()
    assert asked == [-1, -1, -1]
    assert recorder.metrics.warmup_requests.get("ok") == 3 and recorder.measured == 0


# ---- determinism -----------------------------------------------------------------------------


def _bodies(seed: int, n: int = 80) -> list[str]:
    wl = Workload({k: BUILTIN[k] for k in BUILTIN}, {k: 1.0 for k in BUILTIN}, "m", seed)
    out = []
    for i in range(n):
        unit = wl.next_unit(i // 20)
        for p in unit:
            out.append(json.dumps(p.body, sort_keys=True))
            if p.conversation is not None:
                wl.finish_turn(p, True, f"reply {i}")
    return out


def test_same_seed_same_bodies_different_seed_different() -> None:
    a, b, c = _bodies(7), _bodies(7), _bodies(8)
    assert a == b
    assert len(a) == len(c)
    assert sum(x != y for x, y in zip(a, c)) > len(a) * 0.9


def test_prompts_do_not_repeat_within_a_run() -> None:
    """Prompt prefixes vary, so server prefix caches cannot make later windows faster."""
    wl = workload({"short_chat": 1})
    prefixes = {wl.next_unit(0)[0].body["messages"][0]["content"][:80] for _ in range(200)}
    assert len(prefixes) == 200


def test_lengths_follow_the_configured_ranges() -> None:
    wl = workload({"short_chat": 1}, short_chat={"prompt_tokens": (40, 60), "max_tokens": (7, 9)})
    seen_mt, seen_n = set(), set()
    for _ in range(300):
        p = wl.next_unit(0)[0]
        assert 40 <= p.expected_prompt_tokens <= 60 and 7 <= p.body["max_tokens"] <= 9
        assert p.max_tokens == p.body["max_tokens"]
        seen_mt.add(p.max_tokens)
        seen_n.add(p.expected_prompt_tokens)
    assert seen_mt == {7, 8, 9} and min(seen_n) == 40 and max(seen_n) == 60


async def test_prompt_lengths_match_the_simulators_usage() -> None:
    """Every built-in scenario's target prompt length against the simulator's
    ``usage.prompt_tokens`` (one token per word and per punctuation mark, 3 tokens per message + 3).

    Measured: prose prompts land exactly 2 tokens under the target (soakd reserves 8 tokens for
    a chat template, the simulator's template is 6), code prompts -1.5 %..-0.4 %, multi-turn
    conversations -(messages + 1) tokens (soakd assumes 4 template tokens per further message,
    the simulator 3). Tolerance asserted: server - target within [-10, +2] tokens and within
    -7 %..+2 % of the target."""
    async with sim_server(**FAST_SIM) as sim:
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        try:
            for name in BUILTIN:
                wl = Workload({name: BUILTIN[name]}, {name: 1.0}, "soakd-sim", seed=3, corpus=SMALL_CORPUS)
                for _ in range(10 if name != "batch_burst" else 2):
                    for p in wl.next_unit(0):
                        p.body["max_tokens"] = 24  # short answers keep the test fast; history still grows
                        rec = RequestRecord(name, p.scenario.endpoint, p.scenario.stream)
                        await client.execute(rec, p.body)
                        assert rec.ok and rec.usage_from_server, rec
                        wl.finish_turn(p, rec.ok, rec.text)
                        diff = rec.prompt_tokens - p.expected_prompt_tokens
                        assert -10 <= diff <= 2, (name, rec.prompt_tokens, p.expected_prompt_tokens)
                        assert -0.07 <= diff / p.expected_prompt_tokens <= 0.02, (name, diff)
                        if name in ("short_chat", "long_context", "batch_burst"):
                            assert diff == -2
        finally:
            await client.close()


# ---- scenarios ---------------------------------------------------------------------------------


def test_multi_turn_carries_history() -> None:
    wl = workload({"multi_turn": 1}, multi_turn={"turns": 3})
    p1 = wl.next_unit(0)[0]
    assert [m["role"] for m in p1.body["messages"]] == ["user"]
    wl.finish_turn(p1, True, "first reply")
    p2 = wl.next_unit(0)[0]
    msgs = p2.body["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0] == p1.body["messages"][0] and msgs[1]["content"] == "first reply"
    assert p2.expected_prompt_tokens > p1.expected_prompt_tokens + len(msgs[2]["content"].split())
    wl.finish_turn(p2, True, "second reply")
    p3 = wl.next_unit(0)[0]
    assert [m["content"] for m in p3.body["messages"][:4]] == [
        msgs[0]["content"], "first reply", msgs[2]["content"], "second reply"]
    assert len(p3.body["messages"]) == 5
    wl.finish_turn(p3, True, "third reply")
    p4 = wl.next_unit(0)[0]  # turns: 3 -> a new conversation
    assert len(p4.body["messages"]) == 1 and p4.body["messages"][0] != msgs[0]
    # a failed turn ends the conversation
    wl.finish_turn(p4, False, "")
    assert len(wl.next_unit(0)[0].body["messages"]) == 1


def test_concurrent_conversations_do_not_share_a_turn() -> None:
    wl = workload({"multi_turn": 1})
    a, b = wl.next_unit(0)[0], wl.next_unit(0)[0]
    assert a.conversation is not b.conversation
    wl.finish_turn(b, True, "reply to b")
    c = wl.next_unit(0)[0]
    assert c.conversation is b.conversation and c.body["messages"][1]["content"] == "reply to b"


async def test_multi_turn_against_the_simulator() -> None:
    """The history sent back is the server's own replies; prompt usage grows turn by turn."""
    async with sim_server(**FAST_SIM) as sim:
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        wl = Workload({"multi_turn": BUILTIN["multi_turn"]}, {"multi_turn": 1.0}, "soakd-sim", 1, SMALL_CORPUS)
        usage, replies = [], []
        try:
            for turn in range(4):
                p = wl.next_unit(0)[0]
                assert len(p.body["messages"]) == 2 * turn + 1
                assert [m["content"] for m in p.body["messages"][1::2]] == replies
                rec = RequestRecord("multi_turn")
                await client.execute(rec, p.body)
                assert rec.ok, rec
                usage.append(rec.prompt_tokens)
                replies.append(rec.text)
                wl.finish_turn(p, rec.ok, rec.text)
        finally:
            await client.close()
    assert usage == sorted(usage) and len(set(usage)) == 4


def test_custom_scenario_like_a_builtin() -> None:
    cfg = load_config(None, {
        "load": {"mix": {"my_code": 1}},
        "scenarios": {"my_code": {"like": "code_completion", "endpoint": "completions", "stream": False,
                                  "max_tokens": 33, "extra_body": {"ignore_eos": True, "min_tokens": 33}}},
    }, environ={})  # fmt: skip
    sc = resolve_all(cfg)["my_code"]
    assert sc.base == "code_completion" and sc.prompt_tokens == BUILTIN["code_completion"].prompt_tokens
    wl = Workload({"my_code": sc}, {"my_code": 1}, "m", 0, SMALL_CORPUS)
    body = wl.next_unit(0)[0].body
    assert "prompt" in body and "messages" not in body and "stream" not in body
    assert body["max_tokens"] == 33 and body["ignore_eos"] is True and body["min_tokens"] == 33
    assert "def " in body["prompt"]


def test_stream_options_follow_include_usage() -> None:
    on = workload({"short_chat": 1}).next_unit(0)[0].body
    assert on["stream"] is True and on["stream_options"] == {"include_usage": True}
    off = workload({"short_chat": 1}, short_chat={"include_usage": False}).next_unit(0)[0].body
    assert off["stream"] is True and "stream_options" not in off


async def test_batch_burst_releases_its_requests_together() -> None:
    """One closed-loop worker, a mix of only batch_burst (burst_size 6): all six are in flight at
    once — only a burst can make a single worker have more than one request outstanding."""
    async with sim_server(ttft_base=0.2, tpot_base=0.001, tpot_per_batch=0, ttft_per_prompt_token=0) as sim:
        cfg = load_config(None, {"load": {"concurrency": 1, "mix": {"batch_burst": 1}},
                                 "scenarios": {"batch_burst": {"burst_size": 6, "max_tokens": 4}}}, environ={})
        scenarios = resolve_all(cfg)
        metrics = SoakMetrics(tuple(scenarios))
        loop = asyncio.get_running_loop()
        tl = Timeline(loop.time(), 0.0, 10.0, 10.0)
        recorder = Recorder(metrics, WindowSet(tl))
        peak = 0
        started = recorder.started

        def track(rec: RequestRecord) -> None:
            nonlocal peak
            started(rec)
            peak = max(peak, recorder.in_flight)

        recorder.started = track  # type: ignore[method-assign]
        client = OpenAIClient(cfg.target.model_copy(update={"url": sim.base_url}), pool_size=8)
        driver = LoadDriver(cfg.load, client, Workload(scenarios, cfg.load.mix, "soakd-sim", 0, SMALL_CORPUS),
                            recorder, tl, max_requests=12)
        try:
            await asyncio.wait_for(driver.run(grace=5), 10)
        finally:
            await client.close()
    assert peak == 6
    assert recorder.sent == 12 and recorder.outcomes["ok"] == 12
    assert driver.stop_reason == "max_requests"


async def test_open_loop_sends_exactly_max_requests() -> None:
    async with sim_server(**FAST_SIM) as sim:
        load = LoadConfig(rate=400.0, arrival="constant", mix={"short_chat": 1})
        scenarios = {"short_chat": replace(BUILTIN["short_chat"], max_tokens=(4, 4))}
        metrics = SoakMetrics(tuple(scenarios))
        loop = asyncio.get_running_loop()
        tl = Timeline(loop.time(), 0.0, 10.0, 10.0)
        recorder = Recorder(metrics, WindowSet(tl))
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        driver = LoadDriver(load, client, Workload(scenarios, load.mix, "soakd-sim", 0, SMALL_CORPUS),
                            recorder, tl, max_requests=17)
        try:
            await asyncio.wait_for(driver.run(grace=5), 10)
        finally:
            await client.close()
    assert recorder.sent == 17 and recorder.finished_count == 17 and recorder.outcomes["ok"] == 17
    assert driver.stop_reason == "max_requests"


def test_requests_per_unit_accounts_for_bursts() -> None:
    wl = workload({"short_chat": 1.0, "batch_burst": 1.0})  # burst_size 8: 8 singles and 1 burst per cycle
    assert wl.requests_per_unit == pytest.approx(16 / 9)
    sizes = [len(wl.next_unit(0)) for _ in range(900)]
    assert sum(sizes) / len(sizes) == pytest.approx(wl.requests_per_unit)
    assert workload({"short_chat": 3.0, "code_completion": 1.0}).requests_per_unit == 1.0


async def test_open_loop_rate_is_requests_per_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load.rate`` counts requests: with bursts in the mix the unit arrival rate is lower, so the
    requests sent per second match the configured rate."""
    import soakd.soak.driver as driver_mod

    seen: list[float] = []

    def fake_arrivals(kind: str, rate: float, start: float, seed: int = 0):  # noqa: ANN202
        seen.append(rate)
        return iter(())

    monkeypatch.setattr(driver_mod, "arrivals", fake_arrivals)
    load = LoadConfig(rate=30.0, mix={"short_chat": 1, "batch_burst": 1})
    wl = workload(load.mix)
    loop = asyncio.get_running_loop()
    tl = Timeline(loop.time(), 0.0, 10.0, 10.0)
    client = OpenAIClient(TargetConfig(url="http://127.0.0.1:9/v1"))
    driver = LoadDriver(load, client, wl, Recorder(SoakMetrics(tuple(load.mix)), WindowSet(tl)), tl)
    await asyncio.wait_for(driver.run(grace=1), 5)
    await client.close()
    assert seen == [pytest.approx(30.0 * 9 / 16)]


# ---- dataset sources ---------------------------------------------------------------------------


def _dataset_workload(tmp_path: Path, kind: str, path: Path, endpoint: str = "chat") -> Workload:
    cfg = load_config(None, {
        "load": {"mix": {"mine": 1}},
        "scenarios": {"mine": {"like": "short_chat", "endpoint": endpoint, "source": {"type": kind, "path": str(path)}}},
    }, environ={})  # fmt: skip
    scenarios = resolve_all(cfg)
    return Workload(scenarios, cfg.load.mix, "m", 0, SMALL_CORPUS)


def test_jsonl_source(tmp_path: Path) -> None:
    rows = [
        [{"role": "user", "content": f"question {i}"}] for i in range(4)
    ] + [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "question 4"}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]))
    assert len(load_dataset(path, "jsonl")) == 5
    wl = _dataset_workload(tmp_path, "jsonl", path)
    seen = []
    for _ in range(10):
        p = wl.next_unit(0)[0]
        assert p.expected_prompt_tokens == 0  # no target length: kept out of the accuracy figure
        seen.append(json.dumps(p.body["messages"]))
    expected = {json.dumps(r if isinstance(r, list) else r["messages"]) for r in rows}
    assert set(seen[:5]) == expected and set(seen[5:]) == expected  # every prompt once per pass


def test_sharegpt_source(tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is a soak test?"},
                                      {"from": "gpt", "value": "A long test."},
                                      {"from": "human", "value": "And then?"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "You are terse."},
                                      {"from": "human", "value": "Hi"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "only the model speaks"}]},
        {"id": "d", "conversations": "not a list"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    items = load_dataset(path, "sharegpt")
    assert items == [
        [{"role": "user", "content": "What is a soak test?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    ]
    wl = _dataset_workload(tmp_path, "sharegpt", path, endpoint="completions")
    prompts = {wl.next_unit(0)[0].body["prompt"] for _ in range(4)}
    assert prompts == {"What is a soak test?", "You are terse.\n\nHi"}


@pytest.mark.parametrize(
    ("kind", "text", "needle"),
    [
        ("jsonl", '[{"role": "user", "content": "ok"}]\n\n{"messages": [{"role": "user", "content": 1}]}\n',
         "line 3"),
        ("jsonl", '[{"role": "user", "content": "ok"}]\n[{"role": "user", "content": "ok"}]\n{not json\n',
         "line 3: not valid JSON"),
        ("jsonl", '"just a string"\n', "line 1"),
        ("jsonl", "\n\n", "no usable prompts"),
        ("sharegpt", "{not json", "not valid JSON"),
        ("sharegpt", '{"conversations": []}', "expected a ShareGPT list"),
        ("sharegpt", '[{"conversations": [{"from": "gpt", "value": "x"}]}]', "no usable prompts"),
    ],
)
def test_malformed_dataset_names_the_line(tmp_path: Path, kind: str, text: str, needle: str) -> None:
    path = tmp_path / f"bad-{kind}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_dataset(path, kind)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_resolve_builtin_override_keeps_other_defaults() -> None:
    cfg = load_config(None, {"scenarios": {"long_context": {"max_tokens": 600}}}, environ={})
    sc = resolve("long_context", cfg.scenarios["long_context"])
    assert sc.max_tokens == (600, 600) and sc.prompt_tokens == BUILTIN["long_context"].prompt_tokens


# ---- arrivals -------------------------------------------------------------------------------------


def test_poisson_mean_rate_and_dispersion() -> None:
    """20,000 arrivals at 50/s: the mean rate within 3 % (the standard error is 0.7 %) and the
    gaps' coefficient of variation within 5 % of 1 (exponential gaps)."""
    n, rate = 20_000, 50.0
    it = poisson(rate, 100.0, seed=11)
    times = [next(it) for _ in range(n)]
    gaps = [b - a for a, b in zip([100.0, *times], times)]
    assert all(g > 0 for g in gaps)
    measured = n / (times[-1] - 100.0)
    assert abs(measured / rate - 1) < 0.03
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert abs(cv - 1) < 0.05


def test_poisson_reproducible_from_seed() -> None:
    a = [t for t, _ in zip(arrivals("poisson", 10, 0.0, 5), range(100))]
    b = [t for t, _ in zip(arrivals("poisson", 10, 0.0, 5), range(100))]
    c = [t for t, _ in zip(arrivals("poisson", 10, 0.0, 6), range(100))]
    assert a == b and a != c


def test_constant_spacing_is_exact_and_does_not_drift() -> None:
    it = constant(3.0, 10.0)
    times = [next(it) for _ in range(300_001)]
    for i in (0, 1, 2, 3, 1000, 300_000):
        assert times[i] == 10.0 + i * (1.0 / 3.0)
    assert math.isclose(times[300_000], 10.0 + 100_000.0, rel_tol=0, abs_tol=1e-9)
    assert [t for t, _ in zip(arrivals("constant", 3.0, 10.0, seed=99), range(5))] == times[:5]


def test_unknown_arrival_process() -> None:
    with pytest.raises(ValueError, match="poisson or constant"):
        arrivals("bursty", 1.0, 0.0)


def test_backoff_delay_doubles_from_the_floor_to_the_cap_with_jitter() -> None:
    from soakd.soak.driver import BACKOFF_CAP, BACKOFF_FLOOR, backoff_delay

    assert backoff_delay(1, 0.0) == BACKOFF_FLOOR and backoff_delay(2, 0.0) == 2 * BACKOFF_FLOOR
    assert backoff_delay(1, 0.999) < 1.5 * BACKOFF_FLOOR
    assert backoff_delay(50, 0.0) == BACKOFF_CAP and backoff_delay(10_000, 0.999) < 1.5 * BACKOFF_CAP
    delays = [backoff_delay(k, 0.5) for k in range(1, 12)]
    assert delays == sorted(delays) and min(delays) >= BACKOFF_FLOOR


# ---- shared prefixes (issue 23 item 2) -----------------------------------------------------------------


def _prefix_workload(endpoint: str = "chat", **shared: object) -> Workload:
    cfg = load_config(None, {"load": {"mix": {"docs": 1}}, "scenarios": {"docs": {
        "like": "short_chat", "endpoint": endpoint, "prompt_tokens": 50, "max_tokens": 8,
        "shared_prefix": {"count": 3, "tokens": 200, **shared}}}})
    return Workload(resolve_all(cfg), cfg.load.mix, "m", 0, SMALL_CORPUS)


def test_shared_prefixes_are_few_fixed_and_start_the_prompt() -> None:
    wl = _prefix_workload(share=0.5)
    units = [wl.next_unit(w)[0] for w in range(4) for _ in range(150)]
    with_prefix = [u for u in units if u.body["messages"][0]["role"] == "system"]
    assert 0.4 < len(with_prefix) / len(units) < 0.6
    prefixes = {u.body["messages"][0]["content"] for u in with_prefix}
    assert len(prefixes) == 3 and all(len(p.split(" ")) == 200 for p in prefixes)
    # the same prefixes in every window (a deployment's system prompts), the question after them its own
    assert {u.body["messages"][0]["content"] for u in with_prefix[-60:]} == prefixes
    assert len({u.body["messages"][-1]["content"] for u in units}) > 0.95 * len(units)  # (a small test corpus)
    for u in units:
        extra = 200 + CHAT_MESSAGE_OVERHEAD if u in with_prefix else 0
        assert u.expected_prompt_tokens == 50 + extra
    # the same seed, the same traffic
    again = _prefix_workload(share=0.5)
    assert [again.next_unit(w)[0].body for w in range(4) for _ in range(150)] == [u.body for u in units]


def test_a_shared_prefix_starts_a_completions_prompt_and_is_refused_with_a_trace() -> None:
    wl = _prefix_workload("completions")
    first = [wl.next_unit(0)[0].body["prompt"] for _ in range(30)]
    heads = {p.split("\n\n")[0] for p in first}
    assert len(heads) == 3 and all(len(h.split(" ")) == 200 for h in heads)
    with pytest.raises(ConfigError, match="shared_prefix does not apply to a trace source"):
        load_config(None, {"load": {"mix": {"r": 1}}, "scenarios": {"r": {
            "source": {"type": "trace", "path": "examples/traces/mooncake.jsonl"}, "shared_prefix": {"count": 2}}}})


def test_a_corpus_slice_is_its_words_joined() -> None:
    """A prompt is cut from the corpus's joined text (one slice, not a join per request): the same string as
    joining the words at the same seeded offset, at every length up to the corpus's, and past it."""
    corpus = Corpus(3, size=5_000)
    for seed in range(40):
        for n in (0, 1, 2, 7, 128, 4_998, 4_999, 5_000, 12_345):
            want_rng, rng = random.Random(seed), random.Random(seed)
            k = max(1, n)
            if k >= corpus.size:
                want = " ".join((corpus.words * (k // corpus.size + 1))[:k])
            else:
                off = want_rng.randrange(0, corpus.size - k)
                want = " ".join(corpus.words[off:off + k])
            assert corpus.text(rng, n) == want, (seed, n)
            assert rng.random() == want_rng.random()  # the same draws: what follows is seeded as before


async def test_an_arrival_due_before_the_end_is_not_sent_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An open-loop arrival whose time is inside the run but whose send comes at or after its end (a wait for a
    slot, a load worker's whole-millisecond clock) is not sent: it would belong to a window past the run's last,
    of length zero (the fresh-clone make test of 9fa82bb: ZeroDivisionError opening window 5 of a 5-window run
    with two load workers). The closed loop already stops at the end."""
    import soakd.soak.driver as driver_mod

    def one_arrival(kind: str, rate: float, start: float, seed: int = 0):  # noqa: ANN202
        yield start + 9.999  # due a millisecond before the end of a 10-s run

    class LateClock:  # the send is read a millisecond after the end
        def monotonic(self) -> float:
            return 10.0005

        def wall(self) -> float:
            return 1_700_000_010.0

    monkeypatch.setattr(driver_mod, "arrivals", one_arrival)
    load = LoadConfig(rate=1.0, mix={"short_chat": 1})
    tl = Timeline(0.0, 0.0, 2.0, 10.0)  # five windows, 0-4
    recorder = Recorder(SoakMetrics(tuple(load.mix)), WindowSet(tl, clock=LateClock()))
    client = OpenAIClient(TargetConfig(url="http://127.0.0.1:9/v1"))
    driver = LoadDriver(load, client, workload(load.mix), recorder, tl, clock=LateClock())
    try:
        await asyncio.wait_for(driver.run(grace=1), 5)
    finally:
        await client.close()
    assert recorder.sent == 0 and driver.stop_reason == "duration"
    assert all(k <= 4 for k in recorder.windows.open)
