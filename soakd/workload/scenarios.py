"""Scenarios: the built-in five (defaults from the validation method) and custom ones, resolved
from the configuration into immutable ``Scenario`` objects that build request bodies."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from soakd.config import ConfigError, ScenarioConfig, SoakConfig
from soakd.workload.corpus import Corpus, code_prompt
from soakd.workload.trace import json_lines, load_trace, replay_text

CHAT_TEMPLATE_OVERHEAD = 8
"""Tokens a chat template adds around one user message (Llama-3 ≈ 10, Qwen ≈ 9, the simulator 0+).
Synthetic chat prompts are shortened by this much so usage.prompt_tokens lands near the target."""

CHAT_MESSAGE_OVERHEAD = 4
"""Tokens a chat template adds for each further message of a conversation (role header, end marker)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    base: str  # the built-in behaviour: short_chat, long_context, batch_burst, multi_turn, code_completion
    endpoint: str = "chat"
    stream: bool = True
    include_usage: bool = True
    temperature: float = 0.7
    prompt_tokens: tuple[int, int] = (64, 256)
    max_tokens: tuple[int, int] = (64, 128)
    extra_body: dict[str, Any] = field(default_factory=dict)
    burst_size: int = 1
    turns: int = 1
    structure_check: str = "none"
    source_type: str = "synthetic"
    source_path: Path | None = None
    source_format: str | None = None  # trace: mooncake, burstgpt, conversations (None: from the file)
    speedup: float = 1.0  # trace: replay this many times faster
    block_size: int = 512  # trace, mooncake: tokens per hash id
    shared_prefix: tuple[int, int, float] | None = None  # (count, tokens, share): shared system prompts


BUILTIN: dict[str, Scenario] = {
    "short_chat": Scenario("short_chat", "short_chat", prompt_tokens=(64, 256), max_tokens=(64, 128)),
    "long_context": Scenario("long_context", "long_context", prompt_tokens=(1900, 2100), max_tokens=(512, 512)),
    "batch_burst": Scenario("batch_burst", "batch_burst", prompt_tokens=(32, 128), max_tokens=(32, 64), burst_size=8),
    "multi_turn": Scenario("multi_turn", "multi_turn", prompt_tokens=(32, 128), max_tokens=(64, 128), turns=4),
    "code_completion": Scenario(
        "code_completion", "code_completion", prompt_tokens=(128, 512), max_tokens=(128, 256), temperature=0.2
    ),
}


def resolve(name: str, cfg: ScenarioConfig | None) -> Scenario:
    if cfg is None:
        return BUILTIN[name]
    base_name = name if name in BUILTIN else (cfg.like or "short_chat")
    sc = replace(BUILTIN[base_name], name=name)
    updates: dict[str, Any] = {}
    for key in ("endpoint", "stream", "include_usage", "temperature", "prompt_tokens", "max_tokens",
                "extra_body", "burst_size", "turns", "structure_check"):
        value = getattr(cfg, key)
        if value is not None:
            updates[key] = value
    if cfg.shared_prefix is not None:
        sp = cfg.shared_prefix
        updates["shared_prefix"] = (sp.count, sp.tokens, sp.share)
    if cfg.source is not None:
        updates["source_type"] = cfg.source.type
        updates["source_path"] = cfg.source.path
        updates["source_format"] = cfg.source.format
        updates["speedup"] = cfg.source.speedup
        updates["block_size"] = cfg.source.block_size
    return replace(sc, **updates)


