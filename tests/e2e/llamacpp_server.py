"""llama.cpp's ``llama-server`` as a child process on 127.0.0.1, for the end-to-end tests.

The binary and the tiny model come from tests/e2e/prepare_llamacpp.py (``make e2e-prepare``):
the tests fail, with the command to run, when they are missing — never skip.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import prepare_llamacpp  # noqa: E402


sys.path.insert(0, str(HERE.parent))  # tests/: the shared helpers
from helpers import SoakdProcess, run_soakd, soakd_env  # noqa: E402,F401

# 4 slots of 4096 tokens each: long_context (about 2,100 prompt + 512 output) fits a slot
N_PARALLEL = 4
CTX_TOTAL = 4 * 4096


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepared_paths() -> tuple[Path, Path]:
    """(llama-server, tiny.gguf); AssertionError naming the preparation command when missing."""
    binary, model = prepare_llamacpp.server_binary(), prepare_llamacpp.model_path()
    missing = [str(p) for p in (binary, model) if not p.is_file()]
    if missing:
        raise AssertionError(
            f"llama.cpp e2e assets missing: {', '.join(missing)}. Run `make e2e-prepare` "
            f"(or {sys.executable} tests/e2e/prepare_llamacpp.py); `make test` does it first."
        )
    return binary, model


class LlamaServer:
    """One ``llama-server`` on a fixed loopback port (kept across restarts), its log in a file."""

    def __init__(self, log_dir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.binary, self.model = prepared_paths()
        self.port = port or free_port()
        self.log_dir = log_dir
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.origin + "/v1"

    def args(self) -> list[str]:
        return [
            str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--metrics", "-c", str(CTX_TOTAL), "-np", str(N_PARALLEL), "-t", "1", "-tb", "1",
            "--no-webui", "--alias", "tiny-llama", *self.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        log = open(self.log_dir / f"llama-server-{self.starts}.log", "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # fmt: skip
        log.close()

    def log_text(self, which: int | None = None) -> str:
        path = self.log_dir / f"llama-server-{which or self.starts}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    async def wait_ready(self, timeout: float = 60.0) -> float:
        """Poll /health until 200 (the model is loaded); returns the seconds it took."""
        t0 = time.monotonic()
        last = ""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() - t0 < timeout:
                if self.proc is not None and self.proc.poll() is not None:
                    raise AssertionError(f"llama-server exited {self.proc.returncode} while starting:\n"
                                         f"{self.log_text()[-4000:]}")  # fmt: skip
                try:
                    async with session.get(self.origin + "/health") as resp:
                        if resp.status == 200:
                            return time.monotonic() - t0
                        last = f"HTTP {resp.status}"
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    last = type(exc).__name__
                await asyncio.sleep(0.1)
        raise AssertionError(f"llama-server not ready after {timeout}s ({last}):\n{self.log_text()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop it at once (SIGKILL: a crash, as an OOM kill would)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    async def __aenter__(self) -> LlamaServer:
        self.start()
        try:
            await self.wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


async def scrape(url: str, timeout: float = 5.0) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url) as resp:
            return await resp.text()


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name`` in a Prometheus exposition ('' = no labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, brace, labels = head.partition("{")
        if metric == name:
            out[labels.rstrip("}") if brace else ""] = float(value)
    return out
