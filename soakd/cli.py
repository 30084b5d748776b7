"""Command line: ``soakd run | sweep | batch | compare | sim | demo | check | report | metrics``.

Exit codes: 0 success, 1 failure, 2 usage or configuration error, 3 inconclusive.

Longer than 500 lines: one entry point per command (run, sweep, batch, demo, check, report,
metrics), each a thin shell over its package; the parser is the one place all flags are declared.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from soakd import __version__
from soakd.config import ConfigError, SoakConfig, deep_merge, flags, load_config
from soakd.core.durations import parse_duration

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2  # and 3, inconclusive: soakd.core.verdict.EXIT_CODES
EXIT_NO_KNEE = 3  # soakd sweep: no knee within the levels (throughput still rising at the last one)


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


def _dur(flag: str, value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ConfigError([f"{flag}: {exc}"]) from None


def add_run_arguments(p: argparse.ArgumentParser, *, demo: bool = False) -> None:
    """The flags of ``soakd run`` (and ``demo``, which has no target flags): the configuration
    flags of ``soakd.config.flags`` plus the options that are not configuration."""
    if not demo:
        p.add_argument("-c", "--config", type=Path, default=os.environ.get("SOAKD_CONFIG"),
                       help="YAML configuration file (see examples/soak.yaml); env SOAKD_CONFIG")
    flags.add_arguments(p, target=not demo)
    p.add_argument("--new-run", action="store_true",
                   help="start a fresh run even if the state dir holds an unfinished one (default: resume it)")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")


def _load(args: argparse.Namespace, path: Path | None = None, base: dict[str, Any] | None = None,
          environ: dict[str, str] | None = None) -> SoakConfig:
    """The effective configuration: file < environment < ``base`` < flags; errors name the flag."""
    over = flags.overrides(args)
    if base is not None:
        over = deep_merge(base, over)
    try:
        return load_config(path, over, environ=environ)
    except ConfigError as exc:
        raise flags.annotate(exc, args) from None


def _configured(args: argparse.Namespace, base: dict[str, Any] | None = None) -> tuple[SoakConfig | None, int]:
    """The configuration of a command that sends load (run, sweep, batch): loaded, every target's key
    read (a key that is configured but missing fails now), logging set up; or (None, the exit code)
    after --print-config or an error."""
    from soakd import logging_setup

    try:
        cfg = _load(args, args.config, base=base)
        if args.print_config:
            _print_config(cfg)
            return None, EXIT_OK
        for t in cfg.target_list():
            cfg.api_key(t)
    except ConfigError as exc:
        return None, _config_error(exc)
    logging_setup.configure(cfg.log.format, cfg.log.level)
    return cfg, EXIT_OK


def _print_config(cfg: SoakConfig) -> None:
    sys.stdout.write(yaml.safe_dump(cfg.redacted(), sort_keys=False, default_flow_style=None))


def _stderr_line(text: str) -> None:
    """A line on stderr, after the log lines (a thread writes them to stdout)."""
    from soakd import logging_setup

    logging_setup.drain()
    sys.stderr.write(text + "\n")


def _config_error(exc: ConfigError) -> int:
    sys.stderr.write(f"soakd: {exc}\n")
    return EXIT_CONFIG


def _install_signals(daemon: Any) -> None:
    loop = asyncio.get_running_loop()
    # SIGHUP (the terminal closed, an ssh session dropped, a supervisor's "reload") drains like SIGTERM:
    # soakd has no log file to reopen (it logs to stdout), and dying at once loses the open window
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            loop.add_signal_handler(sig, daemon.request_stop, sig.name)
        except (NotImplementedError, RuntimeError):
            pass


# ---- run ---------------------------------------------------------------------------------------


async def _soak(cfg: SoakConfig, progress: bool | None = None, nvml_module: Any = None, new_run: bool = False,
                record_listeners: tuple[Any, ...] = ()) -> tuple[int, Any]:
    from soakd.runtime import Runtime, StartupError
    from soakd.soak.target import TargetUnavailable

    runtime = Runtime(cfg, progress=progress, nvml_module=nvml_module, new_run=new_run,
                      record_listeners=record_listeners)
    _install_signals(runtime)
    try:
        outcome = await runtime.run()
    except (StartupError, TargetUnavailable) as exc:
        _stderr_line(f"soakd: {exc}")
        return EXIT_FAIL, None
    if outcome.unsaved:  # the record is not saved: that is the news, whatever the verdict
        from soakd.core.verdict import EXIT_UNSAVED

        kept, dropped, where = outcome.unsaved
        _stderr_line(f"soakd: run {outcome.run_id} ended, but {kept + dropped} of its writes could not be saved to "
                     f"{cfg.run.state_dir / 'soakd.db'} (disk full?)"
                     + (f"; {kept} are kept in {where} and the next start on this state dir reads them back"
                        if kept else "") + f"; no report was written (exit {EXIT_UNSAVED})")
        return EXIT_UNSAVED, outcome
    if outcome.verdict is None:  # the target never answered, or the run was stopped before it had one
        return (EXIT_OK if outcome.graceful_stop else EXIT_FAIL), outcome
    return outcome.verdict.exit_code, outcome  # soakd.core.verdict.EXIT_CODES


def _print_summary(cfg: SoakConfig, outcome: Any) -> None:
    """The terminal summary, rendered from the run's report in the store."""
    from soakd import logging_setup

    logging_setup.drain()  # the log lines first (a thread writes them)
    if outcome.stop_reason == "target_unreachable":
        sys.stdout.write(f"\nsoakd: {cfg.target.display_url} never answered GET /models; no run was recorded\n")
        return
    from soakd.report import ReportError, build_report
    from soakd.report.summary import format_summary
    from soakd.store import StoreError, StoreReader

    try:
        with StoreReader(cfg.run.state_dir) as reader:
            report = build_report(reader, outcome.run_id)
        text = format_summary(report, outcome)
    except (StoreError, ReportError) as exc:
        sys.stderr.write(f"soakd: no summary: {exc}\n")
        return
    except Exception as exc:  # noqa: BLE001 - the run is over and recorded: its exit code must stand
        sys.stderr.write(f"soakd: no summary ({type(exc).__name__}: {exc}); the run is in the store: "
                         f"soakd report --state-dir {cfg.run.state_dir} --run {outcome.run_id}\n")
        return
    sys.stdout.write(text)