def resolve_all(config: SoakConfig) -> dict[str, Scenario]:
    """The scenarios named in the mix, resolved; dataset files are checked here (fail fast)."""
    out = {}
    errors = []
    for name, weight in config.load.mix.items():
        if weight <= 0:
            continue
        sc = resolve(name, config.scenarios.get(name))
        if sc.source_path is not None:
            if not sc.source_path.is_file():
                errors.append(f"scenarios.{name}.source.path: file {sc.source_path} does not exist")
            else:
                try:  # read and check it now, before any load: a bad line fails the start, not hour 3
                    if sc.source_type == "trace":
                        load_trace(sc.source_path, sc.source_format)
                    else:
                        load_dataset(sc.source_path, sc.source_type)
                except ConfigError as exc:
                    errors.extend(f"scenarios.{name}.source.path: {e}" for e in exc.errors)
        out[name] = sc
    traces = [n for n, sc in out.items() if sc.source_type == "trace"]
    if traces and len(out) > 1:
        errors.append(f"load.mix: scenario {traces[0]!r} replays a trace, which sets the traffic itself: it must be "
                      f"the mix's only scenario (the mix has {', '.join(sorted(out))})")
    if errors:
        raise ConfigError(errors)
    return out


def with_trace_arrivals(config: SoakConfig, scenarios: dict[str, Scenario]) -> SoakConfig:
    """The configuration with the load a trace scenario implies: a trace with timestamps and no
    ``load.concurrency`` replays its timestamps (``load.arrival: trace``; with ``load.rate``, its shape at that
    mean rate). ``arrival: trace`` without a trace with timestamps is an error."""
    trace = next((sc for sc in scenarios.values() if sc.source_type == "trace" and sc.source_path is not None), None)
    timed = trace is not None and load_trace(trace.source_path, trace.source_format).timed  # type: ignore[arg-type]
    load = config.load
    if load.arrival == "trace" and not timed:
        what = "no trace scenario" if trace is None else f"trace {trace.source_path} has no timestamps"
        raise ConfigError([f"load.arrival: trace needs a trace scenario with timestamps ({what}); set load.rate "
                           "or load.concurrency instead"])
    if timed and load.concurrency is None and load.arrival != "trace" and "arrival" not in load.model_fields_set:
        return config.model_copy(update={"load": load.model_copy(update={"arrival": "trace"})})
    levels = config.sweep.levels
    if trace is not None and load.closed_loop and levels and any(v != int(v) for v in levels):
        raise ConfigError([f"sweep.levels: the trace {trace.source_path} is replayed as a closed loop (no timestamps, "
                           f"or load.concurrency set): levels are concurrencies (whole numbers), got {levels}"])
    return config


def trace_log_fields(scenarios: dict[str, Scenario], config: SoakConfig) -> dict[str, str]:
    """For the log line that starts the load: what a window of a replayed trace sends ({} without one)."""
    if config.load.arrival != "trace":
        return {}
    return {"arrival": "trace", "trace": replay_text(scenarios, config.load.rate, config.run.window)}


# ---- prompt sources --------------------------------------------------------------------------


def load_dataset(path: Path, kind: str) -> list[list[dict[str, str]]]:
    """Read a JSONL (one messages list, or {"messages": [...]}, per line) or ShareGPT JSON file
    into a list of message lists. Raises ConfigError naming the line on malformed input.
    The result is cached per (path, kind, size, mtime): validation at start and the prompt source
    read the file once."""
    try:
        st = path.stat()
    except OSError:
        return _load_dataset(path, kind, 0, 0)
    return _load_dataset(path, kind, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _load_dataset(path: Path, kind: str, _size: int, _mtime_ns: int) -> list[list[dict[str, str]]]:
    where = f"dataset {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{where}: cannot read it: {exc}"]) from None
    items: list[list[dict[str, str]]] = []
    if kind == "jsonl":
        for lineno, obj in json_lines(where, text):
            msgs = obj.get("messages") if isinstance(obj, dict) else obj
            if not _valid_messages(msgs):
                raise ConfigError([f"{where} line {lineno}: expected an OpenAI messages list "
                                   '([{"role": "user", "content": "..."}]) or {"messages": [...]}'])
            items.append(msgs)
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError([f"{where}: not valid JSON: {exc}"]) from None
        roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
        for i, entry in enumerate(data if isinstance(data, list) else []):
            conv = entry.get("conversations") if isinstance(entry, dict) else None
            if not isinstance(conv, list):
                continue
            msgs = []
            for turn in conv:
                if not isinstance(turn, dict):
                    break
                role = roles.get(str(turn.get("from", "")).lower())
                value = turn.get("value")
                if role is None or not isinstance(value, str):
                    break
                msgs.append({"role": role, "content": value})
                if role == "user":
                    break  # up to the first user turn: the model answers it
            if msgs and msgs[-1]["role"] == "user":
                items.append(msgs)
        if not isinstance(data, list):
            raise ConfigError([f"{where}: expected a ShareGPT list of {{\"conversations\": [...]}}"])
    if not items:
        raise ConfigError([f"{where}: no usable prompts in it"])
    return items


