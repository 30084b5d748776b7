"""The one configuration of soakd: models (``model``, ``analysis``, ``sim``) and loading them
(``loading``: YAML file < environment ``SOAKD_*`` < command-line flags).

This package imports nothing of soakd but ``soakd.core``: every other part takes its section of
the configuration from here, never the other way round.
"""

from soakd.config.analysis import (
    AnalysisConfig,
    CanaryConfig,
    ClientConfig,
    DiagnosisConfig,
    DriftConfig,
    LeakConfig,
    QuiesceConfig,
    ThrottleConfig,
    VerdictConfig,
)
from soakd.config.loading import ENV_PREFIX, deep_merge, env_overrides, format_validation_error, load_config, read_yaml
from soakd.config.model import (
    BUILTIN_SCENARIOS,
    ConfigError,
    DcgmSamplerConfig,
    HostSamplerConfig,
    LoadConfig,
    LogConfig,
    MetricsConfig,
    NvmlSamplerConfig,
    RunConfig,
    RunPolicies,
    SamplersConfig,
    ScenarioConfig,
    ServerSamplerConfig,
    SloConfig,
    SoakConfig,
    SourceConfig,
    SweepConfig,
    TargetConfig,
    Timeouts,
    Validation,
)
from soakd.config.sim import SimConfig, SimDeviceConfig, SimFaults

__all__ = [
    "BUILTIN_SCENARIOS",
    "ENV_PREFIX",
    "AnalysisConfig",
    "CanaryConfig",
    "ClientConfig",
    "ConfigError",
    "DcgmSamplerConfig",
    "DiagnosisConfig",
    "DriftConfig",
    "HostSamplerConfig",
    "LeakConfig",
    "LoadConfig",
    "LogConfig",
    "MetricsConfig",
    "NvmlSamplerConfig",
    "QuiesceConfig",
    "RunConfig",
    "RunPolicies",
    "SamplersConfig",
    "ScenarioConfig",
    "ServerSamplerConfig",
    "SimConfig",
    "SimDeviceConfig",
    "SimFaults",
    "SloConfig",
    "SoakConfig",
    "SourceConfig",
    "SweepConfig",
    "TargetConfig",
    "ThrottleConfig",
    "Timeouts",
    "Validation",
    "VerdictConfig",
    "deep_merge",
    "env_overrides",
    "format_validation_error",
    "load_config",
    "read_yaml",
]
