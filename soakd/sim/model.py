"""The simulator's engine state: admission, KV-cache blocks, latency model, faults, metrics.

Everything here is synchronous and cheap except :meth:`SimModel.admit`, which awaits a
running slot. Time for the drift model comes from an injectable ``clock`` (``time.monotonic``
by default), so the state machine can be tested without sleeping.

Engine model
------------
* A request is *waiting* until a running slot is free (``max_batch``) and the KV cache has
  room for its prompt; admission is first-come first-served (head-of-line blocking, like
  vLLM's FCFS scheduler). A request is always admitted when nothing is running, so a full
  (e.g. leaked) cache slows the server down instead of deadlocking it.
* A running request holds ``ceil((prompt + generated) / kv_block_size)`` blocks. When
  decoding grows the cache past its capacity the request is counted once in
  ``vllm:num_preemptions_total`` (the simulator does not actually re-schedule it);
  ``vllm:kv_cache_usage_perc`` is clamped to 1.
* Prefix caching (``prefix_caching``, on by default as in vLLM V1): a prompt's leading full blocks that an
  earlier prompt had are not prefilled again (:mod:`soakd.sim.prefix`); the cache keeps
  ``prefix_cache_blocks``, fewer from ``faults.prefix_cache_shrink_at`` on (eviction under fragmentation).
* Leaked blocks (fault ``kv_leak_*``) stay held until the state is replaced (restart).
* While the KV cache is saturated and stuck (fault ``kv_saturate_*``) ``vllm:kv_cache_usage_perc`` reads
  1, no request is admitted and none gets a token (:meth:`SimModel.frozen_until`); the running ones
  keep their slots. When it ends, tokens flow again and finishing requests admit the waiting ones.
* The running batch is integrated over time (:meth:`SimModel.load_integrals`: request-seconds
  and busy seconds), so the simulated GPU (:mod:`soakd.sim.device`) can average the load
  between two readings exactly; when a device is attached (``model.device``) its slowdown
  (1/clock ratio while throttled) multiplies every latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from soakd.config.sim import SimConfig
from soakd.sim.histograms import (
    DONE,
    REQUEST_LATENCY_BUCKETS,
    RUNNING,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    WAITING,
    Histogram,
    build_1_2_5_buckets,
)
from soakd.sim.prefix import PrefixCache


class Device(Protocol):
    """What the engine reads of the simulated GPU (``soakd.sim.device.SimDevice``)."""

    def slowdown(self) -> float: ...


__all__ = [
    "FINISH_REASONS",
    "FaultPlan",
    "SimModel",
    "SimRequest",
]

FINISH_REASONS = ("stop", "length", "abort")

@dataclass(slots=True)
class FaultPlan:
    """The faults drawn for one request. Token indexes are 0-based output positions."""

    status: int | None = None  # 500 or 429: answered at once with an error
    stall_at: int | None = None  # the stream pauses before emitting this token
    truncate_at: int | None = None  # the connection is aborted before this token
    malformed_at: int | None = None  # this token's chunk is not valid JSON
    garbled: bool = False
    empty: bool = False


class SimRequest:
    """One request's engine-side state."""

    __slots__ = (
        "blocks",
        "cached_tokens",
        "generated",
        "id",
        "max_tokens",
        "preempted",
        "prompt_tokens",
        "queued_ahead",
        "state",
        "t_admitted",
        "t_arrival",
        "waiter",
    )

    def __init__(self, request_id: str, prompt_tokens: int, max_tokens: int, now: float) -> None:
        self.id = request_id
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.generated = 0
        self.blocks = 0
        self.cached_tokens = 0  # leading prompt tokens found in the prefix cache: not prefilled
        self.state = WAITING
        self.t_arrival = now
        self.t_admitted: float | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.queued_ahead = 0
        self.preempted = False


