"""The command-line flags that set configuration fields: one table, flag -> field path.

``add_arguments`` declares them on an argparse parser (help text from the table, choices from
the field's ``Literal`` type, the default from the model), ``overrides`` turns parsed
arguments into the nested mapping that ``load_config`` puts on top of the file and the
environment, and ``annotate`` adds the flag to a configuration error about a field a flag set.
Options that are not configuration (``-c``, ``--new-run``, ``--print-config``) are the CLI's own.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from soakd.config.model import ConfigError, SoakConfig
from soakd.core.durations import parse_duration

Kind = Literal["value", "int", "float", "duration", "path", "mix", "false", "bool", "levels"]


@dataclass(frozen=True)
class Flag:
    flag: str
    path: str  # the configuration field, e.g. "run.duration"
    help: str
    kind: Kind = "value"
    target: bool = False  # a flag about the target (not offered by ``soakd demo``, which has its own)
    clears: str | None = None  # a field this flag sets to null (closed vs open loop)
    negative: str | None = None  # kind "bool": the flag that sets the field false
    sweep: bool = False  # a flag of ``soakd sweep`` only


FLAGS: tuple[Flag, ...] = (
    Flag("--target", "target.url", "OpenAI base URL including /v1, e.g. http://127.0.0.1:8000/v1", target=True),
    Flag("--model", "target.model", "model name (default: the first of GET /v1/models)", target=True),
    Flag("--api-key-env", "target.api_key_env", "environment variable that holds the API key", target=True),
    Flag("--api-key-file", "target.api_key_file", "file whose first line is the API key", "path", target=True),
    Flag("--duration", "run.duration", "soak length: 45s, 30m, 12h (run default 12h)", "duration"),
    Flag("--concurrency", "load.concurrency", "closed loop: requests kept in flight", "int", clears="load.rate"),
    Flag("--rate", "load.rate", "open loop: requests per second", "float", clears="load.concurrency"),
    Flag("--arrival", "load.arrival", "open-loop arrival process"),
    Flag("--max-in-flight", "load.max_in_flight", "open loop: cap on requests in flight", "int"),
    Flag("--workers", "load.workers", "load worker processes (default 1): for a node one process cannot drive", "int"),
    Flag("--mix", "load.mix", "scenario weights, e.g. short_chat=4,long_context=1,batch_burst=1", "mix"),
    Flag("--window", "run.window", "analysis window (default 30m)", "duration"),
    Flag("--warmup", "run.warmup", "warm-up excluded from statistics (default 2m)", "duration"),
    Flag("--max-requests", "run.max_requests", "end after this many requests", "int"),
    Flag("--grace", "run.grace", "drain period for in-flight requests at shutdown (default 30s)", "duration"),
    Flag("--wait-for-target", "run.wait_for_target",
         "at start, how long to wait for the target to answer (default 15m), then exit 1 with the cause", "duration"),
    Flag("--metrics-host", "metrics.host", "listen address for /metrics (default 0.0.0.0)"),
    Flag("--metrics-port", "metrics.port", "listen port for /metrics (default 9400; 0 = any)", "int"),
    Flag("--state-dir", "run.state_dir", "state and report directory (default ./soakd-state)", "path"),
    Flag("--junit", "run.junit", "also write the verdict as JUnit XML to FILE at the end of the run", "path"),
    Flag("--seed", "run.seed", "seed for prompts, arrivals and the mix", "int"),
    Flag("--no-keep-alive", "target.keep_alive",
         "open a new connection per request (servers that drop reused connections)", "false"),
    Flag("--server-metrics-url", "samplers.server.url",
         "the server's Prometheus /metrics URL, or none (default: the target's origin + /metrics)"),
    Flag("--dcgm-url", "samplers.dcgm.url",
         "dcgm-exporter /metrics URL (GPU telemetry when the GPU is not visible to soakd)"),
    Flag("--nvml", "samplers.nvml.mode", "NVML GPU sampler (default auto)"),
    Flag("--sample-interval", "samplers.interval", "default sampling interval of every sampler (default 5s)",
         "duration"),
    Flag("--log-format", "log.format", "log output"),
    Flag("--log-level", "log.level", "log level"),
    Flag("--progress", "log.progress", "live progress line (--no-progress: none)", "bool", negative="--no-progress"),
    Flag("--baseline", "analysis.baseline",
         "an earlier run's JSON report whose baseline window this run is compared with", "path"),
    Flag("--load-from", "load.from_sweep",
         "take the load from a sweep's JSON (soakd sweep --json): a fraction of its knee", "path"),
    Flag("--load-fraction", "load.sweep_fraction", "with --load-from: the share of the knee (default 0.8)", "float"),
    Flag("--levels", "sweep.levels",
         "sweep levels: a list (1,2,4,8) or a geometric range start:stop (1:64, times --factor)", "levels",
         sweep=True),
    Flag("--factor", "sweep.factor", "geometric step of a start:stop range (default 2)", "float", sweep=True),
    Flag("--step", "sweep.step", "measured time per step (default 60s)", "duration", sweep=True),
    Flag("--step-warmup", "sweep.warmup", "load at each new level before measuring (default 10s)", "duration",
         sweep=True),
    Flag("--min-gain", "sweep.min_gain", "throughput gain per step below which the knee is reached (default 0.05)",
         "float", sweep=True),
)

BY_FLAG: dict[str, Flag] = {f.flag: f for f in FLAGS}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _field(path: str) -> Any:
    """The pydantic field behind a dotted path of SoakConfig."""
    model: type[BaseModel] = SoakConfig
    parts = path.split(".")
    for i, name in enumerate(parts):
        info = model.model_fields[name]
        if i == len(parts) - 1:
            return info
        model = info.annotation  # a section model
    raise KeyError(path)


def _choices(path: str) -> list[str] | None:
    ann = _field(path).annotation
    if typing.get_origin(ann) is Literal:
        return [str(a) for a in typing.get_args(ann)]
    return None


def add_arguments(parser: argparse.ArgumentParser, *, flags: tuple[str, ...] | None = None,
                  target: bool = True, sweep: bool = False) -> None:
    """Declare the table's flags (``flags``: only these; ``target=False``: none about the target;
    ``sweep``: also those of ``soakd sweep``)."""
    exclusive: dict[frozenset[str], Any] = {}
    for f in FLAGS:
        if (flags is not None and f.flag not in flags) or (f.target and not target) or (f.sweep and not sweep):
            continue
        where: Any = parser
        if f.clears is not None:
            key = frozenset({f.path, f.clears})
            if key not in exclusive:
                exclusive[key] = parser.add_mutually_exclusive_group()
            where = exclusive[key]
        dest = _dest(f.flag)
        if f.kind == "false":
            where.add_argument(f.flag, dest=dest, action="store_true", default=None, help=f.help)
        elif f.kind == "bool":
            where.add_argument(f.flag, dest=dest, action="store_true", default=None, help=f.help)
            where.add_argument(f.negative, dest=dest, action="store_false", help=argparse.SUPPRESS)
        else:
            conv = {"int": int, "float": float, "path": Path}.get(f.kind, str)
            where.add_argument(f.flag, dest=dest, type=conv, choices=_choices(f.path), help=f.help)


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, weight = part.partition("=")
        name = name.strip()
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError([f"--mix: weight of {name!r} must be a number, got {weight!r} "
                               "(expected e.g. short_chat=4,long_context=1)"]) from None
        mix[name] = w
    if not mix:
        raise ConfigError(["--mix: empty; expected e.g. short_chat=4,long_context=1"])
    return mix


def parse_levels(text: str) -> Any:
    """``--levels``: ``1,2,4,8`` (a list) or ``1:64`` (sweep.start and sweep.stop; see _put_levels)."""
    text = text.strip()
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            return {"start": float(a), "stop": float(b)}
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError([f"--levels: expected a list like 1,2,4,8 or a range like 1:64, got {text!r}"]) from None


def _value(f: Flag, raw: Any) -> Any:
    if f.kind == "duration":
        try:
            return parse_duration(raw)
        except ValueError as exc:
            raise ConfigError([f"{f.flag}: {exc}"]) from None
    if f.kind == "mix":
        return parse_mix(raw)
    if f.kind == "levels":
        return parse_levels(raw)
    if f.kind == "path":
        return str(raw)
    if f.kind == "false":
        return False
    return raw


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration the given flags set (a nested mapping; flags not given set nothing)."""
    out: dict[str, Any] = {}
    for f in FLAGS:
        raw = getattr(args, _dest(f.flag), None)
        if raw is None:
            continue
        value = _value(f, raw)
        if f.kind == "levels" and isinstance(value, dict):  # a range: start and stop, no list
            _put(out, "sweep.start", value["start"])
            _put(out, "sweep.stop", value["stop"])
            _put(out, "sweep.levels", None)
        else:
            _put(out, f.path, value)
        if f.clears is not None:
            _put(out, f.clears, None)
    return out


def annotate(exc: ConfigError, args: argparse.Namespace) -> ConfigError:
    """The error with ``(from --flag)`` on each line about a field a given flag set."""
    given = {f.path: f.flag for f in FLAGS if getattr(args, _dest(f.flag), None) is not None}
    lines = []
    for line in exc.errors:
        path = line.split(":", 1)[0]
        flag = given.get(path)
        lines.append(f"{line} (from {flag})" if flag and flag not in line else line)
    return ConfigError(lines)
