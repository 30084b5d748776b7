"""Which samplers a configuration asks for. To add a sampler: write its module, add it here,
add its metrics to the catalogue (soakd/metrics.py), and a fixture-based test."""

from __future__ import annotations

from typing import Any

from soakd.config import SoakConfig
from soakd.samplers.base import Sampler


def build_samplers(config: SoakConfig, nvml_module: Any = None) -> list[tuple[Sampler, float]]:
    sc = config.samplers
    out: list[tuple[Sampler, float]] = []
    host = None
    if sc.host.enabled:
        from soakd.samplers.host import HostSampler

        host = HostSampler(sc.host)
        out.append((host, sc.host.interval or sc.interval))
    if sc.nvml.mode != "off":
        from soakd.samplers.nvml import NvmlSampler

        target_pids = host.target_pids if host is not None and (
            sc.host.target_pid or sc.host.target_process_name) else None
        out.append((NvmlSampler(sc.nvml, nvml_module=nvml_module, target_pids=target_pids),
                    sc.nvml.interval or sc.interval))
    if sc.dcgm.url:
        from soakd.samplers.dcgm import DcgmSampler

        out.append((DcgmSampler(sc.dcgm), sc.dcgm.interval or sc.interval))
    if sc.server.url.lower() != "none":
        from soakd.samplers.server import ServerSampler

        out.append((ServerSampler(sc.server, config.target.url), sc.server.interval or sc.interval))
    return out
