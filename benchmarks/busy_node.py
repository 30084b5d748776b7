#!/usr/bin/env python3
"""A busy node, live: soakd against the simulator while soakd itself is starved of CPU.

Each run starts the simulator (``soakd sim``, pinned to the last core) and ``soakd run`` against it
(short windows, so a run takes about two minutes), with soakd starved in one of two ways:

- ``compete``: soakd and a CPU-bound process (``while 1: pass``) pinned to the same core (core 0) at the
  same priority: the kernel gives each about half of it, in slices;
- ``quota``: soakd in a cgroup limited to half a core (CFS bandwidth: ``cpu.max`` "50000 100000" on
  cgroup v2, or ``cpu.cfs_quota_us`` 50000 per 100000 on a v1 cpu controller where v2 has no cpu
  controller), pinned to core 0.

and the simulator either calm (``calm``) or with its latency step fault (``step``: every delay 10%
longer from a point after the baseline pool). What must hold (issue 21): a calm server PASSes (not
INCONCLUSIVE) in >= 9 of 10 runs, a +10% step FAILs in >= 9 of 10, and the share of requests impaired
by soakd's own stalls is reported; and no run names the server "target hung" or "engine wedged" (it never
stopped: that would be soakd's own stall charged to it). Samplers and the target found down are counted
and shown. Needs ``taskset`` (util-linux); the quota mode needs root and a
writable cgroup (else it is skipped, saying why).

Usage::

    python benchmarks/busy_node.py --runs 10                   # 2 modes x 2 faults x 10 runs, ~80 min
    python benchmarks/busy_node.py --runs 2 --modes compete    # a quick look
    python benchmarks/busy_node.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXIT = {0: "PASS", 1: "FAIL", 3: "INCONCLUSIVE"}
V2 = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quota_cgroup(name: str) -> tuple[Path | None, str]:
    """A cgroup limited to half a core: (its directory, how), or (None, why not)."""
    try:
        if "cpu" in (V2 / "cgroup.controllers").read_text().split():
            d = V2 / name
            d.mkdir(exist_ok=True)
            (d / "cpu.max").write_text("50000 100000")
            return d, "cgroup v2 cpu.max 50000 100000"
    except OSError:
        pass
    try:
        if (V1_CPU / "cpu.cfs_quota_us").exists():
            d = V1_CPU / name
            d.mkdir(exist_ok=True)
            (d / "cpu.cfs_period_us").write_text("100000")
            (d / "cpu.cfs_quota_us").write_text("50000")
            return d, ("cgroup v1 cpu.cfs_quota_us 50000 / cpu.cfs_period_us 100000 "
                       "(cgroup v2 has no cpu controller here)")
    except OSError as exc:
        return None, f"no writable cgroup cpu controller ({exc})"
    return None, "no cgroup cpu controller (neither v2 cpu.max nor v1 cpu.cfs_quota_us)"


def sim_block(pairs: list[str]) -> dict[str, Any]:
    """``--sim KEY=VALUE`` pairs as the simulator's ``sim:`` block (values read as JSON where they parse)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--sim {pair!r}: expected KEY=VALUE")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def config(path: Path, a: argparse.Namespace) -> None:
    warmup, window, windows = a.warmup, a.window, a.windows
    path.write_text(json.dumps({
        "run": {"duration": warmup + window * windows, "window": window, "warmup": warmup, "grace": 10.0},
        "load": {"concurrency": a.concurrency, "mix": {"short_chat": 1}},
        "scenarios": {"short_chat": {"prompt_tokens": 64, "max_tokens": a.tokens}},
        "samplers": {"interval": 1.0, "nvml": {"mode": "off"}},
        "analysis": {"drift": {"baseline_windows": a.pool}, "quiesce": {"enabled": False},
                     "canary": {"enabled": False}},
        "metrics": {"host": "127.0.0.1", "port": 0},
        "log": {"progress": False, "format": "json", "level": "warning"},
    }))


