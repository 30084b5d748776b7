"""The embedded simulator: config, engine model, wire format, metrics, latency and faults.

Real servers on 127.0.0.1 port 0, real aiohttp clients; the drift, freeze and saturation tests inject a clock.

The simulator paces its tokens on the event loop's clock, against deadlines fixed when the request was admitted: on a
busy machine a token can come late (by as long as this process was held up), never early. The timing tests
therefore hold every time they read to its exact lower bound, and to an upper bound widened only by the stalls
that :class:`LoopLag` measured while the request ran.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from soakd.sim import (
    SimConfig,
    SimFaults,
    SimModel,
    SimServer,
    add_sim_arguments,
    count_chat_tokens,
    count_tokens,
    sim_config_from_args,
)
from soakd.sim.text import CODE, PROSE, looks_like_code

from helpers import LoopLag, wait_until

pytestmark = pytest.mark.timeout(20)

FAST = {"ttft_base": 0, "tpot_base": 0, "tpot_per_batch": 0, "ttft_per_prompt_token": 0}
MSG = [{"role": "user", "content": "Tell me about rivers."}]


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class JumpClock:
    """The simulator's clock, running with the monotonic clock, that a test can move to a given uptime at once
    (into a freeze or a saturation, which the simulator schedules by uptime) instead of waiting for it."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def jump_to(self, sim: SimServer, uptime: float) -> None:
        self.offset += uptime - (self() - sim.model.started)


@asynccontextmanager
async def running(**overrides: Any) -> AsyncIterator[tuple[SimServer, aiohttp.ClientSession]]:
    clock = overrides.pop("clock", None)
    cfg = SimConfig(port=0, **overrides)
    async with SimServer(cfg, clock=clock) as sim:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
            yield sim, session


