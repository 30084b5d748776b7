"""Host sampler: soakd's own footprint (it must be flat before it can accuse anyone of leaking)
and the target's process when it shares soakd's PID namespace (a pod with shareProcessNamespace,
or the same host)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

from soakd.config import HostSamplerConfig
from soakd.core.series import Series, series
from soakd.samplers.base import SamplerUnavailable

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_stat(pid: int | str, proc: str = "/proc") -> tuple[float, int]:
    """(cpu seconds user+system, resident bytes) from /proc/<pid>/stat."""
    with open(f"{proc}/{pid}/stat", "rb") as fh:
        data = fh.read().decode("utf-8", "replace")
    # the command name may contain spaces and parentheses: split after the last ')'
    fields = data[data.rindex(")") + 2:].split()
    utime, stime = int(fields[11]), int(fields[12])
    rss_pages = int(fields[21])
    return (utime + stime) / _TICKS, rss_pages * _PAGE


def read_anon_swap(pid: int | str, proc: str = "/proc") -> int | None:
    """Anonymous resident memory plus swap of a process, in bytes (/proc/<pid>/status RssAnon + VmSwap):
    what a heap leak grows, also once the kernel swaps it out (RSS alone then falls). None where the
    kernel does not report RssAnon (before 4.5)."""
    anon = swap = None
    with open(f"{proc}/{pid}/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith(b"VmSwap:"):
                swap = int(line.split()[1]) * 1024
    return None if anon is None else anon + (swap or 0)


def find_pids(name: str, proc: str = "/proc", exclude: int | None = None) -> set[int]:
    """PIDs whose command line contains ``name``, ignoring case (vLLM's engine core renames itself
    ``VLLM::EngineCore``)."""
    name = name.lower()
    out: set[int] = set()
    for entry in os.listdir(proc):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            with open(f"{proc}/{entry}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if name in cmd.lower():
            out.add(int(entry))
    return out


class HostSampler:
    name = "host"

    def __init__(self, config: HostSamplerConfig, proc: str = "/proc") -> None:
        self.config = config
        self.proc = proc
        self.self_pid = os.getpid()
        self._target_missing_logged = False
        # load.workers > 1: soakd's load worker processes, whose CPU and memory are soakd's too (the runtime sets it)
        self.worker_pids: Callable[[], list[int]] = list
        self._worker_cpu: dict[int, float] = {}  # the last CPU seen of each worker (a counter never goes down)

    def target_pids(self) -> set[int]:
        c = self.config
        if c.target_pid is not None:
            return {c.target_pid} if os.path.exists(f"{self.proc}/{c.target_pid}") else set()
        if c.target_process_name:  # never soakd itself, nor its load workers
            return find_pids(c.target_process_name, self.proc, exclude=self.self_pid) - set(self.worker_pids())
        return set()

    def _sample(self) -> list[Series]:
        if not os.path.isdir(f"{self.proc}/{self.self_pid}"):
            raise SamplerUnavailable(f"{self.proc} is not available on this system")
        cpu, rss = read_stat(self.self_pid, self.proc)
        for pid in self.worker_pids():
            try:
                w_cpu, w_rss = read_stat(pid, self.proc)
            except (OSError, ValueError):
                continue
            self._worker_cpu[pid] = w_cpu
            rss += w_rss
        cpu += sum(self._worker_cpu.values())
        out = [
            series("soakd_self_resident_memory_bytes", rss),
            series("soakd_self_cpu_seconds_total", cpu),
        ]
        try:
            out.append(series("soakd_self_open_fds", len(os.listdir(f"{self.proc}/{self.self_pid}/fd"))))
        except OSError:
            pass
        pids = self.target_pids()
        if pids:
            t_cpu = t_rss = 0.0
            t_anon: float | None = 0.0
            seen = 0
            for pid in pids:
                try:
                    c, r = read_stat(pid, self.proc)
                except (OSError, ValueError):
                    continue
                try:
                    a = read_anon_swap(pid, self.proc)
                except (OSError, ValueError, IndexError):
                    a = None
                t_cpu += c
                t_rss += r
                t_anon = None if a is None or t_anon is None else t_anon + a
                seen += 1
            if seen:
                out.append(series("soakd_target_resident_memory_bytes", t_rss))
                out.append(series("soakd_target_cpu_seconds_total", t_cpu))
                if t_anon is not None:
                    out.append(series("soakd_target_anon_memory_bytes", t_anon))
        return out

    async def sample(self) -> Sequence[Series]:
        return await asyncio.to_thread(self._sample)

    async def aclose(self) -> None:
        return None
