"""examples/soak.yaml documents every configuration field and is itself a valid configuration."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel

from soakd.config import ScenarioConfig, SoakConfig, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "soak.yaml"


def _field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    paths = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            paths.extend(_field_paths(ann, path + "."))
    return paths


def _has(tree: dict, path: str) -> bool:
    node = tree
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_example_loads():
    cfg = load_config(EXAMPLE, environ={})
    assert cfg.load.mix["short_chat"] == 4
    assert cfg.scenarios["long_context"].prompt_tokens == (2000, 2000)


def test_example_sets_every_field():
    tree = yaml.safe_load(EXAMPLE.read_text())
    missing = [p for p in _field_paths(SoakConfig) if p != "scenarios" and not _has(tree, p)]
    assert not missing, f"examples/soak.yaml lacks {missing}"


def test_example_mentions_every_scenario_field():
    text = EXAMPLE.read_text()
    missing = [name for name in ScenarioConfig.model_fields if f"{name}:" not in text]
    assert not missing, f"examples/soak.yaml does not document scenario fields {missing}"


def _flat(node: object, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out: dict[str, object] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def test_example_values_are_the_defaults():
    """docs/configuration.md says the example shows every field *with its default*: a default that changes (a
    metric tracked by default, a finding kind that fails the run) must change there too. The scenarios are
    examples, and load.concurrency's null means its 8."""
    example = _flat(load_config(EXAMPLE, environ={}).model_dump(mode="json"))
    default = _flat(SoakConfig().model_dump(mode="json"))
    allowed = {"load.concurrency": (8, None)}
    differ = {k: (example.get(k), default.get(k)) for k in sorted(set(example) | set(default))
              if not k.startswith("scenarios.") and example.get(k) != default.get(k)
              and allowed.get(k) != (example.get(k), default.get(k))}
    assert not differ, f"examples/soak.yaml (left) differs from the defaults (right): {differ}"