def cmd_run(args: argparse.Namespace, record_listeners: tuple[Any, ...] = ()) -> int:
    """``soakd run``. ``record_listeners``: callables given every finished request record (for
    tools that embed soakd, such as benchmarks/client_capacity.py's trace)."""
    from soakd import logging_setup

    cfg, code = _configured(args)
    if cfg is None:
        return code
    try:
        code, outcome = _run_async(_soak(cfg, new_run=args.new_run, record_listeners=record_listeners))
    except ConfigError as exc:
        return _config_error(exc)
    if outcome is not None and logging_setup.use_console(cfg.log.format):
        _print_summary(cfg, outcome)
    return code


# ---- sweep -------------------------------------------------------------------------------------


def _write_sweep(doc: dict[str, Any], args: argparse.Namespace) -> None:
    from soakd.sweep import render

    for path, text in ((args.json, lambda: json.dumps(doc, indent=2) + "\n"),
                       (args.markdown, lambda: render.markdown(doc)), (args.html, lambda: render.html_page(doc))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text(), encoding="utf-8")
    from soakd import logging_setup

    logging_setup.drain()  # the log lines first (a thread writes them)
    sys.stdout.write(render.terminal(doc))


def cmd_sweep(args: argparse.Namespace) -> int:
    """``soakd sweep``: the load levels of ``sweep:`` (or --levels) one step each until the knee;
    the table on stdout, --json/--markdown/--html files; ``--show`` renders a stored sweep."""
    from soakd.store import StoreError

    if args.show is not None:
        from soakd.sweep.runner import read_sweep

        state_dir = args.state_dir or Path(os.environ.get("SOAKD_RUN__STATE_DIR", "./soakd-state"))
        try:
            doc = read_sweep(state_dir, args.show or None)
        except StoreError as exc:
            sys.stderr.write(f"soakd sweep: {exc}\n")
            return EXIT_CONFIG
        _write_sweep(doc, args)
        return EXIT_OK
    cfg, code = _configured(args)
    if cfg is None:
        return code

    async def sweep() -> Any:
        from soakd.sweep.runner import SweepRunner

        runner = SweepRunner(cfg)
        _install_signals(runner)
        try:
            return await runner.run()
        except OSError as exc:
            raise StoreError(f"cannot listen on {cfg.metrics.host}:{cfg.metrics.port} for /metrics: "
                             f"{exc.strerror or exc}; choose another --metrics-port (0 picks a free one)") from None

    from soakd.soak.target import TargetUnavailable

    try:
        outcome = _run_async(sweep())
    except (StoreError, TargetUnavailable) as exc:
        _stderr_line(f"soakd sweep: {exc}")
        return EXIT_FAIL
    if outcome.document is None:
        sys.stderr.write(f"soakd sweep: {cfg.target.display_url} never answered GET /models; no sweep was recorded\n")
        return EXIT_FAIL
    _write_sweep(outcome.document, args)
    if outcome.document.get("knee") is not None:
        return EXIT_OK
    # no knee within the levels (throughput still rising at the last one): inconclusive, not a failure
    return EXIT_NO_KNEE if outcome.document.get("stop_reason") == "end" else EXIT_FAIL


