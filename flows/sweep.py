"""`sweep`: one train-and-eval per correction (or per override list), side by side. A failing member
does not stop the others; the sweep fails at the end, naming the members that failed."""

from __future__ import annotations

import time

from prefect import flow

from flows.train_and_eval import train_and_eval


def member_overrides(corrections: list[str], overrides: list[str], stamp: str) -> list[list[str]]:
    return [[*overrides, f"algorithm.correction.name={c}", f"trainer.run_name=sweep-{stamp}-{c.replace('+', '_')}"]
            for c in corrections]


@flow(name="sweep", log_prints=True)
def sweep(corrections: list[str] | None = None, overrides: list[str] | None = None,
          runs: list[list[str]] | None = None) -> dict:
    """corrections: e.g. ["none", "tis", "score_centering"] on top of `overrides`; or explicit `runs`."""
    if runs is None:
        if not corrections:
            raise ValueError("sweep: give `corrections` (with optional common `overrides`) or `runs`")
        runs = member_overrides(list(corrections), list(overrides or []), time.strftime("%Y%m%d-%H%M%S"))
    rows, failed = [], []
    for member in runs:
        state = train_and_eval(overrides=member, return_state=True)
        if state.is_completed():
            r = state.result()
            rows.append({"overrides": member, "final_reward": r["final_reward"], "final_accuracy": r["final_accuracy"],
                         "evaluation": r["evaluation"], "pipeline_id": r["pipeline_id"]})
        else:
            failed.append(f"{member}: {state.message}")
            rows.append({"overrides": member, "failed": state.message})
    for r in rows:
        print(r)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(runs)} sweep members failed:\n" + "\n".join(failed))
    return {"members": rows}
