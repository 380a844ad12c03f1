"""Results where users look, on the session's real Prefect server (tests/prefect_services.py).

`prefect deployment run train-and-eval/local --watch` (the CLI, as `make run` runs it) on the deployment's own
`chain`, `make run`'s chain read from the Makefile (INT8 W8A8 + INT4 KV rollout, score centering, the held-out task
and the six benchmarks) on the quick settings: every stage runs (none skipped), and the flow run carries the run
summary and the benchmark table with intervals as artifacts, read back through the API and through
`prefect artifact ls` / `prefect artifact inspect`, equal to what the stages recorded; its log has the one-line
result, and the terminal that watches it shows the warm start's, the RL steps' and the evaluation's progress
lines with their ETA. Then the second run the README suggests, `--params '{"overrides":
["algorithm.correction.name=tis"]}'`: its resolved config differs from the first's in the correction alone, and it
trains from the first's prepared model (no second warm start). The sweep's flow run (the session's tiny sweep)
carries its Compare link and its members. The regression verdict is checked on the failing nightly run of
tests/test_flows_prefect.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from scripts.run_local import AGAIN_PARAMS, REPO, prefect_env
from tasks import publish
from tests.prefect_services import api, artifacts_of, flow_run_line

pytestmark = pytest.mark.slow
PREFECT = str(Path(REPO) / ".venv" / "bin" / "prefect")
# a progress line (parity.core.progress) as --watch prints it: the stage, done/total, the ETA (`done` on the last
# line), the rate, the elapsed time
PROGRESS = (r"(warm start|train|evaluate): (\d+)/(\d+) (step|problem)s \(\d+%\), (ETA \S+|done), "
            r"[\d.]+ (?:\w+/s|s/\w+), \S+ elapsed")


def _cli(prefect: dict, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    # its output is captured (a pipe), as `make run | tee` makes it; rich: no truncated keys in tables
    env = {**prefect_env(prefect["root"] / "home", prefect["api"], piped=True), "COLUMNS": "250"}
    return subprocess.run([PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _watch(prefect: dict, *params: str) -> dict:
    """`prefect deployment run train-and-eval/local [--params ...] --watch`: its output and its flow run."""
    watch = _cli(prefect, "deployment", "run", "train-and-eval/local", *params, "--watch", "--watch-timeout", "840")
    found = re.search(r"UUID: ([0-9a-f-]{36})", watch.stdout)
    assert found, watch.stdout + watch.stderr
    return {"flow_run": api(f"{prefect['api']}/flow_runs/{found[1]}"), "watch": watch}


@pytest.fixture(scope="module")
def chain(prefect_services):
    """The deployment's own chain, as `make run` triggers it (no --params)."""
    return {"out": prefect_services["root"] / "chain", **_watch(prefect_services)}


@pytest.fixture(scope="module")
def second_run(chain, prefect_services):
    """The second run `make run`'s last line suggests."""
    return _watch(prefect_services, *shlex.split(AGAIN_PARAMS))


def _pipeline(out: Path, flow_run_id: str) -> dict:
    from parity.tracking.registry import Registry

    with Registry(f"sqlite:///{out}/registry.db") as reg:
        (pid,) = reg.pipelines_of_flow_run(flow_run_id)
        return reg.pipeline(pid)


def _progress_lines(text: str) -> list[re.Match]:
    return [m for line in text.splitlines() if (m := re.search(PROGRESS, line))]


