"""``soakd sweep`` against the simulator: it finds the simulator's capacity (its ``max_batch``
running slots, vLLM's max_num_seqs) within one step, writes the sweep into the store and as
JSON/Markdown/HTML, shows it on /metrics while it runs, and ``soakd run --load-from`` soaks at a
fraction of the knee. Bad sweep ranges and sweep files are clear errors.

The simulator runs in this process and the sweep in a child process (``python -m soakd sweep``),
so that neither starves the other on a busy machine. Its latency (20 ms to the first token, 10 ms
per further token, 8 tokens: 90 ms a request) dwarfs what soakd and the loop add, so the
throughput doubles from 1 to 2 to 4 requests in flight and stays flat beyond 4 (``max_batch``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from soakd.config import ConfigError, load_config
from soakd.core.summary import Quantiles, SubWindows, WindowSummary
from soakd.config import SweepConfig
from soakd.sweep.plan import decide, step_of
from helpers import SoakdProcess, http_get, run_soakd, sim_server

pytestmark = pytest.mark.timeout(180)

SLOW_SIM = {"ttft_base": 0.02, "tpot_base": 0.01, "tpot_per_batch": 0, "ttft_per_prompt_token": 0, "max_batch": 4}


def sweep_args(url: str, state: Path, *extra: str) -> list[str]:
    return ["sweep", "--target", url, "--mix", "short_chat=1", "--levels", "1,2,4,8,16", "--step", "4s",
            "--step-warmup", "1s", "--grace", "5s", "--metrics-host", "127.0.0.1", "--state-dir", str(state),
            "--log-format", "json", *extra]


async def test_sweep_finds_the_simulators_capacity(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env_cfg = tmp_path / "sweep.yaml"
    # a step runs on until it has min_requests: at concurrency 1 the simulator answers ~10 requests/s, so 120 take 12 s
    # idle, the default limit (3 x 4 s); on a busy machine longer (the fresh-clone make test of ae315eb with two CPU
    # burners had fewer than 120): a limit that leaves room, so that what is asserted is the sweep's rule
    env_cfg.write_text("scenarios:\n  short_chat: {max_tokens: 8, slo: {e2e: 5s}}\n"
                       "sweep: {min_requests: 120, max_step: 40s}\n")
    async with sim_server(**SLOW_SIM) as sim:
        proc = await SoakdProcess.start(*sweep_args(sim.base_url, state, "-c", str(env_cfg), "--metrics-port", "0",
                                                    "--json", str(tmp_path / "sweep.json"),
                                                    "--markdown", str(tmp_path / "sweep.md"),
                                                    "--html", str(tmp_path / "sweep.html")))
        try:
            started = await proc.json_event("sweep_started", timeout=30)
            await proc.json_event("sweep_step", timeout=60)  # one step done: /metrics shows it
            _, text = await http_get(started["metrics_url"])
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            assert fams["soakd_sweep_level"].samples[0].labels == {"mode": "concurrency"}
            assert [s.labels["level"] for s in fams["soakd_sweep_step_requests_per_second"].samples][:1] == ["1"]
            assert "soakd_requests" in fams and "soakd_goodput_requests" in fams  # the client side, live
            finished = await proc.json_event("sweep_finished", timeout=120)
            rc = await proc.finish()
        finally:
            await proc.kill()
    out = proc.output()
    assert rc == 0, out[-3000:]
    doc = json.loads((tmp_path / "sweep.json").read_text())
    levels = [s["level"] for s in doc["steps"]]
    rps = [s["requests_per_second"] for s in doc["steps"]]
    assert doc["stop_reason"] == "plateau", (doc["message"], rps)
    assert doc["knee"]["level"] in (4, 8), (levels, rps)  # the capacity is 4 running requests: within one step
    assert finished["knee"] == doc["knee"]
    assert levels[:3] == [1, 2, 4] and rps[1] > 1.5 * rps[0] and rps[2] > 1.5 * rps[1]
    assert all(s["requests"] >= 120 for s in doc["steps"])  # each step long enough for p50/p95 with intervals
    assert all(s["latency"]["e2e_p95"]["ci"] is not None for s in doc["steps"])
    assert doc["best_goodput"] is not None and doc["best_goodput"]["goodput_ratio"] > 0.9
    assert "knee at concurrency" in out and "| level |" in (tmp_path / "sweep.md").read_text()
    assert "<svg" in (tmp_path / "sweep.html").read_text()

    # the store holds it: --show renders the same document
    rc, shown, err = await run_soakd("sweep", "--show", "--state-dir", str(state), "--json", str(tmp_path / "again.json"))
    assert rc == 0, err
    assert json.loads((tmp_path / "again.json").read_text())["knee"] == doc["knee"]
    # a sweep is not a soak: the report of the state dir has no run to show
    rc, _, err = await run_soakd("report", "--state-dir", str(state))
    assert rc != 0 and "no run" in err.lower() or "no runs" in err.lower(), err

    # soak at 80% of the knee
    cfg = load_config(None, {"load": {"from_sweep": str(tmp_path / "sweep.json"), "sweep_fraction": 0.8}}, environ={})
    assert cfg.load.concurrency == max(1, int(doc["knee"]["level"] * 0.8)) and cfg.load.rate is None


async def test_open_loop_sweep_sees_the_queue_grow(tmp_path: Path) -> None:
    """Open loop beyond the capacity (4 slots of 90 ms: about 44 req/s): the queue grows within the
    step and the sweep says so instead of waiting for a steady state."""
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text("scenarios:\n  short_chat: {max_tokens: 8}\n")
    async with sim_server(**SLOW_SIM) as sim:
        rc, out, err = await run_soakd(
            "sweep", "-c", str(cfg), "--target", sim.base_url, "--rate", "1", "--mix", "short_chat=1", "--levels", "10,20,80",
            "--step", "4s", "--step-warmup", "0.5s", "--grace", "10s", "--metrics-host", "127.0.0.1",
            "--metrics-port", "0", "--state-dir", str(tmp_path), "--log-format", "json",
            "--json", str(tmp_path / "sweep.json"), timeout=120)
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert rc == 0, (out + err)[-3000:]
    assert doc["mode"] == "rate"
    last = doc["steps"][-1]
    assert last["level"] == 80 and doc["stop_reason"] in ("queue", "plateau"), doc["message"]
    assert doc["knee"]["level"] == 20, [(s["level"], s["requests_per_second"], s["queue_rise"]) for s in doc["steps"]]
    assert last["queue_rise"] is not None and last["queue_rise"] > 0.2


@pytest.mark.parametrize("levels, needle", [
    ("8,4", "sweep.levels: must rise strictly"),
    ("0,1", "sweep.levels: every level must be > 0"),
    ("1.5,3", "closed-loop levels are concurrencies"),
    ("8:2", "sweep.stop"),
    ("x", "--levels: expected a list"),
])
async def test_a_sweep_range_that_cannot_run_is_a_clear_error(tmp_path: Path, levels: str, needle: str) -> None:
    rc, _, err = await run_soakd("sweep", "--target", "http://127.0.0.1:9/v1", "--levels", levels,
                                 "--state-dir", str(tmp_path))
    assert rc == 2 and needle in err, err


def test_bad_sweep_files_for_load_from(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read a sweep"):
        load_config(None, {"load": {"from_sweep": str(bad)}}, environ={})
    bad.write_text(json.dumps({"mode": "concurrency", "knee": None}))
    with pytest.raises(ConfigError, match="found no knee"):
        load_config(None, {"load": {"from_sweep": str(bad)}}, environ={})
    # no knee within the levels: refused unless a share of the last level is asked for explicitly
    rising = tmp_path / "rising.json"
    rising.write_text(json.dumps({"mode": "concurrency", "knee": None, "stop_reason": "end",
                                  "message": "no knee within the levels: throughput still rising at the last level 8",
                                  "steps": [{"level": 1}, {"level": 2}, {"level": 4}, {"level": 8}]}))
    with pytest.raises(ConfigError, match="found no knee \\(no knee within the levels.*--load-fraction"):
        load_config(None, {"load": {"from_sweep": str(rising)}}, environ={})
    cfg = load_config(None, {"load": {"from_sweep": str(rising), "sweep_fraction": 0.5}}, environ={})
    assert cfg.load.concurrency == 4
    bad.write_text(json.dumps({"mode": "rate", "knee": {"level": 20.0}}))
    cfg = load_config(None, {"load": {"from_sweep": str(bad), "sweep_fraction": 0.5}}, environ={})
    assert cfg.load.rate == 10.0 and cfg.load.concurrency is None


def _window(rate: float, seconds: float = 60.0, *, noise: list[float] | None = None, error_rate: float = 0.0,
            e2e: list[float] | None = None) -> WindowSummary:
    k = 10
    sub = seconds / k
    counts = [round(rate * sub * (1 + (noise[j] if noise else 0.0))) for j in range(k)]
    ok = sum(counts)
    total = round(ok / (1 - error_rate))
    q = Quantiles(p50=0.1, p95=0.2, count=ok, p50_ci=(0.09, 0.11), p95_ci=(0.18, 0.22))
    return WindowSummary(window=0, duration_seconds=seconds, requests=total, outcomes={"ok": ok},
                         error_rate=1 - ok / total, requests_per_second=ok / seconds, e2e_seconds=q,
                         subwindows=SubWindows(seconds=sub, requests=counts, ok=counts, e2e=e2e or [0.1] * k))


async def test_no_knee_within_explicit_levels_says_so_and_exits_3(tmp_path: Path) -> None:
    """--levels 1,2: the simulator (4 slots) still doubles its throughput at 2: "no knee within the
    levels", exit 3, the hint for explicit levels; the HTML draws geometric levels on a log axis."""
    async with sim_server(**SLOW_SIM) as sim:
        args = sweep_args(sim.base_url, tmp_path / "state", "--json", str(tmp_path / "s.json"),
                          "--html", str(tmp_path / "s.html"), "--metrics-port", "0")
        args[args.index("1,2,4,8,16")] = "1,2"
        rc, out, err = await run_soakd(*args, timeout=120)
    assert rc == 3, out[-2000:] + err
    assert "no knee within the levels" in out and "add higher levels to --levels" in out, out[-1500:]
    assert "knee at" not in out
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["knee"] is None and doc["stop_reason"] == "end"


