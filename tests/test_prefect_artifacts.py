"""Results where users look, on the session's real Prefect server (tests/prefect_services.py).

`prefect deployment run train-and-eval/local --watch` (the CLI, as the README shows it) with `make run`'s chain
read from the Makefile (INT8 W8A8 + INT4 KV rollout, score centering, the held-out task and the six benchmarks)
on the quick settings: every stage runs (none skipped), and the flow run carries the run summary and the
benchmark table with intervals as artifacts, read back through the API and through `prefect artifact ls` /
`prefect artifact inspect`, equal to what the stages recorded; its log has the one-line result. The sweep's
flow run (the session's tiny sweep) carries its Compare link and its members. The regression verdict is checked
on the failing nightly run of tests/test_flows_prefect.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from scripts.run_local import REPO, prefect_env
from tasks import publish
from tests.conftest import QUICK
from tests.prefect_services import api, artifacts_of, flow_run_line

pytestmark = pytest.mark.slow
PREFECT = str(Path(REPO) / ".venv" / "bin" / "prefect")


def make_run_chain() -> list[str]:
    """The Makefile's CHAIN: the overrides `make run` adds to the embedded default."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return shlex.split(re.search(r"^CHAIN := (.*)$", text, re.M)[1])


def _cli(prefect: dict, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    # its output is captured (a pipe), as `make run | tee` makes it; rich: no truncated keys in tables
    env = {**prefect_env(prefect["root"] / "home", prefect["api"], piped=True), "COLUMNS": "250"}
    return subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def chain(prefect_services, prepared_model):
    out = prefect_services["root"] / "chain"
    overrides = [f"outputs_dir={out}", *make_run_chain(), *QUICK, f"model.path={prepared_model}",
                 "eval.limit=2", "eval.benchmarks.arithmetic.limit=8", "rollout.precision.validation.num_prompts=4",
                 "rollout.precision.validation.samples_per_prompt=1", "rollout.precision.validation.max_new_tokens=8",
                 "trainer.run_name=chain", "tracking.model_name=chain-model"]
    watch = _cli(prefect_services, "deployment", "run", "train-and-eval/local", "--params",
                 json.dumps({"overrides": overrides}), "--watch", "--watch-timeout", "840")
    found = re.search(r"UUID: ([0-9a-f-]{36})", watch.stdout)
    assert found, watch.stdout + watch.stderr
    fr = api(f"{prefect_services['api']}/flow_runs/{found[1]}")
    return {"out": out, "flow_run": fr, "watch": watch}


def test_make_run_chain_runs_every_stage(chain):
    from parity.tracking.registry import Registry

    assert chain["watch"].returncode == 0, chain["watch"].stdout[-4000:] + chain["watch"].stderr[-4000:]
    assert chain["flow_run"]["state"]["type"] == "COMPLETED"
    with Registry(f"sqlite:///{chain['out']}/registry.db") as reg:
        (pid,) = reg.pipelines_of_flow_run(chain["flow_run"]["id"])
        p = reg.pipeline(pid)
    assert [(s["name"], s["status"]) for s in p["stages"]] == [
        ("prepare", "completed"), ("quantize", "completed"), ("validate", "completed"), ("train", "completed"),
        ("evaluate", "completed"), ("register", "completed")]
    assert p["stages"][2]["result"]["status"] == "passed"
    steps = [json.loads(x) for x in (chain["out"] / "runs" / "chain" / "metrics.jsonl").read_text().splitlines()]
    assert all(s["correction/sc_rho_mean"] > 0 for s in steps if "reward/mean" in s)  # score centering ran
    benchmarks = p["stages"][4]["result"]["macro"]
    assert "avg@k" in benchmarks


def test_train_and_eval_publishes_summary_and_benchmarks(chain, prefect_services):
    from parity.tracking import mlflow_log
    from parity.tracking.registry import Registry

    api_url, fr = prefect_services["api"], chain["flow_run"]
    arts = artifacts_of(api_url, fr["id"])
    assert {publish.SUMMARY_KEY, publish.BENCHMARKS_KEY} <= set(arts), sorted(arts)
    with Registry(f"sqlite:///{chain['out']}/registry.db") as reg:
        (pid,) = reg.pipelines_of_flow_run(fr["id"])
        p = reg.pipeline(pid)
    train, evaluate = p["stages"][3]["result"], p["stages"][4]["result"]
    metrics = json.loads((Path(evaluate["out_dir"]) / "metrics.json").read_text())

    rows = arts[publish.BENCHMARKS_KEY]["rows"]
    assert [r["benchmark"] for r in rows] == ["arithmetic", "aime24", "aime25", "amc23", "math500", "minerva_math",
                                              "olympiadbench"]
    for r in rows:
        m = metrics["benchmarks"][r["benchmark"]]
        assert r["problems"] == m["problems"] == (8 if r["benchmark"] == "arithmetic" else 2)
        avg = m["metrics"]["avg@k"]
        assert (r["avg@k"], r["ci_low"], r["ci_high"]) == (avg["value"], avg["ci_low"], avg["ci_high"])
        assert r["ci_low"] <= r["avg@k"] <= r["ci_high"]

    md = arts[publish.SUMMARY_KEY]["data"]
    title = mlflow_log.client(f"sqlite:///{chain['out']}/mlflow.db").get_run(p["mlflow_run_id"]).info.run_name
    assert md.startswith(f"# {title}\n") and "score_centering" in title
    assert "validation: passed" in md
    held = f"{100 * train['initial_accuracy']:.1f}% -> {100 * train['final_accuracy']:.1f}%"
    # the held-out accuracy and the benchmarks, each named for what it is and its size (QUICK: 16 held-out problems,
    # 12 new tokens; the chain's eval=quick, here the first 8 arithmetic problems and 2 of each other benchmark)
    heldout = ("the arithmetic task's test split, its first 16 problems, greedy, up to 12 new tokens, through the "
               "rollout engine during training")
    assert f"| held-out accuracy | {held} on {heldout} |" in md
    macro = f"{100 * metrics['macro']['avg@k']['value']:.1f}%"
    bench_set = ("7 benchmarks, 20 problems: aime24 2, aime25 2, amc23 2, arithmetic 8, math500 2, minerva_math 2, "
                 "olympiadbench 2")
    arith = metrics["benchmarks"]["arithmetic"]["sampling"]
    same_split = (f"(benchmark arithmetic: the first 8 problems of the held-out test split, greedy, up to "
                  f"{arith['max_new_tokens_used']} new tokens, on the final checkpoint after training)")
    bench = f"benchmark average (macro avg@k) {macro} over {bench_set} {same_split}"
    assert f"| benchmarks (evaluate stage) | {bench} |" in md
    assert f"| registered model | chain-model version {p['stages'][5]['result']['version']} |" in md
    assert "| arithmetic | 8 | 1 |" in md  # the benchmark table with its intervals, in percent

    # the one-line result in the flow's own log (what --watch streams)
    logs, line = flow_run_line(api_url, fr["id"], r"Result: (.*)")
    assert line is not None, logs[-20:]
    assert line[1].startswith(f"{title}: held-out accuracy {held} on {heldout}; {bench}; final reward ")
    assert "validation passed" in line[1]
    # --watch printed it whole, on one line, though its output is a pipe and the line longer than the console
    assert len(line[1]) > 250 and f"Result: {line[1]}\n" in chain["watch"].stdout, chain["watch"].stdout[-3000:]
    # and the evaluation's table under the line that names its set, none of its rows broken
    table = metrics["table"].splitlines()
    assert f"evaluate: {bench_set}; percent, [95% bootstrap interval]" in chain["watch"].stdout
    assert all(f"{row}\n" in chain["watch"].stdout for row in table[2:]), table

    # and from the terminal, as the README shows
    ls = _cli(prefect_services, "artifact", "ls")
    assert ls.returncode == 0 and publish.SUMMARY_KEY in ls.stdout and publish.BENCHMARKS_KEY in ls.stdout, ls.stdout
    inspect = _cli(prefect_services, "artifact", "inspect", publish.SUMMARY_KEY, "--limit", "20", "--output", "json")
    assert inspect.returncode == 0, inspect.stderr
    versions = json.loads(inspect.stdout)
    mine = [v for v in versions if v["flow_run_id"] == fr["id"]]
    assert len(mine) == 1 and mine[0]["data"] == md


def test_sweep_publishes_its_compare_link(sweep_store, prefect_services):
    api_url = prefect_services["api"]
    arts = artifacts_of(api_url, sweep_store["flow_run"]["id"])
    link = arts[publish.COMPARE_KEY]  # Prefect keeps a link artifact as markdown: [text](url)
    assert link["data"] == f"[Compare {sweep_store['sweep']} (4 runs)]({sweep_store['compare_url']})"
    members = arts[publish.MEMBERS_KEY]["rows"]
    assert [m["status"] for m in members] == ["completed"] * 4
    assert sorted(m["member"] for m in members) == sorted(f"arith_tiny / int8+int4kv / {c} / seed {s}"
                                                          for c in ("none", "tis") for s in (0, 1))
    for child in sweep_store["children"]:  # each member's own summary, on its own flow run
        assert publish.SUMMARY_KEY in artifacts_of(api_url, child["id"])
