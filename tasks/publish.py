"""What a flow run shows where its users look: Prefect artifacts attached to the flow run (the UI's Artifacts
tab, `prefect artifact ls`, `prefect artifact inspect KEY`) and one `Result: ...` line in the flow's own log,
which `prefect deployment run ... --watch` prints with the run's other logs.

    train-and-eval         train-and-eval-summary (markdown), train-and-eval-benchmarks (table, with intervals)
    benchmark-regression   benchmark-regression-verdict (markdown), benchmark-regression-checks (table)
    sweep                  sweep-compare (link to the dashboard's Compare page), sweep-members (table)

A key names one kind of artifact; each flow run adds a version of it (`prefect artifact inspect KEY` lists them
newest first, each with its flow run). Everything here was already recorded (registry DB, MLflow) before it is
published, so a server that refuses an artifact costs the artifact (a warning in the log), never the run."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

SUMMARY_KEY = "train-and-eval-summary"
BENCHMARKS_KEY = "train-and-eval-benchmarks"
VERDICT_KEY = "benchmark-regression-verdict"
CHECKS_KEY = "benchmark-regression-checks"
COMPARE_KEY = "sweep-compare"
MEMBERS_KEY = "sweep-members"

log = logging.getLogger(__name__)


def _in_flow_run() -> bool:
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def _logger() -> Any:
    if _in_flow_run():
        from prefect import get_run_logger

        return get_run_logger()
    return log


def _publish(kind: str, **kwargs: Any) -> None:
    """One artifact on the current flow run (none outside a flow run: plain library calls have no run page)."""
    if not _in_flow_run():
        return
    from prefect import artifacts

    try:
        getattr(artifacts, f"create_{kind}_artifact")(**kwargs)
    except Exception as e:  # the results are recorded elsewhere already; the artifact is a view of them
        _logger().warning("could not publish the %s artifact %r: %s", kind, kwargs.get("key"), e)


def result_line(text: str) -> str:
    line = f"Result: {text}"
    _logger().info(line)
    if _in_flow_run():
        from prefect.logging.handlers import APILogHandler

        try:  # sent now, not in the next batch: it reaches the server (and `--watch`) before the run's final state
            APILogHandler().flush()
        except Exception as e:
            log.warning("could not flush the flow run's log: %s", e)
    return line


def _pct(x: Any) -> str:
    return "n/a" if not isinstance(x, int | float) else f"{100 * x:.1f}%"


def _num(x: Any) -> str:
    return "n/a" if not isinstance(x, int | float) else f"{x:.3f}"


def benchmark_rows(eval_out_dir: str | Path) -> list[dict]:
    """One row per benchmark from the evaluation's metrics.json: avg@k with its bootstrap interval, and the
    other metrics' values (fractions; the interval level is the evaluation's eval.ci_level), and how it was
    sampled (temperature, max_new_tokens: the responses' budget it ran with)."""
    summary = json.loads((Path(eval_out_dir) / "metrics.json").read_text())
    rows = []
    for name, r in summary["benchmarks"].items():
        avg = r["metrics"]["avg@k"]
        row = {"benchmark": name, "problems": r["problems"], "k": r["k"], "avg@k": avg["value"],
               "ci_low": avg["ci_low"], "ci_high": avg["ci_high"]}
        row.update({m: v["value"] for m, v in r["metrics"].items() if m != "avg@k"})
        sampling = r.get("sampling") or {}
        row.update({"temperature": sampling.get("temperature"),
                    "max_new_tokens": sampling.get("max_new_tokens_used", sampling.get("max_new_tokens"))})
        rows.append(row)
    return rows


def _interval(r: dict) -> str:
    return f"{_pct(r['avg@k'])} [{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}]"


def benchmarks_text(rows: list[dict], macro: Any, heldout: dict | None) -> str:
    """The benchmark numbers named for what they are: the set the average is over, with its problems (one benchmark:
    its own avg@k and interval), and, where a benchmark is the training task's own test split, how it differs from
    the held-out accuracy beside it."""
    from parity.tracking import naming

    problems = naming.benchmark_problems({r["benchmark"]: r for r in rows})
    if len(rows) == 1:
        (r,) = rows
        text = f"benchmark {r['benchmark']} avg@{r['k']} {_interval(r)} on {r['problems']} problems"
    else:
        text = f"benchmark average (macro avg@k) {_pct(macro)} over {naming.benchmark_set(problems)}"
    same = [r for r in rows if heldout and r["benchmark"] == heldout.get("task")]
    for r in same:
        which = "" if len(rows) == 1 else f"benchmark {r['benchmark']}: "
        how = naming.sampling_text(r.get("temperature"), r["k"], r.get("max_new_tokens"))
        text += (f" ({which}the first {r['problems']} problems of the held-out test split, {how}, on the final "
                 "checkpoint after training)")
    return text


def train_and_eval(result: dict, seconds: float) -> str:
    """The completed pipeline: summary (markdown) and benchmark table (intervals) artifacts, the result line."""
    out_dir = Path(result["eval_out_dir"])
    rows = benchmark_rows(out_dir)
    table_md = (out_dir / "table.md").read_text().strip() if (out_dir / "table.md").is_file() else ""
    reg = result.get("registered_model") or {}
    registered = f"{reg['model_name']} version {reg['version']}" if reg else "not registered (tracking.log_model)"
    from parity.tracking import naming

    held = f"{_pct(result['initial_accuracy'])} -> {_pct(result['final_accuracy'])}"
    heldout = result.get("heldout")
    held_on = f" on {naming.heldout_text(heldout)}" if heldout else ""
    macro = (result.get("evaluation") or {}).get("avg@k")
    bench_text = benchmarks_text(rows, macro, heldout)
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in (result.get("lib_seconds") or {}).items())
    md = "\n".join([
        f"# {result['title']}", "",
        "| | |", "|---|---|",
        f"| status | completed in {seconds:.0f} s |",
        f"| rollout precision | {result['precision']} (validation: {result['validation']}) |",
        f"| held-out accuracy | {held}{held_on} |",
        f"| final reward | {_num(result.get('final_reward'))} |",
        f"| benchmarks (evaluate stage) | {bench_text} |",
        f"| registered model | {registered} |",
        f"| MLflow run | {result['mlflow_run_id']} (pipeline {result['pipeline_id']}) |",
        f"| checkpoint | {result['checkpoint']} |",
        f"| stage times | {stages} |", "",
        "## Benchmarks (percent, bootstrap interval)", "", table_md, "",
        f"Per-sample results: {out_dir / 'samples.jsonl'}",
    ])
    _publish("markdown", markdown=md, key=SUMMARY_KEY, description=f"train-and-eval: {result['title']}")
    _publish("table", table=rows, key=BENCHMARKS_KEY,
             description=f"{result['title']}: avg@k with its bootstrap interval (ci_low, ci_high) per benchmark")
    return result_line(f"{result['title']}: held-out accuracy {held}{held_on}; {bench_text}; final reward "
                       f"{_num(result.get('final_reward'))}, validation {result['validation']}, {registered}; "
                       f"details: prefect artifact inspect {SUMMARY_KEY}")


