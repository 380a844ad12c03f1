"""Session-wide Prefect services and the tiny sweep run through them, shared by the flow, tracking and
dashboard tests (tests/conftest.py imports the fixtures).

`prefect_services`: a real Prefect server on 127.0.0.1 (its home and database in a temp dir) and the
deployments served by `python -m flows.deployments`, with `served_chain` as their `chain` default (as `make run`
serves its own overrides): `prefect deployment run` without `chain` runs on it, and the other tests' runs pass
`"chain": []` (runs of their own shape, run_deployment). `sweep_store`: `sweep/local` triggered through the
Prefect REST API with two corrections x two seeds on the quick settings, its rollout in W8A8 INT8 + INT4 KV
(so each member quantizes, validates, trains and evaluates in the seed's numerics), into its own outputs
folder, so its MLflow store and registry hold exactly the sweep (the other flow tests write beside it, not into
it). `sweep_regression`: `benchmark-regression/nightly` on the sweep's registered model afterwards."""

from __future__ import annotations

import json
import re
import shlex
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from scripts.run_local import (
    REPO,
    free_port,
    start_server,
    start_serving,
    stop_process,
    wait_deployment,
    wait_healthy,
)
from tests.quantized_outputs import VALIDATION

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
SWEEP_MODEL = "sweeptest-model"
SWEEP_CORRECTIONS = ["none", "tis"]
SWEEP_SEEDS = [0, 1]
SWEEP_PRECISION = ["rollout.precision.weights=int8", "rollout.precision.activations=int8",
                   "rollout.precision.kv_cache=int4_per_token_head"]


def make_run_chain() -> list[str]:
    """The Makefile's CHAIN: the overrides `make run` adds to the embedded default."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return shlex.split(re.search(r"^CHAIN := (.*)$", text, re.M)[1])


def served_chain(root: Path) -> list[str]:
    """The session's deployments' `chain`: `make run`'s chain (INT8 W8A8 + INT4 KV rollout, score centering, the
    held-out task and the six benchmarks) on the quick settings, its own warm start (30 steps), a small evaluation
    (2 problems a benchmark, 8 of the held-out task) and validation, into root/chain."""
    from tests.conftest import QUICK

    return [f"outputs_dir={root / 'chain'}", *make_run_chain(), *QUICK, "eval.limit=2",
            "eval.benchmarks.arithmetic.limit=8", "rollout.precision.validation.num_prompts=4",
            "rollout.precision.validation.samples_per_prompt=1", "rollout.precision.validation.max_new_tokens=8",
            "tracking.model_name=chain-model"]


def api(url: str, method: str = "GET", body: dict | None = None) -> dict | list:
    """One REST call; 429/502/503 are retried with a short backoff as Prefect's own client does (the server
    answers 503 while its SQLite database is busy, which a loaded 2-core CI machine met once)."""
    for attempt in range(6):
        req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code not in (429, 502, 503) or attempt == 5:
                raise
            time.sleep(2 * (attempt + 1))
    raise AssertionError("unreachable")


def sweep_eval(out: Path, prepared_model: Path) -> list[str]:
    """The sweep's settings that the nightly regression check shares with it (its stores, model, evaluation), so
    the check finds the members' own evaluations in their deploy precision and reuses them."""
    from tests.conftest import QUICK

    return [f"outputs_dir={out}", *QUICK, f"model.path={prepared_model}", "eval.suite=[arithmetic]", "eval.limit=4",
            f"tracking.model_name={SWEEP_MODEL}"]


def run_deployment(api_url: str, name: str, overrides: list[str], timeout_s: float = 600,
                   parameters: dict | None = None) -> dict:
    """`prefect deployment run NAME` through the REST API, waited for until the flow run is terminal; with
    `"chain": []` unless `parameters` name one: `overrides` alone make the run."""
    dep = api(f"{api_url}/deployments/name/{name}")
    run = api(f"{api_url}/deployments/{dep['id']}/create_flow_run", "POST",
              {"parameters": {"chain": [], "overrides": overrides, **(parameters or {})}})
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        fr = api(f"{api_url}/flow_runs/{run['id']}")
        if fr["state"]["type"] in TERMINAL:
            return fr
        time.sleep(2)
    raise TimeoutError(f"flow run {run['id']} of {name} not finished after {timeout_s} s")


