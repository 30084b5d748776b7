"""Waiting for the target at start: ``GET /models`` until it answers (the model to use, and that
the target is up), backing off from 0.5 s to 10 s, for at most ``run.wait_for_target`` (and the
run's duration) or until stopped; then the model is checked.

What does not answer in time is a start failure with its cause and a hint (``TargetUnavailable``):
nothing listens at the port, the URL lacks ``/v1`` (404 on ``/models`` while ``/v1/models``
answers), a page answers instead of the API (HTML), the server says it is not ready (503 while it
loads). A model the target does not list, and that a one-token request confirms it does not serve,
fails the start with the list it serves. A target that refuses the API key is a configuration
error, not an outage. During the run an outage is an outage (the run's own findings).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import structlog

from soakd.client.openai import OpenAIClient, UnexpectedAnswer
from soakd.config import ConfigError, TargetConfig
from soakd.core.durations import format_duration

log = structlog.get_logger("soakd")

PROGRESS_EVERY = 60.0  # seconds between target_waiting lines while the target does not answer


class TargetUnavailable(Exception):
    """The target did not answer as an OpenAI-compatible server within ``run.wait_for_target``, or
    does not serve the model: exit 1 with this message (cause and hint)."""

    def __init__(self, message: str, cause: str, hint: str) -> None:
        super().__init__(message)
        self.cause, self.hint = cause, hint


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    hint: str


def key_source(target: TargetConfig) -> str:
    """The configuration field the API key comes from (for error messages)."""
    return ("target.api_key_env" if target.api_key_env else "target.api_key_file" if target.api_key_file
            else "target.api_key_env / target.api_key_file")


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


async def diagnose(client: OpenAIClient, target: TargetConfig, exc: BaseException) -> Diagnosis:
    """What a failed ``GET /models`` means, and what to try."""
    where = urlsplit(target.url).netloc
    if isinstance(exc, UnexpectedAnswer):
        if exc.status == 404:
            base = target.url.rstrip("/")
            if not base.endswith("/v1"):
                alt = base + "/v1" if urlsplit(base).path not in ("", "/") else _origin(base) + "/v1"
                try:
                    async with client.session.get(alt + "/models",
                                                  timeout=aiohttp.ClientTimeout(total=10)) as resp:
                        ok = resp.status == 200 and b'"data"' in await resp.read()
                except (aiohttp.ClientError, TimeoutError, OSError):
                    ok = False
                if ok:
                    return Diagnosis(f"HTTP 404 on {target.display_url}/models, while {alt}/models answers",
                                     f"the URL lacks /v1: use --target {alt}")
            return Diagnosis(f"HTTP 404 on GET {target.display_url}/models",
                             "no OpenAI-compatible API at this URL: vLLM, SGLang, TGI, llama.cpp and TensorRT-LLM "
                             "serve it under /v1 (--target http://HOST:PORT/v1)")
        if exc.status == 200 and exc.html:
            return Diagnosis(f"GET {target.display_url}/models answered HTML, not JSON",
                             "a web page answers at this URL (a UI, a proxy's login or error page): point --target "
                             "at the server's OpenAI-compatible API (http://HOST:PORT/v1)")
        if exc.status == 200:
            return Diagnosis(f"GET {target.display_url}/models answered {exc.content_type or 'a body'} that is "
                             "not JSON", "point --target at the server's OpenAI-compatible API (http://HOST:PORT/v1)")
        if exc.status in (502, 503, 504):
            return Diagnosis(f"HTTP {exc.status} on GET {target.display_url}/models",
                             "the server (or a proxy in front of it) is up but not ready: a model still loading, "
                             "or a backend that is down; raise run.wait_for_target if loading takes longer")
        return Diagnosis(f"HTTP {exc.status} on GET {target.display_url}/models", "see the server's log")
    if isinstance(exc, getattr(aiohttp, "ClientConnectorDNSError", ())) or "Name or service not known" in str(exc):
        return Diagnosis(f"cannot resolve {urlsplit(target.url).hostname}", "check the host name in --target")
    if isinstance(exc, aiohttp.ClientConnectorError) or isinstance(exc, ConnectionRefusedError):
        return Diagnosis(f"nothing accepts connections at {where} ({exc.strerror or exc})"
                         if isinstance(exc, OSError) else f"cannot connect to {where} ({exc})",
                         "is the server running, and is this its port? A server still loading its model does "
                         "not listen yet: raise run.wait_for_target if loading takes longer")
    if isinstance(exc, TimeoutError):
        return Diagnosis(f"GET {target.display_url}/models did not answer in time",
                         "the server accepts connections but does not answer: overloaded, or still starting")
    return Diagnosis(f"{type(exc).__name__}: {exc}", "see the server's log")


async def check_model(client: OpenAIClient, target: TargetConfig, model: str, listed: list[str]) -> None:
    """A model the target does not list: one one-token request says whether it serves it (some
    servers answer for any model name: TGI). Not served: ``TargetUnavailable`` with the list."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    try:
        status, _rid, raw = await client.post_json("/chat/completions", body)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        log.warning("model_not_listed", model=model, listed=listed[:10], probe=f"{type(exc).__name__}: {exc}")
        return
    text = raw[:500].decode("utf-8", "replace")
    if status in (400, 404) and "model" in text.lower():
        served = ", ".join(listed[:10]) + (" ..." if len(listed) > 10 else "")
        cause = f"the target does not serve the model {model!r} (HTTP {status}: {text[:160].strip()})"
        hint = f"it serves: {served}; pass --model with one of them (or no --model: the first it lists)"
        log.error("target_unavailable", url=target.display_url, cause=cause, hint=hint)
        raise TargetUnavailable(f"{target.display_url}: {cause}; {hint}", cause, hint)
    log.warning("model_not_listed", model=model, listed=listed[:10],
                probe=f"a one-token request with this model answered HTTP {status}: going on")