# ---- compare -----------------------------------------------------------------------------------


def cmd_compare(args: argparse.Namespace) -> int:
    """``soakd compare A/report.json B/report.json``: B against A as an A/B run is judged."""
    from soakd.report.compare import CompareError, compare_reports, format_compare

    try:
        cfg = _load(args, args.config) if args.config else None
        doc = compare_reports(args.a, args.b, cfg.analysis if cfg is not None else None)
    except ConfigError as exc:
        return _config_error(exc)
    except CompareError as exc:
        sys.stderr.write(f"soakd compare: {exc}\n")
        return EXIT_CONFIG
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(format_compare(doc, markdown=args.markdown))
    return EXIT_FAIL if doc["worse"] else EXIT_OK


# ---- batch -------------------------------------------------------------------------------------


def cmd_batch(args: argparse.Namespace) -> int:
    """``soakd batch INPUT``: an OpenAI Batch API input file, sent and accounted for; resumable."""
    from soakd.batch.input import InputError
    from soakd import logging_setup
    from soakd.batch.runner import BatchRunner, print_accounting
    from soakd.soak.target import TargetUnavailable
    from soakd.store import StoreError

    over: dict[str, Any] = {}
    for dest, key in (("batch_concurrency", "concurrency"), ("max_tries", "max_tries"),
                      ("failure_budget", "failure_budget")):
        if getattr(args, dest) is not None:
            over[key] = getattr(args, dest)
    cfg, code = _configured(args, base={"batch": over} if over else None)
    if cfg is None:
        return code
    inp: Path = args.input
    output = args.output or inp.with_name(inp.stem + ".output.jsonl")
    errors = args.errors or inp.with_name(inp.stem + ".errors.jsonl")
    status = logging_setup.status_line()  # inactive where stderr is no terminal
    tty = status.active

    def progress(line: str) -> None:
        status.show(line.split(" | "))

    async def batch() -> Any:
        runner = BatchRunner(cfg, inp, output, errors, new_batch=args.new_batch, progress=progress)
        _install_signals(runner)
        return await runner.run()

    try:
        outcome = _run_async(batch())
    except InputError as exc:
        sys.stderr.write(f"soakd batch: {exc}\n")
        return EXIT_CONFIG
    except (StoreError, TargetUnavailable) as exc:
        _stderr_line(f"soakd batch: {exc}")
        return EXIT_FAIL
    if tty:
        status.end()
    logging_setup.drain()  # the log lines first (a thread writes them)
    print_accounting(outcome)
    return EXIT_OK if outcome.finished and outcome.accounting["within_budget"] else EXIT_FAIL


# ---- demo --------------------------------------------------------------------------------------


def _demo_episodes(cfg: SoakConfig, sim: dict[str, Any]) -> None:
    """--demo-episodes: a thermal-throttling episode (a sixth of the run, SM clock at 60%) and then a power
    cap (a tenth of the run, at half the demo load's extra power), unless the sim: block
    (SOAKD_SIM__FAULTS__*) already schedules them.

    The thermal episode starts a whole window after the baseline pool's last window, where the run is long
    enough for both episodes and a window between them (else a third of the way in): an episode that
    reaches into the pool is part of the reference it would be judged against, and the simulator's clock
    starts before the soak's first window by however long the start took on a busy machine (seen: window
    3 of a 10-s-window demo throttled 29% of its samples, the pool's e2e p50 +35%, no throttling found).
    The power cap starts two thirds in, or a window after the thermal episode ends if that is later."""
    faults, dev, length = sim["faults"], sim["device"], cfg.run.duration
    window, thermal_len, cap_len = cfg.run.window, length / 6, length / 10
    after_pool = cfg.run.warmup + (cfg.analysis.drift.baseline_windows + 1) * window
    fits = after_pool + thermal_len + window + cap_len <= length
    thermal_at = after_pool if fits else length / 3
    if faults.get("thermal_throttle_at") is None:
        faults.update(thermal_throttle_at=round(thermal_at, 3), thermal_throttle_duration=round(thermal_len, 3),
                      thermal_throttle_clock_ratio=0.6)
    if faults.get("power_cap_at") is None:
        load = dev["power_per_request_watts"] * min(cfg.load.effective_concurrency if cfg.load.closed_loop else 16,
                                                    sim["max_batch"])
        cap = min(dev["idle_power_watts"] + max(10.0, load / 2), dev["power_limit_watts"] - 1)
        # a window after the thermal episode as it will run (the user's own, when set; durations are seconds here)
        after_thermal = faults["thermal_throttle_at"] + faults["thermal_throttle_duration"] + window
        cap_at = max(length * 2 / 3, after_thermal) if after_thermal + cap_len <= length else length * 2 / 3
        faults.update(power_cap_at=round(cap_at, 3), power_cap_duration=round(cap_len, 3),
                      power_cap_watts=round(cap, 1))