class SimModel:
    """The engine state machine behind one incarnation of the simulated server."""

    def __init__(self, config: SimConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.started = clock()
        self.started_unix = time.time()  # process_start_time_seconds of this incarnation
        seed = config.seed
        # Separate streams so jitter draws never shift the fault sequence and vice versa.
        self.fault_rng = random.Random(seed)
        self.latency_rng = random.Random(seed * 7919 + 1)
        self.text_rng = random.Random(seed * 7919 + 2)

        self.running = 0
        # (time, request-seconds, busy seconds) up to that time; replaced as one tuple so a
        # reader in another thread (the fake NVML) never sees a half-updated triple
        self._load: tuple[float, float, float] = (self.started, 0.0, 0.0)
        self.device: Device | None = None  # set by the server: its slowdown scales latency
        self.waiting: deque[SimRequest] = deque()
        self.kv_held = 0  # blocks held by running requests + leaked blocks
        self.kv_leaked = 0

        self.requests_finished = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(TOKEN_LATENCY_BUCKETS)
        self.request_tpot = Histogram(TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(config.max_model_len)
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        # the prefix cache of this incarnation (a restart empties it)
        self.prefix_cache = PrefixCache(config.kv_block_size, self._prefix_capacity(full=True))

    # ------------------------------------------------------------------ latency model

    def latency_multiplier(self) -> float:
        """1 + drift_pct/100 * uptime_hours (floored at 0.05), times 1 + step_pct/100 from
        ``latency_step_at`` on (for ``latency_step_duration`` when set), times the attached device's slowdown (1/clock ratio while it is
        throttled). Taken when a request starts."""
        faults = self.config.faults
        pct = faults.latency_drift_pct_per_hour
        multiplier = 1.0
        if pct:
            hours = (self.clock() - self.started) / 3600.0
            multiplier = max(0.05, 1.0 + pct / 100.0 * hours)
        step_at, step_for = faults.latency_step_at, faults.latency_step_duration
        uptime = self.clock() - self.started
        if step_at is not None and uptime >= step_at and (step_for is None or uptime < step_at + step_for):
            multiplier *= 1.0 + faults.latency_step_pct / 100.0
        if self.device is not None:
            multiplier *= self.device.slowdown()
        return multiplier

    def frozen_until(self, t: float, now: float) -> float:
        """``t`` (a time on the caller's clock, whose present is ``now``), moved to the end of the
        engine freeze it falls in (fault ``freeze_every``/``freeze_duration``, server uptime)."""
        f = self.config.faults
        if not f.freeze_every and f.kv_saturate_at is None:
            return t
        offset = (self.clock() - self.started) - now  # uptime = t + offset
        u = t + offset
        if f.kv_saturate_at is not None and f.kv_saturate_at <= u < f.kv_saturate_at + f.kv_saturate_duration:
            return f.kv_saturate_at + f.kv_saturate_duration - offset  # the cache is full: no request gets a token
        if not f.freeze_every:
            return t
        k = math.floor(u / f.freeze_every)
        if k >= 1 and u - k * f.freeze_every < f.freeze_duration:
            return k * f.freeze_every + f.freeze_duration - offset
        return t

    def kv_saturated(self) -> bool:
        """Whether the KV cache is saturated and stuck now (fault ``kv_saturate_at``/``kv_saturate_duration``)."""
        f = self.config.faults
        if f.kv_saturate_at is None:
            return False
        u = self.clock() - self.started
        return f.kv_saturate_at <= u < f.kv_saturate_at + f.kv_saturate_duration

    def output_changed(self) -> bool:
        """Whether deterministic outputs are answered from their changed offset now
        (fault ``output_change_at``, server uptime)."""
        at = self.config.faults.output_change_at
        return at is not None and self.clock() - self.started >= at

    # ------------------------------------------------------------------ load integrals

    def _account(self) -> None:
        """Close the load integrals at now (call before ``running`` changes)."""
        now = self.clock()
        t, request_seconds, busy_seconds = self._load
        dt = now - t
        if dt > 0:
            running = self.running
            self._load = (
                now,
                request_seconds + running * dt,
                busy_seconds + (dt if running else 0.0),
            )

    def load_integrals(self, now: float) -> tuple[float, float]:
        """(request-seconds, busy seconds) since this incarnation started, up to *now*: the
        integral of the running batch and the time anything was running. Read-only, safe
        to call from another thread."""
        t, request_seconds, busy_seconds = self._load
        running = self.running
        dt = max(0.0, now - t)
        return request_seconds + running * dt, busy_seconds + (dt if running else 0.0)

    def noise(self) -> float:
        """A multiplicative noise factor (1.0 when jitter is 0)."""
        jitter = self.config.jitter
        if not jitter:
            return 1.0
        return max(0.0, 1.0 + jitter * self.latency_rng.gauss(0.0, 1.0))

    def prefill_seconds(self, prompt_tokens: int, queued_ahead: int, multiplier: float) -> float:
        """Time from admission to the first token."""
        cfg = self.config
        base = (
            cfg.ttft_base
            + cfg.ttft_per_prompt_token * prompt_tokens
            + cfg.ttft_per_queued * queued_ahead
        )
        if base <= 0:
            return 0.0
        return base * multiplier * self.noise()

    def tpot_seconds(self, multiplier: float) -> float:
        """Time for the next output token, given the current batch."""
        cfg = self.config
        base = cfg.tpot_base + cfg.tpot_per_batch * (self.running - 1 if self.running > 1 else 0)
        if base <= 0:
            return 0.0
        if cfg.jitter:
            return base * multiplier * self.noise()
        return base * multiplier

    # ------------------------------------------------------------------ faults

    def plan_faults(self, max_tokens: int) -> FaultPlan:
        """Draw this request's faults. Always consumes the same number of RNG draws."""
        f = self.config.faults
        rng = self.fault_rng
        draws = [rng.random() for _ in range(7)]
        positions = [rng.randrange(max(1, max_tokens)) for _ in range(3)]
        plan = FaultPlan()
        if draws[0] < f.error_rate_500:
            plan.status = 500
            return plan
        if draws[1] < f.error_rate_429:
            plan.status = 429
            return plan
        # Mid-stream positions: after the first token whenever there is more than one.
        mid = [p if max_tokens < 2 else 1 + p % (max_tokens - 1) for p in positions]
        if draws[2] < f.stall_rate:
            plan.stall_at = mid[0]
        if draws[3] < f.truncate_rate:
            plan.truncate_at = mid[1]
        if draws[4] < f.malformed_rate:
            plan.malformed_at = mid[2]
        plan.garbled = draws[5] < f.garbled_rate
        plan.empty = draws[6] < f.empty_rate
        return plan

    # ------------------------------------------------------------------ KV cache

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.kv_block_size)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (1 while the cache is saturated and stuck)."""
        if self.kv_saturated():
            return 1.0
        return min(1.0, self.kv_held / self.config.kv_blocks_total)

    def grow(self, req: SimRequest, generated: int) -> None:
        """Record that *req* has produced *generated* tokens in total."""
        delta = generated - req.generated
        if delta <= 0 or req.state != RUNNING:
            return
        req.generated = generated
        self.generation_tokens_total += delta
        blocks = -(-(req.prompt_tokens + generated) // self.config.kv_block_size)
        if blocks > req.blocks:
            self.kv_held += blocks - req.blocks
            req.blocks = blocks
            if not req.preempted and self.kv_held > self.config.kv_blocks_total:
                req.preempted = True
                self.num_preemptions += 1

    # ------------------------------------------------------------------ admission

    def _prefix_capacity(self, full: bool = False) -> int:
        cfg = self.config
        if not cfg.prefix_caching:
            return 0
        blocks = cfg.kv_blocks_total if cfg.prefix_cache_blocks is None else cfg.prefix_cache_blocks
        at = cfg.faults.prefix_cache_shrink_at
        if not full and at is not None and self.clock() - self.started >= at:
            return int(blocks * cfg.faults.prefix_cache_shrink_ratio)
        return blocks

    def new_request(self, request_id: str, prompt_tokens: int, max_tokens: int, prompt_text: str = "") -> SimRequest:
        """A request arriving; with prefix caching on, its prompt is looked up in (and added to) the cache."""
        req = SimRequest(request_id, prompt_tokens, max_tokens, self.clock())
        req.queued_ahead = len(self.waiting)
        if self.config.prefix_caching:
            cache = self.prefix_cache
            capacity = self._prefix_capacity()
            if capacity != cache.capacity:
                cache.resize(capacity)
            req.cached_tokens = cache.lookup(prompt_text, prompt_tokens)
        return req

    def _fits(self, req: SimRequest) -> bool:
        if self.running >= self.config.max_batch:
            return False
        if self.running == 0:
            return True  # (while saturated too: the freeze holds it, and nothing would wake a queue later)
        if self.kv_saturated():
            return False  # no free block: admission stuck
        return self.kv_held + self.blocks_for(req.prompt_tokens) <= self.config.kv_blocks_total

    def _start(self, req: SimRequest) -> None:
        req.state = RUNNING
        req.t_admitted = self.clock()
        self._account()
        self.running += 1
        req.blocks = self.blocks_for(req.prompt_tokens)
        self.kv_held += req.blocks
        self.prompt_tokens_total += req.prompt_tokens

    def try_admit(self, req: SimRequest) -> bool:
        """Admit *req* now if it may run (no queue ahead of it and room); no waiting."""
        if req.state == WAITING and not self.waiting and self._fits(req):
            self._start(req)
            return True
        return req.state == RUNNING

    async def admit(self, req: SimRequest) -> None:
        """Wait for a running slot (FIFO). On cancellation call :meth:`finish` anyway."""
        if self.try_admit(req):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        req.waiter = fut
        self.waiting.append(req)
        await fut

    def _pump(self) -> None:
        waiting = self.waiting
        while waiting and self._fits(waiting[0]):
            req = waiting.popleft()
            if req.waiter is not None and req.waiter.done():  # cancelled while waiting
                continue
            self._start(req)
            if req.waiter is not None:
                req.waiter.set_result(None)

    def finish(
        self,
        req: SimRequest,
        reason: str,
        *,
        ttft: float | None = None,
        e2e: float | None = None,
    ) -> None:
        """Release *req* (any state; idempotent) and record it as finished with *reason*."""
        if req.state == DONE:
            return
        was_running = req.state == RUNNING
        if req.state == WAITING:
            with contextlib.suppress(ValueError):  # already popped by _pump
                self.waiting.remove(req)
        req.state = DONE
        if not was_running:
            return
        self._account()
        self.running -= 1
        self.kv_held -= req.blocks
        req.blocks = 0
        self.requests_finished += 1
        self.request_success[reason] = self.request_success.get(reason, 0) + 1
        faults = self.config.faults
        if (
            faults.kv_leak_blocks_per_n_requests
            and self.requests_finished % faults.kv_leak_every_n_requests == 0
        ):
            self.kv_leaked += faults.kv_leak_blocks_per_n_requests
            self.kv_held += faults.kv_leak_blocks_per_n_requests
        if reason != "abort":
            now = self.clock()
            admitted = req.t_admitted if req.t_admitted is not None else now
            self.queue_time.observe(max(0.0, admitted - req.t_arrival))
            if ttft is not None:
                self.ttft.observe(ttft)
            if e2e is not None:
                self.e2e.observe(e2e)
                if ttft is not None and req.generated > 1:
                    self.request_tpot.observe((e2e - ttft) / (req.generated - 1))
            self.request_prompt_tokens.observe(req.prompt_tokens)
            self.request_generation_tokens.observe(req.generated)
        self._pump()

    def abort_all(self) -> None:
        """Fail every waiting request (used when the server goes down)."""
        while self.waiting:
            req = self.waiting.popleft()
            req.state = DONE
            if req.waiter is not None and not req.waiter.done():
                req.waiter.cancel()


