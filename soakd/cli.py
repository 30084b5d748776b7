"""Command line: ``soakd run | sim | demo | check | report | metrics``.

Exit codes: 0 success, 1 failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from soakd import __version__
from soakd.config import ConfigError, SoakConfig, load_config
from soakd.core.durations import parse_duration

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2


# ---- shared helpers ----------------------------------------------------------------------------


def _run_async(coro: Any) -> Any:
    """asyncio.run on uvloop when it is installed (SOAKD_NO_UVLOOP=1 to use the stdlib loop)."""
    loop_factory = None
    if not os.environ.get("SOAKD_NO_UVLOOP"):
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro)


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, weight = part.partition("=")
        name = name.strip()
        try:
            w = float(weight) if sep else 1.0
        except ValueError:
            raise ConfigError([f"--mix: weight of {name!r} must be a number, got {weight!r} "
                               "(expected e.g. short_chat=4,long_context=1)"]) from None
        mix[name] = w
    if not mix:
        raise ConfigError(["--mix: empty; expected e.g. short_chat=4,long_context=1"])
    return mix


def _dur(flag: str, value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ConfigError([f"{flag}: {exc}"]) from None


def add_run_arguments(p: argparse.ArgumentParser, *, demo: bool = False) -> None:
    if not demo:
        p.add_argument("-c", "--config", type=Path, default=os.environ.get("SOAKD_CONFIG"),
                       help="YAML configuration file (see examples/soak.yaml); env SOAKD_CONFIG")
        p.add_argument("--target", help="OpenAI base URL including /v1, e.g. http://127.0.0.1:8000/v1")
        p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
        p.add_argument("--api-key-env", help="environment variable that holds the API key")
        p.add_argument("--api-key-file", type=Path, help="file whose first line is the API key")
    p.add_argument("--duration", help="soak length: 45s, 30m, 12h (run default 12h)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    g.add_argument("--rate", type=float, help="open loop: requests per second")
    p.add_argument("--arrival", choices=["poisson", "constant"], help="open-loop arrival process")
    p.add_argument("--max-in-flight", type=int, help="open loop: cap on requests in flight")
    p.add_argument("--mix", help="scenario weights, e.g. short_chat=4,long_context=1,batch_burst=1")
    p.add_argument("--window", help="analysis window (default 30m)")
    p.add_argument("--warmup", help="warm-up excluded from statistics (default 2m)")
    p.add_argument("--max-requests", type=int, help="end after this many requests")
    p.add_argument("--grace", help="drain period for in-flight requests at shutdown (default 30s)")
    p.add_argument("--metrics-host", help="listen address for /metrics (default 0.0.0.0)")
    p.add_argument("--metrics-port", type=int, help="listen port for /metrics (default 9400; 0 = any)")
    p.add_argument("--state-dir", type=Path, help="state and report directory (default ./soakd-state)")
    p.add_argument("--seed", type=int, help="seed for prompts, arrivals and the mix")
    p.add_argument("--no-keep-alive", action="store_true", default=None,
                   help="open a new connection per request (servers that drop reused connections)")
    p.add_argument("--server-metrics-url", help="the server's Prometheus /metrics URL, or none "
                   "(default: the target's origin + /metrics)")
    p.add_argument("--dcgm-url", help="dcgm-exporter /metrics URL (GPU telemetry when the GPU is not visible to soakd)")
    p.add_argument("--nvml", choices=["auto", "on", "off"], help="NVML GPU sampler (default auto)")
    p.add_argument("--sample-interval", help="default sampling interval of every sampler (default 5s)")
    p.add_argument("--log-format", choices=["auto", "json", "console"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--progress", dest="progress", action="store_true", default=None, help="live progress line")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no live progress line")
    p.add_argument("--new-run", action="store_true",
                   help="start a fresh run even if the state dir holds an unfinished one (default: resume it)")
    p.add_argument("--baseline", type=Path,
                   help="an earlier run's JSON report whose baseline window this run is compared with")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {}

    def put(path: str, value: Any) -> None:
        if value is None:
            return
        node = o
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value

    put("target.url", getattr(args, "target", None))
    put("target.model", getattr(args, "model", None))
    put("target.api_key_env", getattr(args, "api_key_env", None))
    put("target.api_key_file", str(args.api_key_file) if getattr(args, "api_key_file", None) else None)
    if getattr(args, "no_keep_alive", None):
        put("target.keep_alive", False)
    for flag, path in (("duration", "run.duration"), ("window", "run.window"), ("warmup", "run.warmup"),
                       ("grace", "run.grace")):
        v = getattr(args, flag, None)
        if v is not None:
            put(path, _dur(f"--{flag}", v))
    put("run.max_requests", args.max_requests)
    put("run.seed", args.seed)
    put("run.state_dir", str(args.state_dir) if args.state_dir else None)
    if args.concurrency is not None:
        put("load.concurrency", args.concurrency)
        o.setdefault("load", {})["rate"] = None
    if args.rate is not None:
        put("load.rate", args.rate)
        o.setdefault("load", {})["concurrency"] = None
    put("load.arrival", args.arrival)
    put("load.max_in_flight", args.max_in_flight)
    if args.mix:
        put("load.mix", parse_mix(args.mix))
    put("samplers.server.url", args.server_metrics_url)
    put("samplers.dcgm.url", args.dcgm_url)
    put("samplers.nvml.mode", args.nvml)
    if args.sample_interval is not None:
        put("samplers.interval", _dur("--sample-interval", args.sample_interval))
    put("analysis.baseline", str(args.baseline) if getattr(args, "baseline", None) else None)
    put("metrics.host", args.metrics_host)
    put("metrics.port", args.metrics_port)
    put("log.format", args.log_format)
    put("log.level", args.log_level)
    put("log.progress", args.progress)
    return o


def _print_config(cfg: SoakConfig) -> None:
    sys.stdout.write(yaml.safe_dump(cfg.redacted(), sort_keys=False, default_flow_style=None))


def _config_error(exc: ConfigError) -> int:
    sys.stderr.write(f"soakd: {exc}\n")
    return EXIT_CONFIG


def _install_signals(daemon: Any) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, daemon.request_stop, sig.name)
        except (NotImplementedError, RuntimeError):
            pass


# ---- run ---------------------------------------------------------------------------------------


async def _soak(cfg: SoakConfig, progress: bool | None = None, nvml_module: Any = None, new_run: bool = False,
                record_listeners: tuple[Any, ...] = ()) -> tuple[int, Any]:
    from soakd.runtime import Runtime, StartupError

    runtime = Runtime(cfg, progress=progress, nvml_module=nvml_module, new_run=new_run,
                      record_listeners=record_listeners)
    _install_signals(runtime)
    try:
        outcome = await runtime.run()
    except StartupError as exc:
        sys.stderr.write(f"soakd: {exc}\n")
        return EXIT_FAIL, None
    if outcome.stop_reason == "target_unreachable":
        return EXIT_FAIL, outcome
    if outcome.graceful_stop:
        return EXIT_OK, outcome  # a graceful stop; the run stays resumable and its verdict is interim
    if outcome.requests_measured <= 0 and not outcome.windows:
        return EXIT_FAIL, outcome
    verdict = outcome.verdict or {}
    return (EXIT_OK if verdict.get("passed", True) else EXIT_FAIL), outcome


def _print_summary(cfg: SoakConfig, outcome: Any) -> None:
    """The terminal summary, rendered from the run's report in the store."""
    from soakd.report import ReportError, build_report
    from soakd.report.summary import format_summary
    from soakd.store import StoreError, StoreReader

    try:
        with StoreReader(cfg.run.state_dir) as reader:
            report = build_report(reader, outcome.run_id)
    except (StoreError, ReportError) as exc:
        sys.stderr.write(f"soakd: no summary: {exc}\n")
        return
    sys.stdout.write(format_summary(report, outcome.prompt_length_accuracy))


