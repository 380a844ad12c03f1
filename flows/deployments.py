"""The deployments, declared in one place and served by this process (`python -m flows.deployments`):

    train-and-eval/local          on demand; parameters: overrides (Hydra override strings)
    benchmark-regression/nightly  cron tracking.regression.cron (02:00 daily by default)
    sweep/local                   on demand; parameters: corrections, seeds, overrides, runs, name

The flow runs execute in subprocesses of this one (Prefect's runner), so a crashed run does not take
the server or the other deployments down."""

from __future__ import annotations

import os

from prefect import serve

from flows.benchmark_regression import benchmark_regression
from flows.sweep import sweep
from flows.train_and_eval import train_and_eval

DEFAULT_SWEEP = ["none", "tis", "icepop", "score_centering", "dual"]


def deployments(cron: str | None = None, default_overrides: list[str] | None = None) -> list:
    if cron is None:
        from parity.config import load_config

        cron = str(load_config([]).tracking.regression.cron)
    base = list(default_overrides or [])
    return [
        train_and_eval.to_deployment(name="local", parameters={"overrides": base},
                                     description="quantize -> validate -> train -> evaluate on Hydra overrides"),
        benchmark_regression.to_deployment(name="nightly", cron=cron, parameters={"overrides": base},
                                           description="registered candidate vs champion, each in its deploy precision"),
        sweep.to_deployment(name="local", parameters={"corrections": DEFAULT_SWEEP, "seeds": [0], "overrides": base},
                            description="one train-and-eval per correction and seed; prints the dashboard's "
                                        "Compare page of its members"),
    ]


def main() -> None:
    # PARITY_DEPLOYMENT_OVERRIDES: default overrides of every deployment, space-separated (tests, `make run`)
    overrides = os.environ.get("PARITY_DEPLOYMENT_OVERRIDES", "").split()
    serve(*deployments(default_overrides=overrides), limit=int(os.environ.get("PARITY_SERVE_LIMIT", "1")))


if __name__ == "__main__":
    main()
