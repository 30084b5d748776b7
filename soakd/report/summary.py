"""The terminal summary printed at the end of ``soakd run`` and ``soakd demo``: rendered from the
run's report (itself built from the store), like every other summary of a run."""

from __future__ import annotations

from typing import Any

from soakd.report.format import finding_group_lines, finding_views, verdict_lines, verdict_title
from soakd.report.model import RunReport


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def format_summary(report: RunReport | dict[str, Any], process: Any = None) -> str:
    """A few lines per window, the findings, the verdict and what it rests on. ``process``: this
    process's own counts (``soakd.runtime.RunOutcome``: requests measured and their outcomes, including
    those that finished after their window closed, and the prompt-length accuracy, which is not stored)."""
    report = RunReport.load(report)
    run = report.run
    lines = ["", f"soakd summary — run {run.id} against {run.target} (model {run.model}), ended: {run.stop_reason}"]
    rows = {r.window: r for r in report.table}
    if report.windows:
        lines.append("")
        lines.append(" window   reqs   req/s   tok/s  e2e p50/p95 ms  ttft p50/p95 ms  itl p95 ms  errors   notes")
        for w in report.windows:
            e, t, i = w.e2e_seconds, w.ttft_seconds, w.itl_seconds
            err = w.error_rate
            row = rows.get(w.window)
            notes = ", ".join(n for n in (row.notes if row else []) if n != "partial")
            lines.append(
                f" {w.window:>5}{'*' if w.partial else ' '} {w.requests:>6} {w.requests_per_second:>7.1f} "
                f"{w.output_tokens_per_second:>7.0f}  {_ms(e.p50):>6}/{_ms(e.p95):<7} "
                f"{_ms(t.p50):>7}/{_ms(t.p95):<8} {_ms(i.p95):>10}  "
                f"{'-' if err is None else f'{err:.2%}':>6}   {notes}".rstrip()
            )
        if any(w.partial for w in report.windows):
            lines.append(" (* partial window)")
    outcomes: dict[str, int] = {}
    for w in report.windows:
        for k, n in w.outcomes.items():
            outcomes[k] = outcomes.get(k, 0) + int(n or 0)
    measured = sum(outcomes.values())
    if process is not None:
        measured, outcomes = process.requests_measured, process.outcomes
    lines.append("")
    lines.append(f" requests measured: {measured}   outcomes: " + ", ".join(f"{k}={n}" for k, n in outcomes.items() if n))
    views = finding_views(report.finding_events())
    if views:
        lines.append("")
        lines += finding_group_lines(views)
    v = report.verdict
    lines.append("")
    why = verdict_lines(report, brief=True)
    lines.append(f" verdict: {verdict_title(report)}" + (f" — {why[0]}" if why else "") + f" (exit code {v.exit_code})")
    for line in why[1:]:
        lines.append(f"   - {line}")
    stab = v.stability
    if stab:
        unstable = [m for m, st in stab.items() if st.stable is False]

        def sig(m: str) -> str:
            return m + (" (not significant: within sampling noise)" if stab[m].significant is False
                        else " (significant)" if stab[m].significant else "")

        lines.append(" stability ((max-min)/median over full windows, method's 5%): "
                     + ("all tracked quantities within" if not unstable
                        else "outside for " + ", ".join(sig(m) for m in unstable)))
    acc = process.prompt_length_accuracy if process is not None else None
    if acc:
        lines.append(f" prompt length vs target (server usage): median {acc['median']:+.1%}, "
                     f"p05 {acc['p05']:+.1%}, p95 {acc['p95']:+.1%} over {acc['samples']} requests")
    lines.append("")
    return "\n".join(lines)