def _valid_messages(msgs: Any) -> bool:
    return (
        isinstance(msgs, list)
        and bool(msgs)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs)
    )


class PromptSource:
    """Messages for one scenario, deterministic from the seed."""

    def __init__(self, scenario: Scenario, corpus: Corpus, seed: int, share: tuple[int, int] = (0, 1)) -> None:
        """``share``: (k, N), load worker k of N: draws of its own, the run's shared prefixes, a dataset from its
        k-th N-th (the same order in every worker)."""
        self.sc = scenario
        self.corpus = corpus
        own = f"-w{share[0]}" if share[0] else ""
        self.rng = random.Random(f"{seed}-{scenario.name}{own}")
        self.seed = seed
        self.prefix_rng = random.Random(f"{seed}-{scenario.name}-prefixes{own}")  # apart: prompts stay as without
        self.prefix_tokens = 0  # the shared prefix of the last messages() (0: none)
        self._prefixes: dict[int, str] = {}
        self.dataset: list[list[dict[str, str]]] | None = None
        self._order: list[int] = []
        self._pos = 0
        if scenario.source_type not in ("synthetic", "trace") and scenario.source_path is not None:
            self.dataset = load_dataset(scenario.source_path, scenario.source_type)
            self._order = list(range(len(self.dataset)))
            (random.Random(f"{seed}-{scenario.name}") if share[0] else self.rng).shuffle(self._order)
            self._pos = share[0] * len(self._order) // share[1]

    def length(self) -> int:
        lo, hi = self.sc.prompt_tokens
        return lo if lo == hi else self.rng.randint(lo, hi)

    def max_tokens(self) -> int:
        lo, hi = self.sc.max_tokens
        return lo if lo == hi else self.rng.randint(lo, hi)

    def messages(self, target_tokens: int) -> list[dict[str, str]]:
        """The prompt's messages; with shared prefixes, a share of them start with one as a system message
        (``prefix_tokens``: its length then, else 0)."""
        msgs = self._messages(target_tokens)
        self.prefix_tokens = 0
        sp = self.sc.shared_prefix
        if sp is not None and (sp[2] >= 1.0 or self.prefix_rng.random() < sp[2]):
            self.prefix_tokens = sp[1]
            return [{"role": "system", "content": self._prefix(self.prefix_rng.randrange(sp[0]))}, *msgs]
        return msgs

    def _prefix(self, i: int) -> str:
        """Shared prefix ``i``: the same text all run long (seeded by the run's seed, the scenario, ``i``)."""
        text = self._prefixes.get(i)
        if text is None:
            assert self.sc.shared_prefix is not None
            text = self.corpus.text(random.Random(f"{self.seed}-{self.sc.name}-prefix-{i}"), self.sc.shared_prefix[1])
            self._prefixes[i] = text
        return text

    def _messages(self, target_tokens: int) -> list[dict[str, str]]:
        if self.dataset is not None:
            msgs = self.dataset[self._order[self._pos % len(self._order)]]
            self._pos += 1
            return msgs
        # the completions endpoint applies no chat template: the whole target is text
        overhead = CHAT_TEMPLATE_OVERHEAD if self.sc.endpoint == "chat" else 0
        if self.sc.base == "code_completion":
            text = code_prompt(self.rng, self.corpus, target_tokens - overhead)
        else:
            text = self.corpus.text(self.rng, target_tokens - overhead)
        return [{"role": "user", "content": text}]

    def turn_text(self, target_tokens: int) -> str:
        return self.corpus.text(self.rng, target_tokens)