def test_make_run_chain_runs_every_stage(chain):
    assert chain["watch"].returncode == 0, chain["watch"].stdout[-4000:] + chain["watch"].stderr[-4000:]
    assert chain["flow_run"]["state"]["type"] == "COMPLETED"
    p = _pipeline(chain["out"], chain["flow_run"]["id"])
    assert [(s["name"], s["status"]) for s in p["stages"]] == [
        ("prepare", "completed"), ("quantize", "completed"), ("validate", "completed"), ("train", "completed"),
        ("evaluate", "completed"), ("register", "completed")]
    assert p["stages"][2]["result"]["status"] == "passed"
    steps = [json.loads(x) for x in (Path(p["stages"][3]["result"]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
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


def test_progress_with_an_eta_reaches_the_watching_terminal(chain):
    """What `make run`'s terminal shows while the long stages run: each of the warm start, the RL steps and the
    evaluation writes progress lines with an ETA, a line when another tenth is done (the throttle itself:
    tests/test_progress.py), the last one `done` at the total."""
    lines = _progress_lines(chain["watch"].stdout)
    stages = {}
    for m in lines:
        stages.setdefault(m[1].split()[0], []).append(m)
    assert set(stages) == {"warm", "train", "evaluate"}, chain["watch"].stdout[-4000:]
    # the quick settings: 30 warm-start steps, 2 RL steps, 8 held-out problems + 2 of each of the six benchmarks
    for stage, total in (("warm", 30), ("train", 2), ("evaluate", 20)):
        got = stages[stage]
        counts = [int(m[2]) for m in got]
        assert {int(m[3]) for m in got} == {total} and counts == sorted(set(counts)), [m[0] for m in got]
        assert got[0][5].startswith("ETA ") and got[-1][5] == "done" and counts[-1] == total, [m[0] for m in got]
    assert len(stages["warm"]) < 30  # throttled: not a line a step


def test_second_run_changes_the_correction_alone_on_the_prepared_model(chain, second_run, prefect_services):
    """The README's second run (`make run`'s "Again:" line) is the first with the correction changed: the two
    resolved configs, as MLflow holds them, differ in `algorithm.correction.name` alone (names aside), and the
    second run trains from the model the first one prepared (its prepare task cached: no second warm start)."""
    from parity.tracking import mlflow_log

    api_url, out = prefect_services["api"], chain["out"]
    watch = second_run["watch"]
    assert watch.returncode == 0 and second_run["flow_run"]["state"]["type"] == "COMPLETED", watch.stdout[-4000:]
    first, second = (_pipeline(out, r["flow_run"]["id"]) for r in (chain, second_run))
    c = mlflow_log.client(f"sqlite:///{out}/mlflow.db")
    runs = [c.get_run(p["mlflow_run_id"]) for p in (first, second)]
    p1, p2 = (r.data.params for r in runs)
    assert len(p1) > 150 and "model.warm_start.steps" in p1  # the whole resolved config
    names = {"trainer.run_name"}
    assert {k: (p1.get(k), p2.get(k)) for k in (set(p1) | set(p2)) - names if p1.get(k) != p2.get(k)} == {
        "algorithm.correction.name": ("score_centering", "tis")}
    assert runs[1].info.run_name == runs[0].info.run_name.replace("score_centering", "tis")

    prep1, prep2 = (p["stages"][0]["result"] for p in (first, second))
    assert prep2["model_dir"] == prep1["model_dir"] and (prep1["cached"], prep2["cached"]) == (False, True)
    tasks = api(f"{api_url}/task_runs/filter", "POST", {"flow_runs": {"id": {"any_": [second_run["flow_run"]["id"]]}}})
    states = {t["name"].rsplit("-", 1)[0]: t["state"]["name"] for t in tasks}
    assert states["prepare"] == "Cached" and states["quantize"] == "Cached", states
    logs1, warm1 = flow_run_line(api_url, chain["flow_run"]["id"], r"^warm start: ")
    logs2, result2 = flow_run_line(api_url, second_run["flow_run"]["id"], r"^Result: ")  # its last line
    assert warm1 is not None and result2 is not None, (logs1[-10:], logs2[-10:])
    assert not [x for x in logs2 if "warm start" in x]
    assert {m[1].split()[0] for m in _progress_lines(watch.stdout)} == {"train", "evaluate"}


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