def test_geometric_levels_are_charted_on_a_log_axis() -> None:
    from soakd.sweep.render import charts, geometric

    assert geometric([1, 2, 4, 8, 16]) and geometric([10, 30, 90]) and not geometric([10, 20, 30, 40])
    steps = [{"level": lv, "requests_per_second": lv, "latency": {k: {"value": 0.1} for k in
                                                                   ("e2e_p50", "e2e_p95", "ttft_p95")}}
             for lv in (1, 2, 4, 8, 16, 32)]
    svg = charts({"mode": "concurrency", "steps": steps})[0]
    assert "log scale" in svg and ">32<" in svg and ">16<" in svg
    linear = charts({"mode": "concurrency", "steps": [dict(s, level=10 * (i + 1)) for i, s in enumerate(steps)]})[0]
    assert "log scale" not in linear


def test_every_sweep_metric_is_exported_once_a_knee_is_found() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from soakd.metrics import CATALOGUE
    from soakd.sweep.runner import SweepCollector, SweepState

    state = SweepState("concurrency", [1, 2, 4])
    steps = [step_of(0, 1, _window(10), {}, open_loop=False), step_of(1, 2, _window(10.1), {}, open_loop=False)]
    decide(steps[:1], SweepConfig(), 0.01, last=False)
    state.step, state.steps, state.decision = 1, steps, decide(steps, SweepConfig(), 0.01, last=False)
    reg = CollectorRegistry()
    reg.register(SweepCollector(state))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    for spec in (m for m in CATALOGUE if m.group == "sweep"):
        assert fams[spec.name].samples, spec.name
    assert fams["soakd_sweep_knee_level"].samples[0].value == 1.0
    assert {s.labels["level"] for s in fams["soakd_sweep_step_requests_per_second"].samples} == {"1", "2"}