def cmd_run(args: argparse.Namespace, record_listeners: tuple[Any, ...] = ()) -> int:
    """``soakd run``. ``record_listeners``: callables given every finished request record (for
    tools that embed soakd, such as benchmarks/client_capacity.py's trace)."""
    from soakd import logging_setup

    try:
        cfg = load_config(args.config, overrides_from_args(args))
        if args.print_config:
            _print_config(cfg)
            return EXIT_OK
        cfg.api_key()
    except ConfigError as exc:
        return _config_error(exc)
    logging_setup.configure(cfg.log.format, cfg.log.level)
    try:
        code, outcome = _run_async(_soak(cfg, new_run=args.new_run, record_listeners=record_listeners))
    except ConfigError as exc:
        return _config_error(exc)
    if outcome is not None and logging_setup.use_console(cfg.log.format):
        _print_summary(cfg, outcome)
    return code


# ---- demo --------------------------------------------------------------------------------------


def _demo_episodes(cfg: SoakConfig, sim: dict[str, Any]) -> None:
    """--demo-episodes: a thermal-throttling episode a third of the way in (a sixth of the run, SM
    clock at 60%) and a power cap two thirds in (a tenth of the run, at half the demo load's extra
    power), unless the sim: block (SOAKD_SIM__FAULTS__*) already schedules them."""
    faults, dev, length = sim["faults"], sim["device"], cfg.run.duration
    if faults.get("thermal_throttle_at") is None:
        faults.update(thermal_throttle_at=round(length / 3, 3), thermal_throttle_duration=round(length / 6, 3),
                      thermal_throttle_clock_ratio=0.6)
    if faults.get("power_cap_at") is None:
        load = dev["power_per_request_watts"] * min(cfg.load.effective_concurrency if cfg.load.closed_loop else 16,
                                                    sim["max_batch"])
        cap = min(dev["idle_power_watts"] + max(10.0, load / 2), dev["power_limit_watts"] - 1)
        faults.update(power_cap_at=round(length * 2 / 3, 3), power_cap_duration=round(length / 10, 3),
                      power_cap_watts=round(cap, 1))