async def stream_events(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[tuple[float, bytes]]:
    """POST and return ``(arrival_time, data_payload)`` for every SSE data line."""
    events = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            if line.startswith(b"data: "):
                events.append((time.perf_counter(), line[6:].rstrip(b"\r\n")))
    return events


def content_times(events: list[tuple[float, bytes]]) -> list[float]:
    """Arrival times of the chunks that carry content."""
    out = []
    for t, data in events:
        if data == b"[DONE]":
            continue
        choices = json.loads(data)["choices"]
        if choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text")):
            out.append(t)
    return out


async def scrape(sim: SimServer, session: aiohttp.ClientSession) -> dict[str, float]:
    async with session.get(sim.metrics_url) as resp:
        assert resp.status == 200
        text = await resp.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"{{{sample.labels['finished_reason']}}}"
            if "le" in sample.labels:
                continue
            values[key] = sample.value
    return values


async def until_running(sim: SimServer, n: int) -> None:
    """Wait until *n* requests run in the simulator and tokens have flowed (on a busy machine that can take a
    while; the test times its faults from here, not from when it sent the requests)."""
    await wait_until(lambda: sim.model.running >= n and sim.model.generation_tokens_total > 0, interval=0.005,
                     what=f"{n} requests running and tokens flowing")


# ---------------------------------------------------------------------------- config


def test_config_defaults_and_durations() -> None:
    cfg = SimConfig()
    assert (cfg.host, cfg.port, cfg.model, cfg.max_batch) == ("127.0.0.1", 8000, "soakd-sim", 64)
    assert cfg.ttft_base == 0.05 and cfg.tpot_base == 0.005
    cfg = SimConfig(
        ttft_base="250ms", tpot_base="10ms", faults={"stall_duration": "2s", "restart_after": "1m"}
    )
    assert cfg.ttft_base == 0.25 and cfg.tpot_base == 0.01
    assert cfg.faults.stall_duration == 2.0 and cfg.faults.restart_after == 60.0
    assert cfg.model_dump(mode="json")["faults"]["restart_after"] == "1m"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"faults": {"error_rate_500": 1.5}}, "probability between 0 and 1"),
        ({"faults": {"truncate_rate": -0.1}}, "probability between 0 and 1"),
        ({"faults": {"restart_after": 0}}, "positive duration"),
        ({"faults": {"kv_leak_every_n_requests": 0}}, "kv_leak_every_n_requests"),
        ({"max_batch": 0}, "max_batch"),
        ({"port": 70000}, "port"),
        ({"tpot_base": "fast"}, "duration like"),
        ({"bogus": 1}, "bogus"),
        ({"faults": {"bogus": 1}}, "bogus"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        SimConfig(**kwargs)
    assert needle in str(info.value)


def test_api_key_is_secret() -> None:
    cfg = SimConfig(api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(cfg)
    assert "sk-very-secret" not in json.dumps(cfg.model_dump(mode="json"))


def test_cli_flags_overlay_base() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(
        [
            "--port",
            "0",
            "--ttft",
            "20ms",
            "--error-rate-500",
            "0.1",
            "--kv-leak-blocks",
            "3",
            "--restart-after",
            "30s",
            "--max-batch",
            "8",
        ]
    )
    base = SimConfig(model="base-model", seed=7, api_key="k", faults=SimFaults(stall_rate=0.5))
    cfg = sim_config_from_args(args, base)
    assert cfg.port == 0 and cfg.ttft_base == 0.02 and cfg.max_batch == 8
    assert cfg.model == "base-model" and cfg.seed == 7
    assert cfg.api_key is not None and cfg.api_key.get_secret_value() == "k"
    assert cfg.faults.error_rate_500 == 0.1 and cfg.faults.kv_leak_blocks_per_n_requests == 3
    assert cfg.faults.restart_after == 30.0 and cfg.faults.stall_rate == 0.5
    defaults = sim_config_from_args(parser.parse_args([]))
    assert defaults == SimConfig()
    with pytest.raises(ValidationError, match="probability"):
        sim_config_from_args(parser.parse_args(["--stall-rate", "2"]))


# ---------------------------------------------------------------------------- text


def test_count_tokens_is_words_and_punctuation() -> None:
    assert count_tokens("") == 0
    assert count_tokens("Hello, world!") == 4
    assert count_tokens("def f(x): return x+1") == 10
    assert count_tokens("  many   spaces\n\tcount nothing ") == 4
    # chat: 3 per message + content + 3 for the reply priming
    assert count_chat_tokens([{"role": "user", "content": "Hello, world!"}]) == 4 + 6
    two = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    assert count_chat_tokens(two) == 3 + (3 + 3) + (3 + 1)


def test_corpora_read_like_text() -> None:
    prose = "".join(PROSE.tokens[:200])
    assert "\ufffd" not in prose and prose.count(".") >= 10
    assert all(t.endswith((" ", "\n")) for t in PROSE.tokens)
    # no degenerate loops: a word rarely follows itself
    words = prose.split()
    assert sum(a == b for a, b in itertools.pairwise(words)) < len(words) // 50
    assert "def " in "".join(CODE.tokens[:200])
    assert looks_like_code("```python\ndef add(a, b):\n    return a + b\n```")
    assert not looks_like_code("Tell me a story about a quiet village.")


# ---------------------------------------------------------------------------- engine model


async def test_model_admission_and_kv_accounting() -> None:
    cfg = SimConfig(max_batch=2, kv_blocks_total=100, kv_block_size=16)
    model = SimModel(cfg, clock=FakeClock())
    a, b, c = (model.new_request(x, prompt_tokens=20, max_tokens=10) for x in "abc")
    await model.admit(a)
    await model.admit(b)
    assert model.running == 2 and model.kv_held == 4  # ceil(20/16) = 2 blocks each
    waiter = asyncio.ensure_future(model.admit(c))
    await asyncio.sleep(0)
    assert not waiter.done() and len(model.waiting) == 1
    model.grow(a, 13)  # 33 tokens -> 3 blocks
    assert model.kv_held == 5 and model.generation_tokens_total == 13
    model.finish(a, "length", ttft=0.1, e2e=0.5)
    await asyncio.wait_for(waiter, 1)
    assert model.running == 2 and not model.waiting and model.kv_held == 4
    model.finish(b, "length")
    model.finish(c, "abort")
    assert model.running == 0 and model.kv_held == 0 and model.kv_usage == 0
    assert model.request_success == {"stop": 0, "length": 2, "abort": 1}
    assert model.prompt_tokens_total == 60


async def test_model_cancelled_waiter_is_skipped() -> None:
    model = SimModel(SimConfig(max_batch=1), clock=FakeClock())
    a, b, c = (model.new_request(x, 5, 5) for x in "abc")
    await model.admit(a)
    wb = asyncio.ensure_future(model.admit(b))
    wc = asyncio.ensure_future(model.admit(c))
    await asyncio.sleep(0)
    wb.cancel()
    await asyncio.sleep(0)
    model.finish(b, "abort")  # what the handler's finally does
    model.finish(a, "length")
    await asyncio.wait_for(wc, 1)
    assert model.running == 1 and c.state == 1
    model.finish(c, "length")
    assert model.running == 0 and model.request_success["abort"] == 0


async def test_model_kv_leak_and_full_cache() -> None:
    faults = SimFaults(kv_leak_blocks_per_n_requests=5, kv_leak_every_n_requests=2)
    model = SimModel(SimConfig(kv_blocks_total=50, faults=faults), clock=FakeClock())
    for i in range(4):
        r = model.new_request(str(i), 16, 4)
        await model.admit(r)
        model.finish(r, "length")
    assert model.running == 0 and model.kv_leaked == 10 and model.kv_usage == pytest.approx(0.2)
    # A prompt bigger than the free cache still runs when nothing else does (no deadlock),
    # and growing past capacity counts one preemption.
    big = model.new_request("big", 16 * 45, 100)
    await model.admit(big)
    model.grow(big, 100)
    assert model.num_preemptions == 1 and model.kv_usage == 1.0
    model.finish(big, "length")
    assert model.kv_usage == pytest.approx(0.2)


def test_model_latency_drift_and_batch_cost() -> None:
    clock = FakeClock()
    cfg = SimConfig(
        ttft_base=0.1,
        ttft_per_prompt_token=0.001,
        ttft_per_queued=0.01,
        tpot_base=0.01,
        tpot_per_batch=0.002,
        faults={"latency_drift_pct_per_hour": 3600},
    )
    model = SimModel(cfg, clock=clock)
    assert model.latency_multiplier() == 1.0
    assert model.prefill_seconds(100, 2, 1.0) == pytest.approx(0.1 + 0.1 + 0.02)
    model.running = 5
    assert model.tpot_seconds(1.0) == pytest.approx(0.01 + 4 * 0.002)
    clock.t += 1.0  # 3600 %/h = 1 %/s
    assert model.latency_multiplier() == pytest.approx(1.01)
    clock.t += 3599.0
    assert model.latency_multiplier() == pytest.approx(37.0)
    improving = SimModel(SimConfig(faults={"latency_drift_pct_per_hour": -200}), clock=clock)
    clock.t += 3600
    assert improving.latency_multiplier() == 0.05


def test_model_latency_step_with_and_without_an_end() -> None:
    clock = FakeClock()
    lasting = SimModel(SimConfig(faults={"latency_step_at": 10, "latency_step_pct": 50}), clock=clock)
    ending = SimModel(SimConfig(faults={"latency_step_at": 10, "latency_step_pct": 50, "latency_step_duration": 5}),
                      clock=clock)
    seen = []
    for uptime in (9.9, 10.0, 14.9, 15.0, 100.0):
        clock.t = 1000.0 + uptime
        seen.append((lasting.latency_multiplier(), ending.latency_multiplier()))
    assert seen == [(1.0, 1.0), (1.5, 1.5), (1.5, 1.5), (1.5, 1.0), (1.5, 1.0)]
    with pytest.raises(ValueError, match="latency_step_duration"):
        SimFaults(latency_step_at=10, latency_step_duration=0)


def test_model_fault_rates_are_seeded() -> None:
    faults = SimFaults(error_rate_500=0.1, error_rate_429=0.05, stall_rate=0.2, garbled_rate=0.3)
    model = SimModel(SimConfig(seed=3, faults=faults))
    plans = [model.plan_faults(16) for _ in range(4000)]
    again = SimModel(SimConfig(seed=3, faults=faults))
    assert [again.plan_faults(16) for _ in range(4000)] == plans
    n500 = sum(p.status == 500 for p in plans)
    n429 = sum(p.status == 429 for p in plans)
    ok = [p for p in plans if p.status is None]
    assert 330 <= n500 <= 470  # 400 expected
    assert 140 <= n429 <= 220  # 0.9 * 0.05 * 4000 = 180 expected
    assert 0.16 <= sum(p.stall_at is not None for p in ok) / len(ok) <= 0.24
    assert all(1 <= p.stall_at < 16 for p in ok if p.stall_at is not None)  # mid-stream


# ---------------------------------------------------------------------------- API


async def test_models_health_version() -> None:
    async with running(**FAST) as (sim, s):
        assert sim.port > 0 and sim.base_url == f"http://127.0.0.1:{sim.port}/v1"
        async with s.get(sim.base_url + "/models") as r:
            body = await r.json()
        assert body["object"] == "list"
        (card,) = body["data"]
        assert (
            card["id"] == "soakd-sim" and card["object"] == "model" and card["owned_by"] == "soakd"
        )
        assert isinstance(card["created"], int) and card["max_model_len"] == 32768
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200
        async with s.get(sim.url + "/version") as r:
            assert "version" in await r.json()


async def test_chat_non_streaming() -> None:
    async with running(**FAST) as (sim, s):
        body = {"model": "soakd-sim", "messages": MSG, "max_tokens": 12}
        async with s.post(sim.base_url + "/chat/completions", json=body) as r:
            assert r.status == 200
            data = await r.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == "soakd-sim" and isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    content = choice["message"]["content"]
    assert len(content.split()) == 12 and "\ufffd" not in content
    assert data["usage"] == {
        "prompt_tokens": count_chat_tokens(MSG),
        "completion_tokens": 12,
        "total_tokens": count_chat_tokens(MSG) + 12,
    }


async def test_chat_streaming_wire_format() -> None:
    async with running(**FAST) as (sim, s):
        body = {
            "model": "soakd-sim",
            "messages": MSG,
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = await stream_events(s, sim.base_url + "/chat/completions", body)
    assert events[-1][1] == b"[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "soakd-sim" for c in chunks)
    first, *middle, last_content, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None and first["choices"][0]["logprobs"] is None
    assert all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert last_content["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert len(text.split()) == 7 and len(middle) + 1 == 7
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 7


async def test_completions_streaming_and_non_streaming() -> None:
    async with running(**FAST) as (sim, s):
        body = {"model": "soakd-sim", "prompt": "Once upon a time", "max_tokens": 5, "stream": True}
        events = await stream_events(s, sim.base_url + "/completions", body)
        async with s.post(sim.base_url + "/completions", json={**body, "stream": False}) as r:
            full = await r.json()
    assert events[-1][1] == b"[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert len(chunks) == 5  # no usage chunk without include_usage
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert full["object"] == "text_completion" and full["usage"]["completion_tokens"] == 5
    assert full["usage"]["prompt_tokens"] == count_tokens("Once upon a time") == 4
    assert len(full["choices"][0]["text"].split()) == 5


async def test_code_prompt_gets_code() -> None:
    async with running(**FAST) as (sim, s):
        body = {
            "prompt": "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n",
            "max_tokens": 60,
            "temperature": 0,
        }
        async with s.post(sim.base_url + "/completions", json=body) as r:
            text = (await r.json())["choices"][0]["text"]
    assert any(k in text for k in ("def ", "return ", " = ", "for item in"))


async def test_bad_requests_and_unknown_model() -> None:
    async with running(**FAST) as (sim, s):
        url = sim.base_url + "/chat/completions"
        cases = [
            (url, b"{not json", 400),
            (url, json.dumps({"model": "soakd-sim"}).encode(), 400),
            (url, json.dumps({"messages": "hi"}).encode(), 400),
            (url, json.dumps({"messages": MSG, "max_tokens": 0}).encode(), 400),
            (url, json.dumps({"messages": MSG, "max_tokens": 40000}).encode(), 400),
            (url, json.dumps({"messages": MSG, "stream": "yes"}).encode(), 400),
            (url, json.dumps([1, 2]).encode(), 400),
            (sim.base_url + "/completions", json.dumps({"max_tokens": 3}).encode(), 400),
            (sim.base_url + "/responses", b"{not json", 400),
            (sim.base_url + "/responses", json.dumps([1, 2]).encode(), 400),
            (sim.base_url + "/responses", json.dumps({"input": 3}).encode(), 400),
            (sim.base_url + "/embeddings", b"{not json", 400),
            (sim.base_url + "/embeddings", json.dumps([1, 2]).encode(), 400),
            (url, json.dumps({"model": "gpt-9", "messages": MSG}).encode(), 404),  # last: its code is checked below
        ]
        for target, raw, status in cases:
            async with s.post(target, data=raw, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status, raw
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
        values = await scrape(sim, s)
        assert values["vllm:request_success_total{length}"] == 0


async def test_api_key_required_when_configured() -> None:
    async with running(api_key="sekrit", **FAST) as (sim, s):
        body = {"messages": MSG, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            async with s.post(sim.base_url + "/chat/completions", json=body, headers=headers) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.get(sim.base_url + "/models") as r:
            assert r.status == 401
        ok = {"Authorization": "Bearer sekrit"}
        async with s.post(sim.base_url + "/chat/completions", json=body, headers=ok) as r:
            assert r.status == 200
        async with s.get(sim.metrics_url) as r:
            assert r.status == 200  # /metrics stays open, as in vLLM


async def test_determinism_at_temperature_zero_and_with_seed() -> None:
    async with running(**FAST) as (sim, s):

        async def content(**extra: Any) -> str:
            body = {"messages": MSG, "max_tokens": 24, **extra}
            async with s.post(sim.base_url + "/chat/completions", json=body) as r:
                return (await r.json())["choices"][0]["message"]["content"]

        greedy = await content(temperature=0)
        assert greedy == await content(temperature=0)
        assert (await content(temperature=0, max_tokens=8)).split() == greedy.split()[:8]
        seeded = await content(temperature=0.8, seed=42)
        assert seeded == await content(temperature=0.8, seed=42)
        other = {
            "messages": [{"role": "user", "content": "Something else entirely."}],
            "temperature": 0,
        }
        async with s.post(
            sim.base_url + "/chat/completions", json={**other, "max_tokens": 24}
        ) as r:
            assert (await r.json())["choices"][0]["message"]["content"] != greedy
        sampled = {await content(temperature=1.0) for _ in range(4)}
        assert len(sampled) > 1
    # Same output from a fresh server with another seed: a canary can compare across restarts.
    async with running(seed=99, **FAST) as (sim, s):
        async with s.post(
            sim.base_url + "/chat/completions",
            json={"messages": MSG, "max_tokens": 24, "temperature": 0},
        ) as r:
            assert (await r.json())["choices"][0]["message"]["content"] == greedy


# ---------------------------------------------------------------------------- timing


async def test_ttft_and_tpot_match_configuration() -> None:
    """Token i reaches the client ttft + i x tpot after the request was sent: never earlier, and later only by
    20 ms plus what the loop was held up (a token due during a stall comes with the ones after it, in one read)."""
    ttft, tpot, n = 0.1, 0.02, 11
    async with running(
        ttft_base=ttft, tpot_base=tpot, ttft_per_prompt_token=0, tpot_per_batch=0
    ) as (sim, s), LoopLag() as lag:
        body = {"messages": MSG, "max_tokens": n, "stream": True}
        t0 = time.perf_counter()
        events = await stream_events(s, sim.base_url + "/chat/completions", body)
        times = content_times(events)
        rid, t_recv, t_first, t_done = sim.recent[-1]
    assert len(times) == n
    late = [t - (t0 + ttft + i * tpot) for i, t in enumerate(times)]
    assert all(-0.002 <= x <= 0.02 + lag.stalled for x in late), (late, lag.stalled)
    # Server-side timestamps agree with the configuration.
    assert rid.startswith("chatcmpl-") and t_recv < t_first < t_done
    assert ttft - 0.002 <= (t_first - t_recv) / 1e9 <= ttft + 0.015 + lag.stalled
    assert tpot * (n - 1) - 0.004 <= (t_done - t_recv) / 1e9 - ttft <= tpot * (n - 1) + 0.015 + lag.stalled


async def test_prompt_length_adds_prefill_time() -> None:
    async with running(ttft_base=0.01, ttft_per_prompt_token=0.0001, tpot_base=0) as (sim, s):
        long_prompt = " ".join(["word"] * 1000)  # 1000 tokens -> +0.1 s
        body = {"prompt": long_prompt, "max_tokens": 2, "stream": True}
        t0 = time.perf_counter()
        times = content_times(await stream_events(s, sim.base_url + "/completions", body))
        _rid, t_recv, t_first, _t_done = sim.recent[-1]
        # the server's own prefill is the configured one; what the client sees adds only its wake-up (on a busy
        # machine, up to hundreds of ms: the bound above is loose, the one below is not)
        assert 0.105 <= (t_first - t_recv) / 1e9 <= times[0] - t0 <= 1.0


async def test_latency_drift_with_injected_clock() -> None:
    clock = FakeClock()
    faults = {"latency_drift_pct_per_hour": 100}
    async with running(
        clock=clock, ttft_base=0.05, tpot_base=0, ttft_per_prompt_token=0, faults=faults
    ) as (sim, s), LoopLag() as lag:

        async def ttft() -> float:
            t0 = time.perf_counter()
            times = content_times(
                await stream_events(
                    s,
                    sim.base_url + "/completions",
                    {"prompt": "x", "max_tokens": 1, "stream": True},
                )
            )
            return times[0] - t0

        before = await ttft()
        clock.t += 3600  # one hour later: latency doubled
        after = await ttft()
    assert 0.048 <= before <= 0.08 + lag.stalled and 0.098 <= after <= 0.14 + lag.stalled


async def test_queueing_beyond_max_batch_and_kv_usage() -> None:
    """Five requests, two slots: two run and three wait for the first 1.35 s (10 tokens at 0.15 s), each running
    one holding ceil((17 + generated) / 16) = 2 KV blocks throughout (the block count's growth is the engine
    model's test above); the scrape, once all five are in, has over a second to spare on a busy machine."""
    async with running(max_batch=2, ttft_base=0, tpot_base=0.15, tpot_per_batch=0) as (sim, s):
        body = {"prompt": " ".join(["tok"] * 17), "max_tokens": 10, "stream": True}
        tasks = [
            asyncio.create_task(stream_events(s, sim.base_url + "/completions", body))
            for _ in range(5)
        ]
        # all five in: two running, three waiting (the first round lasts 1.35 s)
        await wait_until(lambda: sim.model.running >= 2 and len(sim.model.waiting) >= 3, interval=0.005,
                         what="two requests running and three waiting")
        busy = await scrape(sim, s)
        results = await asyncio.gather(*tasks)
        idle = await scrape(sim, s)
    assert busy["vllm:num_requests_running"] == 2
    assert busy["vllm:num_requests_waiting"] == 3
    assert busy["vllm:kv_cache_usage_perc"] == pytest.approx(4 / 4096)
    assert all(r[-1][1] == b"[DONE]" for r in results)
    assert idle["vllm:num_requests_running"] == 0 and idle["vllm:num_requests_waiting"] == 0
    assert idle["vllm:kv_cache_usage_perc"] == 0
    assert idle["vllm:request_success_total{length}"] == 5
    assert idle["vllm:request_queue_time_seconds_count"] == 5
    # two waited one round (1.35 s), the fifth two: 5.4 s, less however much later than the first two the last
    # three arrived (on a busy machine, a stall between the sends); more than 4 s still rules out a third slot
    assert idle["vllm:request_queue_time_seconds_sum"] > 4.0


async def test_kv_usage_rises_with_load_and_leak_persists() -> None:
    leak = {"kv_leak_blocks_per_n_requests": 8, "kv_leak_every_n_requests": 2}
    async with running(kv_blocks_total=256, ttft_base=0, tpot_base=0.05, faults=leak) as (sim, s):
        body = {"prompt": " ".join(["tok"] * 100), "max_tokens": 20, "stream": True}
        tasks = [
            asyncio.create_task(stream_events(s, sim.base_url + "/completions", body))
            for _ in range(4)
        ]
        await until_running(sim, 4)  # then 0.95 s before the first one finishes
        busy = await scrape(sim, s)
        await asyncio.gather(*tasks)
        idle = await scrape(sim, s)
    assert busy["vllm:kv_cache_usage_perc"] >= 4 * 7 / 256  # ceil(100+/16) = 7+ blocks each
    assert idle["vllm:num_requests_running"] == 0
    assert idle["vllm:kv_cache_usage_perc"] == pytest.approx(16 / 256)  # 2 leaks x 8 blocks stay


async def test_metrics_exposition_parses_with_vllm_names() -> None:
    async with running(**FAST) as (sim, s):
        for stream in (True, False):
            body = {"messages": MSG, "max_tokens": 4, "stream": stream}
            async with s.post(sim.base_url + "/chat/completions", json=body) as r:
                await r.read()
        async with s.get(sim.metrics_url) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
    for sample in families["vllm:prompt_tokens"].samples:
        assert sample.name == "vllm:prompt_tokens_total"
        assert sample.labels == {"model_name": "soakd-sim", "engine": "0"}
        assert sample.value == 2 * count_chat_tokens(MSG)
    gen = families["vllm:generation_tokens"].samples[0]
    assert gen.value == 8
    reasons = {
        s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
    }
    assert reasons == {"stop": 0, "length": 2, "abort": 0}
    counts = {
        s.name: s.value
        for s in families["vllm:inter_token_latency_seconds"].samples
        if s.name.endswith("_count")
    }
    assert counts == {"vllm:inter_token_latency_seconds_count": 6}  # 3 gaps per 4-token request
    e2e = {
        s.name: s.value
        for s in families["vllm:e2e_request_latency_seconds"].samples
        if not s.labels.get("le")
    }
    assert e2e["vllm:e2e_request_latency_seconds_count"] == 2


async def test_two_servers_in_one_process_have_separate_metrics() -> None:
    async with running(**FAST) as (a, s), running(**FAST) as (b, _):
        async with s.post(a.base_url + "/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
            assert r.status == 200
        assert (await scrape(a, s))["vllm:generation_tokens_total"] == 3
        assert (await scrape(b, s))["vllm:generation_tokens_total"] == 0


async def test_client_disconnect_aborts_request() -> None:
    async with running(ttft_base=0, tpot_base=0.05) as (sim, s):
        body = {"messages": MSG, "max_tokens": 100, "stream": True}
        async with s.post(sim.base_url + "/chat/completions", json=body) as r:
            await r.content.readline()
            assert sim.model.running == 1
            r.close()
        for _ in range(50):
            if sim.model.running == 0:
                break
            await asyncio.sleep(0.02)
        assert sim.model.running == 0 and sim.model.kv_held == 0
        assert sim.model.request_success["abort"] == 1


# ---------------------------------------------------------------------------- faults


async def test_error_rates_roughly_as_configured() -> None:
    faults = {"error_rate_500": 0.2, "error_rate_429": 0.1}
    async with running(seed=1, faults=faults, **FAST) as (sim, s):
        statuses = []
        retry_after = set()
        for _ in range(200):
            async with s.post(
                sim.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}
            ) as r:
                statuses.append(r.status)
                body = await r.json()
                if r.status == 429:
                    retry_after.add(r.headers.get("Retry-After"))
                    assert body["error"]["code"] == "rate_limit_exceeded"
                if r.status == 500:
                    assert body["error"]["type"] == "server_error"
    n500, n429 = statuses.count(500), statuses.count(429)
    assert 25 <= n500 <= 57  # expected 40 (binomial sd 5.7)
    assert 8 <= n429 <= 28  # expected 0.8 * 0.1 * 200 = 16
    assert n500 + n429 + statuses.count(200) == 200
    assert retry_after == {"1"}


async def test_truncated_stream_has_no_done() -> None:
    async with running(ttft_base=0, tpot_base=0.002, faults={"truncate_rate": 1.0}) as (sim, s):
        body = {
            "messages": MSG,
            "max_tokens": 10,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(sim.base_url + "/chat/completions", json=body) as r:
                async for line in r.content:
                    lines.append(line)
        data = [ln[6:].strip() for ln in lines if ln.startswith(b"data: ")]
        assert data and b"[DONE]" not in data
        assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with s.post(
                sim.base_url + "/chat/completions", json={**body, "stream": False}
            ) as r:
                await r.read()
        await asyncio.sleep(0.05)
        assert sim.model.running == 0 and sim.model.request_success["abort"] == 2


async def test_malformed_chunk_fails_json() -> None:
    async with running(faults={"malformed_rate": 1.0}, **FAST) as (sim, s):
        events = await stream_events(
            s,
            sim.base_url + "/chat/completions",
            {"messages": MSG, "max_tokens": 8, "stream": True},
        )
        bad = 0
        for _, data in events[:-1]:
            try:
                json.loads(data)
            except ValueError:
                bad += 1
        assert bad == 1 and events[-1][1] == b"[DONE]"
        async with s.post(
            sim.base_url + "/completions", json={"prompt": "x", "max_tokens": 4}
        ) as r:
            with pytest.raises(ValueError):
                json.loads(await r.read())


async def test_stall_pauses_mid_stream() -> None:
    faults = {"stall_rate": 1.0, "stall_duration": 0.4}
    async with running(ttft_base=0, tpot_base=0.005, tpot_per_batch=0, faults=faults) as (sim, s), LoopLag() as lag:
        t0 = time.perf_counter()
        events = await stream_events(
            s,
            sim.base_url + "/chat/completions",
            {"messages": MSG, "max_tokens": 10, "stream": True},
        )
    times = content_times(events)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # the 0.4 s stall shows as one gap far beyond the 5 ms per token (the token before it may be read late on a
    # busy machine, shortening the gap the client sees by that much)
    assert len(times) == 10 and max(gaps) >= 0.4 - 0.02 - lag.stalled and times[-1] - t0 >= 0.4
    # the stall is mid-stream, not before the first token (that would take 0.4 s)
    assert times[0] - t0 < 0.1 + lag.stalled, (times[0] - t0, lag.stalled)
    assert events[-1][1] == b"[DONE]"


def two_requests(sim: SimServer, s: aiohttp.ClientSession) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
    """A streamed chat and a non-streamed completion of 200 tokens each, under way."""
    streamed = asyncio.create_task(stream_events(
        s, sim.base_url + "/chat/completions", {"messages": MSG, "max_tokens": 200, "stream": True}))
    plain = asyncio.create_task(s.post(sim.base_url + "/completions", json={"prompt": "x", "max_tokens": 200}))
    return streamed, plain


async def api_answers(sim: SimServer, s: aiohttp.ClientSession) -> None:
    """GET /v1/models and /health answer (what a wedged engine's server still does)."""
    for url in (sim.base_url + "/models", sim.url + "/health"):
        async with s.get(url) as r:
            assert r.status == 200, url


async def test_an_engine_freeze_stops_every_request_and_the_token_counter_while_the_api_answers() -> None:
    """An engine freeze of 2 s (freeze_every 5 s, freeze_duration 2 s; once tokens flow the test moves the
    simulator's clock to 0.3 s before it): no token for 2 s, for a streamed and a non-streamed request alike;
    vllm:generation_tokens_total stands still with both running, /v1/models and /health answer; afterwards both
    finish and the counter moves again (what soakd's wedge watch reads). The two scrapes come 0.1 s and ~0.4 s
    into the freeze: 1.6 s to spare on a busy machine. (A jump straight into the freeze would let the tokens
    that the requests were already sleeping towards land inside it.)"""
    clock = JumpClock()
    faults = {"freeze_every": 5.0, "freeze_duration": 2.0}
    async with running(
        clock=clock, ttft_base=0, tpot_base=0.01, tpot_per_batch=0, faults=faults
    ) as (sim, s), LoopLag() as lag:
        streamed, plain = two_requests(sim, s)
        await until_running(sim, 2)
        clock.jump_to(sim, 4.7)
        t_jump = time.perf_counter()
        await asyncio.sleep(0.4)
        before = await scrape(sim, s)
        await asyncio.sleep(0.3)
        after = await scrape(sim, s)
        await api_answers(sim, s)
        assert before["vllm:num_requests_running"] == 2 and after["vllm:num_requests_running"] == 2
        assert 0 < before["vllm:generation_tokens_total"] == after["vllm:generation_tokens_total"] < 400
        events = await streamed
        resp = await plain
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 200
        resp.release()
        assert time.perf_counter() - t_jump >= 2.3 - 0.01  # held to the freeze's end (less one token's wait)
        assert (await scrape(sim, s))["vllm:generation_tokens_total"] == 400
        # the stream's gap spans the hold (shorter by as much as the token before it was read late)
        gaps = [b - a for a, b in itertools.pairwise(content_times(events))]
        assert max(gaps) >= 2.0 - 0.02 - lag.stalled, (max(gaps), lag.stalled)


async def test_a_saturated_kv_cache_holds_every_request_and_the_counter_with_usage_at_one() -> None:
    """A KV cache saturated for 2 s (kv_saturate_at 5 s; once tokens flow the test moves the simulator's clock to
    0.3 s before it): /metrics shows what vLLM shows out of KV blocks -- vllm:kv_cache_usage_perc 1, the two
    requests still running, a third one waiting (admission stuck), vllm:generation_tokens_total still -- while
    /v1/models and /health answer; afterwards usage falls back, every request finishes, the counter moves. The
    scrapes come 0.2 s and ~0.5 s into the saturation: 1.5 s to spare."""
    clock = JumpClock()
    faults = {"kv_saturate_at": 5.0, "kv_saturate_duration": 2.0}
    async with running(
        clock=clock, ttft_base=0, tpot_base=0.005, tpot_per_batch=0, faults=faults
    ) as (sim, s), LoopLag() as lag:
        streamed, plain = two_requests(sim, s)
        await until_running(sim, 2)
        clock.jump_to(sim, 4.7)
        t_jump = time.perf_counter()
        await asyncio.sleep(0.5)
        late = asyncio.create_task(s.post(sim.base_url + "/completions", json={"prompt": "y", "max_tokens": 5}))
        before = await scrape(sim, s)
        await asyncio.sleep(0.3)
        after = await scrape(sim, s)
        await api_answers(sim, s)
        assert before["vllm:kv_cache_usage_perc"] == 1.0 == after["vllm:kv_cache_usage_perc"]
        assert after["vllm:num_requests_running"] == 2 and after["vllm:num_requests_waiting"] == 1
        assert 0 < before["vllm:generation_tokens_total"] == after["vllm:generation_tokens_total"] < 400
        events = await streamed
        for task, n in ((plain, 200), (late, 5)):
            resp = await task
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == n
            resp.release()
        assert time.perf_counter() - t_jump >= 2.3 - 0.005  # held until the saturation ended
        end = await scrape(sim, s)
        assert end["vllm:generation_tokens_total"] == 405 and end["vllm:kv_cache_usage_perc"] < 0.1
        # the stream's gap spans the hold (shorter by as much as the token before it was read late)
        gaps = [b - a for a, b in itertools.pairwise(content_times(events))]
        assert max(gaps) >= 2.0 - 0.02 - lag.stalled, (max(gaps), lag.stalled)


async def test_garbled_and_empty_outputs() -> None:
    async with running(faults={"garbled_rate": 1.0}, **FAST) as (sim, s):
        async with s.post(
            sim.base_url + "/chat/completions", json={"messages": MSG, "max_tokens": 12}
        ) as r:
            data = await r.json()
        text = data["choices"][0]["message"]["content"]
        assert "\ufffd" in text and data["usage"]["completion_tokens"] == 12
    async with running(faults={"empty_rate": 1.0}, **FAST) as (sim, s):
        body = {
            "messages": MSG,
            "max_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = await stream_events(s, sim.base_url + "/chat/completions", body)
        chunks = [json.loads(d) for _, d in events[:-1]]
        assert not content_times(events)
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["usage"]["completion_tokens"] == 0
        async with s.post(
            sim.base_url + "/completions", json={"prompt": "x", "max_tokens": 5}
        ) as r:
            data = await r.json()
        assert data["choices"][0]["text"] == "" and data["choices"][0]["finish_reason"] == "stop"


async def test_restart_refuses_connections_then_recovers_with_fresh_state() -> None:
    faults = {"restart_after": 0.6, "restart_downtime": 0.6}
    async with running(ttft_base=0, tpot_base=0.02, faults=faults) as (sim, s):
        port = sim.port
        async with s.post(
            sim.base_url + "/completions", json={"prompt": "hello", "max_tokens": 2}
        ) as r:
            assert r.status == 200
        assert (await scrape(sim, s))["vllm:request_success_total{length}"] == 1
        # An in-flight stream is dropped when the server goes down.
        long_stream = {"prompt": "hello", "max_tokens": 200, "stream": True}
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
            async with s.post(sim.base_url + "/completions", json=long_stream) as r:
                async for _ in r.content:
                    pass
        assert not sim.is_up
        with pytest.raises(aiohttp.ClientConnectorError):
            async with s.get(sim.url + "/health") as r:
                pass
        for _ in range(100):
            if sim.is_up:
                break
            await asyncio.sleep(0.02)
        assert sim.is_up and sim.port == port and sim.restarts == 1
        async with s.get(sim.url + "/health") as r:
            assert r.status == 200
        fresh = await scrape(sim, s)
        assert fresh["vllm:request_success_total{length}"] == 0
        assert fresh["vllm:num_requests_running"] == 0
        async with s.post(
            sim.base_url + "/completions", json={"prompt": "again", "max_tokens": 2}
        ) as r:
            assert r.status == 200


def test_jitter_is_seeded_noise_around_the_mean() -> None:
    cfg = SimConfig(ttft_base=0.1, ttft_per_prompt_token=0, jitter=0.2, seed=5)
    a, b = SimModel(cfg), SimModel(cfg)
    xs = [a.prefill_seconds(0, 0, 1.0) for _ in range(2000)]
    assert xs == [b.prefill_seconds(0, 0, 1.0) for _ in range(2000)]
    mean = sum(xs) / len(xs)
    sd = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
    assert mean == pytest.approx(0.1, rel=0.03) and sd == pytest.approx(0.02, rel=0.15)
    assert min(xs) >= 0


async def test_repeated_restarts_and_stop_while_down() -> None:
    faults = {"restart_after": 0.2, "restart_downtime": 0.15, "restart_repeat": True}
    sim = SimServer(SimConfig(port=0, faults=faults, **FAST), recent_maxlen=5)
    await sim.start()
    with pytest.raises(RuntimeError):
        await sim.start()
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + 5
        while sim.restarts < 2 and time.monotonic() < deadline:
            if sim.is_up:
                try:
                    async with s.post(
                        sim.base_url + "/completions", json={"prompt": "x", "max_tokens": 1}
                    ) as r:
                        await r.read()
                except aiohttp.ClientError:
                    pass  # raced with a restart
            await asyncio.sleep(0.01)
        assert sim.restarts >= 2
        assert 0 < len(sim.recent) <= 5  # bounded, and kept across restarts
        while sim.is_up:
            await asyncio.sleep(0.01)
    t0 = time.monotonic()
    await sim.stop()  # while down: returns promptly and does not come back
    assert time.monotonic() - t0 < 0.5 and not sim.is_up
    await asyncio.sleep(0.3)
    assert not sim.is_up
