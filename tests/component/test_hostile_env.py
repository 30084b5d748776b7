"""soakd where its environment misbehaves (issue 22): a stdout that stalls or breaks."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys
import termios
from pathlib import Path

import aiohttp
import pytest

from helpers import QUICK_SIM, REPO, free_port, run_soakd, serving, sim_server, soakd_env

pytestmark = pytest.mark.timeout(180)

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _run_args(url: str, state: Path, port: int, duration: str) -> list[str]:
    return ["-m", "soakd", "run", "--target", url, "--duration", duration, "--window", "1s", "--warmup", "0.5s",
            "--concurrency", "2", "--mix", "short_chat=1", "--sample-interval", "0.5s", "--nvml", "off",
            "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--state-dir", str(state),
            "--log-format", "json", "--log-level", "debug", "--no-progress"]  # fmt: skip


def _pending(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD on its read end)."""
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") or
               line.startswith(name + " "))


async def test_a_stdout_nobody_reads_does_not_stop_the_run(tmp_path: Path) -> None:
    """stdout is a 4 KiB pipe that nobody reads (a log driver that stalls) for 30 s: soakd's loop goes
    on — /healthz and /metrics answer every second, requests are sent — and once the pipe is read again the run
    ends with its verdict and reports. (Before: the first log line that did not fit blocked the
    event loop, /healthz timed out and no load was sent.)"""
    port = free_port()
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    async with sim_server(**QUICK_SIM) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *_run_args(sim.base_url, tmp_path, port, "90s"), stdout=w,
            stderr=asyncio.subprocess.PIPE, env=soakd_env(), cwd=str(REPO))  # fmt: skip
        os.close(w)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                while _pending(r) < 4096:  # the pipe is full: every log line from now on would block
                    assert loop.time() < deadline and proc.returncode is None, "the pipe never filled"
                    await asyncio.sleep(0.1)
                sent: list[float] = []
                for _ in range(30):  # stdout blocked for 30 s and more: soakd answers every second
                    async with session.get(base + "/healthz") as resp:
                        assert resp.status == 200
                    async with session.get(base + "/metrics") as resp:
                        text = await resp.text()
                    sent.append(_metric(text, "soakd_requests_total"))
                    assert "soakd_log_dropped_total" in text
                    assert _pending(r) >= 4096, "something read the pipe"
                    await asyncio.sleep(1.0)
                assert sent[-1] > sent[0], f"no load was sent while stdout was blocked: {sent}"
                proc.send_signal(15)
                # read the pipe again: the run drains, writes its reports and says so
                with os.fdopen(r, "rb", closefd=False) as reader:
                    out = await asyncio.wait_for(asyncio.to_thread(reader.read), 60)  # to EOF: soakd exited
            await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            os.close(r)
    err = (await proc.stderr.read()).decode() if proc.stderr else ""
    lines = [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
    finished = [x for x in lines if x["event"] == "soakd_finished"]
    assert finished and finished[0]["report"], out.decode()[-2000:] + err
    assert Path(finished[0]["report"]).is_file()
    assert proc.returncode == finished[0]["exit_code"]


async def test_a_broken_stdout_is_said_once_and_the_run_finishes(tmp_path: Path) -> None:
    """stdout's reader goes away (``| head -1``, a log shipper that died) after the first line:
    soakd says so once on stderr, runs to its end and writes its reports; its exit code is the
    verdict's (before: BrokenPipeError out of a log call, exit 1, no verdict, no reports)."""
    port = free_port()
    r, w = os.pipe()
    async with sim_server(**QUICK_SIM) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *_run_args(sim.base_url, tmp_path, port, "4s"), stdout=w,
            stderr=asyncio.subprocess.PIPE, env=soakd_env(), cwd=str(REPO))  # fmt: skip
        os.close(w)
        reader = os.fdopen(r, "rb")
        first = await asyncio.to_thread(reader.readline)
        reader.close()  # the reader is gone: the next write gets EPIPE
        assert b"soakd_started" in first or first.startswith(b"{"), first
        _, err_b = await asyncio.wait_for(proc.communicate(), 90)
    err = err_b.decode()
    assert err.count("stdout is gone") == 1, err
    assert "Traceback" not in err, err
    run_dirs = [p for p in tmp_path.iterdir() if p.is_dir() and (p / "report.json").is_file()]
    assert len(run_dirs) == 1, list(tmp_path.iterdir())
    report = json.loads((run_dirs[0] / "report.json").read_text())
    verdict = report["verdict"]
    assert proc.returncode == verdict["exit_code"], (proc.returncode, verdict, err)


