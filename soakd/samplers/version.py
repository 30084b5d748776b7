"""The inference server's version, asked in the background: what a fleet's pods must share to be compared (``soakd_server_info``'s
``version`` label, ``soakd_target_info``'s ``server_version``).

Each server says it at its own path (read from each server's source): vLLM ``GET /version``
(``{"version": "0.11.0"}``; soakd's simulator too), SGLang ``GET /get_server_info`` (``version``), TGI
``GET /info`` (``version``), llama.cpp's llama-server ``GET /props`` (``build_info``). The first JSON
object with a non-empty field wins; a server that says none of them has no version (an empty label).

``VersionAsker`` asks in the background, beside the scrapes rather than inside them: a server that hangs on
``/version`` (or on every path) must not make the sampler's scrape late (its runner's timeout is 0.9 of the
interval). It asks once per scrape until one attempt gives a version or ``ASKS`` attempts have finished
without one (an attempt that failed in any way, or ran out of time, has finished), one attempt in flight at
a time, each bounded by ``LIMIT`` seconds; after a server restart it asks again (an upgrade changes the
version), keeping the version it had until a new one answers. An attempt still in flight across a restart
is the old process's: its answer is dropped, and the new process is asked afresh.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
import structlog

from soakd.samplers.promtext import ScrapeError, fetch

__all__ = ["ASKS", "LIMIT", "VERSION_PATHS", "VersionAsker", "server_version"]

log = structlog.get_logger("soakd.samplers.version")

VERSION_PATHS: tuple[tuple[str, str], ...] = (
    ("/version", "version"),
    ("/get_server_info", "version"),
    ("/info", "version"),
    ("/props", "build_info"),
)
_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
MAX_LENGTH = 64  # a label value, not a document
ASKS = 3  # finished attempts without a version before soakd stops asking (an empty label)
LIMIT = 5.0  # seconds one attempt (every path) may take


async def server_version(session: aiohttp.ClientSession, origin: str) -> str | None:
    """The server at ``origin`` (scheme://host:port)'s version, or None where no path gives one."""
    for path, key in VERSION_PATHS:
        try:
            text, _ = await fetch(session, origin.rstrip("/") + path, timeout=_TIMEOUT, limit=1 << 20)
        except ScrapeError:
            continue
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            continue
        value = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(value, str | int | float) and not isinstance(value, bool) and str(value).strip():
            return str(value).strip()[:MAX_LENGTH]
    return None


class VersionAsker:
    """The server's version, asked in the background (see the module's docstring)."""

    def __init__(self, origin: str | None) -> None:
        self.origin = origin
        self.version: str | None = None
        self.attempts = 0  # finished attempts since the start or the last restart
        self._want = origin is not None
        self._task: asyncio.Task[None] | None = None
        self._generation = 0  # the server process asked (a restart makes a new one)
        self._closed = False

    def poll(self, session: Callable[[], aiohttp.ClientSession]) -> None:
        """Called with each scrape that answered: start an attempt (on ``session()``) if one is wanted and none
        is in flight."""
        if (self._closed or not self._want or self.origin is None
                or (self._task is not None and not self._task.done())):  # fmt: skip
            return
        self._task = asyncio.create_task(self._ask(session(), self.origin, self._generation),
                                         name="soakd-server-version")

    def restarted(self) -> None:
        """The server restarted: ask again (the version it had stays until a new one answers); an attempt in
        flight asked the old process and is cancelled."""
        self._generation += 1
        self._want = self.origin is not None
        self.attempts = 0
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def settled(self) -> None:
        """Wait for the attempt in flight, if any (tests; the sampler never waits)."""
        if self._task is not None:
            await asyncio.wait({self._task})

    async def _ask(self, session: aiohttp.ClientSession, origin: str, generation: int) -> None:
        try:
            async with asyncio.timeout(LIMIT):
                found = await server_version(session, origin)
        except TimeoutError:
            found = None
        except Exception as exc:  # noqa: BLE001 - a closed session, a surprise: this attempt found nothing
            log.debug("server_version_failed", error=f"{type(exc).__name__}: {exc}")
            found = None
        if generation != self._generation:  # the process asked has been replaced since
            return
        self.attempts += 1
        if found is not None:
            if found != self.version:
                log.info("server_version", version=found, previous=self.version)
            self.version, self._want = found, False
        elif self.attempts >= ASKS:
            self._want = False

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