def cmd_demo(args: argparse.Namespace) -> int:
    """The simulator and a soak against it in one process. The soak samples the simulator's /metrics
    (KV cache, batch) and its simulated GPU through the fake NVML (soakd.sim.fake_pynvml bound to the
    simulator's device), so the soakd_gpu_* series follow the load. A clean run by default;
    --demo-episodes (or SOAKD_SIM__FAULTS__THERMAL_THROTTLE_AT=60s and friends) injects throttling."""
    from soakd import logging_setup

    defaults = {
        "run": {"duration": 180.0, "window": 30.0, "warmup": 10.0, "grace": 10.0, "state_dir": "./soakd-state"},
        "load": {"concurrency": 16},
        "samplers": {"interval": 2.0, "nvml": {"mode": "on"}},
        "metrics": {"host": "127.0.0.1", "port": 9400},
        "log": {"format": "console", "summary_interval": 30.0},
    }
    try:
        from soakd.config import deep_merge

        over = deep_merge(defaults, overrides_from_args(args))
        cfg = load_config(None, over, environ={k: v for k, v in os.environ.items() if k.startswith("SOAKD_")})
        if args.print_config:
            _print_config(cfg)
            return EXIT_OK
    except ConfigError as exc:
        return _config_error(exc)
    logging_setup.configure(cfg.log.format, cfg.log.level)
    progress = cfg.log.progress if cfg.log.progress is not None else True

    async def demo() -> tuple[int, Any]:
        from soakd.sim import fake_pynvml
        from soakd.config.sim import SimConfig
        from soakd.sim.server import SimServer

        sim_data = cfg.sim.model_dump()
        sim_data.update(host="127.0.0.1", port=args.sim_port)
        if getattr(args, "demo_episodes", False):
            _demo_episodes(cfg, sim_data)
        async with SimServer(SimConfig.model_validate(sim_data)) as sim:
            nvml = None
            if cfg.samplers.nvml.mode != "off":
                fake_pynvml.bind(sim.device)  # the soak's NVML sampler sees the simulated GPU(s)
                nvml = fake_pynvml
            run_cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"url": sim.base_url})})
            where = (f"http://{cfg.metrics.host}:{cfg.metrics.port}/metrics" if cfg.metrics.port
                     else "a free port (metrics_url in the soakd_started line)")
            sys.stdout.write(
                f"soakd demo: simulator at {sim.base_url}, soak for {args.duration or '3m'} "
                f"with {int(cfg.run.window)}s windows; metrics at {where}\n"
            )
            sys.stdout.flush()
            return await _soak(run_cfg, progress=progress, nvml_module=nvml, new_run=True)

    try:
        code, outcome = _run_async(demo())
    except ConfigError as exc:
        return _config_error(exc)
    if outcome is not None:
        _print_summary(cfg, outcome)
    return code


