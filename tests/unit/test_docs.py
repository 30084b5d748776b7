"""The README and docs/*.md hold together: every relative link reaches an existing file, every
#anchor a heading of the file it names (GitHub's anchor rules), every docs/X.md#anchor that a
source file, benchmark, deploy file or example points at exists, and the README starts with the
two commands and links every reference doc."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MARKDOWN = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)
POINTER = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: its text (inline code, emphasis and links reduced to their
    text), lowercased, punctuation dropped except '-' and '_', spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line))
    return out


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the file: one per heading (repeats get -1, -2, ...), and HTML ids."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose_lines(path):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_anchor(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for no, line in prose_lines(path):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            out.append((no, target))
    return out


def test_github_anchor_rules() -> None:
    assert github_anchor("Sweep: finding the knee") == "sweep-finding-the-knee"
    assert github_anchor("A/B: two systems under the same traffic") == "ab-two-systems-under-the-same-traffic"
    assert github_anchor("soakd's own health") == "soakds-own-health"
    assert github_anchor("Derivation: leak.py") == "derivation-leakpy"
    assert github_anchor("`soakd run` flags") == "soakd-run-flags"
    assert github_anchor("JUnit XML for CI") == "junit-xml-for-ci"
    assert github_anchor("SoakdGPUXidErrors") == "soakdgpuxiderrors"
    assert github_anchor("max_share and *more*") == "max_share-and-more"


def test_every_relative_link_and_anchor_resolves() -> None:
    cache: dict[Path, set[str]] = {}
    bad = []
    for md in MARKDOWN:
        for no, target in links(md):
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (md.parent / unquote(file_part)).resolve() if file_part else md
            where = f"{md.relative_to(REPO)}:{no}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
                continue
            if anchor:
                if dest.suffix != ".md":
                    bad.append(f"{where} (an anchor into a file that is not Markdown)")
                    continue
                if anchor not in cache.setdefault(dest, anchors(dest)):
                    bad.append(f"{where} (no heading with that anchor in {dest.relative_to(REPO)})")
    assert not bad, "broken links in the docs:\n" + "\n".join(bad)


def test_docs_pointers_in_the_code_resolve() -> None:
    """docs/X.md#anchor in a docstring, comment, help text or config (e.g. "(derivation:
    docs/analysis.md#derivation-leakpy)") names an existing file and heading."""
    bad = []
    for top in ("soakd", "benchmarks", "deploy", "grafana", "examples", "tests", "Makefile", "Dockerfile"):
        base = REPO / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            if path.suffix not in {"", ".py", ".yaml", ".yml", ".json", ".md", ".toml", ".txt"} \
                    or path == Path(__file__).resolve() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for m in POINTER.finditer(text):
                doc = DOCS / m.group(1)
                where = f"{path.relative_to(REPO)}: docs/{m.group(1)}" + (f"#{m.group(2)}" if m.group(2) else "")
                if not doc.exists():
                    bad.append(f"{where} (no such file)")
                elif m.group(2) and m.group(2) not in anchors(doc):
                    bad.append(f"{where} (no such heading)")
    assert not bad, "pointers into docs/ that do not resolve:\n" + "\n".join(bad)


def test_readme_starts_with_the_two_commands() -> None:
    lines = [line for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines[0].startswith("# "), lines[0]
    assert lines[1] == "```sh", "the README's first block after the title is the two commands"
    assert lines[2].startswith("make demo") and lines[3].startswith("make test") and lines[4] == "```"


def test_readme_links_every_reference_doc() -> None:
    linked = {(REPO / t.partition("#")[0]).resolve() for _, t in links(REPO / "README.md") if t.startswith("docs/")}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"the README's table of docs lacks {missing}"


def _keys(shape: dict, prefix: str = "") -> set[str]:
    return {prefix + k for k in shape}


def test_every_status_key_is_documented() -> None:
    """docs/metrics.md's `/status` tables name every key the live shape pins (the top level and `analysis`)."""
    import json

    shape = json.loads((REPO / "tests/fixtures/golden/live-shape.json").read_text(encoding="utf-8"))["status"]
    text = (DOCS / "metrics.md").read_text(encoding="utf-8")
    section = text[text.index("### `/status`"):text.index("Logs are structlog JSON lines")]
    named = set(re.findall(r"`([a-z_]+)`", section))
    missing = (_keys(shape) | _keys(shape["analysis"])) - named
    assert not missing, f"/status keys not in docs/metrics.md: {sorted(missing)}"
