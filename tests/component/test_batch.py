"""``soakd batch`` against the simulator: a batch of 1,000 inputs with bad lines injected, the
server restarted in the middle and soakd itself killed (SIGKILL) and run again: every good line
answered exactly once in the output file, every bad line in the error file with its line and
field, no finished ``custom_id`` sent again after the restart, the accounting and the exit code
of the failure budget. The simulator echoes soakd's ``X-Request-Id``
(``soakd-batch-<custom_id>-<try>-<nonce>``), so the sends of each input are counted at the server.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from soakd.batch.input import read_input
from helpers import QUICK_SIM, SoakdProcess, run_soakd, sim_server

pytestmark = pytest.mark.timeout(240)

BAD = {  # line number (1-based, in the final file) -> the injected bad line and what its error must name
    5: ("{not json", "line 5: line: not JSON"),
    120: (json.dumps({"custom_id": "c-7", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"messages": [{"role": "user", "content": "again"}]}}), "already on line"),
    300: (json.dumps({"custom_id": "x-url", "method": "POST", "url": "/v1/images", "body": {}}), "line 300: url"),
    450: (json.dumps({"custom_id": "x-body", "method": "POST", "url": "/v1/completions"}), "line 450: body"),
    600: (json.dumps({"custom_id": "x-get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}}),
          "line 600: method"),
    700: (json.dumps([1, 2, 3]), "expected a JSON object"),
    800: (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}), "line 800: custom_id"),
    900: (json.dumps({"custom_id": "x-msgs", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"messages": []}}), "line 900: body.messages"),
}


def good_line(i: int) -> dict[str, Any]:
    cid = f"c-{i}"
    if i % 50 == 0:
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"input": f"text {i}"}}
    if i % 10 == 0:
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": f"count to {i}", "max_tokens": 4}}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4}}


def write_input(path: Path, n: int = 1000) -> list[str]:
    lines, cids, i = [], [], 0
    while len(cids) < n:
        no = len(lines) + 1
        if no in BAD:
            lines.append(BAD[no][0])
            continue
        obj = good_line(i)
        cids.append(obj["custom_id"])
        lines.append(json.dumps(obj))
        i += 1
    path.write_text("\n".join(lines) + "\n")
    return cids


def sends_by_custom_id(recent: Any, after_ns: int = 0) -> dict[str, int]:
    out: dict[str, int] = {}
    for rid, t_received, _first, _done in recent:
        if rid.startswith("soakd-batch-") and t_received >= after_ns:
            cid = unquote(rid[len("soakd-batch-"):].rsplit("-", 2)[0])
            out[cid] = out.get(cid, 0) + 1
    return out


def finished_in_store(state: Path) -> set[str]:
    conn = sqlite3.connect(state / "soakd.db")
    try:
        return {r[0] for r in conn.execute("SELECT custom_id FROM batch_items")}
    finally:
        conn.close()


def batch_args(inp: Path, url: str, state: Path, *extra: str) -> list[str]:
    return ["batch", str(inp), "--target", url, "--state-dir", str(state), "--concurrency", "8",
            "--max-tries", "12", "--log-format", "json", *extra]


async def test_batch_restarts_bad_lines_and_exactly_once(tmp_path: Path) -> None:
    inp, state = tmp_path / "in.jsonl", tmp_path / "state"
    cids = write_input(inp)
    cfg = tmp_path / "batch.yaml"
    cfg.write_text("batch: {backoff: 0.1s}\ntarget: {timeouts: {connect: 1s, total: 10s}}\n")
    # the simulator goes down for 0.7 s two seconds in (soakd retries through it); 50 ms to the first token, so
    # that at most ~160 requests a second finish: the first run is killed after the outage, far from its end
    slow = {**QUICK_SIM, "ttft_base": 0.05}
    async with sim_server(**slow, faults={"restart_after": 2.0, "restart_downtime": 0.7}) as sim:
        first = await SoakdProcess.start(*batch_args(inp, sim.base_url, state, "-c", str(cfg)))
        try:
            started = await first.json_event("batch_started", timeout=30)
            assert started["lines"] == 1008 and started["bad_lines"] == len(BAD) and not started["resumed"]
            # the store polled every 20 ms, not at the progress lines (seconds apart: on an idle machine the whole
            # batch once finished between two of them); its stdout read meanwhile, so that a full pipe never blocks it
            drain = first.drain()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (len(finished_in_store(state)) < 400 or sim.restarts < 1):
                assert first.proc.returncode is None, f"the batch ended early:\n{first.output()[-3000:]}"
                await asyncio.sleep(0.02)
            first.signal(signal.SIGKILL)
            killed_ns = time.perf_counter_ns()
            await first.proc.wait()
            await asyncio.gather(*drain)
        finally:
            await first.kill()
        before = finished_in_store(state)
        print(f"\nthe first run was killed after {len(before)} of 1000 inputs, the simulator restarted {sim.restarts}x")
        assert 300 <= len(before) < 1000, len(before)
        assert sim.restarts == 1, "the simulator restarted in the middle of the first run"

        rc, out, err = await run_soakd(*batch_args(inp, sim.base_url, state, "-c", str(cfg),
                                                   "--failure-budget", "0.01"), timeout=120)
        assert rc == 0, (out + err)[-3000:]
        after = sends_by_custom_id(sim.recent, killed_ns)
        total = sends_by_custom_id(sim.recent)

    resent = sorted(set(after) & before)
    assert not resent, f"finished inputs sent again after the restart: {resent[:10]}"
    assert set(total) == set(cids)  # every good input reached the server; no bad one did

    output = [json.loads(x) for x in (tmp_path / "in.output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "in.errors.jsonl").read_text().splitlines()]
    answered = [o["custom_id"] for o in output]
    assert answered == cids  # exactly once each, in input order
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["response"]["request_id"]
    emb = next(o for o in output if o["custom_id"] == "c-50")
    assert emb["response"]["body"]["data"][0]["embedding"]
    assert len(errors) == len(BAD)
    for e, (no, (_text, needle)) in zip(errors, sorted(BAD.items())):
        assert e["response"] is None and e["error"]["line"] == no and needle in e["error"]["message"], e
    assert next(e for e in errors if e["error"]["line"] == 120)["custom_id"] == "c-7"  # the duplicate, named

    assert "answered 1000" in out and f"bad lines {len(BAD)}" in out and "(resumed)" in out
    # finished: a rerun sends nothing and renders the same files; over a zero budget it exits 1
    async with sim_server(**QUICK_SIM) as sim2:
        rc, out, err = await run_soakd(*batch_args(inp, sim2.base_url, state), timeout=60)
        assert not sends_by_custom_id(sim2.recent)
    assert rc == 1 and "failures 0.79% of the lines (budget 0.00%)" in out, out + err
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "in.output.jsonl").read_text().splitlines()] == cids


async def test_inputs_the_server_rejects_are_given_up_at_once(tmp_path: Path) -> None:
    """A 400 is the input's fault: given up after one try (the batch is never stuck on it); an
    output the validators reject is retried, then recorded with the reason."""
    inp = tmp_path / "in.jsonl"
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}},
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "word " * 5000, "max_tokens": 4}},  # beyond the simulator's max_model_len: HTTP 400
        {"custom_id": "emb-bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": 42}},
    ]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    async with sim_server(**QUICK_SIM, max_model_len=512) as sim:
        rc, out, err = await run_soakd(*batch_args(inp, sim.base_url, tmp_path / "state"), timeout=60)
        sends = sends_by_custom_id(sim.recent)
    assert rc == 1, out + err
    errors = {e["custom_id"]: e for e in map(json.loads, (tmp_path / "in.errors.jsonl").read_text().splitlines())}
    assert set(errors) == {"too-long", "emb-bad"}
    assert errors["too-long"]["error"]["code"] == "http_400" and errors["too-long"]["response"]["status_code"] == 400
    assert errors["emb-bad"]["error"]["code"] == "http_400"
    conn = sqlite3.connect(tmp_path / "state" / "soakd.db")
    tries = dict(conn.execute("SELECT custom_id, tries FROM batch_items"))
    conn.close()
    assert tries == {"ok": 1, "too-long": 1, "emb-bad": 1}  # not retried
    assert sends == {"ok": 1, "emb-bad": 1}
    assert "failed 2" in out and "http_400 2" in out


def test_reading_the_input(tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    write_input(inp, n=200)
    good, bad, sha = read_input(inp)
    assert len(good) == 200 and [b.line_no for b in bad] == [no for no in sorted(BAD) if no <= 208]
    assert all(b.error()["message"].startswith(f"line {b.line_no}: ") for b in bad)
    assert len(sha) == 64


def test_input_that_is_not_what_it_claims(tmp_path: Path) -> None:
    """A line that is not UTF-8 is a bad line (never sent with U+FFFD in its prompt); an empty file,
    or one without a line that can be sent, is no batch (InputError: exit 2); /v1/responses lines
    are accepted, as OpenAI's Batch API accepts them."""
    from soakd.batch.input import InputError

    inp = tmp_path / "in.jsonl"
    ok = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/responses",
                     "body": {"input": "Say hi", "max_output_tokens": 4}}).encode()
    latin1 = b'{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "caf\xe9"}}'
    no_input = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/responses", "body": {}}).encode()
    inp.write_bytes(b"\n".join([ok, latin1, no_input]) + b"\n")
    good, bad, _ = read_input(inp)
    assert [(g.custom_id, g.path) for g in good] == [("a", "/responses")]
    assert [(b.line_no, b.field) for b in bad] == [(2, "line"), (3, "body.input")]
    assert "not UTF-8 (byte 0xe9 at column" in bad[0].message
    for content, needle in ((b"", "no request line"), (b"\n  \n", "no request line"),
                            (latin1 + b"\n{oops\n", "no line that can be sent (2 bad: line 1: line: not UTF-8")):
        inp.write_bytes(content)
        with pytest.raises(InputError, match=needle.replace("(", r"\(")):
            read_input(inp)


async def test_empty_batch_exits_2_and_responses_lines_are_answered(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, out, err = await run_soakd(*batch_args(empty, "http://127.0.0.1:9/v1", tmp_path / "s1"), timeout=60)
    assert rc == 2 and "no request line" in err, out + err
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                                       "body": {"input": [{"role": "user", "content": f"question {i}"}],
                                                "max_output_tokens": 4}}) + "\n" for i in range(5)))
    async with sim_server(**QUICK_SIM) as sim:
        rc, out, err = await run_soakd(*batch_args(inp, sim.base_url, tmp_path / "s2"), timeout=60)
    assert rc == 0, out + err
    rows = [json.loads(x) for x in (tmp_path / "in.output.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"r{i}" for i in range(5)]
    body = rows[0]["response"]["body"]
    assert body["object"] == "response" and body["output"][0]["content"][0]["type"] == "output_text"
    assert body["output"][0]["content"][0]["text"] and body["status"] == "incomplete"  # 4 tokens: cut by the limit
