"""MLflow's own UI in a real browser: `make mlflow-ui`'s command (scripts/mlflow_ui.py, which runs `mlflow ui` on
127.0.0.1) over a store holding a real tracked training run, Debian's chromium headless with a fresh profile
(MLflow 3.17 keeps its GenAI | Model training switch in the browser; a new user has GenAI). The link the command
prints opens the experiment on its runs table (not the GenAI traces overview) with Parity's columns and the run's
values in them; the dashboard's run link opens the run's page on the model-training side."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import QUICK
from tests.test_dashboard_browser import Cdp, chromium, free_port, open_chromium, stop, wait_http

REPO = Path(__file__).resolve().parents[1]
BODY_JS = "document.body ? document.body.innerText : ''"
pytestmark = pytest.mark.slow
HEADERS_JS = ("Array.from(document.querySelectorAll('[role=\"columnheader\"], .ag-header-cell-text'))"
              ".map(e => e.innerText.trim()).filter(t => t)")


def _tracked_run(outputs_dir: Path, prepared_model: Path, store: Path) -> dict:
    from parity.commands.train import train
    from parity.config import load_config
    from parity.tracking.train_run import tracked_train

    cfg = load_config([f"outputs_dir={outputs_dir}", *QUICK, f"model.path={prepared_model}",
                       "trainer.run_name=mlflow-ui-run", "algorithm.correction.name=tis", "tracking.enabled=true",
                       f"tracking.tracking_uri=sqlite:///{store}", "tracking.experiment=arith_tiny"])
    return tracked_train(cfg, lambda c, cbs: train(c, callbacks=cbs))


def _wait_text(cdp: Cdp, want: list[str], timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s  # MLflow's bundle is large: slow on a loaded 2-core machine
    text = ""
    while time.monotonic() < deadline:
        text = cdp.eval(BODY_JS) or ""
        if all(w in text for w in want):
            time.sleep(1.0)
            return cdp.eval(BODY_JS) or text
        time.sleep(0.5)
    raise AssertionError(f"{want} not on the page within {timeout_s} s; it shows: {text[:1500]!r}")


def test_mlflow_ui_opens_the_experiment_on_its_training_runs(outputs_dir, prepared_model, tmp_path):
    from parity.tracking import mlflow_log

    store = tmp_path / "mlflow.db"
    out = _tracked_run(outputs_dir, prepared_model, store)
    c = mlflow_log.client(f"sqlite:///{store}")
    run = c.get_run(out["mlflow_run_id"])
    m = run.data.metrics
    assert {"final_reward", "heldout_accuracy", "final_mismatch"} <= set(m), sorted(m)
    exp = c.get_experiment(run.info.experiment_id)
    assert json.loads(json.loads(exp.tags["mlflow.sharedViewState.parity-training-runs"])["state"])["selectedColumns"]

    browser, port = chromium(), free_port()
    ui = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), str(REPO / "scripts" / "mlflow_ui.py"),
                           "--backend-store-uri", f"sqlite:///{store}", "--host", "127.0.0.1", "--port", str(port),
                           "--workers", "1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    profile, chrome = tmp_path / "chromium-profile", None
    try:
        first = ui.stdout.readline()  # printed before the server starts
        link = re.search(r"training runs: (\S+)", first)
        assert link, first
        link = link[1]
        assert link.startswith(f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}/runs?")
        assert "workflowType=machine_learning" in link and "viewStateShareKey=parity-training-runs" in link
        wait_http(f"http://127.0.0.1:{port}/health", 400, ui)
        chrome, cdp = open_chromium(browser, profile, "2400,1200")  # wide: every column of the table is drawn
        try:
            cdp.call("Page.enable")
            cdp.call("Page.navigate", url=link)
            text = _wait_text(cdp, [run.info.run_name[:20], "final_reward"])
            headers = cdp.eval(HEADERS_JS) or []
            shot = Path(os.environ.get("PARITY_SCREENSHOT_DIR", tmp_path)) / "mlflow-runs.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            shot.write_bytes(base64.b64decode(cdp.call("Page.captureScreenshot", format="png")["data"]))
            href = cdp.eval("location.href")
            cdp.call("Page.navigate", url=mlflow_log_run_url(port, exp.experiment_id, run.info.run_id))
            run_text = _wait_text(cdp, [run.info.run_name[:20], "Overview"])
        finally:
            cdp.close()
    finally:
        if chrome is not None:
            stop(chrome)
        os.killpg(ui.pid, 15)
        ui.wait(30)
    # the runs table of the model-training side, not GenAI's traces overview
    assert "/runs" in href and "Total Cost" not in text and "Traces\n0" not in text, text[:800]
    # the view's columns, every one drawn (the table is as wide as the window); MLflow groups them under Tags and
    # Metrics in an order of its own, so the order is not checked
    want = ["parity.precision", "parity.correction", "final_reward", "heldout_accuracy", "final_mismatch"]
    assert set(want) <= set(headers), headers
    row = text[text.index(run.info.run_name[:20]):]
    assert "bf16" in row and "tis" in row  # the run's precision and correction, in their columns
    assert "Model metrics" in run_text or "Metrics" in run_text, run_text[:800]


def mlflow_log_run_url(port: int, experiment_id: str, run_id: str) -> str:
    from parity.tracking.naming import run_url

    return run_url(f"http://127.0.0.1:{port}", experiment_id, run_id)

