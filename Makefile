# One pinned environment for everything. Every target that runs code calls `setup` first,
# so each works as the first command on a fresh clone.
SHELL := /bin/bash
PY := .venv/bin/python
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell pip config get global.find-links 2>/dev/null),/opt/wheels)
export PARITY_DATASETS ?= $(abspath ../shared/datasets)
export OMP_WAIT_POLICY ?= PASSIVE
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run stop test bench bench-gpu lint dashboard mlflow-ui lock clean

setup: .venv/.stamp

.venv/.stamp: requirements.lock pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	@$(PY) -m pip install -q --disable-pip-version-check uv==0.13.9
	$(PY) -m uv pip install --python $(PY) -q --no-deps --find-links $(FIND_LINKS) -r requirements.lock
	$(PY) -m uv pip install --python $(PY) -q --no-deps -e .
	@touch $@

# run: set up, start a local Prefect server + the served deployments, run train-and-eval/local on the
# embedded default, wait, print the summary. Server and deployments keep running until `make stop`.
# OVERRIDES: Hydra overrides of the flow run. The default is the platform's whole chain on the tiny model: the
# rollout in INT8 W8A8 + INT4 per-token-head KV (the torch engine's numerics; quantize and validate run), score
# centering on the rollout's top-64 as the correction (REINFORCE loss, as in its derivation), 40 RL steps, then
# the held-out task and the first 8 problems of each of the six benchmarks (eval=quick), then registration;
# within 12 minutes on 2 cores (a 700-step warm start, most of the time; docs/ORCHESTRATION.md has the figures). EXTRA: overrides added to those
# (`make run EXTRA="trainer.total_steps=100"`); `make run OVERRIDES=` = the BF16 default experiment, 100 steps.
# The deployments are served with these overrides as their `chain` default, so a later
# `prefect deployment run train-and-eval/local --params '{"overrides": [...]}'` is this run with that change alone.
CHAIN := +precision=w8a8_int8_kv_int4 algorithm.correction.name=score_centering algorithm.policy_loss=reinforce \
	rollout.topk_logprobs=64 eval=quick
OVERRIDES ?= $(CHAIN) model.warm_start.steps=700 trainer.total_steps=40 trainer.eval_every=20 \
	trainer.checkpoint_every=20 $(EXTRA)
run: setup
	$(PY) scripts/run_local.py run $(OVERRIDES)

stop:
	$(PY) scripts/run_local.py stop

# mlflow-ui: prints each experiment's link (its runs table with Parity's columns), then serves MLflow's UI
mlflow-ui: setup
	$(PY) scripts/mlflow_ui.py --backend-store-uri sqlite:///$(or $(PARITY_OUTPUTS),outputs)/mlflow.db --host 127.0.0.1 --port $(or $(MLFLOW_PORT),5000) --workers 1

dashboard: setup  ## Streamlit dashboard on http://127.0.0.1:8501 (read-only)
	.venv/bin/streamlit run dashboards/app.py --server.address 127.0.0.1 --server.headless true --browser.gatherUsageStats false

# test: the suite with the numerical tests pinned to float32 (tests/conftest.py), then the files whose tolerances
# follow the compute dtype once more in bfloat16, whatever the CPU (AVX2-only and AVX512-BF16/AMX machines
# resolve model.dtype=auto differently; this way both dtypes are checked on both). The second pass runs even when
# the first fails; the target fails if either did. The second run adds ~64 s of CPU (3 min wall on a 2-core
# machine at load average 7, 2026-12-01). `PARITY_AUTO_DTYPE=bfloat16 make test` resolves model.dtype=auto to
# bfloat16 on any CPU: the suite an AVX512-BF16 machine runs, on an AVX2 one (PARITY_AUTO_DTYPE=float32: the reverse).
# TESTS: the first pass's files (default: all of them).
TESTS ?= tests
DTYPE_TESTS := tests/test_vllm_engine.py tests/test_precision_linear.py
test: setup
	@first=0; second=0; \
	$(PY) -m pytest -q --durations=25 $(TESTS) || first=$$?; \
	PARITY_TEST_DTYPE=bfloat16 PARITY_AUTO_DTYPE=bfloat16 $(PY) -m pytest -q $(DTYPE_TESTS) || second=$$?; \
	echo "make test: first pass ($(TESTS)) exit $$first; second pass (bfloat16: $(DTYPE_TESTS)) exit $$second"; \
	[ $$first -eq 0 ] && [ $$second -eq 0 ]

# bench: every benchmark but the soak (tests/bench/bench_soak.py, 500 RL steps with worker kills: run it alone)
bench: setup
	@for f in tests/bench/bench_*.py; do [ $$f = tests/bench/bench_soak.py ] && continue; echo "== $$f"; $(PY) $$f || exit 1; done

lint: setup
	bash scripts/lint.sh

# GPU benchmark of the numerical core, for a CUDA machine (docs/PERFORMANCE.md)
bench-gpu: setup
	$(PY) tests/bench/bench_gpu.py

lock:
	uv pip compile requirements.in --python-version 3.11 --find-links $(FIND_LINKS) \
	  --excludes requirements-exclude.txt -o requirements.lock

clean:
	rm -rf .venv
