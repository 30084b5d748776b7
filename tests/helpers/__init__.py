"""Shared helpers of the tests: a simulator on 127.0.0.1 port 0, free ports, and
``python -m soakd`` subprocesses driven from the test's own event loop (so an in-process
simulator keeps serving while the CLI talks to it).

Everything is loopback only and bounded in count and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from soakd.sim import SimConfig, SimServer

REPO = Path(__file__).resolve().parents[2]

# A simulator with no modelled latency: requests finish as fast as the loop allows.
FAST_SIM: dict[str, Any] = {"ttft_base": 0, "tpot_base": 0, "tpot_per_batch": 0, "ttft_per_prompt_token": 0}
# A simulator that is quick but still streams over time (1 ms per token), so soaks stay light on CPU.
QUICK_SIM: dict[str, Any] = {
    "ttft_base": 0.005,
    "tpot_base": 0.002,
    "tpot_per_batch": 0,
    "ttft_per_prompt_token": 0,
}


class LoopLag:
    """How long this process's event loop was held up while the block ran: ``stalled`` is the sum of the lateness
    of a 2 ms timer beyond 1 ms (a descheduled process or a blocked loop), an upper bound on how much later than
    its schedule any single time read inside the block can be."""

    PERIOD = 0.002

    def __init__(self) -> None:
        self.stalled = 0.0
        self._task: asyncio.Task[None] | None = None
        self._tick = 0.0  # when the timer in progress was set

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._tick = t = loop.time()
            await asyncio.sleep(self.PERIOD)
            self.stalled += max(0.0, loop.time() - t - self.PERIOD - 0.001)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._watch())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        # the stall that delayed the block's last read may have ended with the block, before the timer's wake-up
        # ran (a readable socket's callback runs first): count the timer in progress as far as it is late now
        self.stalled += max(0.0, asyncio.get_running_loop().time() - self._tick - self.PERIOD - 0.001)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def free_port() -> int:
    """A loopback port that was free a moment ago (for 'the target is not up yet')."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """``async with serving(app) as port`` — a hand-written aiohttp application on a free loopback port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


@asynccontextmanager
async def sim_server(**overrides: Any) -> AsyncIterator[SimServer]:
    """``async with sim_server(ttft_base=0.05) as sim`` — the embedded simulator on a free port."""
    overrides.setdefault("port", 0)
    overrides.setdefault("host", "127.0.0.1")
    async with SimServer(SimConfig(**overrides)) as sim:
        yield sim


