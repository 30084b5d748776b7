"""Loading the configuration: YAML file < environment ``SOAKD_*`` < command-line flags.

Every problem is reported at once (``ConfigError``), each line naming the field path, the bad
value and what is expected.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from soakd.config.model import ConfigError, SoakConfig

# ---- loading: file < env < flags ------------------------------------------------------------

ENV_PREFIX = "SOAKD_"


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        nxt = node.get(key)
        if not isinstance(nxt, dict):
            nxt = {}
            node[key] = nxt
        node = nxt
    node[path[-1]] = value


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """``SOAKD_RUN__DURATION=1h`` -> ``{"run": {"duration": "1h"}}`` (``__`` nests). Values are YAML scalars,
    so ``SOAKD_LOAD__CONCURRENCY=16`` is an int and ``SOAKD_LOAD__MIX='{short_chat: 1}'`` a mapping."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in ("SOAKD_CONFIG",):
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__") if p]
        if not path or path[0] not in SoakConfig.model_fields:
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        _set_path(out, path, value)
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in ("mix",):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and p.startswith("function-"))) or "(top level)"


def format_validation_error(exc: ValidationError, where: str = "") -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        loc = _fmt_loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see examples/soak.yaml for every field)"
        shown = err.get("input")
        value = ""
        if err["type"] not in ("missing",) and not isinstance(shown, (dict, list)) and "api_key" not in loc:
            if repr(shown) not in msg:  # parse_duration's message already quotes the bad value
                value = f" (got {shown!r})"
        for line in msg.split("\n"):
            # cross-field checks name their own field path ("load.mix: ..."); keep it
            head = line.split(":", 1)[0]
            own = ":" in line and re.fullmatch(r"[a-z_][a-z0-9_.]*", head) is not None and (
                loc == "(top level)" or head == loc or head.startswith(loc + ".")
            )
            lines.append(f"{line}{where}" if own else f"{loc}: {line}{value}{where}")
    return lines


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"config file {path}: cannot read it: {exc.strerror or exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"config file {path}: not valid YAML{where}: {problem}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"config file {path}: expected a mapping of sections (target:, run:, load: ...), got {type(data).__name__}"])
    return data


def load_config(
    path: Path | str | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> SoakConfig:
    """Build the effective configuration. Raises ConfigError listing every problem."""
    data: dict[str, Any] = read_yaml(Path(path)) if path else {}
    data = deep_merge(data, env_overrides(environ))
    if overrides:
        data = deep_merge(data, overrides)
    try:
        return SoakConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None
