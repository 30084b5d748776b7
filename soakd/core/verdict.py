"""The run's verdict as one typed model: what every output of a finished (or stopped) run renders.

``RunVerdict`` is built once, by the analysis at the end of the run (``Analyzer.verdict``; an A/B run
adds each other target's ``TargetVerdict``), stored in the run's row, and read back by the report,
the terminal summary, the ``soakd_finished`` log line, JUnit and the exit code. It names its cause
whatever the result: FAIL lists the findings that failed the run, INCONCLUSIVE the windows that
could not be judged and why, PASS what was judged. Verdicts that earlier releases stored (plain
dicts without ``schema_version``) load as they are.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_serializer, model_validator

from soakd.core.findings import Finding, failing_reason

__all__ = ["EXIT_CODES", "EXIT_UNSAVED", "VERDICT_SCHEMA_VERSION", "AbComparison", "Judged", "LeakJudgement", "NotJudged", "Result",
           "RunVerdict", "Stability", "TargetVerdict"]

VERDICT_SCHEMA_VERSION = 2
Result = Literal["PASS", "FAIL", "INCONCLUSIVE", "INCOMPLETE"]
Cause = Literal["client_impaired", "too_few_requests", "target_down", "partial", "nothing_measured"]

# soakd run / demo: 0 PASS (or a graceful stop: the run is resumable, its verdict interim), 1 FAIL (or no
# verdict: nothing measured, the run incomplete), 3 INCONCLUSIVE. 2 is a usage or configuration error.
EXIT_CODES: dict[str, int] = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3, "INCOMPLETE": 1}
# the run ended but its record could not be saved (a full disk): its last writes are in soakd.db.unsaved.jsonl
# (or on stderr), read back by the next start; whatever the verdict, it is not on record
EXIT_UNSAVED = 4

CAUSE_TEXT: dict[str, str] = {
    "client_impaired": "client-impaired (soakd itself stalled)",
    "too_few_requests": "too few requests",
    "target_down": "the target was down",
    "partial": "partial (cut short by the end of the run)",
    "nothing_measured": "nothing was measured",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NotJudged(_Model):
    """Windows that were not judged, for one cause."""

    cause: Cause
    windows: list[int] = Field(default_factory=list)
    detail: str = ""

    def text(self) -> str:
        n = len(self.windows)
        ws = ", ".join(str(w) for w in self.windows[:12]) + (f", … (+{n - 12})" if n > 12 else "")
        head = f"{n} {CAUSE_TEXT[self.cause]}" if n else CAUSE_TEXT[self.cause]
        return head + (f" (window{'s' if n > 1 else ''} {ws})" if n else "") + (f": {self.detail}" if self.detail else "")


class Judged(_Model):
    """What the verdict rests on."""

    windows: int = 0  # full windows judged
    full_windows: int = 0
    partial_windows: int = 0
    requests: int = 0  # measured requests in the judged windows
    requests_measured: int = 0  # in every window, judged or not
    # of the judged windows' requests, those that overlapped a stall of soakd's own loop (their latency left out)
    requests_impaired: int = 0
    # metric -> the smallest change the live page catches within two windows (set when the pool completed)
    detectable: dict[str, float] = Field(default_factory=dict)

    def text(self) -> str:
        out = f"{self.windows} of {self.full_windows} full windows judged ({self.requests:,} requests"
        if self.requests_impaired:
            share = self.requests_impaired / self.requests if self.requests else 0.0
            out += (f", {self.requests_impaired:,} of them ({share:.1%}) impaired by soakd's own stalls: "
                    "their latency left out")
        out += ")"
        if self.detectable:
            def pct(m: str, v: float) -> str:
                unit = "pp" if m in ("error_rate", "goodput_ratio") else "%"
                return f"{v * 100:.1f}{unit}" if v < 10 else f"over 1000{unit} (too few requests per window)"

            out += "; the smallest change a page catches within two windows: " + ", ".join(
                f"{m} {pct(m, v)}" for m, v in self.detectable.items())
        return out


class Stability(_Model):
    """The method's stability figure of one tracked metric over the run's full windows."""

    spread: float | None = None  # (max - min) / median (error rate: max - min)
    stable: bool | None = None
    min: float | None = None
    max: float | None = None
    median: float | None = None
    windows: int = 0
    excluded: int = 0
    threshold: float = 0.05
    absolute: bool = False
    spread_lower: float | None = None
    significant: bool | None = None
    significant_by: str | None = None  # what settled it when the spread could not (a confident change)

    @model_serializer(mode="wrap")
    def _sparse(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        if out.get("significant_by", 0) is None:
            del out["significant_by"]
        return out


class LeakJudgement(_Model):
    """The run's last leak judgement of one memory source (``soakd.analysis.leak.LeakResult``)."""

    source: str
    status: str = "no_data"
    growth_per_hour: float | None = None  # bytes/h, or ratio/h for kv_cache and kv_residue
    ci: tuple[float | None, float | None] | None = None  # a bound off the list of slopes is infinite: null in JSON
    significant: bool = False
    projected: float | None = None
    budget: float = 0.0
    suspected: bool = False
    n_windows: int = 0
    unit: str = "bytes"
    horizon_hours: float = 24.0
    first: float | None = None
    last: float | None = None
    residue: float | None = None
    pattern: str | None = None
    hours_to_exhaustion: float | None = None
    fails: bool = False
    points: str = "windows"
    sustained_from_hours: float | None = None
    steps: int = 0
    steps_bytes: float | None = None
    last_step_hours: float | None = None
    last_step_window: int | None = None
    steps_ongoing: bool | None = None
    kv_flat: bool | None = None