def train_and_eval_failed(title: str, stages: list[str], error: BaseException) -> str:
    reason = f"{type(error).__name__}: {error}"
    md = "\n".join([f"# {title}", "", f"**FAILED** in stage `{stages[-1] if stages else 'setup'}`", "",
                    "```", reason[:4000], "```", "", f"stages run: {', '.join(stages) or 'none'}"])
    _publish("markdown", markdown=md, key=SUMMARY_KEY, description=f"train-and-eval: {title} (failed)")
    return result_line(f"{title}: FAILED in stage {stages[-1] if stages else 'setup'}: {reason.splitlines()[0][:300]}")


def _check_row(x: dict) -> dict:
    base = {"benchmark": x["benchmark"], "model": x.get("model"), "model_version": x.get("model_version")}
    if "baseline_set" in x:
        return {**base, "verdict": "baseline set", "baseline_mean": None, "candidate_mean": None, "delta": None,
                "ci_low": None, "ci_high": None, "margin": None, "paired_problems": None}
    return {**base, "verdict": "ok" if x["passed"] else "REGRESSION",
            **{k: x.get(k) for k in ("baseline_mean", "candidate_mean", "delta", "ci_low", "ci_high", "margin",
                                     "paired_problems")}}


def _signed_pct(x: Any) -> str:
    return "" if not isinstance(x, int | float) else f"{100 * x:+.1f}"


