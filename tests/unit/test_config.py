"""Configuration: one model, YAML file < SOAKD_* environment < flags, every error naming its
field path and bad value, and the API key kept out of everything soakd prints or serves."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from soakd.cli import build_parser
from soakd.config.flags import overrides as overrides_from_args
from soakd.config import ConfigError, SoakConfig, env_overrides, load_config
from soakd.runtime import Runtime
from soakd.workload.scenarios import resolve_all
from helpers import QUICK_SIM, http_get, report_of, run_outcomes, run_soakd, sim_server, soakd_env, wait_until

pytestmark = pytest.mark.timeout(60)

SECRET = "sk-test-Zq8v3LmT0pSecretValue"
HEADER_SECRET = "hdr-test-Vb72KcSecretHeaderValue"  # an X-Api-Key header's value: as secret as the key


def write(tmp_path: Path, text: str, name: str = "soak.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def config_error(tmp_path: Path, text: str, **kw: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ={}, **kw)  # type: ignore[arg-type]
    return info.value


# ---- errors -----------------------------------------------------------------------------------


def test_malformed_yaml_names_line_and_column(tmp_path: Path) -> None:
    err = config_error(tmp_path, "target:\n  url: http://x:1/v1\nrun:\n  duration: [1h\n  window: 30m\n")
    msg = str(err)
    assert "not valid YAML" in msg
    assert "soak.yaml" in msg
    assert "line 5, column" in msg  # where the parser noticed the unclosed [


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    err = config_error(tmp_path, "- target\n- run\n")
    assert "expected a mapping" in str(err)


def test_unreadable_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config(tmp_path / "missing.yaml", environ={})


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("run:\n  durashun: 1h\n", "run.durashun", "unknown field"),
        ("target:\n  timeouts:\n    idle_s: 5\n", "target.timeouts.idle_s", "unknown field"),
        ("load:\n  concurrency: many\n", "load.concurrency", "'many'"),
        ("target:\n  keep_alive: sometimes\n", "target.keep_alive", "'sometimes'"),
        ("load:\n  arrival: bursty\n", "load.arrival", "'bursty'"),
        ("target:\n  url: ftp://example.com/v1\n", "target.url", "'ftp://example.com/v1'"),
        ("run:\n  duration: 12 hours\n", "run.duration", "'12 hours'"),
        ("run:\n  window: 5 minutes\n", "run.window", "'5 minutes'"),
        ("run:\n  duration: -5s\n", "run.duration", "'-5s'"),
        ("run:\n  warmup: -1\n", "run.warmup", "-1"),
        ("load:\n  concurrency: -3\n", "load.concurrency", "-3"),
        ("load:\n  rate: -2.5\n", "load.rate", "-2.5"),
        ("load:\n  max_in_flight: 0\n", "load.max_in_flight", "0"),
        ("metrics:\n  port: 70000\n", "metrics.port", "70000"),
        ("load:\n  mix: {short_chat: -1}\n", "load.mix", "-1"),
        ("load:\n  concurrency: 4\n  rate: 10\n", "load", "concurrency=4, rate=10"),
        ("load:\n  mix: {short_chat: 1, shrot_chat: 2}\n", "load.mix", "'shrot_chat'"),
        ("load:\n  mix: {my_chat: 1}\nscenarios:\n  my_chat:\n    max_tokens: 64\n",
         "scenarios.my_chat", "'my_chat'"),
        ("scenarios:\n  short_chat:\n    max_tokens: [10, 5]\n", "scenarios.short_chat.max_tokens", "[10, 5]"),
        ("scenarios:\n  short_chat:\n    temperature: 3\n", "scenarios.short_chat.temperature", "3"),
        ("scenarios:\n  mine:\n    like: short_chat\n    source: {type: jsonl}\nload:\n  mix: {mine: 1}\n",
         "scenarios.mine.source", "'jsonl'"),
        ("scenarios:\n  BadName:\n    like: short_chat\n", "scenarios", "'BadName'"),
        ("run:\n  window: 500ms\n", "run.window", "0.5s"),
        ("target:\n  headers: {Authorization: Bearer x}\n", "target.headers", "api_key_env"),
    ],
)
def test_error_names_field_path_and_bad_value(tmp_path: Path, text: str, path: str, value: str) -> None:
    err = config_error(tmp_path, text)
    assert len(err.errors) >= 1
    line = next((e for e in err.errors if e.startswith(path + ":")), None)
    assert line is not None, f"no error line starting with {path!r}: {err.errors}"
    assert value in line, f"{value!r} not in {line!r}"


def test_several_errors_are_reported_at_once(tmp_path: Path) -> None:
    err = config_error(
        tmp_path,
        "target:\n  url: nowhere\nrun:\n  duration: soon\n  window: 0\n  durashun: 1h\n"
        "load:\n  concurrency: 0\n  arrival: bursty\n",
    )
    paths = {e.split(":", 1)[0] for e in err.errors}
    assert {"target.url", "run.duration", "run.window", "run.durashun", "load.concurrency", "load.arrival"} <= paths
    text = str(err)
    for bad in ("'nowhere'", "'soon'", "'bursty'"):
        assert bad in text


def test_cross_field_errors_are_reported_together(tmp_path: Path) -> None:
    err = config_error(
        tmp_path,
        "run:\n  window: 0.5\nload:\n  mix: {nope: 1}\ntarget:\n  api_key_env: K\n  api_key_file: /k\n",
    )
    paths = [e.split(":", 1)[0] for e in err.errors]
    assert paths.count("load.mix") == 1 and "run.window" in paths and "target" in paths


def test_missing_dataset_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    cfg = load_config(
        write(tmp_path, f"load:\n  mix: {{mine: 1}}\nscenarios:\n  mine:\n    like: short_chat\n"
                        f"    source: {{type: jsonl, path: {missing}}}\n"),
        environ={},
    )
    with pytest.raises(ConfigError) as info:
        resolve_all(cfg)
    assert info.value.errors[0].startswith("scenarios.mine.source.path:")
    assert str(missing) in info.value.errors[0]


def test_malformed_dataset_fails_at_start_naming_field_and_line(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('[{"role": "user", "content": "hi"}]\n{"messages": [{"role": "user"}]}\n')
    cfg = load_config(
        write(tmp_path, f"load:\n  mix: {{mine: 1}}\nscenarios:\n  mine:\n    like: short_chat\n"
                        f"    source: {{type: jsonl, path: {data}}}\n"),
        environ={},
    )
    with pytest.raises(ConfigError) as info:
        resolve_all(cfg)
    msg = info.value.errors[0]
    assert msg.startswith("scenarios.mine.source.path:") and "line 2" in msg


# ---- sources and precedence -----------------------------------------------------------------


def test_env_overrides() -> None:
    env = {"SOAKD_RUN__DURATION": "1h", "SOAKD_LOAD__CONCURRENCY": "4", "SOAKD_LOAD__MIX": "{short_chat: 3}",
           "SOAKD_CONFIG": "/ignored.yaml", "SOAKD_NOT_A_SECTION": "x", "OTHER": "y"}
    # values are YAML scalars and collections
    assert env_overrides(env) == {"run": {"duration": "1h"}, "load": {"concurrency": 4, "mix": {"short_chat": 3}}}
    assert env_overrides({"SOAKD_SAMPLERS__NVML__MODE": "'off'"}) == {"samplers": {"nvml": {"mode": "off"}}}
    cfg = load_config(None, environ=env)
    assert cfg.load.concurrency == 4 and cfg.run.duration == 3600 and cfg.load.mix == {"short_chat": 3}
    # names are case-insensitive, null is None, a list is YAML, a typo is an error naming the field
    assert load_config(None, environ={"soakd_load__rate": "2.5", "SOAKD_LOAD__CONCURRENCY": "null"}).load.rate == 2.5
    assert load_config(None, environ={"SOAKD_ANALYSIS__DRIFT__METRICS": "[e2e_p50, e2e_p95]"}
                       ).analysis.drift.metrics == ["e2e_p50", "e2e_p95"]
    with pytest.raises(ConfigError, match=r"run\.duraton: unknown field"):
        load_config(None, environ={"SOAKD_RUN__DURATON": "1h"})
    with pytest.raises(ConfigError, match=r"load\.mix"):
        load_config(None, environ={"SOAKD_LOAD__MIX": "{bad"})
    cfg = load_config(None, environ=env)
    assert cfg.run.duration == 3600.0
    assert cfg.load.concurrency == 4
    assert cfg.load.mix == {"short_chat": 3.0}


def test_env_error_names_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"SOAKD_RUN__DURATION": "soon"})
    assert info.value.errors == ["run.duration: expected a duration like 45s, 30m, 12h or 1h30m, got 'soon'"]


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = write(tmp_path, "run:\n  duration: 2h\n  seed: 5\nload:\n  rate: 5\n  concurrency: null\n")
    env = {"SOAKD_RUN__DURATION": "1h"}
    args = build_parser().parse_args(["run", "--duration", "30m", "--concurrency", "3"])
    flags = overrides_from_args(args)

    only_file = load_config(f, environ={})
    assert (only_file.run.duration, only_file.load.rate, only_file.run.seed) == (7200.0, 5.0, 5)
    file_env = load_config(f, environ=env)
    assert file_env.run.duration == 3600.0 and file_env.run.seed == 5
    all_three = load_config(f, flags, environ=env)
    assert all_three.run.duration == 1800.0
    assert all_three.run.seed == 5  # untouched by env and flags
    # --concurrency replaces the file's open loop instead of colliding with it
    assert all_three.load.concurrency == 3 and all_three.load.rate is None and all_three.load.closed_loop


def test_defaults_are_the_methods() -> None:
    cfg = SoakConfig()
    assert cfg.run.duration == 12 * 3600 and cfg.run.window == 1800 and cfg.load.effective_concurrency == 8
    assert set(cfg.load.mix) == {"short_chat", "long_context", "batch_burst", "multi_turn", "code_completion"}


def test_print_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "run:\n  duration: 1h30m\n  window: 10m\nload:\n  rate: 2.5\n"), environ={})
    dumped = cfg.redacted()
    assert dumped["run"]["duration"] == "1h30m" and dumped["run"]["window"] == "10m"
    again = SoakConfig.model_validate(yaml.safe_load(yaml.safe_dump(dumped)))
    assert again == cfg


# ---- secrets -----------------------------------------------------------------------------------


def test_api_key_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_LLM_KEY", f"  {SECRET}\n")
    assert load_config(None, {"target": {"api_key_env": "MY_LLM_KEY"}}, environ={}).api_key() == SECRET
    key_file = tmp_path / "key"
    key_file.write_text(f"{SECRET}\nsecond line ignored\n")
    assert load_config(None, {"target": {"api_key_file": str(key_file)}}, environ={}).api_key() == SECRET
    assert SoakConfig().api_key() is None


def test_missing_api_key_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MY_LLM_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"target\.api_key_env: environment variable MY_LLM_KEY"):
        load_config(None, {"target": {"api_key_env": "MY_LLM_KEY"}}, environ={}).api_key()
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"target\.api_key_file"):
        load_config(None, {"target": {"api_key_file": str(empty)}}, environ={}).api_key()


def test_the_key_is_not_a_config_field() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"target": {"api_key": SECRET}}, environ={})
    assert "target.api_key: unknown field" in str(info.value)
    assert SECRET not in str(info.value)  # not even echoed back in the error


async def test_print_config_never_shows_the_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(SECRET)
    for flag, value in (("--api-key-env", "MY_LLM_KEY"), ("--api-key-file", str(key_file))):
        rc, out, err = await run_soakd(
            "run", "--print-config", "--target", "http://127.0.0.1:9/v1", flag, value,
            env=soakd_env(MY_LLM_KEY=SECRET),
        )  # fmt: skip
        assert rc == 0, err
        printed = yaml.safe_load(out)
        assert printed["target"]["url"] == "http://127.0.0.1:9/v1"
        assert SECRET not in out and SECRET not in err
        assert printed["target"]["api_key_env" if flag == "--api-key-env" else "api_key_file"] == value


async def test_key_reaches_the_server_but_never_logs_or_summary(tmp_path: Path) -> None:
    """A short ``soakd run`` (JSON logs at debug level) against a simulator that requires the key:
    requests succeed — so the key went out as ``Authorization: Bearer`` — and the key is in no
    log line, no stderr and no file soakd wrote."""
    state = tmp_path / "state"
    async with sim_server(api_key=SECRET, **QUICK_SIM) as sim:
        rc, out, err = await run_soakd(
            "run", "--target", sim.base_url, "--api-key-env", "MY_LLM_KEY", "--duration", "2s",
            "--window", "1s", "--warmup", "0s", "--concurrency", "2", "--mix", "short_chat=1",
            "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--state-dir", str(state),
            "--log-format", "json", "--log-level", "debug", "--no-progress",
            env=soakd_env(MY_LLM_KEY=SECRET, SOAKD_TARGET__HEADERS=f"{{X-Api-Key: {HEADER_SECRET}}}"), timeout=30,
        )  # fmt: skip
    assert rc == 3, out[-2000:] + err[-2000:]  # two 1 s windows: too few to judge (INCONCLUSIVE)
    assert SECRET not in out and SECRET not in err
    assert HEADER_SECRET not in out and HEADER_SECRET not in err
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert any(e.get("event") == "soakd_started" for e in events)
    reports = list(state.glob("*/report.json"))
    assert len(reports) == 1
    outcomes = run_outcomes(json.loads(reports[0].read_text()))
    assert outcomes["ok"] > 0 and outcomes["http_error"] == 0
    started = next(e for e in events if e.get("event") == "soakd_started")
    assert started["config"]["target"]["headers"] == {"X-Api-Key": "**********"}
    for f in state.rglob("*"):
        if f.is_file():
            text = f.read_text(errors="replace")
            assert SECRET not in text and HEADER_SECRET not in text, f


async def test_url_password_never_logs_or_reaches_status_or_store(tmp_path: Path) -> None:
    """A user and password in the target URL go out (HTTP basic auth) but are shown as *** in every
    log line, the state dir (the run row's target, the stored config) and the report."""
    password = "pw-Hq4SecretUrlPassword"
    state = tmp_path / "state"
    async with sim_server(**QUICK_SIM) as sim:
        url = sim.base_url.replace("://", f"://qa:{password}@", 1)
        rc, out, err = await run_soakd(
            "run", "--target", url, "--duration", "2s", "--window", "1s", "--warmup", "0s", "--concurrency", "2",
            "--mix", "short_chat=1", "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--state-dir", str(state),
            "--log-format", "json", "--log-level", "debug", "--no-progress", timeout=30,
        )  # fmt: skip
    assert rc == 3, out[-2000:] + err[-2000:]
    assert password not in out and password not in err
    shown = sim.base_url.replace("://", "://***@", 1)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    started = next(e for e in events if e.get("event") == "soakd_started")
    assert started["config"]["target"]["url"] == shown
    report = json.loads(next(state.glob("*/report.json")).read_text())
    assert report["run"]["target"] == shown and run_outcomes(report)["ok"] > 0
    for f in state.rglob("*"):
        if f.is_file():
            assert password not in f.read_text(errors="replace"), f


async def test_key_not_in_status_metrics_or_final_summary(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(SECRET + "\n")
    async with sim_server(api_key=SECRET, **QUICK_SIM) as sim:
        cfg = load_config(None, {
            "target": {"url": sim.base_url, "api_key_file": str(key_file), "headers": {"X-Api-Key": HEADER_SECRET}},
            "run": {"duration": 2.0, "window": 1.0, "warmup": 0, "state_dir": str(tmp_path / "state")},
            "load": {"concurrency": 2, "mix": {"short_chat": 1}},
            "metrics": {"host": "127.0.0.1", "port": 0},
        }, environ={})  # fmt: skip
        runtime = Runtime(cfg, progress=False)
        task = asyncio.create_task(runtime.run())
        try:
            await wait_until(lambda: runtime.load is not None and runtime.load.recorder.finished_count >= 3,
                             what="a few finished requests")
            base = runtime.web.url
            for path in ("/status", "/metrics", "/readyz", "/healthz", "/"):
                status, body = await http_get(base + path)
                assert status == 200, path
                assert SECRET not in body and HEADER_SECRET not in body, path
            _, status_body = await http_get(base + "/status")
            assert json.loads(status_body)["outcomes"]["ok"] >= 3  # the key worked
        finally:
            outcome = await asyncio.wait_for(task, 20)
    for secret in (SECRET, HEADER_SECRET):
        assert secret not in json.dumps(dataclasses.asdict(outcome), default=str)
        assert secret not in json.dumps(runtime.status.status(), default=str)
        assert secret not in json.dumps(report_of(cfg.run.state_dir), default=str)


def test_simulator_key_in_config_is_masked(tmp_path: Path) -> None:
    """The one secret a config file may hold is the simulator's own key (``soakd sim``/``demo``):
    the effective configuration masks it, and the simulator still gets the real value."""
    cfg = load_config(write(tmp_path, f"sim:\n  api_key: {SECRET}\n"), environ={})
    dumped = yaml.safe_dump(cfg.redacted())
    assert SECRET not in dumped and "**********" in dumped
    assert cfg.sim.api_key is not None and cfg.sim.api_key.get_secret_value() == SECRET
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)


@pytest.mark.parametrize("name", ["X-Api-Key", "api-key", "Proxy-Authorization", "Cookie", "X-Auth-Token",
                                  "x-amz-security-token", "X-Team-Key", "X-Client-Secret", "X-Session-Id"])
def test_credential_headers_are_secrets_by_type(tmp_path: Path, name: str) -> None:
    """A header that can carry a credential is a SecretStr from validation on: masked wherever the
    configuration is shown (``redacted()``: --print-config, the store, the soakd_started line, the
    report), in repr, and sent as given."""
    cfg = load_config(write(tmp_path, f"target:\n  headers:\n    {name}: {SECRET}\n    X-Request-Source: soak-qa\n"),
                      environ={})
    shown = cfg.redacted()["target"]["headers"]
    assert shown == {name: "**********", "X-Request-Source": "soak-qa"}  # nothing else is masked
    assert SECRET not in yaml.safe_dump(cfg.redacted()) and SECRET not in repr(cfg)
    assert cfg.target.header_values() == {name: SECRET, "X-Request-Source": "soak-qa"}
    assert cfg.target_list()[0].header_values()[name] == SECRET  # the named copy keeps the value
    again = SoakConfig.model_validate(cfg.model_dump())  # Python-mode round trip: still a secret, same value
    assert again == cfg and again.target.header_values()[name] == SECRET


def test_only_credentials_are_masked(tmp_path: Path) -> None:
    """Keys that merely look secret (first_token, ttft_per_prompt_token, api_key_env) show their values;
    a URL shows everything but its user and password (and credential query parameters)."""
    cfg = load_config(write(tmp_path, (
        "target:\n  url: http://user:pw@vllm.internal:8000/v1\n  api_key_env: MY_LLM_KEY\n"
        "  timeouts: {first_token: 2m}\n"
        "samplers:\n  dcgm: {url: 'http://dcgm:9400/metrics?token=tk&format=text'}\n"
        "sim:\n  ttft_per_prompt_token: 0.00003\n")), environ={})  # fmt: skip
    d = cfg.redacted()
    assert d["target"]["timeouts"]["first_token"] == "2m" and d["sim"]["ttft_per_prompt_token"] == 3e-05
    assert d["target"]["api_key_env"] == "MY_LLM_KEY"
    assert d["target"]["url"] == "http://***@vllm.internal:8000/v1" == cfg.target.display_url
    assert d["samplers"]["dcgm"]["url"] == "http://dcgm:9400/metrics?token=***&format=text"
    assert d["samplers"]["server"]["url"] == "auto"
    assert cfg.target.url == "http://user:pw@vllm.internal:8000/v1"  # what the client connects to
    masked = SoakConfig().redacted()
    assert masked == SoakConfig().model_dump(mode="json")  # a config without credentials: nothing masked
    assert "**********" not in json.dumps(masked) and "***" not in json.dumps(masked)


def test_errors_never_echo_a_credential(tmp_path: Path) -> None:
    err = config_error(tmp_path, "target:\n  url: ftp://user:hunter2@h/v1\n  headers: {X-Api-Key: 123456789}\n")
    text = "\n".join(err.errors)
    assert "target.headers.X-Api-Key: expected a string" in text and "123456789" not in text
    assert "ftp://***@h/v1" in text and "hunter2" not in text
    # the key itself where its variable's name belongs: refused, and not echoed
    err = config_error(tmp_path, f"target:\n  api_key_env: {SECRET}\n")
    assert "target.api_key_env: expected the name of the environment variable" in err.errors[0]
    assert SECRET not in str(err)


def test_yaml_off_is_the_nvml_mode_not_a_boolean(tmp_path):
    """YAML 1.1 reads a bare `off` as false; `samplers.nvml.mode: off` still means off."""
    f = tmp_path / "soak.yaml"
    f.write_text("samplers:\n  nvml:\n    mode: off\n")
    assert load_config(f, environ={}).samplers.nvml.mode == "off"
    assert load_config(None, environ={"SOAKD_SAMPLERS__NVML__MODE": "on"}).samplers.nvml.mode == "on"


def test_every_flag_names_a_field_and_errors_name_the_flag() -> None:
    from soakd.config import flags

    for f in flags.FLAGS:
        flags._field(f.path)  # noqa: SLF001 - raises KeyError for a path the model does not have
    args = build_parser().parse_args(["run", "--metrics-port", "70000", "--duration", "1h"])
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides_from_args(args), environ={})
    annotated = flags.annotate(info.value, args)
    assert any(line.startswith("metrics.port:") and line.endswith("(from --metrics-port)")
               for line in annotated.errors), annotated.errors
    # the choices are the model's
    assert build_parser().parse_args(["run", "--nvml", "off"]).nvml == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--nvml", "sometimes"])


def test_fail_on_names_the_kinds_the_finding_registry_lets_it_name() -> None:
    """``analysis.verdict.fail_on``'s choices and default are the registry's (soakd.core.findings.KINDS)."""
    from typing import get_args

    from soakd.config.analysis import VerdictConfig
    from soakd.core.findings import KINDS

    (choice,) = get_args(VerdictConfig.model_fields["fail_on"].annotation)
    assert set(get_args(choice)) == {k.name for k in KINDS.values() if k.fail_on}
    assert set(VerdictConfig().fail_on) == {k.name for k in KINDS.values() if k.default_fail}