class AbComparison(_Model):
    """One candidate target against the reference over the run, for one metric (``soakd.analysis.ab``)."""

    target: str
    reference: str
    metric: str
    window: int | None = None
    ratio: float
    ci: tuple[float | None, float | None]
    tier: str | None = None
    direction: str = "same"
    threshold: float = 0.05
    windows: int = 0
    value: float | None = None
    reference_value: float | None = None


class TargetVerdict(_Model):
    """One other target of an A/B run, judged against its own baseline."""

    name: str
    result: Result = "PASS"
    reasons: list[str] = Field(default_factory=list)
    failing: list[Finding] = Field(default_factory=list)


class RunVerdict(_Model):
    """PASS, FAIL or INCONCLUSIVE (INCOMPLETE: no verdict was stored, the run has not finished)."""

    schema_version: int = VERDICT_SCHEMA_VERSION
    result: Result = "PASS"
    passed: bool | None = True
    reasons: list[str] = Field(default_factory=list)
    inconclusive: str | None = None
    not_judged: list[NotJudged] = Field(default_factory=list)
    judged: Judged | None = None
    failing: list[Finding] = Field(default_factory=list)  # the findings that failed the run, in reason order
    interim: bool = False  # a stop that leaves the run resumable: the verdict so far
    findings: dict[str, int] = Field(default_factory=dict)  # "kind/severity" -> count
    stability: dict[str, Stability] = Field(default_factory=dict)
    recurring_drops: dict[str, Any] = Field(default_factory=dict)
    drift: dict[str, Any] = Field(default_factory=dict)  # the end-of-run judgement (soakd.analysis.changes.RunDrift)
    leaks: list[LeakJudgement] = Field(default_factory=list)
    periodic: dict[str, Any] | None = None
    ab: list[AbComparison] | None = None  # A/B runs: each candidate against the reference over the run
    targets: dict[str, TargetVerdict] | None = None  # A/B runs: each other target's own verdict
    # what the verdict says although it does not fail the run: a leak page withdrawn by the last judgement
    notes: list[Finding] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        """A verdict an earlier release stored (no ``schema_version``: whoever builds one now passes
        ``VERDICT_SCHEMA_VERSION``): ``result`` from ``passed``; its reasons stay the record."""
        if isinstance(data, dict) and "schema_version" not in data:
            data = {**data, "schema_version": 1}
            if not data.get("result"):
                data["result"] = "PASS" if data.get("passed") else "FAIL"
            if data.get("result") == "FAIL" and data.get("passed") is None:
                data["passed"] = False
        if isinstance(data, dict) and isinstance(data.get("targets"), dict):  # each other target's, by its name
            data = {**data, "targets": {name: {"name": name, **t} if isinstance(t, dict) else t
                                        for name, t in data["targets"].items()}}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def exit_code(self) -> int:
        if self.interim and self.result != "INCOMPLETE":
            return 0
        if self.result == "INCONCLUSIVE" and any(c.cause == "nothing_measured" for c in self.not_judged):
            return 1
        return EXIT_CODES[self.result]

    @model_serializer(mode="wrap")
    def _sparse(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("ab", "targets"):  # A/B runs only
            if out.get(key, 0) is None:
                del out[key]
        if out.get("notes", 0) == []:  # verdicts without notes keep their shape
            del out["notes"]
        return out

    @classmethod
    def load(cls, data: Any) -> RunVerdict:
        return data if isinstance(data, cls) else cls.model_validate(data)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    # ---- the findings it rests on
    def failing_for(self, f: Finding) -> Finding | None:
        """The verdict's failing finding that ``f`` (a finding as stored; another target's carries
        ``target`` in its evidence) is, or None."""
        def key(g: Finding) -> tuple[Any, ...]:
            return (g.kind, g.diagnosis, g.window, g.evidence.get("target"),
                    g.evidence.get("source") if g.kind == "leak" else None)

        k = key(f)
        return next((g for g in self.failing if key(g) == k), None)

    def fails(self, f: Finding) -> bool:
        """Whether ``f`` is one the verdict failed the run on."""
        if self.schema_version < 2:  # an earlier release's verdict: its reasons name the findings
            reason = failing_reason(f.kind, f.diagnosis, f.window)
            return reason in self.reasons or f"[{f.evidence.get('target')}] {reason}" in self.reasons
        return self.failing_for(f) is not None

    def why(self, f: Finding) -> str | None:
        """The verdict's reason line for ``f`` when it failed the run, else None."""
        if self.schema_version < 2:
            if not self.fails(f):
                return None
            reason = failing_reason(f.kind, f.diagnosis, f.window)
            return reason if reason in self.reasons else f"[{f.evidence.get('target')}] {reason}"
        g = self.failing_for(f)
        return None if g is None else g.reason

    def scope_lines(self) -> list[str]:
        """What the verdict rests on: the windows not judged, per cause (for INCONCLUSIVE only the partial
        one: its own line names the others), and what was judged."""
        out = [f"not judged: {c.text()}" for c in self.not_judged
               if c.windows and (c.cause == "partial") == (self.result == "INCONCLUSIVE")]
        if self.judged is not None and self.judged.full_windows and self.result != "INCOMPLETE":
            out.append(f"judged: {self.judged.text()}")
        return out

    def cause_lines(self) -> list[str]:
        """Why the verdict is what it is, one line each (the ``soakd_finished`` log line): the findings that
        failed the run (the worst first), or why it is inconclusive; then what it rests on."""
        out: list[str] = []
        if self.result == "FAIL":
            rank = {"critical": 0, "warning": 1, "info": 2}
            out += list(dict.fromkeys(f"{f.severity} · {f.label} · {f.where()}"
                                      for f in sorted(self.failing, key=lambda f: rank.get(f.severity, 3))))
            out += [r for r in self.reasons if not self.failing]
        elif self.result == "INCONCLUSIVE" and self.inconclusive:
            out.append(self.inconclusive)
        elif self.result == "INCOMPLETE":
            out += self.reasons
        out += self.note_lines()
        return out + self.scope_lines()

    def note_lines(self) -> list[str]:
        """What the verdict says although it does not fail the run (a leak page withdrawn), one line each."""
        return [f"{f.severity} · {f.label} · {f.where()} (not failing): {f.message}" for f in self.notes]

    def with_targets(self, others: dict[str, RunVerdict]) -> RunVerdict:
        """This (the reference target's) verdict with each other target's: one FAILs the run."""
        targets: dict[str, TargetVerdict] = {}
        reasons = list(self.reasons)
        failing = list(self.failing)
        for name, v in others.items():
            mine = [f.model_copy(update={"evidence": {**f.evidence, "target": name},
                                         "why": f"[{name}] {f.why or f.reason}"}) for f in v.failing]
            targets[name] = TargetVerdict(name=name, result=v.result, reasons=list(v.reasons), failing=mine)
            reasons += [f"[{name}] {r}" for r in v.reasons]
            failing += mine
        out = self.model_copy(update={"targets": targets, "reasons": reasons, "failing": failing})
        if reasons:
            out = out.model_copy(update={"result": "FAIL", "passed": False})
        return out
