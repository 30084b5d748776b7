"""Loading the configuration: YAML file < environment ``SOAKD_*`` < command-line flags.

Every problem is reported at once (``ConfigError``), each line naming the field path, the bad
value and what is expected.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import EnvSettingsSource

from soakd.config.model import ConfigError, SoakConfig
from soakd.config.secrets import credential_header, mask_url

# ---- loading: file < env < flags ------------------------------------------------------------

ENV_PREFIX = "SOAKD_"


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping: ``SOAKD_`` prefix, ``__``
    between levels, names case-insensitive, ``null`` for None, lists and mappings in YAML."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(SoakConfig, case_sensitive=False, env_prefix=ENV_PREFIX,  # type: ignore[arg-type]
                         env_nested_delimiter="__", env_parse_none_str="null")

    def _load_env_vars(self) -> Mapping[str, str | None]:
        """The mapping given, not ``os.environ`` (pydantic-settings' own dotenv source overrides
        this method the same way): names lower-cased, ``null`` as None."""
        return {k.lower(): (None if v == "null" else v) for k, v in self._environ.items()}

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError:
            return value  # the model names the field and what it expected


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``SOAKD_RUN__DURATION=1h`` -> ``{"run": {"duration": "1h"}}`` (``__`` nests, names are
    case-insensitive; pydantic-settings reads them). Values are YAML: ``SOAKD_LOAD__CONCURRENCY=16``
    is an int, ``SOAKD_LOAD__MIX='{short_chat: 1}'`` a mapping, ``'off'`` (quoted) the string off;
    what is not valid YAML stays the string it is. Names that are no configuration section
    (``SOAKD_CONFIG``) are not configuration."""
    return _scalars(_EnvSource(os.environ if environ is None else environ)())


def _scalars(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _scalars(v) for k, v in tree.items()}
    if isinstance(tree, str) and tree.strip():
        try:
            return yaml.safe_load(tree)
        except yaml.YAMLError:
            return tree
    return tree


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


def _secret_loc(loc: tuple[Any, ...]) -> bool:
    """Whether the value at ``loc`` may be a credential (never echoed back): the simulator's key, what
    was given as ``api_key_env``/``api_key_file`` (perhaps the key itself, by mistake), or the value of a
    header that can carry one."""
    parts = [str(p) for p in loc]
    return any("api_key" in p for p in parts) or any(
        a == "headers" and credential_header(b) for a, b in zip(parts, parts[1:]))


def format_validation_error(exc: ValidationError, where: str = "") -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        loc = _fmt_loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see examples/soak.yaml for every field)"
        shown = mask_url(err.get("input"))
        value = ""
        if err["type"] not in ("missing",) and not isinstance(shown, (dict, list)) and not _secret_loc(err["loc"]):
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
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError([f"config file {path}: cannot read it: {exc.strerror or exc}"]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError([f"config file {path}: not UTF-8: byte {raw[exc.start]:#04x} at byte offset {exc.start} "
                           f"(line {line}); save it as UTF-8"]) from None
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
        raise ConfigError(format_validation_error(exc) + _cross_field_problems(data, exc)) from None


def _without(data: Any, loc: tuple[Any, ...]) -> None:
    """Remove the value at ``loc`` (the field falls back to its default), or its nearest mapping key."""
    node, parent_key, parent = data, None, None
    for part in loc:
        if isinstance(node, dict) and part in node:
            parent, parent_key, node = node, part, node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            parent, parent_key, node = node, part, node[part]
        else:
            break
    if isinstance(parent, dict) and parent_key is not None:
        parent.pop(parent_key, None)


def _cross_field_problems(data: dict[str, Any], exc: ValidationError) -> list[str]:
    """The checks across fields (the mix's scenarios, the window, the targets) run only once every
    field is valid: run them again with the invalid fields at their defaults, so that every problem is
    reported at once. Problems about a field already reported are left out."""
    import copy

    bad = [err["loc"] for err in exc.errors(include_url=False) if err["loc"]]
    if not bad:  # the checks across fields did run: they are what failed
        return []
    first = set(format_validation_error(exc))
    trial = copy.deepcopy(data)
    for loc in bad:
        _without(trial, loc)
    try:
        SoakConfig.model_validate(trial)
    except ValidationError as again:
        reported = {_fmt_loc(loc) for loc in bad}
        out = []
        for line in format_validation_error(again):
            head = line.split(":", 1)[0]
            if line not in first and not any(head == r or head.startswith(r + ".") or r.startswith(head + ".")
                                             for r in reported):
                out.append(line)
        return out
    return []
