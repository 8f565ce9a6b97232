# Two commands set everything up: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test doctor install install-dev chromium screenshots clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamps re-run the install whenever pyproject.toml changes.
$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[server,agent]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed-run

install: $(VENV)/.installed-run
install-dev: $(VENV)/.installed-dev

# Debian's Chromium drives the browser tests; Playwright never downloads its own.
chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

run: install
	$(BIN)/hybridtrain local --host $(HOST) --port $(PORT)

# One screen of what the suite needs (root, cgroup v1 cpu, Postgres, Redis, Chromium, ip, tc)
# and how to get each missing piece; exits 1 if any is missing (tests/doctor.py).
doctor: install-dev
	$(BIN)/python -m tests.doctor

# Two workers: most tests wait on processes, sockets and Postgres, so two share the two cores
# (a file at a time, the testbed's files in one worker: tests/conftest.py). Schemathesis gives its
# items one node id, of which xdist would run one: its file runs after, in one process.
TEST_WORKERS ?= 2
ONE_PROCESS_TESTS := tests/app/test_openapi_conformance.py

test: install-dev chromium doctor
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=30 $(addprefix --ignore=,$(ONE_PROCESS_TESTS))
	$(BIN)/python -m pytest $(ONE_PROCESS_TESTS)

# docs/screenshots/ again, from the real pages: a control plane on a temporary database, filled
# through its API, photographed in Chromium (docs/screenshots.py; --out DIR writes elsewhere).
screenshots: install-dev chromium
	$(BIN)/python docs/screenshots.py

clean:
	rm -rf $(VENV) var