# ---- check -------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    from soakd.check import format_table, run_checks

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            sys.stderr.write(f"soakd: --api-key-env: environment variable {args.api_key_env} is not set\n")
            return EXIT_CONFIG
    elif args.api_key_file:
        try:
            api_key = args.api_key_file.read_text().strip().splitlines()[0]
        except (OSError, IndexError) as exc:
            sys.stderr.write(f"soakd: --api-key-file: cannot read {args.api_key_file}: {exc}\n")
            return EXIT_CONFIG
    try:
        from soakd.config import TargetConfig

        url = TargetConfig(url=args.target).url
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"soakd: --target: {exc}\n")
        return EXIT_CONFIG
    results, model = _run_async(run_checks(url, args.model, api_key, timeout=_dur("--timeout", args.timeout)))
    if args.json:
        sys.stdout.write(json.dumps([r.__dict__ for r in results], indent=2) + "\n")
    else:
        sys.stdout.write(format_table(results, url, model) + "\n")
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAIL


# ---- sim ---------------------------------------------------------------------------------------


def cmd_sim(args: argparse.Namespace) -> int:
    from soakd import logging_setup
    from soakd.sim.server import serve_forever, sim_config_from_args

    try:
        base = load_config(args.config).sim if args.config else None
        sim_cfg = sim_config_from_args(args, base)
    except ConfigError as exc:
        return _config_error(exc)
    except Exception as exc:  # noqa: BLE001 - pydantic errors from flags
        sys.stderr.write(f"soakd sim: invalid option: {exc}\n")
        return EXIT_CONFIG
    logging_setup.configure(args.log_format or "auto", "info")
    try:
        _run_async(serve_forever(sim_cfg))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        sys.stderr.write(f"soakd sim: cannot listen on {sim_cfg.host}:{sim_cfg.port}: {exc.strerror or exc}\n")
        return EXIT_FAIL
    return EXIT_OK


# ---- metrics catalogue -------------------------------------------------------------------------


