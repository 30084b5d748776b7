"""Waiting for the target: ``GET /models`` until it answers (the model to use, and that the
target is up), backing off from 0.5 s to 10 s, for at most the run's duration or until stopped.
A target that refuses the API key is a configuration error, not an outage."""

from __future__ import annotations

import asyncio
import re

import structlog

from soakd.client.openai import OpenAIClient
from soakd.config import ConfigError, TargetConfig

log = structlog.get_logger("soakd")


def key_source(target: TargetConfig) -> str:
    """The configuration field the API key comes from (for error messages)."""
    return ("target.api_key_env" if target.api_key_env else "target.api_key_file" if target.api_key_file
            else "target.api_key_env / target.api_key_file")


async def resolve_model(client: OpenAIClient, target: TargetConfig, model: str | None, *, has_key: bool,
                        stop: asyncio.Event, give_up_after: float, on_answer: object = None) -> str | None:
    """The model to soak (``model``, or the first the target lists), once the target answers;
    None when stopped or ``give_up_after`` seconds passed. ``on_answer(up: bool)`` is told each
    answer and each failure."""
    loop = asyncio.get_running_loop()
    delay, logged = 0.5, False
    deadline = loop.time() + give_up_after
    while not stop.is_set():
        try:
            models = await client.list_models()
            if callable(on_answer):
                on_answer(True)
            if model is None:
                if not models:
                    raise RuntimeError("GET /models returned no models; pass --model")
                model = models[0]
            elif models and model not in models:
                log.warning("model_not_listed", model=model, listed=models[:10])
            return model
        except Exception as exc:  # noqa: BLE001 - unreachable target: log once, keep trying
            if callable(on_answer):
                on_answer(False)
            if re.search(r"\bHTTP 40[13]\b", str(exc)):
                raise ConfigError([
                    f"{key_source(target)}: the target refused the API key ({exc}); "
                    + ("check the key" if has_key else "it needs one: pass --api-key-env or --api-key-file")
                ]) from None
            if not logged:
                log.warning("target_unreachable", url=target.display_url, error=f"{type(exc).__name__}: {exc}",
                            action="retrying until it answers")
                logged = True
        if loop.time() + delay > deadline:
            return None
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            pass
        delay = min(delay * 2, 10.0)
    return None
