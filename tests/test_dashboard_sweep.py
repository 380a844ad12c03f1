"""The dashboard's pages (streamlit AppTest) on the stores of a real tiny sweep: `sweep/local` run through a
Prefect server with two corrections x two seeds (tests/prefect_services.py, shared with the flow tests).
The Runs page lists one row per pipeline, the Compare page opened with the link the sweep printed shows
its members grouped by correction with their seed bands, the Benchmarks page each evaluation once with
its absolute folder, also when the dashboard is given a relative outputs path; and collapse markers on a
store whose runs raised the collapse alarm."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from tests.prefect_services import SWEEP_CORRECTIONS, SWEEP_SEEDS
from tests.test_dashboard_pages import _app, _chart_values, _specs, displayed

TITLES = [f"arith_tiny / int8+int4kv / {c} / seed {s}" for c in SWEEP_CORRECTIONS for s in SWEEP_SEEDS]
CANDIDATE, CHAMPION = TITLES[3], TITLES[0]  # v4 (tis, seed 1) and v1 (none, seed 0)
REGRESSION = f"{CANDIDATE} / regression v4 vs champion v1"


def _history(out: str, run_name: str) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def manual_eval(sweep_store) -> dict:
    """A manual `python -m parity evaluate` of a sweep member's checkpoint, beside the pipelines' evaluations."""
    from parity.commands import evaluate as evaluate_cmd
    from parity.config import load_config

    out = sweep_store["outputs_dir"]
    run_name = f"{sweep_store['sweep']}-tis-s1"
    ckpt = Path(out) / "runs" / run_name / "checkpoints" / "step_000002"
    cfg = load_config([f"outputs_dir={out}", "eval.suite=[arithmetic]", "eval.limit=4", "eval.grade_workers=1",
                       "eval.max_new_tokens=8", f"eval.model_path={ckpt}"])
    return {"run_name": run_name, **evaluate_cmd.run(cfg)}


@pytest.fixture
def sweep_env(sweep_store, sweep_regression, monkeypatch):
    monkeypatch.setenv("PARITY_TRACKING_URI", sweep_store["tracking_uri"])
    monkeypatch.setenv("PARITY_REGISTRY_URL", sweep_store["registry_url"])
    # the outputs folder spelled relative to where the dashboard runs, the registry's paths are absolute
    monkeypatch.setenv("PARITY_OUTPUTS", os.path.relpath(sweep_store["outputs_dir"]))
    return sweep_store


def _pipeline_metrics(store: dict) -> dict[str, dict]:
    from parity.tracking import mlflow_log

    c = mlflow_log.client(store["tracking_uri"])
    exp = c.get_experiment_by_name("arith_tiny")
    runs = c.search_runs([exp.experiment_id], "tags.`parity.kind` = 'pipeline'")
    return {r.info.run_name: r.data.metrics for r in runs}


def _pipeline_tags(store: dict, tag: str) -> dict[str, str]:
    from parity.tracking import mlflow_log

    c = mlflow_log.client(store["tracking_uri"])
    exp = c.get_experiment_by_name("arith_tiny")
    runs = c.search_runs([exp.experiment_id], "tags.`parity.kind` = 'pipeline'")
    return {r.info.run_name: r.data.tags.get(tag) for r in runs}


def test_runs_page_one_row_per_pipeline(sweep_env):
    at = _app()
    df = at.dataframe[0].value
    assert sorted(df["run"]) == sorted([*TITLES, REGRESSION])  # the four pipelines and the check, stages folded
    metrics = _pipeline_metrics(sweep_env)
    for row in df[df["run"] != REGRESSION].itertuples():
        assert float(row.final_reward) == pytest.approx(metrics[row.run]["final_reward"], abs=5e-4)
        assert float(row.heldout_accuracy) == pytest.approx(metrics[row.run]["heldout_accuracy"], abs=5e-4)
        assert float(row.benchmark_avg) == pytest.approx(metrics[row.run]["benchmark_macro_avg"], abs=5e-4)
        assert float(row.mismatch) == pytest.approx(metrics[row.run]["final_mismatch"], rel=5e-3)
        assert row.status == "FINISHED"
        assert row.bench_set == "arithmetic (4)"  # the set the average is over, with its problems
    # one set for all: said once, under the table; the pipelines carry it in MLflow too
    assert any("bench.: the evaluate stage's `avg@k`" in c.value and "arithmetic (4 problems)" in c.value
               for c in at.caption)
    assert not at.info
    tags = _pipeline_tags(sweep_env, "parity.benchmarks")
    assert {tags[t] for t in TITLES} == {"arithmetic (4 problems)"}
    assert at.multiselect(key="runs_filter_sweep").options == [sweep_env["sweep"]]
    shown = displayed(at.dataframe[0])
    assert set(shown["collapsed"]) <= {"—", "no"} and "None" not in shown.to_string()
    at.multiselect(key="runs_filter_correction").set_value(["tis"]).run()
    assert sorted(at.dataframe[0].value["run"]) == sorted([*TITLES[2:], REGRESSION])
    at.multiselect(key="runs_filter_sweep").set_value([sweep_env["sweep"]]).run()
    at.toggle(key="runs_show_stages").set_value(True).run()
    df = at.dataframe[0].value
    assert len(df) == 2 * 7 and df["run"].tolist()[:7] == [df["run"].iloc[0], "↳ prepare", "↳ quantize", "↳ validate",
                                                            "↳ train", "↳ evaluate", "↳ register"]


def test_compare_page_opens_on_the_sweep_with_seed_bands(sweep_env):
    from streamlit.testing.v1 import AppTest

    from tests.test_dashboard_pages import APP

    at = AppTest.from_file(APP, default_timeout=300)
    at.query_params["sweep"] = sweep_env["sweep"]
    at.run()
    at.switch_page("views/compare.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="compare_sweep").value == sweep_env["sweep"]
    assert len(at.multiselect(key="compare_runs").value) == 4  # every member, nothing picked by hand
    rows = [r for r in _chart_values(at) if r.get("key") == "reward/mean"]
    # legend labels: the one config key that differs once seeds are grouped
    assert {r["series"] for r in rows} == set(SWEEP_CORRECTIONS)
    out, sweep = sweep_env["outputs_dir"], sweep_env["sweep"]
    for corr in SWEEP_CORRECTIONS:
        per_seed = [{h["step"]: h["reward/mean"] for h in _history(out, f"{sweep}-{corr}-s{s}") if "reward/mean" in h}
                    for s in SWEEP_SEEDS]
        got = sorted((r["step"], r["value"], r["lo"], r["hi"], r["n"]) for r in rows if r["series"] == corr)
        want = sorted((step, (per_seed[0][step] + per_seed[1][step]) / 2, min(per_seed[0][step], per_seed[1][step]),
                       max(per_seed[0][step], per_seed[1][step]), 2) for step in per_seed[0])
        assert [g[0] for g in got] == [w[0] for w in want] == [1, 2]
        assert [g[1:] for g in got] == [pytest.approx(w[1:]) for w in want]
    titles = [s["title"]["text"] for s in _specs(at)]
    assert titles[:2] == ["reward (mean over responses)", "held-out accuracy: rollout engine"]
    assert {"mismatch: mean |p_train - p_inf|", "mismatch: k3 KL(pi_inf || pi_train)"} <= set(titles)
    assert at.slider(key="compare_smoothing").value == 0.0  # two steps: nothing to smooth
    summary = at.dataframe[0].value
    assert sorted(summary["run_name"]) == sorted(TITLES) and set(summary["label"]) == set(SWEEP_CORRECTIONS)
    assert set(summary["bench_set"]) == {"arithmetic (4)"}
    # the hover names what differs, whole; the table lists it per run
    assert {(r["series"], r["config"]) for r in rows} == {(c, f"algorithm.correction.name={c}")
                                                          for c in SWEEP_CORRECTIONS}
    assert any(tip.get("field") == "config" for s in _specs(at) for layer in s["layer"]
               for tip in layer["encoding"].get("tooltip", []))
    diff = at.dataframe[1].value
    assert list(diff.columns) == ["label", "run", "algorithm.correction.name", "trainer.seed"] and len(diff) == 4
    # seeds apart: the labels name the seed too
    at.checkbox(key="compare_group").uncheck().run()
    labels = {r["series"] for r in _chart_values(at) if r.get("key") == "reward/mean"}
    assert labels == {f"{c} / seed {s}" for c in SWEEP_CORRECTIONS for s in SWEEP_SEEDS}
    # narrowing by config: one correction left, the seed is what differs
    at.multiselect(key="compare_correction").set_value(["tis"]).run()
    assert {r["series"] for r in _chart_values(at) if r.get("key") == "reward/mean"} == {"seed 0", "seed 1"}


def test_benchmarks_page_each_evaluation_once_with_its_absolute_folder(sweep_env, manual_eval):
    at = _app("benchmarks")
    table = at.dataframe[0].value
    pipelines = table[table["evaluation"].str.startswith("arith_tiny / ")]
    # the champion and the candidate were also evaluated unquantized by the regression check: their precision tells
    assert sorted(pipelines["evaluation"]) == sorted([f"{t} @ step 2" for t in TITLES[1:3]] + [
        f"{t} @ step 2 [{p}]" for t in (CHAMPION, CANDIDATE) for p in ("int8+int4kv", "bf16")])
    assert table["out_dir"].is_unique and len(table) == len(set(table["evaluation"]))
    assert all(Path(p).is_absolute() and (Path(p) / "metrics.json").is_file() for p in table["out_dir"])
    # the manual evaluation: the model it evaluated (the run's checkpoint and step), not a folder hash
    manual = table[table["out_dir"] == str(Path(manual_eval["out_dir"]).resolve())]
    assert manual["evaluation"].tolist() == [f"{manual_eval['run_name']} @ step 2"]
    assert manual.iloc[0]["correction"] == "tis"
    cell = manual.iloc[0]["arithmetic"]
    assert cell.startswith(f"{100 * manual_eval['benchmarks']['arithmetic']['avg@k']:.1f} [")
    # one benchmark each: the average is its value, as the Runs page and MLflow have it, over the set it names
    assert (table["average"] == table["arithmetic"]).all() and set(table["set"]) == {"arithmetic (4)"}
    runs = displayed(_app().dataframe[0]).set_index("run")
    for title in TITLES[1:3]:  # the members evaluated once: their row of each page
        avg = table.set_index("evaluation").loc[f"{title} @ step 2", "average"]
        assert float(avg.split(" ")[0]) == pytest.approx(100 * float(runs.loc[title, "benchmark_avg"]), abs=0.051)
    bars = _chart_values(at)
    assert sorted(r["evaluation"] for r in bars) == sorted(table["evaluation"])
    assert all(r["lo"] <= r["pct"] <= r["hi"] for r in bars)


@pytest.fixture(scope="module")
def collapse_store(tmp_path_factory) -> dict:
    """Two runs of one experiment logged by the platform's MLflow functions: one whose collapse alarm fires at
    step 3 (`train/collapsed` 0, 0, 1, 1 and the summary's collapse_step), one that never collapses."""
    from parity.tracking import mlflow_log, naming

    base = tmp_path_factory.mktemp("collapse")
    uri = f"sqlite:///{base}/mlflow.db"
    c = mlflow_log.client(uri)
    exp = mlflow_log.experiment_id(c, "arith_tiny", mlflow_log.default_artifact_dir(uri))
    ids = {}
    for corr, collapse in (("none", 3), ("tis", None)):
        rid = mlflow_log.start_run(c, exp, f"arith_tiny / bf16 / {corr} / seed 0 / train",
                                   tags={naming.KIND_TAG: "train", "parity.command": "train"})
        mlflow_log.log_params(c, rid, {"experiment_name": "arith_tiny", "algorithm.correction.name": corr,
                                       "trainer.seed": 0})
        for step in range(1, 5):
            mlflow_log.log_metrics(c, rid, {"reward/mean": 0.5 / step, "train/collapsed":
                                            float(collapse is not None and step >= collapse)}, step=step)
        mlflow_log.log_metrics(c, rid, naming.headline_metrics({"final_reward": 0.125, "collapse_step": collapse}), step=4)
        mlflow_log.end_run(c, rid, ok=True)
        ids[corr] = rid
    return {"tracking_uri": uri, "outputs_dir": str(base), "ids": ids}


def test_collapse_markers_and_flag(collapse_store, monkeypatch):
    monkeypatch.setenv("PARITY_TRACKING_URI", collapse_store["tracking_uri"])
    monkeypatch.setenv("PARITY_REGISTRY_URL", f"sqlite:///{collapse_store['outputs_dir']}/none.db")
    monkeypatch.setenv("PARITY_OUTPUTS", collapse_store["outputs_dir"])
    at = _app()
    flags = displayed(at.dataframe[0]).set_index("run")["collapsed"]
    assert flags.to_dict() == {"arith_tiny / bf16 / none / seed 0 / train": "yes (step 3)",
                               "arith_tiny / bf16 / tis / seed 0 / train": "no"}
    at = _app("compare")
    markers = [layer for s in _specs(at) for layer in s["layer"] if layer["mark"]["type"] == "rule"]
    assert markers and all(m["data"]["values"] == [{"series": "none", "step": 3}] for m in markers)
    assert any("Collapse alarm (dashed marker): none at step 3" in c.value for c in at.caption)
    plot = pd.DataFrame(_chart_values(at))
    assert set(plot["series"]) == {"none", "tis"}


def test_the_regression_check_is_labelled_alike_on_every_page(sweep_env):
    """The nightly check of the sweep's model: the Runs page, the Benchmarks page and the Regression page name the
    candidate and the champion by what they were trained as (naming.label, as their MLflow runs are named), with
    the precision each evaluation ran in."""
    runs = displayed(_app().dataframe[0]).set_index("run")
    row = runs.loc[REGRESSION]
    assert (row["precision"], row["correction"], row["seed"], row["status"]) == ("int8+int4kv", "tis", "1", "FINISHED")
    bench = _app("benchmarks").dataframe[0].value.set_index("evaluation")
    for prec in ("int8+int4kv", "bf16"):
        b = bench.loc[f"{CANDIDATE} @ step 2 [{prec}]"]
        assert (b["correction"], b["precision"]) == ("tis", prec)
    assert bench.loc[f"{CHAMPION} @ step 2 [bf16]"]["correction"] == "none"
    reg = _app("regression").dataframe[0].value
    (check,) = reg.to_dict("records")
    assert (check["candidate"], check["champion"], check["precision"]) == (f"{CANDIDATE} v4", f"{CHAMPION} v1",
                                                                           "int8+int4kv")
    assert not check["flagged"] and "candidate v4 [int8+int4kv]" in check["message"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", check["checked"]), check["checked"]  # to the second
    prec = _app("precision").dataframe[0].value
    assert len(prec) >= 4 and set(prec["precision"]) == {"int8+int4kv"}  # every member's validation, kept