def _check_md(r: dict) -> str:
    interval = f"[{_signed_pct(r['ci_low'])}, {_signed_pct(r['ci_high'])}]" if r["ci_low"] is not None else ""
    model = f"{r['model']}" + (f" (v{r['model_version']})" if r["model_version"] else "")
    cells = [r["benchmark"], r["verdict"], "" if r["baseline_mean"] is None else _pct(r["baseline_mean"]),
             "" if r["candidate_mean"] is None else _pct(r["candidate_mean"]), _signed_pct(r["delta"]), interval,
             str(r["paired_problems"] or ""), model]
    return "| " + " | ".join(cells) + " |"


def regression(checks: list[dict], margin: float | None, error: BaseException | None = None,
               nothing_to_compare: str | None = None) -> str:
    """The nightly check's verdict (markdown) and its checks (table); also when the check failed or could not
    run, with the reason, and when there was no champion to compare with (`nothing_to_compare` says why)."""
    rows = [_check_row(x) for x in checks]
    failed = [r["benchmark"] for r in rows if r["verdict"] == "REGRESSION"]
    if failed:
        verdict = f"REGRESSION in {len(failed)} of {len(rows)} benchmark(s): {', '.join(failed)}"
    elif error is not None:
        verdict = f"NOT CHECKED: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    elif not rows and nothing_to_compare:
        verdict = f"NOTHING TO COMPARE: {nothing_to_compare}"
    else:
        verdict = f"PASSED: {len(rows)} benchmark(s), none dropped beyond the margin ({margin:g})"
    lines = [f"# Benchmark regression: {verdict}", "",
             "Each benchmark of the candidate against the champion, paired by problem; a check fails when the drop exceeds "
             f"the margin{'' if margin is None else f' ({margin:g})'} and the bootstrap interval of the difference "
             "lies below 0.", ""]
    if rows:
        lines += ["| benchmark | verdict | champion | candidate | delta (points) | interval | problems | candidate model |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [_check_md(r) for r in rows]
    _publish("markdown", markdown="\n".join(lines), key=VERDICT_KEY, description=f"benchmark regression: {verdict}")
    if rows:
        _publish("table", table=rows, key=CHECKS_KEY, description="benchmark regression: one row per check")
    return result_line(f"benchmark regression {verdict}; details: prefect artifact inspect {VERDICT_KEY}")


def sweep(sweep_id: str, url: str, rows: list[dict]) -> str:
    done = [r for r in rows if "failed" not in r]
    _publish("link", link=url, link_text=f"Compare {sweep_id} ({len(done)} runs)", key=COMPARE_KEY,
             description=f"sweep {sweep_id}: the dashboard's Compare page of its members (`make dashboard`)")
    from parity.tracking import naming

    table = [{"member": r.get("title") or " ".join(r["overrides"]), "status": "failed" if "failed" in r else "completed",
              "final_reward": r.get("final_reward"), "heldout_accuracy": r.get("final_accuracy"),
              "benchmarks_avg": (r.get("evaluation") or {}).get("avg@k"),
              "benchmarks_over": naming.benchmark_set_short(naming.benchmark_problems(r.get("benchmarks") or {})),
              "mlflow_run_id": r.get("mlflow_run_id"), "reason": r.get("failed")} for r in rows]
    _publish("table", table=table, key=MEMBERS_KEY, description=f"sweep {sweep_id}: one row per member")
    return result_line(f"sweep {sweep_id}: {len(done)} of {len(rows)} members completed; compare them: {url}")