def soakd_env(**extra: str) -> dict[str, str]:
    """The test process environment without any SOAKD_* variable (they would leak into the CLI)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOAKD_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


async def run_soakd(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 30.0
) -> tuple[int, str, str]:
    """Run ``python -m soakd ARGS`` to completion without blocking the loop; (rc, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "soakd", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env if env is not None else soakd_env(), cwd=str(cwd) if cwd else str(REPO),
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        raise AssertionError(
            f"soakd {' '.join(args)} did not finish in {timeout}s\nstdout:\n{out.decode()[-3000:]}\n"
            f"stderr:\n{err.decode()[-3000:]}"
        ) from None
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class SoakdProcess:
    """A ``python -m soakd`` child whose stdout is read line by line while it runs."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.stderr = ""

    @classmethod
    async def start(cls, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> SoakdProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "soakd", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=env if env is not None else soakd_env(), cwd=str(cwd) if cwd else str(REPO),
        )  # fmt: skip
        return cls(proc)

    async def wait_for_line(self, needle: str, timeout: float = 20.0) -> str:
        """Read stdout until a line containing ``needle``; returns it (fails with the output so far)."""
        assert self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), left)
            except TimeoutError:
                break
            if not raw:
                break
            line = raw.decode(errors="replace")
            self.lines.append(line)
            if needle in line:
                return line
        await self.kill()
        raise AssertionError(f"no line with {needle!r} within {timeout}s; output:\n{self.output()[-4000:]}\n"
                             f"stderr:\n{self.stderr[-3000:]}")

    async def json_event(self, event: str, timeout: float = 20.0) -> dict[str, Any]:
        """The next JSON log line whose ``event`` is ``event``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            line = await self.wait_for_line(f'"{event}"', max(0.1, deadline - loop.time()))
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("event") == event:
                return obj

    def drain(self) -> list[asyncio.Task[None]]:
        """Keep reading stdout and stderr into ``lines`` (tasks that end at EOF), so that a full pipe never
        blocks a child the test does not read line by line."""
        async def read(stream: asyncio.StreamReader | None) -> None:
            assert stream is not None
            while raw := await stream.readline():
                self.lines.append(raw.decode(errors="replace"))

        return [asyncio.create_task(read(self.proc.stdout)), asyncio.create_task(read(self.proc.stderr))]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    async def finish(self, timeout: float = 30.0) -> int:
        """Wait for exit (killing it after ``timeout``), collecting the rest of stdout and stderr."""
        try:
            out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        except TimeoutError:
            await self.kill()
            raise AssertionError(f"soakd did not exit within {timeout}s; output:\n{self.output()[-4000:]}") from None
        self.lines.extend(out.decode(errors="replace").splitlines(keepends=True))
        self.stderr += err.decode(errors="replace")
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            out, err = await self.proc.communicate()
            self.lines.extend(out.decode(errors="replace").splitlines(keepends=True))
            self.stderr += err.decode(errors="replace")

    def output(self) -> str:
        return "".join(self.lines)


async def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url) as resp:
            return resp.status, await resp.text()


async def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> None:
    """Poll a (sync) predicate until true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: Any, log: Path, timeout: float = 30.0) -> None:
    """Poll ``url`` (a server's readiness endpoint, e.g. Prometheus' /-/ready) until it answers 200; fail with
    the server's log when ``proc`` (a ``subprocess.Popen``) exits or ``timeout`` passes."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        assert proc.poll() is None, f"{proc.args[0]} exited: {log.read_text()[-3000:]}"
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} not ready after {timeout:.0f}s: {log.read_text()[-3000:]}")


def stop_process(proc: Any) -> None:
    """Terminate a ``subprocess.Popen`` server (Prometheus, Alertmanager), killing it after 20 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tool(name: str, how: str) -> str:
    """A program the tests need: the virtualenv's own first (the `test` extra installs some), then
    PATH. Absent, the test fails and says how to install it (``make test`` installs them all): a
    missing tool is a broken set-up, not a reason to skip."""
    import shutil

    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found:
        return found
    raise AssertionError(f"{name} is not installed: {how}")


PROMETHEUS_HINT = "`make test` installs Debian's prometheus package (promtool and the server)"
ALERTMANAGER_HINT = "`make test` installs Debian's prometheus-alertmanager package (amtool and the server)"


def report_of(state_dir: Path, run_id: str | None = None) -> dict[str, Any]:
    """The JSON report of a run (the newest when ``run_id`` is None), built from the store."""
    from soakd.report import build_report
    from soakd.store import StoreReader

    with StoreReader(state_dir) as reader:
        return build_report(reader, run_id).dump()


def run_outcomes(report: dict[str, Any]) -> dict[str, int]:
    """Outcome counts of a report's windows, summed."""
    out: dict[str, int] = {}
    for w in report["windows"]:
        for k, v in w["outcomes"].items():
            out[k] = out.get(k, 0) + v
    return out


async def fill_up(store: Any) -> None:
    """Simulate a full disk under a RunStore: the database may not grow by one more page."""
    pages = (await store._execute("PRAGMA page_count"))[0][0]  # noqa: SLF001
    await store._execute(f"PRAGMA max_page_count = {pages}")  # noqa: SLF001


async def make_room(store: Any) -> None:
    await store._execute("PRAGMA max_page_count = 1073741823")  # noqa: SLF001


def benchmark(name: str) -> Any:
    """A module of ``benchmarks/`` (not a package), imported for tests that run its simulations."""
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
