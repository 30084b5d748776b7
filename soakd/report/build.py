"""Build the final report of a run from the store, once: a ``RunReport`` (``soakd.report.model``).

Every format renders that model; its dump is the JSON report, so ``--baseline report.json`` of a
later run reads it: it carries ``windows`` (the full window summaries, as
``StoreReader.load_windows`` returns them) and ``baseline`` (this run's own baseline window
summary), both of which ``soakd.analysis.drift.baseline_from_report`` accepts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from soakd import __version__
from soakd.analysis import judged as judged_mod
from soakd.analysis.drift import baseline_from_report, choose_baseline
from soakd.analysis.restarts import restarts_by_window
from soakd.analysis.stats import as_float
from soakd.config.analysis import DriftConfig
from soakd.config.secrets import MASK, credential_header, mask_url
from soakd.core.findings import DIAGNOSES, KINDS, Finding
from soakd.core.summary import WindowSummary
from soakd.core.verdict import RunVerdict
from soakd.report.model import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, RunReport, clean, window_notes
from soakd.report.series import telemetry, window_metrics, window_series
from soakd.store import SegmentRow, StoreReader, segment_gaps

__all__ = ["FINDING_GROUPS", "REPORT_SCHEMA", "ReportError", "build_report"]

# Event kinds, in the order the report shows their groups ("canary_reference" joins "canary").
FINDING_GROUPS = (*KINDS, "quiesce", "segment", "baseline")
_GROUP_OF = {"canary_reference": "canary"}


class ReportError(Exception):
    """No run to report on (empty store, unknown run id)."""


# ---------------------------------------------------------------------------------------------
# small helpers


_f = as_float


def _get(d: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return d


def iso(ts: float | None) -> str | None:
    return None if ts is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


_redact_url = mask_url  # a URL's user and password, and credential query parameters, as ***


def redact(obj: Any) -> Any:
    """Defence in depth over the stored config, which ``SoakConfig.redacted()`` masked by type (the
    same data ``--print-config`` prints): credentials in URLs, and the values of headers that can
    carry one (``credential_header``; a config stored by an older release has them as given),
    are masked. Every other value is as stored."""
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            ks = str(k)
            if ks == "headers" and isinstance(v, Mapping):
                out[ks] = {str(h): MASK if credential_header(str(h)) and x not in (None, "") else redact(x)
                           for h, x in v.items()}
            else:
                out[ks] = redact(v)
        return out
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return mask_url(obj)


def _server_kind(reader: StoreReader, run_id: str) -> str | None:
    """The kind the server sampler detected (soakd_server_info{kind}) when the run row has none."""
    kinds = sorted({r.labels.get("kind") for r in reader.load_samples(run_id, "soakd_server_info")} - {None, ""})
    return ", ".join(k for k in kinds if k) or None


def _drift_config(config: Any) -> DriftConfig:
    raw = _get(config, "analysis", "drift")
    if isinstance(raw, Mapping):
        try:
            return DriftConfig.model_validate(dict(raw))
        except Exception:  # noqa: BLE001 - an older/newer config: the defaults are the best guess
            pass
    return DriftConfig()


# ---------------------------------------------------------------------------------------------
# sections


def _run_section(run: Any, config: Any, segments: list[SegmentRow], windows: list[WindowSummary],
                 server_kind: str | None = None) -> dict[str, Any]:
    gaps = segment_gaps(segments)
    ends = [s.ended_unix or s.last_seen_unix or s.started_unix for s in segments]
    last_window_end = max((w.start_unix or 0.0) + (w.wall_duration_seconds or w.duration_seconds or 0.0)
                          for w in windows) if windows else None
    ended = run.ended_unix or (max(ends) if ends else None) or last_window_end
    last_seg = segments[-1] if segments else None
    if run.status == "running":
        if last_seg is not None and last_seg.ended_unix is not None:
            state = (f"stopped ({last_seg.end_reason or 'stopped'}); resumable: the next start with this state dir "
                     "continues the run")
        else:
            state = "running, or interrupted without a clean stop (no verdict until it resumes and finishes)"
    else:
        state = run.status
    observed = sum(max(0.0, (s.ended_unix or s.last_seen_unix or s.started_unix) - s.started_unix) for s in segments)
    load = _get(config, "load") or {}
    closed = load.get("concurrency") is not None and load.get("rate") is None
    return {
        "id": run.id,
        "target": _redact_url(run.target),
        "model": run.model,
        "server_kind": run.server_kind or server_kind,
        "soakd_version": run.version,
        "status": run.status,
        "state": state,
        "stop_reason": run.stop_reason or (last_seg.end_reason if last_seg is not None else None),
        "started_unix": run.created_unix,
        "started_at": iso(run.created_unix),
        "ended_unix": ended,
        "ended_at": iso(ended),
        "wall_seconds": (ended - run.created_unix) if ended is not None else None,
        "observed_seconds": observed,
        "planned_duration": _get(config, "run", "duration"),
        "window": _get(config, "run", "window"),
        "warmup": _get(config, "run", "warmup"),
        "load": {
            "mode": "closed loop" if closed else "open loop",
            "concurrency": load.get("concurrency") if closed else None,
            "rate": None if closed else load.get("rate"),
            "arrival": None if closed else load.get("arrival"),
            "mix": load.get("mix"),
        },
        "segments": [
            {"seq": s.seq, "started_at": iso(s.started_unix), "ended_at": iso(s.ended_unix), "reason": s.reason,
             "end_reason": s.end_reason,
             "seconds": max(0.0, (s.ended_unix or s.last_seen_unix or s.started_unix) - s.started_unix)}
            for s in segments
        ],
        "gaps": [{"from": iso(a), "to": iso(b), "from_unix": a, "to_unix": b, "seconds": max(0.0, b - a)}
                 for a, b in gaps],
        "config_hash": run.config_hash,
        "config": config,
    }


def _verdict_section(run: Any) -> RunVerdict:
    interim = run.status == "running"
    if not isinstance(run.verdict, Mapping):
        v = RunVerdict(schema_version=2, result="INCOMPLETE", passed=None, interim=True, reasons=[
            "no verdict was stored: the run has not finished (still running, or soakd was killed before it could "
            "stop cleanly); resume it, or read the windows below"])
    else:
        try:
            v = RunVerdict.load(dict(run.verdict))
        except ValueError as exc:
            first = exc.errors()[0] if hasattr(exc, "errors") else {}
            where = ".".join(str(x) for x in first.get("loc", ())) if isinstance(first, dict) else ""
            v = RunVerdict(schema_version=2, result="INCOMPLETE", passed=None, interim=interim,
                           reasons=[f"the stored verdict could not be read ({where}: {first.get('msg', exc)}; "
                                    "written by a newer soakd?)"])
        v = v.model_copy(update={"interim": interim})
    return v  # an earlier release's verdict gains its causes in RunReport (model.complete_verdict)


def _baseline(reader_baseline: tuple[int, WindowSummary] | None, windows: list[WindowSummary], config: Any,
              drift_cfg: DriftConfig) -> tuple[WindowSummary | None, WindowSummary | None, dict[str, Any]]:
    """(this run's baseline window, the baseline this run was compared with, info)."""
    own: WindowSummary | None = None
    if reader_baseline is not None:
        own = reader_baseline[1]
    else:
        own = choose_baseline([w for w in windows if not w.partial], drift_cfg.min_requests)
    info: dict[str, Any] = {"window": own.window if own else None, "source": "this run" if own else None,
                            "external_path": None, "external_window": None, "note": None}
    used = own
    path = _get(config, "analysis", "baseline")
    if path:
        info["external_path"] = str(path)
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            ext = baseline_from_report(data, drift_cfg.min_requests)
        except (OSError, ValueError) as exc:
            ext = None
            info["note"] = f"the external baseline {path} could not be read now ({exc}); bands show this run's own"
        if ext is not None:
            used = ext
            info.update(source="external", external_window=ext.window)
        elif info["note"] is None:
            info["note"] = f"{path} holds no usable baseline window; bands show this run's own"
    if used is None:
        info["note"] = info["note"] or (
            f"no full window with at least {drift_cfg.min_requests} requests: nothing to compare with")
    return own, used, info


def _window_row(w: WindowSummary, baseline_idx: int | None, notes: Iterable[str],
                restarts: int = 0, min_requests: int = 0) -> dict[str, Any]:
    dev, srv = w.device, w.server
    oc = w.outcomes
    requests = w.requests
    errors = requests - int(oc.get("ok", requests) or 0) - int(oc.get("cancelled", 0) or 0)
    mem = dev.memory_used_bytes.mean if dev.memory_used_bytes else None
    kv = srv.kv_cache_usage_ratio.mean if srv.kv_cache_usage_ratio else None
    clock = dev.sm_clock_hertz.mean if dev.sm_clock_hertz else None
    cause = judged_mod.not_judged_cause(w, min_requests)
    flags = []
    if w.window == baseline_idx:
        flags.append("baseline")
    if w.partial:
        flags.append("partial")
    if w.target_down_seconds:
        flags.append("target down")
    if restarts:
        flags.append(f"server restarted x{restarts}" if restarts > 1 else "server restarted")
    flags = window_notes(flags, cause)
    c = w.client
    if c is not None and c.requests_impaired and not c.impaired:  # judged on the rest
        flags.append(f"{c.requests_impaired} requests impaired by soakd's own stalls "
                     f"({(c.impaired_share or 0.0):.1%}): latency judged on the rest")
    flags.extend(n for n in notes if n not in flags)
    return {
        "window": w.window,
        "segment": w.segment,
        "partial": w.partial,
        "start_unix": w.start_unix,
        "start": iso(w.start_unix),
        "duration_seconds": w.duration_seconds,
        "requests": requests,
        "requests_per_second": w.requests_per_second,
        "output_tokens_per_second": w.output_tokens_per_second,
        "e2e_p50": w.e2e_seconds.p50, "e2e_p95": w.e2e_seconds.p95,
        "ttft_p50": w.ttft_seconds.p50, "ttft_p95": w.ttft_seconds.p95,
        "itl_p50": w.itl_seconds.p50, "itl_p95": w.itl_seconds.p95,
        "errors": max(0, errors),
        "error_rate": w.error_rate,
        "outcomes": {k: v for k, v in oc.items() if v and k != "ok"},
        "power_watts": dev.power_watts.mean if dev.power_watts else None,
        "temperature_celsius": dev.temperature_celsius.max if dev.temperature_celsius else None,
        "sm_clock_mhz": clock / 1e6 if clock is not None else None,
        "memory_gib": mem / 2**30 if mem is not None else None,
        "kv_cache_usage_ratio": kv,
        "joules_per_token": dev.energy_per_output_token_joules,
        "notes": flags,
        "server_restarts": restarts,
        "not_judged": cause,
        **({"goodput_ratio": w.goodput.ratio} if w.goodput is not None else {}),
        **({"prefix_cache_hit_ratio": srv.prefix_cache_hit_ratio} if srv.prefix_cache_hit_ratio is not None else {}),
    }  # fmt: skip


def _event_dict(e: Any, verdict: RunVerdict) -> dict[str, Any]:
    data = e.data if isinstance(e.data, Mapping) else {}
    f = Finding.from_event(dict(data))
    out: dict[str, Any] = {
        "id": e.id,
        "t_unix": e.t_unix,
        "at": iso(e.t_unix),
        "kind": e.kind,
        "severity": e.severity,
        "window": e.window,
        "message": e.message,
        "diagnosis": data.get("diagnosis") if f is not None else None,
        "detail": data.get("message") if f is not None else None,
        "evidence": data.get("evidence") if f is not None else (data or None),
    }
    if f is not None:  # a finding: its span, the verdict's judgement of it, its registry entry
        if verdict.result == "INCOMPLETE":  # no verdict yet: as judged when it was made
            fails, why = bool(f.fails), f.why
        else:
            reason = verdict.why(f)
            fails = reason is not None
            why = reason if fails else ("the run's verdict did not fail on it" if f.fails else f.why)
        spec = f.spec
        out.update(last_window=f.last_window, metrics=f.metrics, target=data.get("target"), fails=fails, why=why,
                   title=spec.title, section=spec.section, runbook=spec.runbook_url)
    return out


def _end_of_run(e: Any) -> bool:
    """A finding made at the end of a segment over the whole run (change points, trends, the last leak
    judgement, the error budget, the A/B run)."""
    f = Finding.from_event(e.data if isinstance(e.data, Mapping) else None)
    return f is not None and (f.spec.end_of_run or f.window is None)


def _interim(e: Any, resumed_at: float | None) -> bool:
    """An end-of-run judgement made when an earlier segment stopped (SIGTERM: its verdict was interim),
    made again when the resumed run ended: superseded."""
    return resumed_at is not None and e.t_unix < resumed_at and _end_of_run(e)


def _findings(events: list[Any], verdict: RunVerdict, resumed_at: float | None = None
              ) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        g = _GROUP_OF.get(e.kind, e.kind)
        ev = _event_dict(e, verdict)
        if _interim(e, resumed_at):  # shown among the other events, not as a finding of the run
            ev.update(diagnosis=None, message=f"(interim, superseded when the run resumed) {ev['message']}")
            for k in ("last_window", "metrics", "target", "fails", "why", "title", "section", "runbook"):
                ev.pop(k, None)
        groups.setdefault(g, []).append(ev)
    ordered = {g: groups[g] for g in FINDING_GROUPS if g in groups}
    ordered.update({g: v for g, v in sorted(groups.items()) if g not in ordered})
    seen: dict[str, dict[str, Any]] = {}
    for items in ordered.values():
        for ev in items:
            d = ev["diagnosis"]
            if d is None:
                continue
            row = seen.get(d)
            if row is None:
                spec = DIAGNOSES[d]
                row = seen[d] = {"diagnosis": d, "seen": spec.seen, "check": spec.check, "count": 0, "windows": [],
                                 "severity": ev["severity"], "kinds": [], "title": spec.title,
                                 "runbook": spec.runbook_url, "fails": False}
            row["count"] += 1
            span = range(ev["window"], max(ev["window"], ev.get("last_window") or ev["window"]) + 1) \
                if ev["window"] is not None else ()
            for w in span:
                if w not in row["windows"]:
                    row["windows"].append(w)
            if ev["kind"] not in row["kinds"]:
                row["kinds"].append(ev["kind"])
            if ev["severity"] == "critical":
                row["severity"] = "critical"
            row["fails"] = row["fails"] or bool(ev.get("fails"))
    order = {d: i for i, d in enumerate(DIAGNOSES)}
    rows = sorted(seen.values(), key=lambda r: (order.get(r["diagnosis"], len(order)), r["diagnosis"]))
    return ordered, rows


# ---------------------------------------------------------------------------------------------


def build_report(reader: StoreReader, run_id: str | None = None, *, generated_unix: float | None = None
                 ) -> RunReport:
    """The report of ``run_id`` (the newest run when None). Raises ReportError when there is none."""
    run = reader.get_run(run_id) if run_id else reader.latest_run()
    if run is None:
        if run_id:
            known = [r.id for r in reader.list_runs()[:10]]
            raise ReportError(f"no run {run_id!r} in {reader.db}" + (
                f"; runs: {', '.join(known)} (soakd report --list)" if known else "; it holds no runs"))
        raise ReportError(f"{reader.db} holds no runs yet")
    try:
        config = redact(run.config)
    except ValueError:
        config = {}
    drift_cfg = _drift_config(config)
    segments = reader.load_segments(run.id)
    windows = reader.load_windows(run.id)
    own, used, base_info = _baseline(reader.load_baseline(run.id), windows, config, drift_cfg)
    verdict = _verdict_section(run)
    events = reader.load_events(run.id)
    # a run stopped (SIGTERM) and resumed made its end-of-run judgements twice: the last segment's stand
    resumed_at = segments[-1].started_unix if len(segments) > 1 else None
    if resumed_at is not None and not any(e.t_unix >= resumed_at and _end_of_run(e) for e in events):
        resumed_at = None  # the last segment has made none yet: the earlier one's are the run's so far
    findings, troubleshooting = _findings(events, verdict, resumed_at)

    # every window a warning or critical finding covers (its whole span) is noted with its diagnosis
    notes_by_window: dict[int, list[str]] = {}
    for items in findings.values():
        for ev in items:
            if ev["diagnosis"] is None or ev["window"] is None or ev["severity"] not in ("warning", "critical"):
                continue
            for w in range(ev["window"], max(ev["window"], ev.get("last_window") or ev["window"]) + 1):
                lst = notes_by_window.setdefault(w, [])
                if ev["diagnosis"] not in lst:
                    lst.append(ev["diagnosis"])
    baseline_idx = base_info["window"] if base_info["source"] == "this run" else None
    restarts = restarts_by_window(windows)
    rows = [_window_row(w, baseline_idx, notes_by_window.get(w.window, []), restarts.get(w.window, 0),
                        drift_cfg.min_requests) for w in windows]

    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "schema_version": REPORT_SCHEMA_VERSION,
        "generated_at": iso(generated_unix if generated_unix is not None else time.time()),
        "generated_by": f"soakd {__version__}",
        "run": {**_run_section(run, config, segments, windows, _server_kind(reader, run.id)),
                "server_restarts": sum(restarts.values())},
        "verdict": verdict,
        "baseline_window": base_info["window"],
        "baseline_info": base_info,
        "thresholds": {m: drift_cfg.threshold_for(m) for m in window_metrics(windows)},
        "min_requests": drift_cfg.min_requests,
        "table": rows,
        "findings": findings,
        "troubleshooting": troubleshooting,
        "series": {
            "windows": window_series(windows, used, drift_cfg, run.created_unix),
            "telemetry": telemetry(reader, run.id, windows, run.created_unix),
        },
        "windows": windows,
        "baseline": own,
    }
    return RunReport.model_validate(clean_sections(report))


def clean_sections(report: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities out of the plain sections (the models keep their own)."""
    return {k: v if k in ("verdict", "windows", "baseline") else clean(v) for k, v in report.items()}
