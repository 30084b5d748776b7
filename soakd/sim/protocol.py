"""Requests as the simulated server reads them (OpenAI chat and completions bodies, validated the
way vLLM validates them) and its OpenAI-shaped error responses."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from soakd.config.sim import SimConfig
from soakd.sim.text import (
    chat_prompt_text,
    count_chat_tokens,
    count_tokens,
    looks_like_code,
    message_text,
)

# ---------------------------------------------------------------------------- errors


def error_response(
    status: int,
    message: str,
    err_type: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> web.Response:
    return error_response(400, message, "invalid_request_error", param=param)


class InvalidRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _opt_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {value!r}", name)
    if value < minimum:
        raise InvalidRequest(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise InvalidRequest(f"'{name}' must be a boolean, got {value!r}", name)


class ParsedRequest:
    __slots__ = (
        "chat", "code", "deterministic", "include_usage", "max_tokens", "model", "prompt_text",
        "prompt_tokens", "seed", "stream",
    )  # fmt: skip


def parse_request(body: dict[str, Any], chat: bool, cfg: SimConfig) -> ParsedRequest:
    p = ParsedRequest()
    p.chat = chat
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", "model")
    p.model = model
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' is required and must be a non-empty list", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
            try:
                message_text(message.get("content"))
            except TypeError as exc:
                raise InvalidRequest(f"messages[{i}]: {exc}", "messages") from None
        p.prompt_tokens = count_chat_tokens(messages)
        p.prompt_text = chat_prompt_text(messages)
        last = message_text(messages[-1].get("content"))
        p.code = looks_like_code(last)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            p.prompt_tokens = count_tokens(prompt)
            p.prompt_text = prompt
            p.code = looks_like_code(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            p.prompt_tokens = len(prompt)
            p.prompt_text = ",".join(map(str, prompt))
            p.code = False
        elif prompt is None:
            raise InvalidRequest("'prompt' is required", "prompt")
        else:
            raise InvalidRequest(
                "'prompt' must be a string or a list of token ids "
                "(the simulator takes one prompt per request)",
                "prompt",
            )
    p.stream = bool(_opt_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    p.include_usage = bool(_opt_bool(options or {}, "include_usage"))
    max_tokens = _opt_int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    _opt_int(body, "min_tokens", 0)
    _opt_bool(body, "ignore_eos")
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise InvalidRequest("the simulator supports n=1 only", "n")
    p.seed = _opt_int(body, "seed", -(2**63))
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or temperature < 0
    ):
        raise InvalidRequest("'temperature' must be a number >= 0", "temperature")
    p.deterministic = temperature == 0 or p.seed is not None
    room = cfg.max_model_len - p.prompt_tokens
    if max_tokens is None:
        max_tokens = min(cfg.default_max_tokens, room)
    if max_tokens < 1 or max_tokens > room:
        raise InvalidRequest(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
            f"requested {p.prompt_tokens + max(max_tokens, 0)} tokens ({p.prompt_tokens} in the "
            f"messages, {max(max_tokens, 0)} in the completion). Please reduce the length of the "
            "messages or completion.",
            "max_tokens" if room > 0 else ("messages" if chat else "prompt"),
        )
    p.max_tokens = max_tokens
    return p
