# One pinned environment for everything. Every target that runs code calls `setup` first,
# so each works as the first command on a fresh clone.
SHELL := /bin/bash
PY := .venv/bin/python
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell pip config get global.find-links 2>/dev/null),/opt/wheels)
export PARITY_DATASETS ?= $(abspath ../shared/datasets)
export OMP_WAIT_POLICY ?= PASSIVE
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test bench lint stop clean

setup: .venv/.stamp

.venv/.stamp: requirements.lock pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@$(PY) -m pip install -q --disable-pip-version-check uv==0.13.9
	$(PY) -m uv pip install --python $(PY) -q --no-deps --find-links $(FIND_LINKS) -r requirements.lock
	$(PY) -m uv pip install --python $(PY) -q --no-deps -e .
	@touch $@

run: setup
	$(PY) -m parity prepare experiment=arith_tiny
	$(PY) -m parity train experiment=arith_tiny

test: setup
	$(PY) -m pytest -q tests

bench: setup
	@for f in tests/bench/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

lint: setup
	$(PY) -m ruff check platform tasks flows dashboards tests

lock:
	uv pip compile requirements.in --python-version 3.11 --find-links $(FIND_LINKS) \
	  --excludes requirements-exclude.txt -o requirements.lock

clean:
	rm -rf .venv