def one_run(mode: str, fault: str, seed: int, a: argparse.Namespace, cgroup: Path | None) -> dict[str, Any]:
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work = Path(tempfile.mkdtemp(prefix="busy-node-"))
    port = free_port()
    cores = os.cpu_count() or 1
    sim_core = str(cores - 1)
    sim_cmd = ["taskset", "-c", sim_core, py, "-m", "soakd", "sim", "--host", "127.0.0.1", "--port", str(port),
               "--seed", str(seed), "--ttft", str(a.ttft), "--tpot", str(a.tpot), "--jitter", "0.1",
               "--max-batch", str(max(64, a.concurrency)), "--log-format", "json"]
    # the step: after the pool (soakd's startup, 3-15 s on a busy machine, + warm-up + pool windows + one
    # more), for the rest of the run
    step_at = a.startup + a.warmup + (a.pool + 1.5) * a.window
    if fault == "step":
        sim_cmd += ["--latency-step-at", f"{step_at}s", "--latency-step-pct", "10"]
    sim_cfg = work / "sim.json"  # YAML's superset: the simulator reads it as its sim: block
    sim_cfg.write_text(json.dumps({"sim": sim_block(a.sim)}))
    sim_cmd += ["-c", str(sim_cfg)]
    cfg = work / "soak.json"
    config(cfg, a)
    soak = [py, "-m", "soakd", "run", "-c", str(cfg), "--target", f"http://127.0.0.1:{port}/v1",
            "--state-dir", str(work / "state"), "--new-run", "--seed", str(seed)]
    procs: list[subprocess.Popen] = []
    out: dict[str, Any] = {"mode": mode, "fault": fault, "seed": seed}
    try:
        procs.append(subprocess.Popen(sim_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the simulator answers
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            time.sleep(0.2)
        if mode == "compete":
            procs.append(subprocess.Popen(["taskset", "-c", "0", py, "-c", "while 1: pass"]))
            cmd = ["taskset", "-c", "0", *soak]
        else:
            assert cgroup is not None
            procs_file = cgroup / ("cgroup.procs" if (cgroup / "cpu.max").exists() else "tasks")
            # into the cgroup before soakd starts: every thread of it is limited from its first instruction
            cmd = ["sh", "-c", f'echo $$ > {procs_file} && exec taskset -c 0 "$@"', "sh", *soak]
        t0 = time.monotonic()
        rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            timeout=a.warmup + a.window * a.windows + 180).returncode
        out["seconds"] = round(time.monotonic() - t0, 1)
        out["exit_code"] = rc
        out["result"] = EXIT.get(rc, f"exit {rc}")
        reports = list((work / "state").glob("*/report.json"))
        if reports and a.keep is not None:  # the whole report, to read a run's windows afterwards
            a.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(reports[0], a.keep / f"{mode}-{fault}-{seed}.json")
        if reports:
            rep = json.loads(reports[0].read_text())
            windows = [w for w in rep.get("windows") or [] if not w.get("partial")]
            req = sum(w.get("requests", 0) for w in windows)
            imp = sum((w.get("client") or {}).get("requests_impaired", 0) for w in windows)
            v = rep.get("verdict") or {}
            events = [e for items in (rep.get("findings") or {}).values() for e in items]
            named = [e.get("diagnosis") or e.get("kind") for e in events]
            out.update({
                "result": v.get("result", out["result"]),
                "requests": req, "requests_impaired": imp, "impaired_share": imp / req if req else None,
                "windows": len(windows),
                "windows_impaired": sum(bool((w.get("client") or {}).get("impaired")) for w in windows),
                "loop_lag_max_ms": round(1000 * max(((w.get("client") or {}).get("loop_lag_max_seconds") or 0.0)
                                                    for w in windows), 1) if windows else None,
                "output_tokens_per_second": round(sum(w.get("output_tokens_per_second", 0.0) for w in windows)
                                                  / max(1, len(windows))),
                "reasons": v.get("reasons", [])[:3],
                # what soakd's own starvation must never be taken for: the server hung or wedged, a sampler
                # down, the target down (the wedge watch's probe and the samplers wait on soakd's own time)
                "hung": sum(n in ("target hung", "engine wedged") for n in named),
                "sampler_down": sum(e.get("kind") == "sampler_down" for e in events),
                "target_down_seconds": round(sum(w.get("target_down_seconds") or 0.0 for w in windows), 1),
                "inconclusive": v.get("inconclusive"),
            })
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
        shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs per mode and fault (default 10)")
    p.add_argument("--modes", default="compete,quota")
    p.add_argument("--faults", default="calm,step")
    p.add_argument("--window", type=float, default=10.0, help="window seconds (default 10)")
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--pool", type=int, default=3, help="analysis.drift.baseline_windows (default 3)")
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--tokens", type=int, default=128, help="max_tokens per request (default 128)")
    p.add_argument("--ttft", type=float, default=0.02)
    p.add_argument("--tpot", type=float, default=0.004)
    p.add_argument("--sim", action="append", default=[], metavar="KEY=VALUE",
                   help="a field of the simulator's sim: block, dotted for nested ones (repeatable), e.g. "
                        "tpot_per_batch=0 device.power_per_request_watts=4: every stream at --tpot whatever the batch, "
                        "and no simulated power cap at 128 streams (the token rate of --high-rate)")
    p.add_argument("--high-rate", action="store_true",
                   help="~30,000 streamed tokens/s: 128 streams of 128 tokens at 4 ms a token, the simulator's batch "
                        "slowdown and power cap off (sets --concurrency, --tokens, --tpot and two --sim fields)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--startup", type=float, default=8.0,
                   help="seconds soakd takes to start sending after the simulator starts (places the step)")
    p.add_argument("--json", type=Path, help="write every run here (after each run)")
    p.add_argument("--keep", type=Path, help="keep each run's report.json here, as <mode>-<fault>-<seed>.json")
    a = p.parse_args(argv)
    if a.high_rate:
        a.concurrency, a.tokens, a.tpot = 128, 128, 0.004
        a.sim = ["tpot_per_batch=0", "device.power_per_request_watts=4", *a.sim]
    try:
        sim_block(a.sim)
    except ValueError as exc:
        p.error(str(exc))
    if shutil.which("taskset") is None:
        print("taskset (util-linux) is needed", file=sys.stderr)
        return 2
    cgroup, how = (None, "")
    modes = a.modes.split(",")
    if "quota" in modes:
        cgroup, how = quota_cgroup(f"soakd-busy-node-{os.getpid()}")
        print(f"quota: {how}", flush=True)
        if cgroup is None:
            modes.remove("quota")
    rows: list[dict[str, Any]] = []
    try:
        for i in range(a.runs):
            for mode in modes:
                for fault in a.faults.split(","):
                    r = one_run(mode, fault, a.seed + i, a, cgroup)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    if a.json:
                        a.json.write_text(json.dumps({"quota": how, "args": vars(a), "runs": rows}, indent=2,
                                                      default=str))  # paths (--json, --keep) as text
    finally:
        if cgroup is not None:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
    ok = True
    for mode in modes:
        for fault in a.faults.split(","):
            rs = [r for r in rows if r["mode"] == mode and r["fault"] == fault]
            want = "PASS" if fault == "calm" else "FAIL"
            hit = sum(r.get("result") == want for r in rs)
            shares = [r["impaired_share"] for r in rs if r.get("impaired_share") is not None]
            tok = [r["output_tokens_per_second"] for r in rs if r.get("output_tokens_per_second") is not None]
            hung = sum(bool(r.get("hung")) for r in rs)
            down = sum(bool(r.get("sampler_down")) or bool(r.get("target_down_seconds")) for r in rs)
            results = ", ".join(f"{k} {sum(r.get('result') == k for r in rs)}"
                                for k in ("PASS", "FAIL", "INCONCLUSIVE"))
            # and the server never stopped: a hang named is soakd's own stall charged to it
            good = hit >= 0.9 * len(rs) and hung == 0
            ok &= good
            print(f"{'ok  ' if good else 'MISS'} {mode:<8} {fault:<5} {want} in {hit} of {len(rs)} ({results}); "
                  f"requests impaired {min(shares, default=0):.1%}-{max(shares, default=0):.1%} "
                  f"(mean {sum(shares) / max(1, len(shares)):.1%}); "
                  f"~{sum(tok) / max(1, len(tok)):.0f} tokens/s; 'target hung' or 'engine wedged' in {hung} runs, "
                  f"a sampler or the target down in {down}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
