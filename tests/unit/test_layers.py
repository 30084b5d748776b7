"""The house has layers and no cycle.

Every ``import`` of every module under ``soakd/`` — at the top, inside functions and under
``TYPE_CHECKING`` alike — is an edge of the module graph. The graph has no cycle, and each part
imports only the parts below it (``LAYERS``): neutral types in ``soakd.core`` import nothing of
soakd outside it, the configuration only ``core``, the analysis only ``core`` and ``config``, and so on up
to the composition root. A module over ``MAX_LINES`` lines says why in its docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "soakd"
MAX_LINES = 500

# part -> the parts it may import (itself always allowed; "soakd" is the package root: __version__)
LAYERS: dict[str, set[str]] = {
    "core": set(),
    "config": {"core"},
    "metrics": {"core"},
    "terminal": set(),
    "logging_setup": {"terminal"},
    "web": set(),
    "client": {"core", "config"},
    "workload": {"core", "config"},
    "samplers": {"core", "config", "metrics"},
    "sim": {"core", "config"},
    "analysis": {"core", "config"},
    "store": {"core"},
    "report": {"core", "config", "analysis", "store"},
    "check": {"core", "config", "client"},
    "soak": {"core", "config", "metrics", "client", "workload", "samplers", "analysis", "store", "report", "web"},
    "runtime": {"core", "config", "metrics", "client", "workload", "samplers", "analysis", "store", "report",
                "web", "soak", "logging_setup"},
    "sweep": {"core", "config", "metrics", "client", "workload", "soak", "store", "report", "web"},
    "batch": {"core", "config", "client", "soak", "store"},
    "cli": {"*"},
    "__main__": {"cli"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The soakd modules ``path`` imports (``from soakd.x import y``: soakd.x.y when that is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            if t == "soakd" or t.startswith("soakd."):
                while t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != name:
                    out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(path, name, known) for name, path in mods.items()}


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "soakd"


def test_no_import_cycle() -> None:
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_each_part_imports_only_the_parts_below_it() -> None:
    bad = []
    for mod, targets in sorted(graph().items()):
        p = part(mod)
        if p == "soakd":
            assert not targets, f"soakd/__init__.py imports {targets}"
            continue
        assert p in LAYERS, f"{mod}: part {p!r} has no place in LAYERS (tests/unit/test_layers.py)"
        allowed = LAYERS[p]
        for t in sorted(targets):
            tp = part(t)
            if tp in (p, "soakd") or "*" in allowed or tp in allowed:
                continue
            bad.append(f"{mod} imports {t}")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_core_modules_import_nothing_of_soakd() -> None:
    """Nothing outside ``soakd.core`` (the verdict's types are built of the finding's)."""
    g = graph()
    bad = {m: sorted(x for x in t if part(x) != "core") for m, t in g.items() if part(m) == "core"}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, bad


def test_long_modules_say_why() -> None:
    long = []
    for name, path in modules().items():
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines <= MAX_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if "Longer than" not in doc:
            long.append(f"{name} ({lines} lines)")
    assert not long, ("modules over ~500 lines without a 'Longer than ...' reason in their docstring: "
                      + ", ".join(long))
