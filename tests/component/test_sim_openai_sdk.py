"""The official OpenAI SDK works unchanged against the simulator (the methodology's step 1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest

from soakd.sim import SimConfig, SimServer

pytestmark = pytest.mark.timeout(20)

FAST = {"ttft_base": 0, "tpot_base": 0.001, "tpot_per_batch": 0, "ttft_per_prompt_token": 0}
MSG = [{"role": "user", "content": "Describe a quiet village."}]


@asynccontextmanager
async def sdk(
    api_key: str = "x", **overrides: Any
) -> AsyncIterator[tuple[SimServer, openai.AsyncOpenAI]]:
    async with SimServer(SimConfig(port=0, **{**FAST, **overrides})) as sim:
        client = openai.AsyncOpenAI(
            base_url=sim.base_url, api_key=api_key, max_retries=0, timeout=10
        )
        try:
            yield sim, client
        finally:
            await client.close()


async def test_models_list() -> None:
    async with sdk() as (_, client):
        models = [m async for m in client.models.list()]
    assert [m.id for m in models] == ["soakd-sim"]
    assert models[0].owned_by == "soakd"


async def test_chat_non_streaming() -> None:
    async with sdk() as (_, client):
        resp = await client.chat.completions.create(model="soakd-sim", messages=MSG, max_tokens=9)
    assert resp.choices[0].message.role == "assistant"
    assert len(resp.choices[0].message.content.split()) == 9
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 9
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 9


async def test_chat_streaming_with_usage() -> None:
    async with sdk() as (_, client):
        stream = await client.chat.completions.create(
            model="soakd-sim",
            messages=MSG,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": 16},
        )
        chunks = [c async for c in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(content.split()) == 16 and finish == ["length"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == 16
    assert usage_chunks[0] is chunks[-1]


async def test_max_completion_tokens() -> None:
    async with sdk() as (_, client):
        resp = await client.chat.completions.create(
            model="soakd-sim", messages=MSG, max_completion_tokens=5, temperature=0
        )
    assert resp.usage.completion_tokens == 5


async def test_completions_streaming_and_non_streaming() -> None:
    async with sdk() as (_, client):
        stream = await client.completions.create(
            model="soakd-sim",
            prompt="The history of bridges",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        full = await client.completions.create(
            model="soakd-sim", prompt="The history of bridges", max_tokens=6
        )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text.split()) == 6 and chunks[-1].usage.completion_tokens == 6
    assert full.usage.prompt_tokens == 4 and full.choices[0].finish_reason == "length"


async def test_temperature_zero_is_deterministic() -> None:
    async with sdk() as (_, client):
        outs = {
            (
                await client.chat.completions.create(
                    model="soakd-sim", messages=MSG, max_tokens=20, temperature=0
                )
            )
            .choices[0]
            .message.content
            for _ in range(3)
        }
    assert len(outs) == 1


async def test_error_types_surface_in_the_sdk() -> None:
    async with sdk(faults={"error_rate_500": 1.0}) as (_, client):
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="soakd-sim", messages=MSG, max_tokens=2)
        assert info.value.status_code == 500
    async with sdk(faults={"error_rate_429": 1.0}) as (_, client):
        with pytest.raises(openai.RateLimitError) as rate:
            await client.chat.completions.create(model="soakd-sim", messages=MSG, max_tokens=2)
        assert rate.value.response.headers["retry-after"] == "1"
        assert rate.value.code == "rate_limit_exceeded"
    async with sdk() as (_, client):
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="no-such-model", messages=MSG, max_tokens=2)
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="soakd-sim", messages=[], max_tokens=2)
    async with _auth_sdk() as (_, client):
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="soakd-sim", messages=MSG, max_tokens=2)


@asynccontextmanager
async def _auth_sdk() -> AsyncIterator[tuple[SimServer, openai.AsyncOpenAI]]:
    async with SimServer(SimConfig(port=0, api_key="right", **FAST)) as sim:
        client = openai.AsyncOpenAI(
            base_url=sim.base_url, api_key="wrong", max_retries=0, timeout=10
        )
        good = openai.AsyncOpenAI(base_url=sim.base_url, api_key="right", max_retries=0, timeout=10)
        try:
            resp = await good.chat.completions.create(model="soakd-sim", messages=MSG, max_tokens=2)
            assert resp.usage.completion_tokens == 2
            yield sim, client
        finally:
            await client.close()
            await good.close()
