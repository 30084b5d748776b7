"""The embedded simulated inference server: a vLLM-like OpenAI-compatible API with
vLLM's ``/metrics``, a latency/KV-cache model, simulated GPU(s) driven by the load
(``/dcgm/metrics``, and ``fake_pynvml.bind(device)`` for NVML) and injectable faults
(``soakd sim``)."""

from soakd.config.sim import SimConfig, SimDeviceConfig, SimFaults
from soakd.sim.cli import add_sim_arguments, sim_config_from_args
from soakd.sim.device import GpuReading, SimDevice
from soakd.sim.model import SimModel
from soakd.sim.server import SIM_STATE, SimServer, build_app, serve_forever
from soakd.sim.text import count_chat_tokens, count_tokens

__all__ = [
    "SIM_STATE",
    "GpuReading",
    "SimConfig",
    "SimDevice",
    "SimDeviceConfig",
    "SimFaults",
    "SimModel",
    "SimServer",
    "add_sim_arguments",
    "build_app",
    "count_chat_tokens",
    "count_tokens",
    "serve_forever",
    "sim_config_from_args",
]
