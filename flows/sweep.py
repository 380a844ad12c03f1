"""`sweep`: one train-and-eval per correction and seed (or per override list), side by side. A failing member
does not stop the others; the sweep fails at the end, naming the members that failed.

Every member's MLflow runs carry the tag `parity.sweep=<sweep id>`, and the flow ends by printing the
dashboard's Compare page opened on that sweep (`<PARITY_DASHBOARD_URL>/compare?sweep=<id>`): the members'
curves side by side, seeds of one correction as a mean line with a band, nothing to pick by hand."""

from __future__ import annotations

import os
import time

from prefect import flow

from flows.train_and_eval import train_and_eval
from parity.study.members import correction_arm, expand
from parity.tracking.naming import compare_url
from tasks import publish

DEFAULT_DASHBOARD_URL = "http://127.0.0.1:8501"  # `make dashboard`


def member_overrides(corrections: list[str], overrides: list[str], stamp: str,
                     seeds: list[int] | None = None) -> list[list[str]]:
    """One override list per correction (and per seed, when seeds are given), each with its own run name
    `sweep-<stamp>-<correction>[-s<seed>]`: the study's member expansion (parity.study.members) over one arm per
    correction."""
    def run_name(correction: str, seed: int | None) -> str:
        return f"sweep-{stamp}-{correction.replace('+', '_')}" + ("" if seed is None else f"-s{seed}")

    return [m.override_list() for m in expand([correction_arm(c) for c in corrections], seeds, overrides, run_name)]


def sweep_members(corrections: list[str] | None, chain: list[str], overrides: list[str], runs: list[list[str]] | None,
                  seeds: list[int], stamp: str) -> list[list[str]]:
    """Each member's overrides: `chain`, then `overrides` and the member's correction (and seed); or `chain`, then
    each of `runs`."""
    if runs is not None:
        return [[*chain, *member] for member in runs]
    if not corrections:
        raise ValueError("sweep: give `corrections` (with optional `seeds` and common `overrides`) or `runs`")
    return member_overrides(list(corrections), [*chain, *overrides], stamp, seeds)


def dashboard_compare_url(sweep_id: str) -> str:
    return compare_url(os.environ.get("PARITY_DASHBOARD_URL", DEFAULT_DASHBOARD_URL), sweep=sweep_id)


@flow(name="sweep", log_prints=True)
def sweep(corrections: list[str] | None = None, overrides: list[str] | None = None,
          runs: list[list[str]] | None = None, seeds: list[int] | None = None, name: str | None = None,
          chain: list[str] | None = None) -> dict:
    """corrections: e.g. ["none", "tis", "score_centering"] (times `seeds`, e.g. [0, 1]) on top of `chain` (the
    served deployment's) and `overrides`; or explicit `runs`, each after `chain`. `name`: the sweep's id (default
    sweep-<time>)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sweep_id = name or f"sweep-{stamp}"
    runs = sweep_members(corrections, list(chain or []), list(overrides or []), runs, list(seeds or []), stamp)
    rows, failed = [], []
    for member in runs:
        state = train_and_eval(overrides=member, sweep=sweep_id, return_state=True)
        if state.is_completed():
            r = state.result()
            rows.append({"overrides": member, "title": r["title"], "final_reward": r["final_reward"],
                         "final_accuracy": r["final_accuracy"], "evaluation": r["evaluation"],
                         "benchmarks": r["benchmarks"], "pipeline_id": r["pipeline_id"], "mlflow_run_id": r["mlflow_run_id"]})
        else:
            failed.append(f"{member}: {state.message}")
            rows.append({"overrides": member, "failed": state.message})
    for r in rows:
        print(r)
    url = dashboard_compare_url(sweep_id)
    print(f"Sweep {sweep_id}: {len(rows) - len(failed)} of {len(rows)} members completed. "
          f"Compare them side by side: {url}")
    publish.sweep(sweep_id, url, rows)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(runs)} sweep members failed (compare the others: {url}):\n"
                           + "\n".join(failed))
    return {"sweep": sweep_id, "compare_url": url, "members": rows}