def test_the_knee_rule() -> None:
    cfg = SweepConfig()
    jitter = [0.02, -0.02] * 5
    steps = [step_of(0, 1, _window(10, noise=jitter), {}, open_loop=False)]
    assert not decide(steps, cfg, 0.01, last=False).stop
    steps.append(step_of(1, 2, _window(19.5, noise=jitter), {}, open_loop=False))
    assert not decide(steps, cfg, 0.01, last=False).stop and steps[-1].status == "rising"
    steps.append(step_of(2, 4, _window(20.2, noise=jitter), {}, open_loop=False))  # +3.6%: below min_gain
    d = decide(steps, cfg, 0.01, last=False)
    assert d.stop and d.reason == "plateau" and d.knee == 1 and steps[1].status == "knee"
    # a noisy step whose gain is not beyond its uncertainty is no rise either
    noisy = [0.6, -0.6] * 5
    s2 = [step_of(0, 1, _window(10, noise=noisy), {}, open_loop=False),
          step_of(1, 2, _window(11.5, noise=noisy), {}, open_loop=False)]
    decide(s2[:1], cfg, 0.01, last=False)
    assert decide(s2, cfg, 0.01, last=False).reason == "plateau"
    # errors above the budget: past the knee, the knee is the step before
    s3 = [step_of(0, 1, _window(10), {}, open_loop=False), step_of(1, 2, _window(20, error_rate=0.05), {},
                                                                  open_loop=False)]
    decide(s3[:1], cfg, 0.01, last=False)
    d = decide(s3, cfg, 0.01, last=False)
    assert (d.reason, d.knee) == ("errors", 0)
    # an SLO broken (a scenario's goodput below its objective): past the knee
    from soakd.config import SloConfig
    from soakd.core.summary import Goodput, ScenarioSummary

    slo = {"short_chat": SloConfig(ttft=0.5, quantile=0.95)}
    good, bad = _window(10), _window(20)
    good.scenarios = {"short_chat": ScenarioSummary(goodput=Goodput(requests=600, met=590))}
    good.goodput = Goodput(requests=600, met=590)
    bad.scenarios = {"short_chat": ScenarioSummary(goodput=Goodput(requests=1200, met=1000))}
    bad.goodput = Goodput(requests=1200, met=1000)
    s6 = [step_of(0, 1, good, slo, open_loop=False), step_of(1, 2, bad, slo, open_loop=False)]
    decide(s6[:1], cfg, 0.01, last=False)
    d = decide(s6, cfg, 0.01, last=False)
    assert (d.reason, d.knee) == ("slo", 0) and s6[1].slo_broken == ["short_chat"] and s6[0].goodput_per_second
    # open loop: e2e rising through the step is a growing queue
    rising = [0.1 * 1.1 ** j for j in range(10)]
    s4 = [step_of(0, 10, _window(10), {}, open_loop=True), step_of(1, 20, _window(19, e2e=rising), {},
                                                                   open_loop=True)]
    decide(s4[:1], cfg, 0.01, last=False)
    d = decide(s4, cfg, 0.01, last=False)
    assert (d.reason, d.knee) == ("queue", 0) and s4[1].queue_growing
    # still rising at the last level: no plateau, the end of the range says so
    s5 = [step_of(0, 1, _window(10, noise=jitter), {}, open_loop=False),
          step_of(1, 2, _window(20, noise=jitter), {}, open_loop=False)]
    decide(s5[:1], cfg, 0.01, last=False)
    d = decide(s5, cfg, 0.01, last=True)
    assert d.reason == "end" and d.knee is None and "no knee within the levels" in d.message
    assert "raise sweep.stop (now 256)" in d.message
    decide(s5[:1], SweepConfig(levels=[1, 2]), 0.01, last=False)
    d = decide(s5, SweepConfig(levels=[1, 2]), 0.01, last=True)  # explicit levels: sweep.stop is no help
    assert d.knee is None and "add higher levels to --levels" in d.message and "sweep.stop" not in d.message.replace(
        "(sweep.levels)", "")