def flow_run_logs(api_url: str, flow_run_id: str) -> list[str]:
    """Every log line of a flow run, oldest first (the API answers 200 at most a call: paged)."""
    out: list[str] = []
    while True:
        page = api(f"{api_url}/logs/filter", "POST", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                       "sort": "TIMESTAMP_ASC", "limit": 200, "offset": len(out)})
        out += [row["message"] for row in page]
        if len(page) < 200:
            return out


def flow_run_line(api_url: str, flow_run_id: str, pattern: str, timeout_s: float = 60.0) -> tuple[list[str], Any]:
    """(the flow run's log lines, the first match of `pattern` in them), polling until the line has arrived: the
    workers ship logs to the server in batches, so the last lines of a finished run may land a little later."""
    deadline = time.monotonic() + timeout_s
    while True:
        logs = flow_run_logs(api_url, flow_run_id)
        match = next((m for line in logs if (m := re.search(pattern, line))), None)
        if match is not None or time.monotonic() > deadline:
            return logs, match
        time.sleep(1.0)


def artifacts_of(api_url: str, flow_run_id: str) -> dict[str, dict]:
    """The Prefect artifacts a flow run published, by key (tasks/publish.py); a table's rows decoded."""
    rows = api(f"{api_url}/artifacts/filter", "POST", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    out = {}
    for a in rows:
        if a["type"] == "table" and isinstance(a["data"], str):
            a = {**a, "rows": json.loads(a["data"])}
        out[a["key"]] = a
    return out


@pytest.fixture(scope="session")
def prefect_services(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefect")
    out = root / "outputs"
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    server = start_server(root / "home", port, root / "server.log")
    serving = None
    try:
        wait_healthy(api_url, server, timeout_s=300)
        serving = start_serving(root / "home", api_url, root / "serve.log",
                                extra_env={"PARITY_OUTPUTS": str(out),
                                           "PARITY_DEPLOYMENT_OVERRIDES": json.dumps(served_chain(root))})
        wait_deployment(api_url, "train-and-eval/local", serving, timeout_s=300)
        for name in ("benchmark-regression/nightly", "sweep/local"):
            wait_deployment(api_url, name, serving, timeout_s=60)
        yield {"api": api_url, "out": out, "root": root}
    finally:
        if serving is not None:
            stop_process(serving.pid)
        stop_process(server.pid)


@pytest.fixture(scope="session")
def sweep_store(prefect_services, prepared_model: Path) -> dict:
    """The sweep's flow run, its member flow runs, the Compare link it printed and its stores."""

    api_url, out = prefect_services["api"], prefect_services["root"] / "sweep"
    common = [*sweep_eval(out, prepared_model), *SWEEP_PRECISION, *VALIDATION]
    t0 = time.monotonic()
    fr = run_deployment(api_url, "sweep/local", common,
                        parameters={"corrections": SWEEP_CORRECTIONS, "seeds": SWEEP_SEEDS})
    seconds = time.monotonic() - t0
    children = api(f"{api_url}/flow_runs/filter", "POST",
                   {"flow_runs": {"parent_flow_run_id": {"any_": [fr["id"]]}}, "sort": "START_TIME_ASC"})
    logs, link = flow_run_line(api_url, fr["id"], r"Compare them side by side: (\S+)")
    return {"flow_run": fr, "children": children, "logs": logs, "compare_url": link[1] if link else None,
            "sweep": re.search(r"[?&]sweep=([^&]+)", link[1])[1] if link else None, "seconds": seconds,
            "outputs_dir": str(out), "tracking_uri": f"sqlite:///{out}/mlflow.db",
            "registry_url": f"sqlite:///{out}/registry.db"}


@pytest.fixture(scope="session")
def sweep_regression(prefect_services, sweep_store, prepared_model: Path) -> dict:
    """`benchmark-regression/nightly` on the sweep's model: its candidate (the last version registered, v4) against
    its champion (the first, v1), with a margin no drop can exceed, so the run completes whatever the tiny models
    score; the records it leaves are what is checked."""
    out = Path(sweep_store["outputs_dir"])
    t0 = time.monotonic()
    fr = run_deployment(prefect_services["api"], "benchmark-regression/nightly",
                        [*sweep_eval(out, prepared_model), "tracking.regression.margin=1.0",
                         "tracking.regression.bootstrap=500"])
    return {"flow_run": fr, "seconds": time.monotonic() - t0, "outputs_dir": str(out)}