def cmd_metrics(args: argparse.Namespace) -> int:
    from soakd.metrics import CATALOGUE, catalogue_markdown, readme_with_table

    if args.update_readme:
        path = Path(args.update_readme)
        path.write_text(readme_with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
        return EXIT_OK
    if args.markdown:
        sys.stdout.write(catalogue_markdown())
    else:
        for m in CATALOGUE:
            sys.stdout.write(f"{m.name}\t{m.kind}\t{','.join(m.labels)}\n")
    return EXIT_OK


# ---- report ------------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """Render a run's report from the state dir (stdout or -o FILE), or list the runs."""
    import time

    from soakd.report import ReportError, build_report, render
    from soakd.report.render import write_atomic
    from soakd.store import StoreError, StoreReader

    state_dir = Path(args.state_dir or os.environ.get("SOAKD_RUN__STATE_DIR") or "./soakd-state")
    by_suffix = {".md": "md", ".markdown": "md", ".html": "html", ".htm": "html", ".json": "json"}
    fmt = args.format or by_suffix.get(args.output.suffix.lower() if args.output else "", "md")
    try:
        reader = StoreReader(state_dir)
    except StoreError as exc:
        sys.stderr.write(f"soakd report: {exc}\n")
        return EXIT_CONFIG
    try:
        if args.list:
            runs = reader.list_runs()
            if not runs:
                sys.stderr.write(f"soakd report: {reader.db} holds no runs yet\n")
                return EXIT_CONFIG
            sys.stdout.write(f"{'run':<14} {'started (UTC)':<20} {'status':<9} {'verdict':<10} {'windows':>7}  "
                             "target\n")
            for r in runs:
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.created_unix))
                verdict = (r.verdict or {}).get("result") or "-"
                if r.status == "running" and r.verdict:
                    verdict += "*"
                sys.stdout.write(f"{r.id:<14} {started:<20} {r.status:<9} {verdict:<10} {r.windows:>7}  "
                                 f"{r.target or '-'}\n")
            if any(r.status == "running" and r.verdict for r in runs):
                sys.stdout.write("(* interim verdict: the run was stopped and can resume)\n")
            return EXIT_OK
        try:
            report = build_report(reader, args.run)
        except ReportError as exc:
            sys.stderr.write(f"soakd report: {exc}\n")
            return EXIT_CONFIG
    finally:
        reader.close()
    text = render(report, fmt)
    if args.output:
        try:
            write_atomic(args.output, text)
        except OSError as exc:
            sys.stderr.write(f"soakd report: cannot write {args.output}: {exc.strerror or exc}\n")
            return EXIT_FAIL
        sys.stderr.write(f"soakd report: {fmt} report of run {report['run']['id']} written to {args.output}\n")
    else:
        sys.stdout.write(text)
    return EXIT_OK


# ---- main --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="soakd", description="Soak-test daemon for OpenAI-compatible LLM servers.")
    parser.add_argument("--version", action="version", version=f"soakd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="soak a target server", description="Soak an OpenAI-compatible server. "
                       "Precedence: command-line flags > SOAKD_* environment variables (SOAKD_RUN__DURATION=1h) > "
                       "the YAML file > defaults.")
    add_run_arguments(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo", help="soak the embedded simulator for a few minutes")
    add_run_arguments(p, demo=True)
    p.add_argument("--sim-port", type=int, default=0, help="simulator port (default: any free port)")
    p.add_argument("--demo-episodes", action="store_true",
                   help="inject a thermal-throttling episode a third of the way in and a power cap two thirds in "
                        "(default: a clean run; SOAKD_SIM__FAULTS__* schedule them yourself)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("check", help="OpenAI compatibility probe of a target")
    p.add_argument("--target", required=True, help="OpenAI base URL including /v1")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key-env")
    p.add_argument("--api-key-file", type=Path)
    p.add_argument("--timeout", default="60s", help="per-probe timeout (default 60s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("sim", help="run the embedded simulated inference server")
    p.add_argument("-c", "--config", type=Path, help="YAML file whose sim: block configures the simulator")
    p.add_argument("--log-format", choices=["auto", "json", "console"])
    from soakd.sim.server import add_sim_arguments

    add_sim_arguments(p)
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("report", help="render a run's report (Markdown, HTML or JSON) from the state dir",
                       description="Render the report of a run from the state dir: the verdict, per-window table, "
                       "findings with diagnoses and (HTML) charts. The JSON report is what "
                       "`soakd run --baseline` reads.")
    p.add_argument("--state-dir", type=Path,
                   help="state dir of the run (default ./soakd-state; env SOAKD_RUN__STATE_DIR)")
    p.add_argument("--run", metavar="ID", help="run id (default: the newest run; see --list)")
    p.add_argument("--format", choices=["md", "html", "json"],
                   help="output format (default md, or from the -o file's extension)")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--list", action="store_true", help="list the runs in the state dir (id, start, status, verdict)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("metrics", help="list every metric soakd exports")
    p.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    p.add_argument("--update-readme", metavar="README", help="rewrite the metric table in this README")
    p.set_defaults(func=cmd_metrics)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130

