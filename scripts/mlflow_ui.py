"""`make mlflow-ui`: MLflow's UI on the local store, with the address of each experiment's training runs.

Prints, for every experiment of the store, the link that opens it on its runs table with Parity's columns
(parity.tracking.naming.experiment_url: MLflow 3.17's UI opens an experiment on its GenAI traces overview
unless the address says `workflowType=machine_learning`), then runs `mlflow ui` with the same arguments.
The store is only read here (nothing is created when it does not exist yet)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _arg(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else default


def experiment_links(store: str, ui: str) -> list[tuple[str, str]]:
    """(experiment name, link) of each active experiment holding runs; [] when the store does not exist."""
    sys.path.insert(0, str(REPO))
    from dashboards import data
    from parity.tracking.naming import experiment_url

    try:
        client = data.mlflow_client(store)  # read-only for SQLite; a missing store is SourceUnavailable
        exps = client.search_experiments()
        return [(e.name, experiment_url(ui, e.experiment_id)) for e in exps
                if client.search_runs([e.experiment_id], max_results=1)]
    except data.SourceUnavailable:
        return []


def main(argv: list[str]) -> int:
    store = _arg(argv, "--backend-store-uri", "sqlite:///outputs/mlflow.db")
    ui = f"http://{_arg(argv, '--host', '127.0.0.1')}:{_arg(argv, '--port', '5000')}"
    links = experiment_links(store, ui)
    for name, link in links:
        print(f"MLflow: experiment {name!r}, training runs: {link}", flush=True)
    if not links:
        print(f"MLflow: no runs in {store} yet; the UI is at {ui}", flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "ui", *argv])
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