# ---- a target checked at start ---------------------------------------------------------------------


async def _run_until_exit(*args: str, timeout: float = 150.0) -> tuple[int, str, str]:
    # a bound on a hang only: at nice 10 beside a loaded test suite (vLLM compiling on both cores) soakd had not
    # finished its imports after 60 s
    return await run_soakd("run", *args, "--duration", "1h", "--wait-for-target", "2s", "--metrics-port", "0",
                           "--metrics-host", "127.0.0.1", "--log-format", "json", "--nvml", "off", timeout=timeout)


async def test_a_target_url_without_v1_fails_at_start_with_the_fix(tmp_path: Path) -> None:
    async with sim_server(**QUICK_SIM) as sim:
        origin = sim.base_url.removesuffix("/v1")
        rc, out, err = await _run_until_exit("--target", origin, "--state-dir", str(tmp_path))
    assert rc == 1, out + err
    assert f"the URL lacks /v1: use --target {origin}/v1" in err, err
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    unavailable = [e for e in events if e["event"] == "target_unavailable"]
    assert unavailable and "HTTP 404" in unavailable[0]["cause"], out
    assert not any(e["event"] == "load_started" for e in events)


async def test_nothing_listening_fails_within_wait_for_target_with_the_cause(tmp_path: Path) -> None:
    """--duration 1h, the port closed: the run ends after --wait-for-target (2 s), not the hour."""
    port = free_port()
    rc, _out, err = await _run_until_exit("--target", f"http://127.0.0.1:{port}/v1", "--state-dir", str(tmp_path))
    assert rc == 1
    assert f"nothing accepts connections at 127.0.0.1:{port}" in err and "run.wait_for_target" in err, err


async def test_an_html_page_instead_of_the_api_fails_at_start(tmp_path: Path) -> None:
    from aiohttp import web

    async def page(_request: web.Request) -> web.Response:
        return web.Response(text="<!doctype html><html><body>Login</body></html>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/{tail:.*}", page)
    async with serving(app) as port:
        rc, _out, err = await _run_until_exit("--target", f"http://127.0.0.1:{port}/v1", "--state-dir", str(tmp_path))
    assert rc == 1
    assert "answered HTML, not JSON" in err and "JSONDecodeError" not in err, err


async def test_a_model_the_target_does_not_serve_fails_at_start_with_the_list(tmp_path: Path) -> None:
    """--model nope: one probe request, exit 1 naming what is served (before: a warning, then
    14,434 requests answered 404 in one 10-s window)."""
    async with sim_server(**QUICK_SIM) as sim:
        rc, out, err = await _run_until_exit("--target", sim.base_url, "--model", "nope", "--state-dir", str(tmp_path))
    assert rc == 1, out + err
    assert "does not serve the model 'nope'" in err and "it serves: soakd-sim" in err, err
    assert not any(json.loads(x)["event"] == "load_started" for x in out.splitlines() if x.startswith("{"))