class _EpisodeAnchor:
    """The demo's thermal and power-cap episodes (``faults.thermal_throttle_at``, ``faults.power_cap_at``,
    the simulated device's) count from the soak's start, not the simulator's: the first finished request
    moves the simulated devices' start to the moment it was sent (the load's start, within one request:
    the demo's closed loop sends its first requests at once). Starting the soak (the target check, NVML,
    the state, the web server) takes seconds on a busy machine (seen: 15 s, which put an episode meant for
    after the pool into it). The model's faults (latency steps, freezes, restarts) count from its start."""

    def __init__(self, devices: list[Any]) -> None:
        self.devices: list[Any] | None = devices

    def __call__(self, rec: Any) -> None:
        if self.devices is None:
            return
        ago = max(0.0, (time.perf_counter_ns() - rec.t_start_ns) / 1e9) if rec.t_start_ns else 0.0
        for dev in self.devices:
            with dev._lock:  # the NVML worker reads it in _advance
                dev.started = dev.clock() - ago
        self.devices = None


def cmd_demo(args: argparse.Namespace) -> int:
    """The simulator and a soak against it in one process. The soak samples the simulator's /metrics
    (KV cache, batch) and its simulated GPU through the fake NVML (soakd.sim.fake_pynvml bound to the
    simulator's device), so the soakd_gpu_* series follow the load. A clean run by default;
    --demo-episodes (or SOAKD_SIM__FAULTS__THERMAL_THROTTLE_AT=60s and friends) injects throttling."""
    from soakd import logging_setup

    defaults = {
        "run": {"duration": 180.0, "window": 20.0, "warmup": 10.0, "grace": 10.0, "state_dir": "./soakd-state"},
        "load": {"concurrency": 16},
        "samplers": {"interval": 2.0, "nvml": {"mode": "on"}},
        "metrics": {"host": "127.0.0.1", "port": 9400},
        "log": {"format": "console", "summary_interval": 30.0},
    }
    try:
        cfg = _load(args, base=defaults)
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
        slower = dict(sim_data, port=0, ttft_base=sim_data["ttft_base"] * 1.1, tpot_base=sim_data["tpot_base"] * 1.1)
        async with SimServer(SimConfig.model_validate(sim_data)) as sim, contextlib.AsyncExitStack() as stack:
            devices = [sim.device]
            nvml = None
            if cfg.samplers.nvml.mode != "off":
                fake_pynvml.bind(sim.device)  # the soak's NVML sampler sees the simulated GPU(s)
                nvml = fake_pynvml
            run_cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"url": sim.base_url})})
            if getattr(args, "ab", False):  # a second simulator, 10% slower: the candidate
                cand = await stack.enter_async_context(SimServer(SimConfig.model_validate(slower)))
                devices.append(cand.device)
                from soakd.config import NamedTargetConfig

                run_cfg = run_cfg.model_copy(update={"targets": [
                    NamedTargetConfig(name="reference", **run_cfg.target.model_dump()),
                    NamedTargetConfig(name="candidate", **dict(run_cfg.target.model_dump(), url=cand.base_url))]})
            where = (f"http://{cfg.metrics.host}:{cfg.metrics.port}/metrics" if cfg.metrics.port
                     else "a free port (metrics_url in the soakd_started line)")
            logging_setup.drain()  # the log lines first (a thread writes them)
            sys.stdout.write(
                f"soakd demo: simulator at {sim.base_url}, soak for {args.duration or '3m'} "
                f"with {int(cfg.run.window)}s windows; metrics at {where}\n"
            )
            sys.stdout.flush()
            return await _soak(run_cfg, progress=progress, nvml_module=nvml, new_run=True,
                               record_listeners=(_EpisodeAnchor(devices),))

    try:
        code, outcome = _run_async(demo())
    except ConfigError as exc:
        return _config_error(exc)
    if outcome is not None:
        _print_summary(cfg, outcome)
    return code


