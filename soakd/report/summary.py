"""The terminal summary printed at the end of ``soakd run`` and ``soakd demo``: rendered from the
run's report (itself built from the store), like every other summary of a run."""

from __future__ import annotations

from typing import Any


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def format_summary(report: dict[str, Any], process: Any = None) -> str:
    """A few lines per window, the findings, the verdict. ``process``: this process's own counts
    (``soakd.runtime.RunOutcome``: requests measured and their outcomes, including those that
    finished after their window closed, and the prompt-length accuracy, which is not stored)."""
    run = report.get("run") or {}
    lines = ["", f"soakd summary — run {run.get('id')} against {run.get('target')} "
             f"(model {run.get('model')}), ended: {run.get('stop_reason')}"]
    windows = report.get("windows") or []
    if windows:
        lines.append("")
        lines.append(" window   reqs   req/s   tok/s  e2e p50/p95 ms  ttft p50/p95 ms  itl p95 ms  errors")
        for w in windows:
            e, t, i = w["e2e_seconds"], w["ttft_seconds"], w["itl_seconds"]
            err = w["error_rate"]
            lines.append(
                f" {w['window']:>5}{'*' if w['partial'] else ' '} {w['requests']:>6} {w['requests_per_second']:>7.1f} "
                f"{w['output_tokens_per_second']:>7.0f}  {_ms(e['p50']):>6}/{_ms(e['p95']):<7} "
                f"{_ms(t['p50']):>7}/{_ms(t['p95']):<8} {_ms(i['p95']):>10}  "
                f"{'-' if err is None else f'{err:.2%}'}"
            )
        if any(w["partial"] for w in windows):
            lines.append(" (* partial window)")
    outcomes: dict[str, int] = {}
    for w in windows:
        for k, v in (w.get("outcomes") or {}).items():
            outcomes[k] = outcomes.get(k, 0) + int(v or 0)
    measured = sum(outcomes.values())
    if process is not None:
        measured, outcomes = process.requests_measured, process.outcomes
    lines.append("")
    lines.append(f" requests measured: {measured}   outcomes: " + ", ".join(f"{k}={v}" for k, v in outcomes.items() if v))
    findings = [ev for items in (report.get("findings") or {}).values() for ev in items if ev.get("diagnosis")]
    if findings:
        lines.append("")
        lines.append(f" findings ({len(findings)}):")
        for f in findings[-10:]:
            lines.append(f"  - [{f.get('severity')}] {f.get('kind')}: {f.get('diagnosis')} — "
                         f"{str(f.get('detail') or f.get('message'))[:150]}")
    verdict = report.get("verdict")
    if verdict:
        stab = verdict.get("stability") or {}
        unstable = [m for m, v in stab.items() if v.get("stable") is False]
        lines.append("")
        why = verdict.get("reasons") or ([verdict["inconclusive"]] if verdict.get("inconclusive") else [])
        lines.append(f" verdict: {verdict.get('result')}" + (" — " + "; ".join(why) if why else ""))
        if stab:
            def sig(m: str) -> str:
                return m + (" (not significant: within sampling noise)" if stab[m].get("significant") is False
                            else " (significant)" if stab[m].get("significant") else "")
            lines.append(" stability ((max-min)/median over full windows, method's 5%): "
                         + ("all tracked quantities within" if not unstable
                            else "outside for " + ", ".join(sig(m) for m in unstable)))
    acc = process.prompt_length_accuracy if process is not None else None
    if acc:
        lines.append(f" prompt length vs target (server usage): median {acc['median']:+.1%}, "
                     f"p05 {acc['p05']:+.1%}, p95 {acc['p95']:+.1%} over {acc['samples']} requests")
    lines.append("")
    return "\n".join(lines)
