#!/usr/bin/env python3
"""Prepare llama.cpp's native ``llama-server`` and a tiny GGUF model for the end-to-end tests.

Idempotent, into a cache outside the repository (``$SOAKD_E2E_CACHE``, default
``~/.cache/soakd-e2e``):

  llama.cpp/<version>/bin/llama-server   built from the llama.cpp source vendored in the
                                         pinned llama-cpp-python sdist (PyPI), CPU only
  llama.cpp/<version>/STAMP              what was built, with which flags
  venv-gguf/                             a small venv with the pinned ``gguf`` package
  models/tiny.gguf (+ .stamp)            written by tests/e2e/make_tiny_gguf.py (deterministic)

A second run finds the stamps and does nothing (a second or so). Any failure exits non-zero
with the step that failed: ``make test`` must fail loudly, never skip.

Nothing is downloaded but two PyPI packages through pip: the sdist (``--no-binary :all:``) and
``gguf`` with its dependencies. The CMake flags switch off everything that would fetch at
build time (the web UI from a bucket, npm, OpenSSL-via-FetchContent).

Usage: python tests/e2e/prepare_llamacpp.py [--force] [--jobs N]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GGUF_VERSION = "0.19.0"
NUMPY_VERSION = "2.4.6"  # the model's random weights come from numpy's generator: pinned with it
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary to keep
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else: downloads the web UI from a bucket
    "-DLLAMA_BUILD_UI=OFF",  # else: npm ci / npm run build
    "-DLLAMA_OPENSSL=OFF",  # loopback HTTP only
    "-DGGML_NATIVE=ON",  # built on the machine that runs it (the cache never leaves it)
]

HERE = Path(__file__).resolve().parent


def cache_root() -> Path:
    return Path(os.environ.get("SOAKD_E2E_CACHE") or Path.home() / ".cache" / "soakd-e2e")


def server_dir() -> Path:
    return cache_root() / "llama.cpp" / LLAMA_CPP_PYTHON_VERSION


def server_binary() -> Path:
    return server_dir() / "bin" / "llama-server"


def model_path() -> Path:
    return cache_root() / "models" / "tiny.gguf"


def log(msg: str) -> None:
    print(f"[prepare-llamacpp] {msg}", flush=True)


def die(msg: str) -> None:
    print(f"[prepare-llamacpp] FAILED: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def run(cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, quiet_log: Path | None = None) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    if quiet_log is None:
        rc = subprocess.call(cmd, cwd=cwd, env=env)
    else:
        with open(quiet_log, "w") as fh:
            rc = subprocess.call(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        if rc != 0:
            tail = quiet_log.read_text(errors="replace").splitlines()[-60:]
            print("\n".join(tail), file=sys.stderr)
    if rc != 0:
        die(f"command exited {rc}: {' '.join(str(c) for c in cmd)}")


def ensure_toolchain() -> None:
    missing = [t for t in ("cmake", "g++", "make") if shutil.which(t) is None]
    if not missing:
        return
    log(f"missing build tools {missing}: installing Debian's cmake/g++/make")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(sudo + ["apt-get", "update", "-qq"], env=env)
    run(sudo + ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "cmake", "g++", "make"], env=env)


def build_stamp() -> str:
    return f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}\n" + "\n".join(CMAKE_FLAGS) + "\n"


def prepare_server(force: bool, jobs: int) -> None:
    dest = server_dir()
    stamp = dest / "STAMP"
    binary = server_binary()
    if not force and binary.is_file() and stamp.is_file() and stamp.read_text() == build_stamp():
        log(f"llama-server {LLAMA_CPP_PYTHON_VERSION}: cached at {binary}")
        return
    ensure_toolchain()
    t0 = time.monotonic()
    dest.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=dest))
    try:
        sdist_dir = work / "sdist"
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(sdist_dir)])
        tarballs = list(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
        if len(tarballs) != 1:
            die(f"expected one llama_cpp_python sdist in {sdist_dir}, found {tarballs}")
        log(f"unpacking {tarballs[0].name}")
        with tarfile.open(tarballs[0]) as tf:
            tf.extractall(work / "src", filter="data")
        srcs = list((work / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
        if len(srcs) != 1 or not (srcs[0] / "tools" / "server").is_dir():
            die(f"no vendored llama.cpp with tools/server in the sdist ({srcs})")
        src = srcs[0]
        build = work / "build"
        t_cfg = time.monotonic()
        run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], quiet_log=work / "configure.log")
        configure_log = (work / "configure.log").read_text(errors="replace")
        if "downloading" in configure_log.lower():
            die("the CMake configure step tried to download something; see " + str(work / "configure.log"))
        log(f"configured in {time.monotonic() - t_cfg:.0f}s; building llama-server with -j {jobs} "
            "(several minutes on 2 cores)")
        t_build = time.monotonic()
        run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
            quiet_log=work / "build.log")
        built = build / "bin" / "llama-server"
        if not built.is_file():
            die(f"the build finished but {built} is missing")
        log(f"built in {time.monotonic() - t_build:.0f}s")
        (dest / "bin").mkdir(exist_ok=True)
        tmp = dest / "bin" / "llama-server.tmp"
        shutil.copy2(built, tmp)
        tmp.replace(binary)
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            die(f"{binary} --version exited {out.returncode}: {out.stderr[-2000:]}")
        version_text = (out.stdout + out.stderr).strip()
        (dest / "VERSION").write_text(version_text + "\n")
        stamp.write_text(build_stamp())
        log(f"llama-server ready in {time.monotonic() - t0:.0f}s total: {version_text.splitlines()[0] if version_text else ''}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def prepare_gguf_venv() -> Path:
    venv = cache_root() / "venv-gguf"
    py = venv / "bin" / "python"
    stamp = venv / ".soakd-stamp"
    want = f"gguf=={GGUF_VERSION} numpy=={NUMPY_VERSION}\n"
    if py.is_file() and stamp.is_file() and stamp.read_text() == want:
        return py
    log(f"creating {venv} with gguf=={GGUF_VERSION}")
    shutil.rmtree(venv, ignore_errors=True)
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         f"gguf=={GGUF_VERSION}", f"numpy=={NUMPY_VERSION}"])
    stamp.write_text(want)
    return py


def prepare_model(force: bool) -> None:
    generator = HERE / "make_tiny_gguf.py"
    corpus = HERE.parent.parent / "soakd" / "workload" / "corpus.py"  # the model's vocabulary
    h = hashlib.sha256(generator.read_bytes())
    h.update(corpus.read_bytes())
    digest = h.hexdigest()
    out = model_path()
    stamp = out.with_suffix(".stamp")
    want = f"{digest} gguf=={GGUF_VERSION} numpy=={NUMPY_VERSION}\n"
    if not force and out.is_file() and stamp.is_file() and stamp.read_text() == want:
        log(f"model: cached at {out}")
        return
    py = prepare_gguf_venv()
    out.parent.mkdir(parents=True, exist_ok=True)
    run([str(py), str(generator), "--out", str(out)])
    stamp.write_text(want)


def smoke(binary: Path, model: Path) -> None:
    """Serve the model once and stream one chat completion with usage: a wrong GGUF or a broken
    build fails here, with llama-server's log, not later in a test. Stamped: skipped when the
    binary and the model are the ones that passed."""
    import json
    import socket
    import urllib.request

    if not binary.is_file() or not model.is_file():
        die("preparation finished without the binary or the model")
    stamp = server_dir() / "SMOKE"
    want = f"{binary.stat().st_mtime_ns} {model.stat().st_size} {model.with_suffix('.stamp').read_text()}"
    if stamp.is_file() and stamp.read_text() == want:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logf = server_dir() / "smoke.log"
    with open(logf, "wb") as fh:
        proc = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "--metrics", "-c", "4096", "-np", "1", "-t", "1", "--no-webui"],
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                print(logf.read_text(errors="replace")[-4000:], file=sys.stderr)
                die(f"llama-server did not become ready with {model} (exit {proc.poll()}); log {logf}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        body = json.dumps({"messages": [{"role": "user", "content": "the server model memory"}],
                           "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read().decode()
        events = [json.loads(ln[6:]) for ln in raw.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
        text = "".join((e["choices"][0].get("delta") or {}).get("content") or "" for e in events if e.get("choices"))
        usage = [e["usage"] for e in events if e.get("usage")]
        if "data: [DONE]" not in raw or not text.strip() or not usage:
            die(f"unexpected streamed answer from llama-server: {raw[-1500:]!r}")
        if usage[-1].get("completion_tokens") != 16:
            die(f"expected 16 completion tokens (ignore_eos), got usage {usage[-1]}")
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        if "llamacpp:requests_processing" not in metrics:
            die("llama-server --metrics has no llamacpp:requests_processing")
        log(f"smoke: streamed {usage[-1]} -> {text.strip()[:60]!r}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    stamp.write_text(want)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild the server and rewrite the model")
    ap.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="parallel compile jobs")
    ap.add_argument("--print-paths", action="store_true", help="print the binary and model paths and exit")
    args = ap.parse_args()
    if args.print_paths:
        print(server_binary())
        print(model_path())
        return 0
    t0 = time.monotonic()
    cache_root().mkdir(parents=True, exist_ok=True)
    lock = open(cache_root() / ".prepare_llamacpp.lock", "w")  # noqa: SIM115 - held until exit
    fcntl.flock(lock, fcntl.LOCK_EX)  # two `make test` at once: the second waits, then finds it done
    prepare_server(args.force, args.jobs)
    prepare_model(args.force)
    smoke(server_binary(), model_path())
    log(f"ready in {time.monotonic() - t0:.1f}s: {server_binary()} {model_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
