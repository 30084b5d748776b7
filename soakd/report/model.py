"""The run's report as one typed model, ``RunReport``: what every report format renders.

``soakd.report.build`` builds it once from the store; ``report.json`` is its dump (with
``schema_version``), and a ``report.json`` written by this or an earlier release loads back into it
(``RunReport.load``), so ``--baseline``, ``soakd compare`` and re-rendering read the same model. Its
JSON Schema is generated from it and published as ``docs/report.schema.json`` (``json_schema()``; a
test keeps the two the same).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from soakd.analysis import judged as judged_mod
from soakd.core.findings import DIAGNOSES, SECTIONS, SEVERITY_ORDER, Finding
from soakd.core.summary import WindowSummary
from soakd.core.verdict import CAUSE_TEXT, RunVerdict
from soakd.store.rows import finite

__all__ = [
    "REPORT_SCHEMA",
    "REPORT_SCHEMA_VERSION",
    "BaselineInfo",
    "ReportEvent",
    "ReportRun",
    "RunReport",
    "Telemetry",
    "TroubleshootingRow",
    "WindowRow",
    "WindowSeries",
    "clean",
    "complete_verdict",
    "json_schema",
]

REPORT_SCHEMA = "soakd-report/1"  # the document's name (what --baseline checks); unchanged since the first release
REPORT_SCHEMA_VERSION = 2  # 1: before the typed model (no schema_version in the file)


clean = finite  # JSON-safe copy: NaN/inf -> None, tuples -> lists, keys -> str (as the store writes JSON)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ReportLoad(_Model):
    mode: str = "open loop"
    concurrency: int | None = None
    rate: float | None = None
    arrival: str | None = None
    mix: dict[str, Any] | None = None


class ReportSegment(_Model):
    seq: int
    started_at: str | None = None
    ended_at: str | None = None
    reason: str | None = None
    end_reason: str | None = None
    seconds: float = 0.0


class ReportGap(_Model):
    from_: str | None = Field(None, alias="from")
    to: str | None = None
    from_unix: float
    to_unix: float
    seconds: float = 0.0


class ReportRun(_Model):
    id: str = ""
    target: str | None = None
    model: str | None = None
    server_kind: str | None = None
    soakd_version: str | None = None
    status: str = "running"
    state: str = ""
    stop_reason: str | None = None
    started_unix: float = 0.0
    started_at: str | None = None
    ended_unix: float | None = None
    ended_at: str | None = None
    wall_seconds: float | None = None
    observed_seconds: float = 0.0
    planned_duration: Any = None
    window: Any = None
    warmup: Any = None
    load: ReportLoad = Field(default_factory=ReportLoad)
    segments: list[ReportSegment] = Field(default_factory=list)
    gaps: list[ReportGap] = Field(default_factory=list)
    config_hash: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    server_restarts: int = 0


class BaselineInfo(_Model):
    window: int | None = None
    source: str | None = None  # "this run" | "external" | None
    external_path: str | None = None
    external_window: int | None = None
    note: str | None = None


class WindowRow(_Model):
    """One row of the per-window table."""

    window: int
    segment: int = 0
    partial: bool = False
    start_unix: float | None = None
    start: str | None = None
    duration_seconds: float = 0.0
    requests: int = 0
    requests_per_second: float | None = None
    output_tokens_per_second: float | None = None
    e2e_p50: float | None = None
    e2e_p95: float | None = None
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    itl_p50: float | None = None
    itl_p95: float | None = None
    errors: int = 0
    error_rate: float | None = None
    outcomes: dict[str, int] = Field(default_factory=dict)
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_mhz: float | None = None
    memory_gib: float | None = None
    kv_cache_usage_ratio: float | None = None
    joules_per_token: float | None = None
    notes: list[str] = Field(default_factory=list)
    server_restarts: int = 0
    goodput_ratio: float | None = None
    prefix_cache_hit_ratio: float | None = None  # the server's prefix-cache hit rate in the window
    not_judged: str | None = None  # why the window was not judged (client_impaired, target_down, ...); None: judged

    @model_serializer(mode="wrap")
    def _sparse(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("goodput_ratio", "prefix_cache_hit_ratio"):
            if out.get(key, 0) is None:
                del out[key]
        return out


class ReportEvent(_Model):
    """An event of the run as the report lists it; a finding's carries its diagnosis, span, the
    verdict's judgement and its registry entry (title, section, runbook)."""

    id: int | None = None
    t_unix: float | None = None
    at: str | None = None
    kind: str
    severity: str = "info"
    window: int | None = None
    message: str = ""
    diagnosis: str | None = None
    detail: str | None = None  # a finding's own message (``message`` is ``diagnosis: detail``)
    evidence: dict[str, Any] | None = None
    last_window: int | None = None
    metrics: list[str] | None = None
    target: str | None = None  # another target's (an A/B run)
    fails: bool | None = None
    why: str | None = None
    title: str | None = None
    section: str | None = None
    runbook: str | None = None

    @model_serializer(mode="wrap")
    def _sparse(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if self.diagnosis is None:  # not a finding: the fields of an event as they always were
            for k in ("last_window", "metrics", "target", "fails", "why", "title", "section", "runbook"):
                out.pop(k, None)
        elif out.get("target") is None:
            out.pop("target", None)
        return out

    @property
    def finding(self) -> Finding | None:
        if self.diagnosis is None or self.diagnosis not in DIAGNOSES:
            return None
        evidence = dict(self.evidence or {})
        if self.target and "target" not in evidence:
            evidence["target"] = self.target
        try:
            return Finding(kind=self.kind, diagnosis=self.diagnosis, severity=self.severity,  # type: ignore[arg-type]
                           message=self.detail if self.detail is not None else self.message, evidence=evidence,
                           window=self.window, last_window=self.last_window, metrics=self.metrics or [],
                           fails=self.fails, why=self.why)
        except ValueError:
            return None

    def where(self) -> str:
        f = self.finding
        if f is not None:
            return f.where()
        return f"window {self.window}" if self.window is not None else "run"


class TroubleshootingRow(_Model):
    diagnosis: str
    seen: str = ""
    check: str = ""
    count: int = 0
    windows: list[int] = Field(default_factory=list)
    severity: str = "info"
    kinds: list[str] = Field(default_factory=list)
    title: str | None = None
    runbook: str | None = None
    fails: bool = False  # one of its findings failed the run


class WindowSeries(_Model):
    window: list[int | None] = Field(default_factory=list)
    partial: list[bool] = Field(default_factory=list)
    elapsed_seconds: list[float | None] = Field(default_factory=list)
    metrics: dict[str, list[float | None]] = Field(default_factory=dict)
    baseline: dict[str, float | None] = Field(default_factory=dict)
    threshold: dict[str, float] = Field(default_factory=dict)
    relative: dict[str, list[float | None]] = Field(default_factory=dict)


class Telemetry(_Model):
    source: str = "windows"
    period_seconds: float | None = None
    elapsed_seconds: list[float] = Field(default_factory=list)
    values: dict[str, list[float | None]] = Field(default_factory=dict)
    device: bool = False
    server: bool = False
    gpus: int | None = None
    notes: list[str] = Field(default_factory=list)


class ReportSeries(_Model):
    windows: WindowSeries = Field(default_factory=WindowSeries)
    telemetry: Telemetry = Field(default_factory=Telemetry)


class RunReport(_Model):
    """The report of one run (``report.json``)."""

    schema_name: str = Field(REPORT_SCHEMA, alias="schema")
    schema_version: int = REPORT_SCHEMA_VERSION
    generated_at: str | None = None
    generated_by: str | None = None
    run: ReportRun
    verdict: RunVerdict = Field(default_factory=RunVerdict)
    baseline_window: int | None = None
    baseline_info: BaselineInfo = Field(default_factory=BaselineInfo)
    thresholds: dict[str, float] = Field(default_factory=dict)
    min_requests: int = 0
    table: list[WindowRow] = Field(default_factory=list)
    findings: dict[str, list[ReportEvent]] = Field(default_factory=dict)  # events by kind, in the report's order
    troubleshooting: list[TroubleshootingRow] = Field(default_factory=list)
    series: ReportSeries = Field(default_factory=ReportSeries)
    windows: list[WindowSummary] = Field(default_factory=list)
    baseline: WindowSummary | None = None  # this run's own baseline window (what --baseline of a later run reads)

    @model_validator(mode="before")
    @classmethod
    def _older(cls, data: Any) -> Any:
        """A report an earlier release wrote: no ``schema_version`` (version 1)."""
        if isinstance(data, dict) and "schema_version" not in data:
            data = {**data, "schema_version": 1}
            v = data.get("verdict")
            if isinstance(v, dict) and "schema_version" not in v:
                data["verdict"] = {**v, "schema_version": 1}
        return data

    @model_validator(mode="after")
    def _causes(self) -> RunReport:
        """A verdict an earlier release stored has no causes: they come from the windows themselves; a
        report an earlier release wrote gains what this one adds (each finding's judgement, title,
        section and runbook, each window's cause for not being judged), so that it renders as a report
        of the same run built now."""
        if self.verdict.judged is None:
            self.verdict = complete_verdict(self.verdict, self.windows, self.min_requests)
        if self.schema_version < 2:
            for e in self.events():
                f = e.finding
                if f is not None and e.section is None:
                    spec = f.spec
                    e.title, e.section, e.runbook = spec.title, spec.section, spec.runbook_url
                    e.why = self.verdict.why(f)
                    e.fails = e.why is not None
            failing = {e.diagnosis for e in self.finding_events() if e.fails}
            for r in self.troubleshooting:
                if r.title is None and r.diagnosis in DIAGNOSES:
                    r.title, r.runbook = DIAGNOSES[r.diagnosis].title, DIAGNOSES[r.diagnosis].runbook_url
                    r.fails = r.diagnosis in failing
            by = {w.window: w for w in self.windows}
            for row in self.table:
                w = by.get(row.window)
                if w is not None and row.not_judged is None:
                    row.not_judged = judged_mod.not_judged_cause(w, self.min_requests)
                    row.notes = window_notes(row.notes, row.not_judged)
        return self

    @model_serializer(mode="wrap")
    def _sparse(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("baseline", 0) is None:
            del out["baseline"]
        return out

    @classmethod
    def load(cls, data: Any) -> RunReport:
        """From a ``report.json`` document (this release's or an earlier one's), or a report already."""
        if isinstance(data, cls):
            return data
        if isinstance(data, str | bytes):
            data = json.loads(data)
        return cls.model_validate(data)

    def dump(self) -> dict[str, Any]:
        """The JSON document (``report.json``)."""
        return clean(self.model_dump(mode="json", by_alias=True))

    # ---- what the renderers read
    def events(self) -> list[ReportEvent]:
        return [e for items in self.findings.values() for e in items]

    def finding_events(self) -> list[ReportEvent]:
        """Every finding of the run (events with a registered diagnosis), in the report's order."""
        return [e for e in self.events() if e.finding is not None]

    def failing(self) -> list[ReportEvent]:
        """The findings that failed the run, in the order they were made."""
        return sorted((e for e in self.finding_events() if e.fails), key=lambda e: (e.t_unix or 0.0, e.id or 0))

    def by_section(self) -> list[tuple[str, str, list[ReportEvent]]]:
        """(section id, its title, its findings: failing first, then by severity and time) for every section
        with a finding, in the registry's order."""
        out = []
        for sid, title in SECTIONS.items():
            items = [e for e in self.finding_events() if e.section == sid]
            if items:
                items.sort(key=lambda e: (not e.fails, SEVERITY_ORDER.get(e.severity, 3), e.t_unix or 0.0))
                out.append((sid, title, items))
        return out

    def other_events(self, exclude: tuple[str, ...] = ("quiesce", "segment")) -> list[ReportEvent]:
        """Events that are not findings (the baseline, the canary's reference, revisions, recoveries)."""
        return [e for e in self.events() if e.finding is None and e.kind not in exclude]

    def flagged_windows(self) -> list[int]:
        """Every window a warning or critical finding covers (its whole span)."""
        out: set[int] = set()
        for e in self.finding_events():
            f = e.finding
            if f is not None and f.severity in ("warning", "critical"):
                out.update(f.windows)
        known = {r.window for r in self.table}
        return sorted(w for w in out if not known or w in known)

    def row(self, window: int) -> WindowRow | None:
        return next((r for r in self.table if r.window == window), None)


def window_notes(notes: list[str], cause: str | None) -> list[str]:
    """A window's notes with the cause it was not judged for (client-impaired, too few requests: the
    others have their own note), after the baseline/partial/target-down/restart flags."""
    if cause not in ("client_impaired", "too_few_requests"):
        return notes
    note = f"not judged: {CAUSE_TEXT[cause]}"
    if note in notes:
        return notes
    flags = ("baseline", "partial", "target down")
    head = [n for n in notes if n in flags or n.startswith("server restarted")]
    return [*head, note, *(n for n in notes if n not in head)]


def complete_verdict(verdict: RunVerdict, windows: list[WindowSummary], min_requests: int) -> RunVerdict:
    """The windows judged and those not judged, from the windows (``soakd.analysis.judged``, as the
    analysis makes them now), for a verdict stored without them."""
    if verdict.judged is not None:
        return verdict
    nj = judged_mod.not_judged(windows, min_requests)
    if verdict.result == "INCOMPLETE" or windows:
        nj = [c for c in nj if c.cause != "nothing_measured"]
    return verdict.model_copy(update={"judged": judged_mod.judged(windows, min_requests), "not_judged": nj})


def json_schema() -> dict[str, Any]:
    """The JSON Schema of ``report.json`` (``docs/report.schema.json``)."""
    schema = RunReport.model_json_schema(by_alias=True, mode="validation")
    verdict = schema.get("$defs", {}).get("RunVerdict")
    if verdict is not None:  # computed: in every report.json, not read back
        verdict.setdefault("properties", {})["exit_code"] = {
            "type": "integer", "title": "Exit Code", "readOnly": True,
            "description": "soakd run's exit code for this verdict: 0 PASS (or interim), 1 FAIL, 3 INCONCLUSIVE"}
    schema["$id"] = "https://github.com/soakd/soakd/blob/main/docs/report.schema.json"
    schema["title"] = "soakd report (report.json)"
    return schema
