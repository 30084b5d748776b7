"""One aiohttp application on soakd's event loop: /metrics, /healthz, /readyz, /status.

/metrics only reads snapshots (no I/O in collect()). /healthz is liveness: the process is up
and its event loop is not stalled (a heartbeat measures scheduling lag). /readyz is readiness:
the configuration is loaded and the target has answered at least once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.registry import CollectorRegistry

STALL_LIMIT = 5.0


class Heartbeat:
    """Measures event-loop lag: a task that should wake every ``period`` seconds (10 ms). Each beat
    goes to ``on_beat(loop time, lag seconds, CPU seconds since the last beat)`` when set (the
    windows' client-health record: ``soakd.soak.windows.WindowSet.add_lag``)."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.last_beat = time.monotonic()
        self.max_lag_recent = 0.0
        self.on_beat: Callable[[float, float, float], None] | None = None
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        decay = 0.9 ** (self.period / 0.5)  # the same decay per second whatever the period
        cpu = time.process_time()
        while True:
            before = loop.time()
            await asyncio.sleep(self.period)
            now = loop.time()
            lag = max(0.0, now - before - self.period)
            # exponential decay so one old stall does not fail liveness forever
            self.max_lag_recent = max(lag, self.max_lag_recent * decay)
            self.last_beat = time.monotonic()
            if self.on_beat is not None:
                c = time.process_time()
                self.on_beat(now, lag, c - cpu)
                cpu = c

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def healthy(self) -> tuple[bool, dict[str, float]]:
        age = time.monotonic() - self.last_beat
        ok = age < STALL_LIMIT + self.period and self.max_lag_recent < STALL_LIMIT
        return ok, {"heartbeat_age_seconds": round(age, 3), "loop_lag_seconds": round(self.max_lag_recent, 4)}


def build_app(
    registry: CollectorRegistry,
    status: Callable[[], dict[str, Any]],
    ready: Callable[[], tuple[bool, str]],
    heartbeat: Heartbeat,
) -> web.Application:
    app = web.Application()
    metrics_handler = make_aiohttp_handler(registry)

    async def healthz(_request: web.Request) -> web.Response:
        ok, info = heartbeat.healthy()
        return web.json_response({"status": "ok" if ok else "stalled", **info}, status=200 if ok else 503)

    async def readyz(_request: web.Request) -> web.Response:
        ok, why = ready()
        return web.json_response({"ready": ok, "reason": why}, status=200 if ok else 503)

    async def status_handler(_request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(status(), indent=2, default=str), content_type="application/json")

    async def index(_request: web.Request) -> web.Response:
        return web.Response(
            text="<html><head><title>soakd</title></head><body><h1>soakd</h1><ul>"
            '<li><a href="/metrics">/metrics</a></li><li><a href="/status">/status</a></li>'
            '<li><a href="/healthz">/healthz</a></li><li><a href="/readyz">/readyz</a></li>'
            "</ul></body></html>",
            content_type="text/html",
        )

    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status_handler)
    app.router.add_get("/", index)
    return app


class WebServer:
    """AppRunner + TCPSite inside soakd's loop; port 0 picks a free port."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            raise
        addresses = self._runner.addresses  # the bound port when port=0
        if addresses:
            self.port = int(addresses[0][1])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
