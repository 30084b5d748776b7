"""The final report of a run: JSON (what ``--baseline`` reads), Markdown, self-contained HTML
with inline SVG charts, and JUnit XML for CI systems. ``soakd report`` renders it from a state dir; the runtime writes all three
into ``<state_dir>/<run_id>/`` at the end of every run (SIGTERM included)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from soakd.report.build import REPORT_SCHEMA, ReportError, build_report
from soakd.report.format import charts
from soakd.report.render import (
    FORMATS,
    REPORT_FILES,
    render,
    render_html,
    render_json,
    render_junit,
    render_markdown,
    write_reports,
)

__all__ = [
    "FORMATS",
    "REPORT_FILES",
    "REPORT_SCHEMA",
    "ReportError",
    "build_report",
    "charts",
    "render",
    "render_html",
    "render_json",
    "render_junit",
    "render_markdown",
    "write_final_reports",
    "write_reports",
]

log = structlog.get_logger("soakd")


async def write_final_reports(state_dir: Path | str, run_id: str, junit: Path | None = None
                              ) -> dict[str, Path] | None:
    """The runtime's end-of-run call: write the reports in a worker thread (``junit``: the JUnit
    file also there, as ``soakd run --junit FILE`` asks; the store is read
    through its own read-only connection). A failure is logged, never raised: the run's data is in
    the store and ``soakd report --run ID`` can render it later."""
    try:
        paths = await asyncio.to_thread(write_reports, state_dir, run_id, None, junit)
    except Exception as exc:  # noqa: BLE001 - a report failure must not fail the run
        log.error("report_failed", run_id=run_id, error=f"{type(exc).__name__}: {exc}",
                  hint=f"soakd report --state-dir {state_dir} --run {run_id} renders it from the store")
        return None
    log.info("report_written", run_id=run_id, **{fmt: str(p) for fmt, p in paths.items()})
    return paths