async def resolve_model(client: OpenAIClient, target: TargetConfig, model: str | None, *, has_key: bool,
                        stop: asyncio.Event, give_up_after: float,
                        on_answer: Callable[[bool], None] | None = None) -> str | None:
    """The model to soak (``model``, or the first the target lists), once the target answers;
    None when stopped. Raises ``TargetUnavailable`` when ``give_up_after`` seconds passed (the
    cause and a hint), or when the target does not serve ``model``. ``on_answer(up)`` is told
    each answer and each failure."""
    loop = asyncio.get_running_loop()
    delay = 0.5
    t0 = loop.time()
    deadline = t0 + give_up_after
    diag: Diagnosis | None = None
    next_progress = t0 + PROGRESS_EVERY
    while not stop.is_set():
        try:
            models = await client.list_models()
        except Exception as exc:  # noqa: BLE001 - unreachable target: diagnose, log, keep trying
            if on_answer is not None:
                on_answer(False)
            if re.search(r"\bHTTP 40[13]\b", str(exc)):
                raise ConfigError([
                    f"{key_source(target)}: the target refused the API key ({exc}); "
                    + ("check the key" if has_key else "it needs one: pass --api-key-env or --api-key-file")
                ]) from None
            now = loop.time()
            first = diag is None
            diag = await diagnose(client, target, exc)
            if first:
                log.warning("target_unreachable", url=target.display_url, error=f"{type(exc).__name__}: {exc}",
                            cause=diag.cause, hint=diag.hint,
                            action=f"waiting up to {format_duration(give_up_after)} for it (run.wait_for_target)")
            elif now >= next_progress:
                next_progress = now + PROGRESS_EVERY
                log.info("target_waiting", url=target.display_url, waited=format_duration(round(now - t0)),
                         left=format_duration(round(max(0.0, deadline - now))), cause=diag.cause)
        else:
            if on_answer is not None:
                on_answer(True)
            if model is None:
                if models:
                    return models[0]
                diag = Diagnosis(f"GET {target.display_url}/models lists no model", "pass --model")
            elif models and model not in models:
                await check_model(client, target, model, models)
                return model
            else:
                return model
        if loop.time() + delay > deadline:
            assert diag is not None
            msg = (f"{target.display_url} did not answer as an OpenAI-compatible server within "
                   f"{format_duration(round(give_up_after, 3))} (run.wait_for_target): {diag.cause}; {diag.hint}")
            log.error("target_unavailable", url=target.display_url, cause=diag.cause, hint=diag.hint,
                      waited=format_duration(round(loop.time() - t0)))
            raise TargetUnavailable(msg, diag.cause, diag.hint)
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            pass
        delay = min(delay * 2, 10.0)
    return None
