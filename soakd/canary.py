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
from typing import TYPE_CHECKING, Any

import structlog
from pydantic import BaseModel, ConfigDict, Field

from soakd.client.records import Outcome, RequestRecord
from soakd.durations import Duration

if TYPE_CHECKING:
    from soakd.client.openai import OpenAIClient

log = structlog.get_logger("soakd.canary")

DEFAULT_PROMPT = (
    "List the first twelve prime numbers, separated by commas, and then name the planet "
    "closest to the sun."
)


class CanaryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Send the canary and compare its output across the run.")
    interval: Duration = Field(
        300.0, gt=0, description="How often under load, when not tied to the quiesce probes."
    )
    with_quiesce: bool = Field(
        True,
        description="Send it during quiesce probes (idle server: batch of one, reproducible). "
        "When quiesce probes are off it runs on its interval under load.",
    )
    prompt: str = Field(DEFAULT_PROMPT, min_length=1, description="The fixed prompt.")
    max_tokens: int = Field(32, ge=1, le=4096)
    seed: int = Field(1234, description="Sent as the request seed (servers that honour it).")
    endpoint: str = Field("chat", pattern="^(chat|completions)$")


@dataclass
class CanaryResult:
    ok: bool
    match: bool | None  # None: no reference yet or the request failed
    digest: str | None
    reference: str | None
    text: str
    error: str = ""
    idle: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class Canary:
    def __init__(self, config: CanaryConfig, client: "OpenAIClient", model: str,
                 reference: str | None = None) -> None:
        self.config = config
        self.client = client
        self.model = model
        self.reference = reference  # restored from the store on resume
        self.reference_text = ""
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
            self.reference_text = rec.text
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
                "t": time.time(), "match": self.last.match, "digest": self.last.digest, "error": self.last.error or None,
            },
        }
