"""The simulated server's shared state (model, device, recent requests, faults, key) and the
byte templates of its SSE chunks (vLLM's wire format)."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from soakd.config.sim import SimConfig
from soakd.sim.collector import SimCollector
from soakd.sim.names import NamedCollector
from soakd.sim.device import SimDevice
from soakd.sim.model import SimModel

RECENT_MAXLEN = 10_000
RecentEntry = tuple[str, int, "int | None", int]
"""``(request_id, t_received_ns, t_first_token_ns, t_done_ns)``, all ``perf_counter_ns``."""

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
CHAT_ROLE = (
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
)
CHAT_PRE = b'"delta":{"content":'
CHAT_POST = b'},"logprobs":null,"finish_reason":null}]}\n\n'
CHAT_POST_LAST = b'},"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
CHAT_EMPTY_LAST = b'"delta":{},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n'
CMPL_PRE = b'"text":'
CMPL_POST = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
CMPL_POST_LAST = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'
CMPL_EMPTY_LAST = b'"text":"","logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n'


class SimState:
    """Per-application state: one incarnation of the simulated engine."""

    def __init__(
        self,
        config: SimConfig,
        *,
        recent: deque[RecentEntry] | None = None,
        clock: Callable[[], float] | None = None,
        device: SimDevice | None = None,
    ) -> None:
        self.config = config
        self.model = SimModel(config, clock=clock or time.monotonic)
        # the GPU(s) outlive a simulated restart: SimServer passes its own; alone, one per app
        self.device = device or SimDevice(config, lambda: self.model, clock=clock or time.monotonic)
        self.model.device = self.device
        self.registry = CollectorRegistry(auto_describe=False)
        if config.metric_names == "vllm":
            self.registry.register(SimCollector(lambda: self.model, config.model))
        elif config.metric_names != "none":  # another server's names (soakd.sim.names)
            self.registry.register(NamedCollector(lambda: self.model, config.model, config.metric_names))
        self.recent: deque[RecentEntry] = (
            recent if recent is not None else deque(maxlen=RECENT_MAXLEN)
        )
        self.tasks: set[asyncio.Task[Any]] = set()
        self.api_key = config.api_key.get_secret_value() if config.api_key is not None else None
        self.model_json = json.dumps(config.model).encode()
        self.created = int(time.time())
        self._id_prefix = secrets.token_hex(12)
        self._ids = itertools.count(1)

    def next_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):08x}"


SIM_STATE = web.AppKey("soakd_sim_state", SimState)