# ---- check -------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    """The target and its key come from the same configuration as ``soakd run`` (flags, SOAKD_*
    environment, ``-c`` file)."""
    from soakd.check import format_table, run_checks

    try:
        cfg = _load(args, args.config)
        targets = [(t, cfg.api_key(t)) for t in cfg.target_list()]  # every target of an A/B configuration
        timeout = _dur("--timeout", args.timeout)
    except ConfigError as exc:
        return _config_error(exc)
    ok, docs = True, []
    for t, api_key in targets:
        results, model = _run_async(run_checks(t, api_key, timeout=timeout))
        ok = ok and all(r.ok for r in results)
        if args.json:
            docs.append([r.__dict__ for r in results])
        else:
            head = f"[{t.name}] " if len(targets) > 1 else ""
            sys.stdout.write(head + format_table(results, t.display_url, model) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2) + "\n")
    return EXIT_OK if ok else EXIT_FAIL


# ---- sim ---------------------------------------------------------------------------------------


def cmd_sim(args: argparse.Namespace) -> int:
    from soakd import logging_setup
    from soakd.sim.cli import sim_config_from_args
    from soakd.sim.server import serve_forever

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

    if args.schema:  # the JSON Schema of report.json (docs/report.schema.json)
        from soakd.report.model import json_schema

        sys.stdout.write(json.dumps(json_schema(), indent=2, sort_keys=True) + "\n")
        return EXIT_OK
    state_dir = Path(args.state_dir or os.environ.get("SOAKD_RUN__STATE_DIR") or "./soakd-state")
    by_suffix = {".md": "md", ".markdown": "md", ".html": "html", ".htm": "html", ".json": "json", ".xml": "junit"}
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
        sys.stderr.write(f"soakd report: {fmt} report of run {report.run.id} written to {args.output}\n")
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
    p.add_argument("--ab", action="store_true",
                   help="an A/B soak: a second simulator 10%% slower on every delay as the target 'candidate' beside "
                        "'reference' (the A/B panels, findings and report section)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("sweep", help="raise the load step by step until the knee",
                       description="Concurrency (closed loop, --concurrency) or rate (open loop, --rate) in steps, "
                       "the soak's mix and prompts, each step long enough for p50/p95 with their intervals, until "
                       "throughput stops rising beyond its uncertainty, an SLO breaks or errors exceed the budget. "
                       "soakd run --load-from FILE.json soaks at a fraction of the knee.")
    p.add_argument("-c", "--config", type=Path, default=os.environ.get("SOAKD_CONFIG"),
                   help="YAML configuration file (its sweep: section and the soak's target, load, scenarios)")
    flags.add_arguments(p, target=True, sweep=True)
    p.add_argument("--json", type=Path, metavar="FILE", help="write the sweep as JSON (what --load-from reads)")
    p.add_argument("--markdown", type=Path, metavar="FILE", help="write the table as Markdown")
    p.add_argument("--html", type=Path, metavar="FILE", help="write the table and charts as HTML")
    p.add_argument("--show", nargs="?", const="", metavar="ID",
                   help="render a stored sweep (the newest, or ID) from --state-dir instead of running one")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("compare", help="compare two runs' JSON reports as an A/B run (B against A)",
                       description="Window k of B against window k of A, per tracked metric (the configuration's, "
                       "each report's own, goodput where both have it), with intervals (the A/B judgement of "
                       "soakd.analysis.ab): over every window both runs had eligible, and in each segment between "
                       "change points of the paired differences (a step half-way through B is not diluted by the "
                       "windows before it). Metrics that cannot be compared and windows left out are listed with "
                       "why. Exit 1 when B is confidently worse on any metric, over the run or in a segment (the "
                       "last line names the metric and its windows), 0 otherwise, 2 when a report cannot be read.")
    p.add_argument("a", type=Path, help="the reference run's report.json")
    p.add_argument("b", type=Path, help="the candidate run's report.json")
    p.add_argument("-c", "--config", type=Path, help="YAML configuration whose analysis: section applies")
    p.add_argument("--json", action="store_true", help="the comparison as JSON")
    p.add_argument("--markdown", action="store_true", help="the table as Markdown")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("batch", help="send an OpenAI Batch API input file and account for every line",
                       description="Send an OpenAI Batch API input file (JSONL: custom_id, method, url, body) with "
                       "bounded concurrency, validate every output, retry retryable failures with backoff, write the "
                       "batch output and error files (one line per custom_id) and the accounting; a batch that was "
                       "interrupted resumes without re-sending a finished custom_id. Exit 1 above the failure budget.")
    p.add_argument("input", type=Path, help="the batch input file (.jsonl)")
    p.add_argument("-o", "--output", type=Path, help="the output file (default INPUT.output.jsonl)")
    p.add_argument("--errors", type=Path, help="the error file (default INPUT.errors.jsonl)")
    p.add_argument("-c", "--config", type=Path, default=os.environ.get("SOAKD_CONFIG"),
                   help="YAML configuration file (its target: and batch: sections)")
    flags.add_arguments(p, flags=("--target", "--model", "--api-key-env", "--api-key-file", "--state-dir",
                                  "--no-keep-alive", "--log-format", "--log-level"))
    p.add_argument("--concurrency", dest="batch_concurrency", type=int, help="requests in flight (default 8)")
    p.add_argument("--max-tries", type=int, help="tries per input before it is given up (default 3)")
    p.add_argument("--failure-budget", type=float, help="share of lines that may fail before exit 1 (default 0)")
    p.add_argument("--new-batch", action="store_true", help="start over instead of resuming an unfinished batch")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("check", help="OpenAI compatibility probe of a target")
    p.add_argument("-c", "--config", type=Path, default=os.environ.get("SOAKD_CONFIG"),
                   help="YAML configuration file whose target: section is probed; env SOAKD_CONFIG")
    flags.add_arguments(p, flags=("--target", "--model", "--api-key-env", "--api-key-file"))
    p.add_argument("--timeout", default="60s", help="per-probe timeout (default 60s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("sim", help="run the embedded simulated inference server")
    p.add_argument("-c", "--config", type=Path, help="YAML file whose sim: block configures the simulator")
    p.add_argument("--log-format", choices=["auto", "json", "console"])
    from soakd.sim.cli import add_sim_arguments

    add_sim_arguments(p)
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("report", help="render a run's report (Markdown, HTML, JSON or JUnit XML) from the state dir",
                       description="Render the report of a run from the state dir: the verdict, per-window table, "
                       "findings with diagnoses and (HTML) charts. The JSON report is what "
                       "`soakd run --baseline` reads.")
    p.add_argument("--state-dir", type=Path,
                   help="state dir of the run (default ./soakd-state; env SOAKD_RUN__STATE_DIR)")
    p.add_argument("--run", metavar="ID", help="run id (default: the newest run; see --list)")
    p.add_argument("--format", choices=["md", "html", "json", "junit"],
                   help="output format (default md, or from the -o file's extension; .xml: junit)")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--list", action="store_true", help="list the runs in the state dir (id, start, status, verdict)")
    p.add_argument("--schema", action="store_true",
                   help="print the JSON Schema of report.json (published as docs/report.schema.json) and exit")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("metrics", help="list every metric soakd exports")
    p.add_argument("--markdown", action="store_true", help="as the Markdown table of docs/metrics.md")
    p.add_argument("--update-readme", metavar="FILE",
                   help="rewrite the metric table between the metrics-table markers of this Markdown file "
                        "(docs/metrics.md)")
    p.set_defaults(func=cmd_metrics)
    return parser


def load_worker_main(argv: list[str]) -> int:
    """``soakd _load-worker FD``: a load worker process of ``load.workers`` (``soakd.soak.worker``), started by
    soakd itself: control on stdin, records out on FD, log lines on stdout as the parent's (with ``worker``)."""
    import structlog  # noqa: PLC0415

    from soakd import logging_setup  # noqa: PLC0415
    from soakd.soak import worker  # noqa: PLC0415

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop, and tells it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def on_init(cfg: Any, index: int) -> None:
        logging_setup.configure(cfg.log.format, cfg.log.level)
        structlog.contextvars.bind_contextvars(worker=index)

    parent = os.getppid()
    try:
        _run_async(worker.serve(int(argv[0]), on_init))
    except Exception as exc:  # noqa: BLE001
        if os.getppid() != parent:  # the parent is gone (its pipes with it): nothing to report, nobody to tell
            return 0
        print(f"soakd load worker failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        logging_setup.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["_load-worker"]:  # not a user's command: soakd's own load worker process
        return load_worker_main(args_in[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130

