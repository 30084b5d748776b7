# soakd — two commands on a fresh machine (Python 3.11, Debian, root, no GPU):
#   make demo   creates the virtualenv, installs soakd, soaks the embedded simulator, shows the result
#   make test   installs what the tests need (Python packages, Debian's prometheus for promtool and a
#               real Prometheus server, prometheus-alertmanager for amtool and a real Alertmanager,
#               Debian's chromium for the report screenshot) and runs the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process, no workers); tests/conftest.py says how tests are shared out
TEST_WORKERS ?= 2

.PHONY: demo test install install-test system-deps e2e-prepare bench clean metrics-table

$(PY):
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "python3 -m venv failed; installing Debian's python3-venv"; \
	  $(SUDO) apt-get update -qq && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv && \
	  rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	@$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install -q -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	@touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# promtool (metric and rule checks) and a real Prometheus server come from Debian's package, amtool
# and a real Alertmanager from prometheus-alertmanager (the tests start their own on 127.0.0.1, with
# their own storage, and never use the packages' services);
# chromium (headless) screenshots the HTML report.
system-deps:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1 || \
	    ! command -v amtool >/dev/null 2>&1 || ! command -v prometheus-alertmanager >/dev/null 2>&1; then \
	  echo "installing Debian's prometheus (promtool + server) and prometheus-alertmanager (amtool + server)"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus prometheus-alertmanager >/dev/null; \
	fi
	@promtool --version 2>&1 | head -1
	@amtool --version 2>&1 | head -1
	@# Debian's chromium: the HTML report's screenshot test (skipped, with the reason, without it)
	@if [ ! -x /usr/bin/chromium ]; then \
	  echo "installing Debian's chromium (headless screenshot of the HTML report)"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; \
	fi

# Real inference servers for tests/e2e, prepared idempotently into ~/.cache/soakd-e2e (or SOAKD_E2E_CACHE):
# the first run builds/installs them (minutes), later runs find them stamped and skip. A failure
# fails `make test` here, loudly: the e2e tests are never skipped.
e2e-prepare: $(VENV)/.installed-test
	$(PY) tests/e2e/prepare_llamacpp.py
	bash tests/e2e/prepare_vllm.sh

demo: $(VENV)/.installed
	$(PY) -m soakd demo $(DEMO_ARGS)

# Two passes, both always run. First every test but the real-server ones and those marked alone on $(TEST_WORKERS)
# pytest-xdist workers (tests/conftest.py: a module whole on one worker): most of them wait on a soak in wall time,
# and two at once nearly halve their time on two cores. Then the real-server tests (marker e2e) and the detection
# tests (marker alone) one at a time: vLLM takes every core while it starts and serves, and a test that judges a
# live simulator in wall time sees the load beside it come and go (seen: 3 of tests/component/test_detection.py's
# failed beside vLLM, one paged +20% beside the other worker and a benchmark). pytest exits 5 when it collected no
# test: that is a failure here, said out loud (where neither pass collected one: PYTEST_ARGS may select one kind).
test: $(VENV)/.installed-test system-deps e2e-prepare
	@set +e; \
	$(PY) -m pytest -m "not e2e and not alone" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
	  $(PYTEST_ARGS); a=$$?; \
	$(PY) -m pytest -m "e2e or alone" $(PYTEST_ARGS); b=$$?; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then \
	  echo "make test: pytest collected no tests (exit 5) - treating as failure"; exit 1; fi; \
	[ $$a -eq 5 ] && a=0; [ $$b -eq 5 ] && b=0; \
	if [ $$a -ne 0 ] || [ $$b -ne 0 ]; then \
	  echo "make test: failed (tests on workers: exit $$a; real-server and detection tests: exit $$b)"; exit 1; fi

bench: $(VENV)/.installed
	$(PY) benchmarks/client_capacity.py
	$(PY) benchmarks/verdict_quality.py --quick

metrics-table: $(VENV)/.installed
	$(PY) -m soakd metrics --update-readme docs/metrics.md

clean:
	rm -rf $(VENV) soakd-state .pytest_cache build *.egg-info
