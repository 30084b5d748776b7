"""Render a report (``soakd.report.model.RunReport``, from ``soakd.report.build.build_report``) as
JSON, Markdown (``soakd.report.markdown``), HTML (``soakd.report.html``) or JUnit XML
(``soakd.report.junit``), and write all four into a run's directory. JSON is the model's dump
(``--baseline`` of a later run reads it).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from soakd.report.build import build_report
from soakd.report.html import render_html
from soakd.report.junit import render_junit
from soakd.report.markdown import render_markdown
from soakd.report.model import RunReport
from soakd.store import StoreReader

__all__ = ["FORMATS", "REPORT_FILES", "render", "render_html", "render_json", "render_junit", "render_markdown",
           "write_reports"]

FORMATS = ("json", "md", "html", "junit")
REPORT_FILES = {"json": "report.json", "md": "report.md", "html": "report.html", "junit": "junit.xml"}


# ---------------------------------------------------------------------------------------------
# JSON


def render_json(report: RunReport | dict[str, Any]) -> str:
    return json.dumps(RunReport.load(report).dump(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------------------

RENDERERS: dict[str, Callable[[Any], str]] = {
    "json": render_json, "md": render_markdown, "html": render_html, "junit": render_junit,
}


def render(report: RunReport | dict[str, Any], fmt: str) -> str:
    if fmt not in RENDERERS:
        raise ValueError(f"unknown report format {fmt!r}; use one of {', '.join(FORMATS)}")
    return RENDERERS[fmt](RunReport.load(report))


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_reports(state_dir: Path | str, run_id: str, reader: StoreReader | None = None,
                  junit: Path | None = None) -> dict[str, Path]:
    """Build the report of ``run_id`` once and write report.json, report.md, report.html and junit.xml
    into ``<state_dir>/<run_id>/`` (each atomically), and the JUnit file also to ``junit`` when given.
    Returns {format: path}, and ``junit_file`` for the extra file."""
    own = reader is None
    rd = StoreReader(state_dir) if reader is None else reader
    try:
        report = build_report(rd, run_id)
    finally:
        if own:
            rd.close()
    out_dir = Path(state_dir) / run_id
    paths: dict[str, Path] = {}
    for fmt in FORMATS:
        path = out_dir / REPORT_FILES[fmt]
        text = render(report, fmt)
        write_atomic(path, text)
        paths[fmt] = path
        if fmt == "junit" and junit is not None:
            write_atomic(Path(junit), text)
            paths["junit_file"] = Path(junit)
    return paths
