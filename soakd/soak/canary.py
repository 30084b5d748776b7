"""The output-consistency canary: a fixed prompt at temperature 0 (with a ``seed``), its output
hashed; the hash must stay the same for the whole run. A change is an event: silent numerical
changes are exactly what a new chip, driver or kernel can introduce.

Greedy decoding is reproducible only at a fixed batch composition (floating-point reductions
differ with the batch; vLLM documents this), so by default the canary runs inside the quiesce
probes, on an idle server, where it is the only request. Without quiesce probes it runs on its own
interval under load, where a mismatch may also mean "batch-variant kernels" — the event says which.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from soakd.analysis.engine import Analyzer
from soakd.client.openai import OpenAIClient
from soakd.config.analysis import CanaryConfig
from soakd.core.records import Outcome, RequestRecord
from soakd.soak.events import EventLog

log = structlog.get_logger("soakd.canary")


@dataclass
class CanaryResult:
    ok: bool
    match: bool | None  # None: no reference yet or the request failed
    digest: str | None
    reference: str | None
    text: str
    error: str = ""
    idle: bool = False
    t_unix: float = field(default_factory=time.time)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class Canary:
    def __init__(self, config: CanaryConfig, client: OpenAIClient, model: str,
                 reference: str | None = None) -> None:
        self.config = config
        self.client = client
        self.model = model
        self.reference = reference  # restored from the store on resume
        self.checks = 0
        self.mismatches = 0
        self.errors = 0
        self.last: CanaryResult | None = None

    def body(self) -> dict[str, Any]:
        c = self.config
        body: dict[str, Any] = {"model": self.model, "max_tokens": c.max_tokens, "temperature": 0, "seed": c.seed}
        if c.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": c.prompt}]
        else:
            body["prompt"] = c.prompt
        return body

    async def check(self, idle: bool = False) -> CanaryResult:
        rec = RequestRecord("canary", self.config.endpoint, stream=False)
        await self.client.execute(rec, self.body())
        self.checks += 1
        if rec.outcome is not Outcome.OK:
            self.errors += 1
            res = CanaryResult(False, None, None, self.reference, rec.text,
                               error=f"{rec.outcome.value}/{rec.reason} {rec.error}".strip(), idle=idle)
            self.last = res
            return res
        d = digest(rec.text)
        if self.reference is None:
            self.reference = d
            log.info("canary_reference", digest=d, idle=idle, text=rec.text[:200])
            res = CanaryResult(True, None, d, d, rec.text, idle=idle)
        else:
            match = d == self.reference
            if not match:
                self.mismatches += 1
            res = CanaryResult(True, match, d, self.reference, rec.text, idle=idle)
        self.last = res
        return res

    def status(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "checks": self.checks,
            "mismatches": self.mismatches,
            "errors": self.errors,
            "last": None if self.last is None else {
                "t": self.last.t_unix, "match": self.last.match, "digest": self.last.digest, "error": self.last.error or None,
            },
        }


class CanaryRunner:
    """Runs the canary (inside a quiesce probe, or on its own interval under load) and hands
    each result to the analysis; the first output becomes the run's stored reference."""

    def __init__(self, canary: Canary, analyzer: Analyzer, events: EventLog) -> None:
        self.canary = canary
        self.analyzer = analyzer
        self.events = events

    async def check(self, idle: bool, window: int | None) -> None:
        had_reference = self.canary.reference is not None
        res = await self.canary.check(idle=idle)
        if res.ok and not had_reference and res.digest:
            self.events.emit("canary_reference", "info", f"canary reference output {res.digest}",
                             {"digest": res.digest, "text": res.text[:500], "idle": idle}, window)
        elif not res.ok:
            log.warning("canary_failed", error=res.error, idle=idle)
        self.analyzer.add_canary(res, window)

    async def under_load(self, window: int) -> None:
        """The interval job (when not tied to quiesce probes)."""
        await self.check(idle=False, window=window)
        await self.events.flush()

    def status(self) -> dict[str, Any]:
        return self.canary.status()
