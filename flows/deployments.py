"""The deployments, declared in one place and served by this process (`python -m flows.deployments`):

    train-and-eval/local          on demand; parameters: chain, overrides (Hydra override strings)
    benchmark-regression/nightly  cron tracking.regression.cron (02:00 daily by default); chain, overrides
    sweep/local                   on demand; parameters: corrections, seeds, chain, overrides, runs, name

Every deployment composes `chain` then `overrides`. `chain`'s default is what PARITY_DEPLOYMENT_OVERRIDES names
(`make run` sets it to the overrides its own run ran), `overrides` is empty: Prefect's `--params` replaces a
parameter's whole default, so `--params '{"overrides": ["algorithm.correction.name=tis"]}'` is the served chain
with that one change (the same warm start, so its cached model), and `--params '{"chain": [], ...}'` a run of
another shape, from the config's defaults.

The flow runs execute in subprocesses of this one (Prefect's runner), so a crashed run does not take
the server or the other deployments down."""

from __future__ import annotations

import json
import os
import sys

from prefect import serve

from flows.benchmark_regression import benchmark_regression
from flows.sweep import sweep
from flows.train_and_eval import train_and_eval

DEFAULT_SWEEP = ["none", "tis", "icepop", "score_centering", "dual"]


def deployments(cron: str | None = None, chain: list[str] | None = None) -> list:
    if cron is None:
        from parity.config import load_config

        cron = str(load_config(list(chain or [])).tracking.regression.cron)
    base = {"chain": list(chain or []), "overrides": []}
    return [
        train_and_eval.to_deployment(name="local", parameters=base,
                                     description="quantize -> validate -> train -> evaluate on Hydra overrides "
                                                 "(`chain`, then `overrides`)"),
        benchmark_regression.to_deployment(name="nightly", cron=cron, parameters=base,
                                           description="registered candidate vs champion, each in its deploy precision"),
        sweep.to_deployment(name="local", parameters={"corrections": DEFAULT_SWEEP, "seeds": [0], **base},
                            description="one train-and-eval per correction and seed; prints the dashboard's "
                                        "Compare page of its members"),
    ]


def chain_from_env(value: str | None) -> list[str]:
    """PARITY_DEPLOYMENT_OVERRIDES: a JSON list of override strings (what `make run` writes), or overrides
    separated by spaces (docker/.env)."""
    value = (value or "").strip()
    if not value.startswith("["):
        return value.split()
    try:
        chain = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"PARITY_DEPLOYMENT_OVERRIDES: not a JSON list of strings ({e})") from None
    if not isinstance(chain, list) or not all(isinstance(o, str) for o in chain):
        raise ValueError(f"PARITY_DEPLOYMENT_OVERRIDES: not a JSON list of strings: {value[:200]}")
    return chain


def main() -> None:
    try:
        chain = chain_from_env(os.environ.get("PARITY_DEPLOYMENT_OVERRIDES"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    serve(*deployments(chain=chain), limit=int(os.environ.get("PARITY_SERVE_LIMIT", "1")))


if __name__ == "__main__":
    main()
