"""Trace replay (issue 23 item 1): the shipped samples of each format, malformed files, arrivals restarted
every window, shared prefixes from hash ids, the units a trace makes, and a replay through the real client
against the simulator."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from soakd.client.openai import OpenAIClient
from soakd.config import ConfigError, TargetConfig, load_config
from soakd.core.records import RequestRecord
from soakd.core.timeline import Timeline
from soakd.metrics import SoakMetrics
from soakd.soak.driver import LoadDriver
from soakd.soak.recorder import Recorder
from soakd.soak.windows import WindowSet
from soakd.workload.corpus import Corpus
from soakd.workload.scenarios import CHAT_TEMPLATE_OVERHEAD, resolve_all, with_trace_arrivals
from soakd.workload.trace import load_trace, sniff_format, time_scale, trace_arrivals
from soakd.workload.workload import Workload
from helpers import FAST_SIM, REPO, sim_server

pytestmark = pytest.mark.timeout(60)

SAMPLES = REPO / "examples" / "traces"
SMALL_CORPUS = Corpus(0, size=20_000)


def _config(path: Path, **source: Any) -> Any:
    load = source.pop("load", {})
    return load_config(None, {"load": {"mix": {"replay": 1}, **load},
                              "scenarios": {"replay": {"like": "short_chat",
                                                       "source": {"type": "trace", "path": str(path), **source}}}})


def _workload(path: Path, **source: Any) -> tuple[Any, Workload]:
    cfg = _config(path, **source)
    scenarios = resolve_all(cfg)
    cfg = with_trace_arrivals(cfg, scenarios)
    return cfg, Workload(scenarios, cfg.load.mix, "soakd-sim", 0, SMALL_CORPUS)


# ---- the samples -----------------------------------------------------------------------------------


def test_each_shipped_sample_reads_as_its_format() -> None:
    lines = {p.name: [ln for ln in p.read_text().splitlines() if ln.strip()] for p in SAMPLES.iterdir()
             if p.suffix in (".jsonl", ".csv")}
    moon = load_trace(SAMPLES / "mooncake.jsonl")
    assert moon.format == "mooncake" and len(moon.entries) == len(lines["mooncake.jsonl"]) == 40
    raw = [json.loads(ln) for ln in lines["mooncake.jsonl"]]
    t0 = min(r["timestamp"] for r in raw)
    assert [e.offset for e in moon.entries] == pytest.approx(sorted((r["timestamp"] - t0) / 1000 for r in raw))
    assert sorted(e.input_length for e in moon.entries) == sorted(r["input_length"] for r in raw)
    assert all(e.hash_ids for e in moon.entries)

    burst = load_trace(SAMPLES / "burstgpt.csv")
    assert burst.format == "burstgpt"
    assert len(burst.entries) + burst.skipped == len(lines["burstgpt.csv"]) - 1  # the header
    assert burst.skipped == 2  # the two failed requests (0 response tokens)
    assert all(e.output_length > 0 for e in burst.entries)

    conv = load_trace(SAMPLES / "conversations.jsonl")
    assert conv.format == "conversations" and conv.timed and len(conv.entries) == 8
    assert conv.requests == sum(sum(1 for m in e.messages if m["role"] == "user") for e in conv.entries)
    assert any(e.messages[0]["role"] == "system" for e in conv.entries)  # the OpenAI-shaped line


@pytest.mark.parametrize(
    ("name", "text", "needles"),
    [
        ("t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 5}\n{"timestamp": 5, "input_length": 10\n',
         ["line 2", "not valid JSON"]),
        ("t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
                    '{"timestamp": 5, "input_length": 10}\n', ["line 2", "'output_length'", "missing"]),
        ("t.jsonl", '{"timestamp": 0, "input_length": -3, "output_length": 5}\n', ["line 1", "'input_length'",
                                                                                  "-3"]),
        ("t.jsonl", '{"timestamp": "soon", "input_length": 3, "output_length": 5}\n', ["line 1", "'timestamp'"]),
        ("t.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 5, "hash_ids": [1, "x"]}\n',
         ["line 1", "'hash_ids'"]),
        ("t.csv", "Timestamp,Model,Request tokens\n0,GPT-4,12\n", ["line 1", "'Response tokens'"]),
        ("t.csv", "Timestamp,Model,Request tokens,Response tokens\n0,GPT-4,12,3\n1.5,GPT-4,twelve,3\n",
         ["line 3", "'Request tokens'", "twelve"]),
        ("t.jsonl", '{"conversations": [{"from": "human", "value": "hi"}]}\n{"conversations": [{"from": "human"}]}\n',
         ["line 2", "conversations[0]"]),
        ("t.jsonl", '{"messages": "hi"}\n', ["line 1", "'messages'", "expected a list"]),
        ("t.jsonl", '{"messages": [{"role": "assistant", "content": "hi"}]}\n', ["no requests in it"]),
        ("t.jsonl", '{"timestamp": 0, "input_length": NaN, "output_length": 5}\n', ["line 1", "'input_length'"]),
        ("t.csv", "Timestamp,Model,Request tokens,Response tokens\n0,GPT-4,inf,3\n", ["line 2", "'Request tokens'"]),
        ("t.jsonl", '{"timestamp": 1, "messages": [{"role": "user", "content": "a"}]}\n'
                    '{"messages": [{"role": "user", "content": "b"}]}\n', ["line 2", "'timestamp'"]),
        ("t.jsonl", "\n\n", ["cannot tell its format"]),
    ],
)
def test_a_malformed_trace_fails_with_its_line_and_field(tmp_path: Path, name: str, text: str,
                                                         needles: list[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        resolve_all(_config(path))
    message = "\n".join(err.value.errors)
    assert "scenarios.replay.source.path" in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_a_trace_must_be_the_only_scenario_of_the_mix() -> None:
    cfg = load_config(None, {"load": {"mix": {"replay": 1, "short_chat": 1}}, "scenarios": {
        "replay": {"source": {"type": "trace", "path": str(SAMPLES / "mooncake.jsonl")}}}})
    with pytest.raises(ConfigError, match="load.mix: scenario 'replay' replays a trace"):
        resolve_all(cfg)


def test_format_is_sniffed_and_can_be_forced(tmp_path: Path) -> None:
    assert sniff_format(SAMPLES / "burstgpt.csv") == "burstgpt"
    assert sniff_format(SAMPLES / "mooncake.jsonl") == "mooncake"
    assert sniff_format(SAMPLES / "conversations.jsonl") == "conversations"
    odd = tmp_path / "trace.txt"
    odd.write_text((SAMPLES / "burstgpt.csv").read_text())
    assert load_trace(odd, "burstgpt").format == "burstgpt"


# ---- arrivals ----------------------------------------------------------------------------------------


def test_every_window_replays_the_same_stretch_of_the_trace() -> None:
    trace = load_trace(SAMPLES / "mooncake.jsonl")
    scale = time_scale(trace, speedup=5.0)
    tl = Timeline(100.0, 3.0, 5.0, 3.0 + 4 * 5.0)
    sends = list(trace_arrivals(trace, tl, scale))
    assert sends and all(tl.start <= a.t < tl.end for a in sends)
    assert [a.t for a in sends] == sorted(a.t for a in sends)
    per_window: dict[int, list[tuple[float, int]]] = {}
    for a in sends:
        w = tl.window_at(a.t)
        start = tl.window_bounds(w)[0] if w >= 0 else tl.start
        per_window.setdefault(w, []).append((round(a.t - start, 9), a.index))
    assert sorted(per_window) == [-1, 0, 1, 2, 3]
    assert per_window[0] == per_window[1] == per_window[2] == per_window[3]
    # the trace (one pass: period * scale seconds) is shorter than a window: it loops within it
    period = trace.period * scale
    assert period < 5.0
    expected = sum(1 for e in trace.entries if e.offset * scale < 5.0) + sum(
        1 for e in trace.entries if period + e.offset * scale < 5.0)
    assert len(per_window[0]) == expected
    assert [i for _, i in per_window[0][:40]] == list(range(40))
    # the gaps are the trace's, scaled
    gaps = [b - a for (a, _), (b, _) in zip(per_window[0][:40], per_window[0][1:40])]
    want = [(b.offset - a.offset) * scale for a, b in zip(trace.entries, trace.entries[1:])]
    assert gaps == pytest.approx(want, abs=1e-6)
    # a pass is numbered once: windows never share one
    passes = {w: {a.pass_no for a in sends if tl.window_at(a.t) == w} for w in per_window}
    assert all(not (passes[a] & passes[b]) for a in passes for b in passes if a < b)


def test_a_trace_longer_than_a_window_is_cut_and_a_rate_keeps_its_shape() -> None:
    trace = load_trace(SAMPLES / "mooncake.jsonl")
    tl = Timeline(0.0, 0.0, 2.0, 6.0)
    sends = list(trace_arrivals(trace, tl, 1.0))  # ~20 s of trace, 2-s windows
    for w in range(3):
        mine = [a for a in sends if tl.window_at(a.t) == w]
        assert [a.index for a in mine] == [i for i, e in enumerate(trace.entries) if e.offset < 2.0]
    scale = time_scale(trace, rate=10.0)
    assert trace.requests / (trace.period * scale) == pytest.approx(10.0)
    assert time_scale(trace, speedup=4.0) == pytest.approx(0.25)


# ---- what is sent --------------------------------------------------------------------------------------


def test_requests_with_the_same_leading_hash_ids_share_a_byte_identical_prefix() -> None:
    _, wl = _workload(SAMPLES / "mooncake.jsonl", block_size=64)
    trace = wl.trace
    assert trace is not None
    units = [wl.next_unit(0) for _ in trace.entries]  # closed loop: the trace's order, one pass
    texts = [u[0].body["messages"][0]["content"] for u in units]
    for entry, unit, text in zip(trace.entries, units, texts, strict=True):
        assert len(text.split(" ")) == entry.input_length - CHAT_TEMPLATE_OVERHEAD
        assert unit[0].max_tokens == unit[0].body["max_tokens"] == entry.output_length
        assert unit[0].expected_prompt_tokens == entry.input_length
    shared = 0
    for i, a in enumerate(trace.entries):
        for j in range(i + 1, len(trace.entries)):
            b = trace.entries[j]
            common = 0
            while common < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[common] == b.hash_ids[common]:
                common += 1
            wa, wb = texts[i].split(" "), texts[j].split(" ")
            n = min(common * 64, len(wa), len(wb))
            assert wa[:n] == wb[:n]
            if common:
                shared += 1
            else:
                assert wa[:64] != wb[:64]
    assert shared > 20
    # the next pass (a new window) sends the same shape with blocks of its own: no cache hit across windows
    again = [wl.next_unit(1)[0].body["messages"][0]["content"] for _ in trace.entries]
    assert [len(t.split(" ")) for t in again] == [len(t.split(" ")) for t in texts]
    assert all(x.split(" ")[:64] != y.split(" ")[:64] for x, y in zip(again, texts, strict=True))


def test_burstgpt_rows_are_sent_with_their_lengths() -> None:
    cfg, wl = _workload(SAMPLES / "burstgpt.csv")
    assert cfg.load.arrival == "trace" and not cfg.load.closed_loop
    trace = wl.trace
    assert trace is not None
    for entry in trace.entries:
        (p,) = wl.next_unit(0)
        assert p.max_tokens == entry.output_length
        assert len(p.body["messages"][0]["content"].split(" ")) == max(1, entry.input_length - CHAT_TEMPLATE_OVERHEAD)


def test_a_conversation_is_replayed_turn_by_turn_with_its_recorded_history() -> None:
    _, wl = _workload(SAMPLES / "conversations.jsonl")
    trace = wl.trace
    assert trace is not None
    for entry in trace.entries:
        unit = wl.next_unit(0)
        users = [i for i, m in enumerate(entry.messages) if m["role"] == "user"]
        assert len(unit) == len(users)
        assert [p.after_previous for p in unit] == [False] + [True] * (len(unit) - 1)
        for p, u in zip(unit, users, strict=True):
            sent = p.body["messages"]
            # the recorded history, the first message tagged with the pass (no window finds another's in the cache)
            assert sent[1:] == list(entry.messages[1:u + 1])
            assert sent[0]["content"] == f"[1000000] {entry.messages[0]['content']}"
            reply = entry.messages[u + 1]["content"] if u + 1 < len(entry.messages) else None
            assert reply is not None and p.max_tokens == len(reply.replace(".", " .").split())


def test_concurrency_replays_the_trace_in_order_and_arrival_trace_needs_timestamps(tmp_path: Path) -> None:
    cfg, _ = _workload(SAMPLES / "mooncake.jsonl", load={"concurrency": 4})
    assert cfg.load.closed_loop and cfg.load.arrival == "poisson"
    untimed = tmp_path / "c.jsonl"
    untimed.write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n')
    cfg, _ = _workload(untimed)
    assert cfg.load.closed_loop  # nothing to time it by: the trace's order at the default concurrency
    with pytest.raises(ConfigError, match="has no timestamps"):
        _workload(untimed, load={"arrival": "trace"})


# ---- through the real client, against the simulator -----------------------------------------------------


async def _replay(sample: str, speedup: float, window: float, duration: float,
                  **load: Any) -> tuple[Any, Timeline, list[tuple[float, int, dict[str, Any]]], Recorder]:
    """Replay a sample through the real driver and client against the simulator: (workload, timeline, what was
    sent: (when, window, body), recorder)."""
    cfg, wl = _workload(SAMPLES / sample, speedup=speedup, load=load)
    async with sim_server(**FAST_SIM) as sim:
        loop = asyncio.get_running_loop()
        tl = Timeline(loop.time() + 0.2, 0.0, window, duration)
        recorder = Recorder(SoakMetrics(tuple(cfg.load.mix)), WindowSet(tl))
        client = OpenAIClient(TargetConfig(url=sim.base_url), pool_size=64)
        sent: list[tuple[float, int, dict[str, Any]]] = []
        execute = client.execute

        async def spy(rec: RequestRecord, body: dict[str, Any], check: str = "none") -> None:
            sent.append((loop.time(), rec.window, body))
            await execute(rec, body, check)

        client.execute = spy  # type: ignore[method-assign]
        driver = LoadDriver(cfg.load, client, wl, recorder, tl)
        try:
            await asyncio.wait_for(driver.run(grace=5), 30)
        finally:
            await client.close()
    return wl, tl, sent, recorder


@pytest.mark.parametrize("sample", ["mooncake.jsonl", "burstgpt.csv"])
async def test_a_trace_is_replayed_against_the_simulator_at_its_timestamps(sample: str) -> None:
    speedup = 8.0 if sample == "mooncake.jsonl" else 10.0
    wl, tl, sent, recorder = await _replay(sample, speedup, 1.5, 3.0)
    trace = wl.trace
    plan = list(trace_arrivals(trace, tl, time_scale(trace, speedup=speedup)))
    assert len(sent) == len(plan) and recorder.outcomes["ok"] == len(plan)
    # the lengths the trace gives, in its order
    assert [b["max_tokens"] for _, _, b in sent] == [trace.entries[a.index].output_length for a in plan]
    assert [len(b["messages"][0]["content"].split(" ")) for _, _, b in sent] == [
        max(1, trace.entries[a.index].input_length - CHAT_TEMPLATE_OVERHEAD) for a in plan]
    # at the trace's times: never early, and the gaps are the trace's (scaled)
    lateness = [when - a.t for (when, _, _), a in zip(sent, plan, strict=True)]
    assert min(lateness) > -0.005
    gaps = [abs((y[0] - x[0]) - (b.t - a.t)) for x, y, a, b in zip(sent, sent[1:], plan, plan[1:])]
    print(f"lateness median {statistics.median(lateness) * 1000:.1f} ms, max {max(lateness) * 1000:.1f} ms; "
          f"gap error median {statistics.median(gaps) * 1000:.1f} ms")
    assert statistics.median(lateness) < 0.1 and statistics.median(gaps) < 0.05
    # each counted in the window it was dispatched in: the planned one, or the next when it left late across
    for (when, w, _), a in zip(sent, plan, strict=True):
        assert w in (tl.window_at(a.t), tl.window_at(a.t) + 1)
        assert w == tl.window_at(a.t) or tl.window_bounds(w)[0] - a.t <= max(lateness) + 1e-3
    if sample == "mooncake.jsonl":  # the shared prefixes, as the simulator received them
        by_pass: dict[int, list[tuple[int, str]]] = {}
        for (_, _, b), a in zip(sent, plan, strict=True):
            by_pass.setdefault(a.pass_no, []).append((a.index, b["messages"][0]["content"]))
        for items in by_pass.values():
            for i, x in items:
                for j, y in items:
                    ha, hb = trace.entries[i].hash_ids, trace.entries[j].hash_ids
                    if i != j and ha[:1] == hb[:1]:
                        assert x.split(" ")[:512] == y.split(" ")[:512]


async def test_a_conversation_trace_is_sent_turn_by_turn_against_the_simulator() -> None:
    wl, tl, sent, recorder = await _replay("conversations.jsonl", 8.0, 2.0, 4.0)
    trace = wl.trace
    plan = list(trace_arrivals(trace, tl, time_scale(trace, speedup=8.0)))
    firsts = [(when, b) for when, _, b in sent  # a conversation's first request: its messages up to the first user turn
              if sum(m["role"] == "user" for m in b["messages"]) == 1]
    assert len(firsts) == len(plan)  # every conversation started, at its time
    assert recorder.outcomes["ok"] == len(sent) and {k for k, v in recorder.outcomes.items() if v} == {"ok"}
    for when, a in zip(sorted(w for w, _ in firsts), plan, strict=True):
        assert when - a.t > -0.005
    # every request is a recorded conversation's history up to a user turn, tagged with its pass
    recorded = {tuple((m["role"], m["content"]) for m in e.messages) for e in trace.entries}
    for _, _, b in sent:
        msgs = b["messages"]
        assert msgs[-1]["role"] == "user" and msgs[0]["content"].startswith("[")
        untagged = [(msgs[0]["role"], msgs[0]["content"].split("] ", 1)[1])] + [(m["role"], m["content"])
                                                                                for m in msgs[1:]]
        assert any(r[:len(untagged)] == tuple(untagged) for r in recorded)
    assert len(sent) > len(plan)  # later turns followed the first ones

def test_real_dump_variants_are_read_and_lines_with_nothing_to_send_are_counted(tmp_path: Path) -> None:
    path = tmp_path / "dump.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"conversation": [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text",
                                                                                           "text": "KV cache?"}]},
                          {"role": "assistant", "content": "A cache of keys and values."}]},
        {"conversations": []},
        {"conversations": [{"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "tool", "content": "{}"}, {"role": "assistant", "content": "hello"}]},
    ]) + "\n", encoding="utf-8")
    trace = load_trace(path)
    assert trace.format == "conversations" and len(trace.entries) == 2 and trace.skipped == 2
    assert trace.entries[0].messages[0] == {"role": "user", "content": "what is KV cache?"}
    assert [m["role"] for m in trace.entries[1].messages] == ["system", "user", "assistant"]
    bom = tmp_path / "bom.csv"
    bom.write_bytes("\ufeffTimestamp,Model,Request tokens,Response tokens\n0.5,GPT-4,12,3\n".encode())
    assert load_trace(bom).entries[0].input_length == 12


def test_a_rate_is_what_each_window_carries_even_when_the_trace_is_longer() -> None:
    for sample in ("mooncake.jsonl", "burstgpt.csv"):
        trace = load_trace(SAMPLES / sample)
        for rate, window in ((1.0, 10.0), (2.0, 5.0), (50.0, 10.0)):
            scale = time_scale(trace, rate=rate, window=window)
            tl = Timeline(0.0, 0.0, window, 4 * window)
            per = [sum(1 for a in trace_arrivals(trace, tl, scale) if tl.window_at(a.t) == w) for w in range(4)]
            assert len(set(per)) == 1
            assert per[0] == pytest.approx(rate * window, rel=0.1, abs=1.5), (sample, rate, window, per)


def test_pass_numbers_never_repeat_across_windows_or_a_resumed_segment() -> None:
    trace = load_trace(SAMPLES / "mooncake.jsonl")
    first = Timeline(0.0, 2.0, 3.0, 11.0)
    resumed = Timeline(100.0, 0.0, 3.0, 9.0, first_index=3)
    a = {x.pass_no for x in trace_arrivals(trace, first, 0.05)}
    b = {x.pass_no for x in trace_arrivals(trace, resumed, 0.05)}
    assert len(a) > 3 and len(b) >= 3 and not (a & b)


def test_an_explicit_arrival_process_is_kept() -> None:
    cfg, _ = _workload(SAMPLES / "mooncake.jsonl", load={"arrival": "constant", "rate": 5.0})
    assert cfg.load.arrival == "constant"


async def test_max_requests_counts_a_conversation_turn_by_turn() -> None:
    cfg, wl = _workload(SAMPLES / "conversations.jsonl", load={"concurrency": 1})
    async with sim_server(**FAST_SIM) as sim:
        loop = asyncio.get_running_loop()
        tl = Timeline(loop.time(), 0.0, 10.0, 10.0)
        recorder = Recorder(SoakMetrics(tuple(cfg.load.mix)), WindowSet(tl))
        client = OpenAIClient(TargetConfig(url=sim.base_url))
        driver = LoadDriver(cfg.load, client, wl, recorder, tl, max_requests=5)
        try:
            await asyncio.wait_for(driver.run(grace=5), 20)
        finally:
            await client.close()
    assert recorder.sent == 5 and recorder.outcomes["ok"] == 5 and driver.stop_reason == "max_requests"


def test_a_sweep_of_a_timed_trace_takes_rate_levels(tmp_path: Path) -> None:
    cfg, _ = _workload(SAMPLES / "mooncake.jsonl")
    cfg = load_config(None, {**cfg.model_dump(mode="json", exclude={"sim"}), "sweep": {"levels": [0.5, 1, 2.5]}})
    cfg = with_trace_arrivals(cfg, resolve_all(cfg))
    assert cfg.load.arrival == "trace" and cfg.sweep_levels() == [0.5, 1.0, 2.5]
    untimed = tmp_path / "c.jsonl"
    untimed.write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n')
    cfg = load_config(None, {"load": {"mix": {"replay": 1}}, "sweep": {"levels": [0.5, 1]}, "scenarios": {
        "replay": {"source": {"type": "trace", "path": str(untimed)}}}})
    with pytest.raises(ConfigError, match="sweep.levels: the trace .* closed loop"):
        with_trace_arrivals(cfg, resolve_all(cfg))