# ---- never hammer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["http_500", "html_200", "model_404"])
async def test_a_target_that_fails_fast_gets_less_than_the_configured_load(tmp_path: Path, answer: str) -> None:
    """A target that fails every request at once (5xx, an HTML page, 404 for the model): closed
    loop at concurrency 8 for 4 s. Each worker backs off after a failed request (0.1 s doubling to
    2 s, jittered): at most 8 / 0.1 = 80 requests a second reach it, whatever it does (before:
    400-690 a second at concurrency 2)."""
    from aiohttp import web

    from soakd.soak.driver import BACKOFF_FLOOR

    hits = 0

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def chat(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        await request.read()
        if answer == "http_500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if answer == "html_200":
            return web.Response(text="<html>maintenance</html>", content_type="text/html")
        return web.json_response({"error": {"message": "The model `m` does not exist.", "code": 404}}, status=404)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as port:
        rc, out, err = await run_soakd(
            "run", "--target", f"http://127.0.0.1:{port}/v1", "--duration", "4s", "--window", "1s",
            "--warmup", "0s", "--concurrency", "8", "--mix", "short_chat=1", "--nvml", "off", "--no-progress",
            "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--state-dir", str(tmp_path),
            "--log-format", "json", timeout=90)  # fmt: skip
    finished = [json.loads(x) for x in out.splitlines() if x.startswith("{") and '"soakd_finished"' in x]
    assert finished, out[-2000:] + err
    elapsed = finished[0]["elapsed"]
    bound = 8 / BACKOFF_FLOOR * elapsed + 8
    print(f"{answer}: {hits} requests in {elapsed:.1f} s at concurrency 8 (bound {bound:.0f}); "
          f"failing: {finished[0]['failing']}; reasons: {finished[0]['reasons']}")
    assert 8 <= hits <= bound, (hits, bound)
    assert rc == 1 and finished[0]["verdict"] == "FAIL", finished[0]
    messages = " ".join(f["message"] for f in finished[0]["failing"])
    reason = {"http_500": "http_500", "html_200": "malformed_body", "model_404": "http_404"}[answer]
    assert reason in messages, messages  # the failing finding names what failed
    if answer == "model_404":
        assert "no longer serves the model" in messages, messages


# ---- a terminal that looks right ---------------------------------------------------------------------


def _screen(raw: bytes, columns: int) -> list[str]:
    """The physical lines a terminal of ``columns`` shows for ``raw``: carriage return, erase to the
    end of the line, newline, and the wrap at the last column (colours dropped)."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", raw.decode("utf-8", "replace"))
    lines, cur, col, i = [], [], 0, 0
    while i < len(text):
        if text.startswith("\x1b[K", i):
            del cur[col:]
            i += 3
            continue
        ch = text[i]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        else:
            if col == columns:  # the terminal wraps: what follows starts the next line
                lines.append("".join(cur))
                cur, col = [], 0
            if col < len(cur):
                cur[col] = ch
            else:
                cur.append(ch)
            col += 1
        i += 1
    if cur:
        lines.append("".join(cur))
    return lines


@pytest.mark.parametrize("columns", [80, 120])
async def test_the_progress_line_fits_the_terminal_and_log_lines_start_on_their_own(tmp_path: Path,
                                                                                    columns: int) -> None:
    """soakd run on a terminal (a pty of 80 or 120 columns, stdout and stderr both): the progress
    line is never wider than the terminal, shows the percentage and the ETA, and every log line
    starts on its own line (before: 128 characters, wrapping, log lines glued to its end)."""
    import pty
    import struct
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    chunks: list[bytes] = []

    def pump() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    async with sim_server(**QUICK_SIM) as sim:
        args = _run_args(sim.base_url, tmp_path, free_port(), "5s")
        args = [a for a in args if a not in ("--no-progress",)]
        args[args.index("json")] = "console"
        proc = await asyncio.create_subprocess_exec(sys.executable, *args, stdin=slave, stdout=slave, stderr=slave,
                                                    env=soakd_env(), cwd=str(REPO))
        rc = await asyncio.wait_for(proc.wait(), 90)
    await asyncio.sleep(0.3)
    os.close(slave)
    reader.join(5)
    os.close(master)
    raw = b"".join(chunks)
    import re

    text = raw.decode("utf-8", "replace")
    assert rc in (0, 3), text[-3000:]
    draws = [d for d in re.findall(r"\r([^\r\n\x1b]*)\x1b\[K", re.sub(r"\x1b\[[0-9;]*m", "", text)) if " ETA " in d]
    assert draws, text[-3000:]
    assert max(map(len, draws)) <= columns - 1, max(draws, key=len)
    assert all(re.match(r"\d\d:\d\d:\d\d/\d\d:\d\d:\d\d +\d+% ETA ", d) for d in draws), draws[:3]
    lines = _screen(raw, columns)
    stamp = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
    logs = [ln for ln in lines if stamp.search(ln)]
    assert any("window_closed" in ln for ln in logs), lines[:20]
    # every log line starts its own line: never after a progress line's text (no half lines left behind)
    assert all(stamp.match(ln) for ln in logs), [ln for ln in logs if not stamp.match(ln)][:3]
    assert all(re.match(r"\d\d:\d\d:\d\d/", ln) for ln in lines if " ETA " in ln), [ln for ln in lines if " ETA " in ln][:3]
