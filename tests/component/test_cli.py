"""``python -m soakd``: exit codes (0 ok, 1 failure, 2 usage/configuration) and what it prints."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from soakd.metrics import CATALOGUE, catalogue_markdown
from helpers import FAST_SIM, free_port, run_soakd, sim_server, soakd_env

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("args", "yaml_text", "needles"),
    [
        (["--duration", "soon"], None, ["--duration", "'soon'"]),
        (["--mix", "short_chat=abc"], None, ["--mix", "'abc'"]),
        (["--mix", "short_chat=1,nope=2"], None, ["load.mix", "'nope'"]),
        (["--window", "0.5s"], None, ["run.window", "0.5s"]),
        (["--concurrency", "0"], None, ["load.concurrency", "0"]),
        (["--target", "localhost:8000"], None, ["target.url", "'localhost:8000'"]),
        ([], "load:\n  concurrency: -1\n  arrival: bursty\n", ["load.concurrency", "-1", "load.arrival", "'bursty'"]),
        # three problems in different layers (two fields, one check across fields): all at once
        ([], "load:\n  concurrency: -1\n  arrival: bursty\n  mix: {short_chat: 1, nope: 2}\n",
         ["load.concurrency", "load.arrival", "load.mix: unknown scenario(s) ['nope']"]),
        ([], b"run:\n  duration: 1h  # caf\xe9\n", ["not UTF-8: byte 0xe9 at byte offset 26 (line 2)"]),
        ([], "run: [unclosed\n", ["not valid YAML", "line 2, column 1"]),
        ([], "load:\n  mix: {mine: 1}\nscenarios:\n  mine:\n    like: short_chat\n"
             "    source: {type: sharegpt, path: /nonexistent/sharegpt.json}\n",
         ["scenarios.mine.source.path", "/nonexistent/sharegpt.json"]),
        ([], "load:\n  mix: {replay: 1, short_chat: 1}\nscenarios:\n  replay:\n"
             "    source: {type: trace, path: examples/traces/burstgpt.csv}\n",
         ["load.mix: scenario 'replay' replays a trace", "only scenario"]),
        ([], "load:\n  mix: {replay: 1}\nscenarios:\n  replay:\n"
             "    source: {type: trace, path: tests/fixtures/trace_bad_line.jsonl}\n",
         ["scenarios.replay.source.path", "line 3", "'output_length'"]),
        (["--api-key-env", "SOAKD_TEST_UNSET_KEY"], None, ["target.api_key_env", "SOAKD_TEST_UNSET_KEY"]),
    ],
)
async def test_config_errors_exit_2_naming_the_field(
    tmp_path: Path, args: list[str], yaml_text: str | bytes | None, needles: list[str]
) -> None:
    cmd = ["run", "--target", f"http://127.0.0.1:{free_port()}/v1", "--duration", "1s",
           "--metrics-port", "0", "--state-dir", str(tmp_path / "state"), *args]
    if yaml_text is not None:
        path = tmp_path / "soak.yaml"
        path.write_bytes(yaml_text) if isinstance(yaml_text, bytes) else path.write_text(yaml_text)
        cmd += ["--config", str(tmp_path / "soak.yaml")]
    rc, out, err = await run_soakd(*cmd)
    assert rc == 2, (out, err)
    assert err.startswith("soakd: invalid configuration:") or err.startswith("soakd: ")
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err


async def test_env_config_error_exits_2() -> None:
    rc, _, err = await run_soakd("run", "--print-config", env=soakd_env(SOAKD_LOAD__CONCURRENCY="lots"))
    assert rc == 2 and "load.concurrency" in err and "'lots'" in err


async def test_unwritable_state_dir_exits_2(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc, _, err = await run_soakd("run", "--target", f"http://127.0.0.1:{free_port()}/v1", "--duration", "1s",
                                 "--metrics-port", "0", "--state-dir", str(blocker / "state"))
    assert rc == 2 and "run.state_dir" in err and "--state-dir" in err


async def test_usage_error_exits_2() -> None:
    rc, _, err = await run_soakd("run", "--no-such-flag")
    assert rc == 2 and "unrecognized arguments" in err
    rc, _, err = await run_soakd("run", "--concurrency", "2", "--rate", "3")
    assert rc == 2 and "not allowed with" in err


async def test_print_config_shows_effective_values() -> None:
    rc, out, err = await run_soakd("run", "--print-config", "--target", "http://10.0.0.5:8000/v1/",
                                   "--duration", "90m", "--rate", "3.5", "--mix", "short_chat=4,long_context=1",
                                   env=soakd_env(SOAKD_RUN__WINDOW="15m"))
    assert rc == 0, err
    import yaml

    cfg = yaml.safe_load(out)
    assert cfg["target"]["url"] == "http://10.0.0.5:8000/v1"
    assert cfg["run"]["duration"] == "1h30m" and cfg["run"]["window"] == "15m"
    assert cfg["load"]["rate"] == 3.5 and cfg["load"]["concurrency"] is None
    assert cfg["load"]["mix"] == {"short_chat": 4.0, "long_context": 1.0}


async def test_check_against_the_simulator_passes() -> None:
    async with sim_server(**FAST_SIM) as sim:
        rc, out, err = await run_soakd("check", "--target", sim.base_url)
        rc_json, out_json, _ = await run_soakd("check", "--target", sim.base_url, "--json")
    assert rc == 0, out + err
    assert f"soakd check {sim.base_url} (model soakd-sim)" in out
    rows = [line for line in out.splitlines() if line.startswith(("GET /models", "chat", "completions"))]
    assert len(rows) == 4 and all("  PASS  " in r for r in rows), out
    assert "4/4 probes passed" in out
    assert rc_json == 0
    results = json.loads(out_json)
    assert [r["ok"] for r in results] == [True] * 4


async def test_check_against_a_dead_port_fails() -> None:
    rc, out, err = await run_soakd("check", "--target", f"http://127.0.0.1:{free_port()}/v1", "--timeout", "5s")
    assert rc == 1, out + err
    assert "FAIL" in out and "cannot connect" in out and "0/4 probes passed" in out


async def test_check_with_the_wrong_key_fails() -> None:
    async with sim_server(api_key="sk-right", **FAST_SIM) as sim:
        rc, out, _ = await run_soakd("check", "--target", sim.base_url, "--api-key-env", "K",
                                     env=soakd_env(K="sk-wrong"))
        rc_ok, out_ok, _ = await run_soakd("check", "--target", sim.base_url, "--api-key-env", "K",
                                           env=soakd_env(K="sk-right"))
    assert rc == 1 and "HTTP 401" in out
    assert rc_ok == 0 and "4/4 probes passed" in out_ok


async def test_check_bad_target_exits_2() -> None:
    rc, _, err = await run_soakd("check", "--target", "ftp://example.com")
    assert rc == 2 and "--target" in err


async def test_run_against_a_target_that_never_answers_exits_1(tmp_path: Path) -> None:
    rc, out, err = await run_soakd("run", "--target", f"http://127.0.0.1:{free_port()}/v1", "--duration", "1s",
                                   "--metrics-port", "0", "--metrics-host", "127.0.0.1",
                                   "--state-dir", str(tmp_path), "--log-format", "json")
    assert rc == 1, out + err
    events = [json.loads(line)["event"] for line in out.splitlines() if line.startswith("{")]
    assert "target_unreachable" in events and "load_started" not in events


async def test_metrics_port_in_use_exits_1(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = await run_soakd("run", "--target", f"http://127.0.0.1:{free_port()}/v1", "--duration", "1s",
                                     "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                                     "--state-dir", str(tmp_path), "--log-format", "json")
    assert rc == 1 and f"127.0.0.1:{port}" in err and "--metrics-port" in err


async def test_metrics_catalogue_commands() -> None:
    rc, out, _ = await run_soakd("metrics")
    assert rc == 0
    names = [line.split("\t")[0] for line in out.splitlines()]
    assert names == [m.name for m in CATALOGUE]
    rc, md, _ = await run_soakd("metrics", "--markdown")
    assert rc == 0 and md == catalogue_markdown()
    assert md.startswith("| name | type | labels | help |")


async def test_version() -> None:
    from soakd import __version__

    rc, out, _ = await run_soakd("--version")
    assert rc == 0 and out.strip() == f"soakd {__version__}"


async def test_run_with_a_refused_key_fails_fast_with_exit_2(tmp_path: Path) -> None:
    """A target that answers 401 is misconfiguration, not an outage: exit 2 at once (not after
    retrying for the whole duration), naming the field, never echoing the key."""
    async with sim_server(api_key="sk-right", **FAST_SIM) as sim:
        common = ["run", "--target", sim.base_url, "--duration", "60s", "--metrics-host", "127.0.0.1",
                  "--metrics-port", "0", "--state-dir", str(tmp_path), "--log-format", "json"]
        rc, out, err = await run_soakd(*common, "--api-key-env", "K", env=soakd_env(K="sk-wrong-key"), timeout=20)
        rc_none, _, err_none = await run_soakd(*common, timeout=20)
    assert rc == 2, out + err
    assert "target.api_key_env" in err and "refused" in err and "401" in err
    assert "sk-wrong-key" not in out + err
    assert rc_none == 2 and "needs one" in err_none
