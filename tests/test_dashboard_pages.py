"""Every dashboard page under streamlit's AppTest, against stores filled by a real tiny pipeline in the older
layout (one MLflow experiment `parity`, runs named `train-and-eval-<id>` / `train` / `evaluate`, params on
the pipeline run only: stores written before runs were named by what they ran still read right): a 2-step
training run logged by parity.tracking's MlflowCallback under a pipeline parent run, its checkpoint
evaluated at BF16 and at W8A8 INT8 and recorded in the registry, and regression checks. Built once per
test session. The pages on a real sweep's stores: tests/test_dashboard_sweep.py."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
APP = str(REPO / "dashboards" / "app.py")


def _read_samples(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault(r["benchmark"], []).append({k: r.get(k) for k in ("problem_id", "sample", "score",
                                                                              "extracted", "status")})
    return out


def _evaluate(cfg, reg, c, exp, parent: str, pid: int, ckpt: str, precision: str, int8: bool) -> int:
    from parity.commands import evaluate as evaluate_cmd
    from parity.tracking import mlflow_log

    ecfg = copy.deepcopy(cfg)
    e = ecfg.eval
    e.suite, e.limit, e.k, e.temperature, e.bootstrap, e.model_path = ["arithmetic"], 24, 2, 1.0, 200, ckpt
    e.out_dir = str(Path(cfg.outputs_dir) / "eval" / f"{cfg.trainer.run_name}-{precision}-20261129-000000")
    if int8:
        ecfg.rollout.precision.weights = ecfg.rollout.precision.activations = "int8"
    run_id = mlflow_log.start_run(c, exp, "evaluate", parent_run_id=parent, tags={"parity.stage": "evaluate"})
    res = evaluate_cmd.run(ecfg)
    art = reg.add_artifact("checkpoint", ckpt, precision, pipeline_id=pid)
    row = res["benchmarks"]["arithmetic"]
    rid = reg.add_evaluation("arithmetic", row["k"], row["problems"],
                             {k: v for k, v in row.items() if k not in ("k", "problems")},
                             _read_samples(Path(res["samples"]))["arithmetic"], pipeline_id=pid, artifact_id=art,
                             out_dir=res["out_dir"])
    mlflow_log.log_metrics(c, run_id, {"eval/arithmetic/avg@k": row["avg@k"],
                                       **{f"eval/macro/{m}": v for m, v in res["macro"].items()}})
    mlflow_log.end_run(c, run_id, ok=True)
    return rid


def _validation_report(cfg, model_dir: str) -> dict | None:
    """A real `parity.precision.validate` report of W8A8 INT8 vs BF16 on a few held-out prompts, where that
    module exists (None otherwise: the real-report test then skips)."""
    try:
        from parity.precision.validate import validate_precision, write_report
    except ImportError:
        return None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.data.arithmetic import arithmetic_problems
    from parity.data.prompts import render_prompt
    from parity.rollout import build_engine

    qcfg = copy.deepcopy(cfg)
    qcfg.rollout.precision.weights = qcfg.rollout.precision.activations = "int8"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [tok(render_prompt(cfg.data.prompt_template, p.problem))["input_ids"]
               for p in arithmetic_problems("test", 8, cfg.data.arithmetic)]
    engine = build_engine(qcfg, model_dir)
    try:
        report = validate_precision(model, engine, prompts, samples_per_prompt=2, max_new_tokens=8,
                                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    finally:
        engine.close()
    write_report(report, Path(cfg.outputs_dir) / "precision_validation" / "tiny_qwen3-W8A8-INT8")
    return report


def build_stores(quick_cfg, base: Path) -> dict:
    """MLflow store + registry + outputs of one tiny pipeline; idempotent within a session (marker file)."""
    marker = base / "dashboard_stores.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    from parity.commands.train import train
    from parity.config import flatten
    from parity.tracking import mlflow_log
    from parity.tracking.registry import Registry
    from parity.tracking.regression import compare

    uri, reg_url = f"sqlite:///{base}/dash_mlflow.db", f"sqlite:///{base}/dash_registry.db"
    cfg = quick_cfg("trainer.run_name=dash-dual", "algorithm.correction.name=dual", f"tracking.tracking_uri={uri}",
                    f"tracking.registry_url={reg_url}")
    c = mlflow_log.client(uri)
    exp = mlflow_log.experiment_id(c, "parity", mlflow_log.default_artifact_dir(uri))
    with Registry(reg_url) as reg:
        pid = reg.start_pipeline("train-and-eval", overrides=["algorithm.correction.name=dual"],
                                 experiment=str(cfg.experiment_name))
        parent = mlflow_log.start_run(c, exp, f"train-and-eval-{pid}", tags={"parity.flow": "train-and-eval"})
        reg.set_pipeline_mlflow_run(pid, parent)
        mlflow_log.log_params(c, parent, flatten(cfg))
        train_run = mlflow_log.start_run(c, exp, "train", parent_run_id=parent, tags={"parity.stage": "train"})
        cb = mlflow_log.MlflowCallback(uri, train_run)
        summary = train(cfg, callbacks=[cb])
        assert cb.close(wait_s=5.0)
        mlflow_log.end_run(c, train_run, ok=True)
        ckpt = str(summary["latest_checkpoint"])
        bf16 = _evaluate(cfg, reg, c, exp, parent, pid, ckpt, "bf16", False)
        int8 = _evaluate(cfg, reg, c, exp, parent, pid, ckpt, "wint8-aint8-kvbf16", True)
        real = compare("arithmetic", reg.sample_scores(bf16), reg.sample_scores(int8), margin=0.05, n_boot=200)
        reg.add_regression_check(benchmark="arithmetic", baseline_result_id=bf16, candidate_result_id=int8,
                                 paired_problems=real.paired_problems, delta=real.delta, ci_low=real.ci_low,
                                 ci_high=real.ci_high, margin=real.margin, passed=real.passed, message=real.message,
                                 pipeline_id=pid)
        time.sleep(0.01)  # a later created_at: the flagged check is the newest
        reg.add_regression_check(benchmark="arithmetic", baseline_result_id=bf16, candidate_result_id=int8,
                                 paired_problems=24, delta=-0.25, ci_low=-0.4, ci_high=-0.1, margin=0.05,
                                 passed=False, message="arithmetic: REGRESSION: dashboard test drop", pipeline_id=pid)
        mlflow_log.end_run(c, parent, ok=True)
        reg.finish_pipeline(pid, "completed")
    from parity.training.warm_start import prepare_model

    validation = _validation_report(cfg, str(prepare_model(cfg)["model_dir"]))
    history = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    out = {"tracking_uri": uri, "registry_url": reg_url, "outputs_dir": str(cfg.outputs_dir), "parent": parent,
           "train_run": train_run, "history": history, "real_check_passed": bool(real.passed),
           "validation": validation,
           "evals": {"bf16": reg_eval_metrics(reg_url, bf16), "int8": reg_eval_metrics(reg_url, int8)}}
    marker.write_text(json.dumps(out))
    return out


def reg_eval_metrics(url: str, result_id: int) -> dict:
    from parity.tracking.registry import Registry

    with Registry(url, upgrade=False) as reg:
        return reg.evaluation(result_id)["metrics"]


@pytest.fixture(scope="session")
def dashboard_stores(quick_cfg, outputs_dir: Path, prepared_model) -> dict:
    return build_stores(quick_cfg, outputs_dir)


@pytest.fixture
def app_env(dashboard_stores, monkeypatch):
    monkeypatch.setenv("PARITY_TRACKING_URI", dashboard_stores["tracking_uri"])
    monkeypatch.setenv("PARITY_REGISTRY_URL", dashboard_stores["registry_url"])
    monkeypatch.setenv("PARITY_OUTPUTS", dashboard_stores["outputs_dir"])
    return dashboard_stores


def _app(page: str | None = None):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=300).run()
    if page:
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _texts(elements) -> list[str]:
    return [e.value for e in elements]


def displayed(df_element):
    """What a table shows: a Styler's display values ('—' where a value is missing), or the table itself when
    its cells are already the text shown."""
    from streamlit import dataframe_util

    styler = df_element.proto.arrow_data.styler
    if not styler.display_values:
        return df_element.value
    return dataframe_util.convert_arrow_bytes_to_pandas_df(styler.display_values)


def number(cell) -> float:
    """A number the Runs table writes out as text ('0.344', '1.20e-03')."""
    return float(cell)


def test_runs_page_folds_the_stages_of_an_older_store_under_their_pipeline(app_env):
    """A store of the older layout (one MLflow experiment, runs named `train-and-eval-1` / `train`, params on the
    pipeline run only): one row for the pipeline, carrying what its stages measured; stages on demand."""
    at = _app()
    df = at.dataframe[0].value
    assert df["run"].tolist() == ["train-and-eval-1"]
    row = df.iloc[0]
    last_reward = [r["reward/mean"] for r in app_env["history"] if "reward/mean" in r][-1]
    assert number(row["final_reward"]) == pytest.approx(last_reward, abs=5e-4)
    assert number(row["heldout_accuracy"]) == pytest.approx([r["eval/accuracy"] for r in app_env["history"]
                                                     if "eval/accuracy" in r][-1])
    assert row["correction"] == "dual" and row["precision"] == "bf16" and row["status"] == "FINISHED"
    assert row["mlflow"].endswith(f"/runs/{app_env['parent']}?workflowType=machine_learning")  # MLflow's training sidebar
    # the benchmark average of the pipeline's latest evaluate stage (its macro avg@k)
    assert number(row["benchmark_avg"]) == pytest.approx(app_env["evals"]["int8"]["avg@k"], abs=5e-4)
    # the last step's mismatch of its train stage, the steps it got through, how long it took; no failure
    assert number(row["mismatch"]) == pytest.approx([r["mismatch/abs_prob_diff_mean"] for r in app_env["history"]
                                                     if "mismatch/abs_prob_diff_mean" in r][-1], rel=5e-3)
    assert row["steps"] == "2" and row["duration"].endswith(" s") and row["failure"] == "—"
    assert list(df.columns)[:2] == ["run", "mlflow"]  # the link stays in view however wide the names
    shown = displayed(at.dataframe[0])
    # its train stage logged the collapse alarm's `train/collapsed` (0 throughout): "no", not missing
    assert shown.iloc[0]["collapsed"] == "no" and shown.iloc[0]["seed"] == "0"
    at.toggle(key="runs_show_stages").set_value(True).run()
    df = at.dataframe[0].value
    assert df["run"].tolist() == ["train-and-eval-1", "↳ train", "↳ evaluate", "↳ evaluate"]
    assert number(df.iloc[1]["final_reward"]) == pytest.approx(last_reward, abs=5e-4)
    assert df.iloc[2]["final_reward"] == "—"
    assert [number(df.iloc[2]["benchmark_avg"]), number(df.iloc[3]["benchmark_avg"])] == pytest.approx(
        [app_env["evals"]["bf16"]["avg@k"], app_env["evals"]["int8"]["avg@k"]], abs=5e-4)
    assert displayed(at.dataframe[0]).iloc[2]["final_reward"] == "—"
    at.text_input(key="runs_filter_text").set_value("nothing-matches").run()
    assert at.dataframe[0].value.empty


def _chart_values(at) -> list[dict]:
    """Rows of every vega-lite chart's data (Arrow IPC streams in the proto)."""
    import pyarrow as pa

    rows = []
    for ch in at.get("vega_lite_chart"):
        blobs = [ds.data.data for ds in ch.proto.datasets] + ([ch.proto.data.data] if ch.proto.data.data else [])
        for blob in blobs:
            rows += pa.ipc.open_stream(blob).read_all().to_pylist()
    return rows


def _specs(at) -> list[dict]:
    return [json.loads(ch.proto.spec) for ch in at.get("vega_lite_chart")]


def test_compare_page_plots_the_logged_curves(app_env):
    at = _app("compare")
    assert at.multiselect(key="compare_runs").value == [app_env["parent"]]  # the pipeline, its train stage's curves
    at.multiselect(key="compare_metrics").set_value(["reward/mean", "correction/lambda", "correction/sc_term_abs"]).run()
    assert not at.exception
    rows = _chart_values(at)
    want = {(r["step"], r["reward/mean"]) for r in app_env["history"] if "reward/mean" in r}
    got = {(r["step"], r["value"]) for r in rows if r.get("key") == "reward/mean"}
    assert {(s, round(v, 9)) for s, v in got} == {(s, round(v, 9)) for s, v in want}
    assert any(r.get("key") == "correction/lambda" for r in rows)
    # dual logs no score-centering term: the page says so instead of drawing an empty chart
    assert any("- `correction/sc_term_abs`: not logged by **train-and-eval-1**" in t for t in _texts(at.info))
    csv = at.get("download_button")[0]
    assert csv.proto.label == "Download data (CSV)"
    # two steps: no smoothing by default; smoothing changes the plotted values by the EMA
    assert at.slider(key="compare_smoothing").value == 0.0
    at.slider(key="compare_smoothing").set_value(0.5).run()
    sm = sorted((r["step"], r["value"]) for r in _chart_values(at) if r.get("key") == "reward/mean")
    raw = sorted(want)
    assert sm[0][1] == pytest.approx(raw[0][1])
    assert sm[1][1] == pytest.approx((0.25 * raw[0][1] + 0.5 * raw[1][1]) / 0.75)
    # one run: its name is the label, a seed group of one has a band of zero width
    at.slider(key="compare_smoothing").set_value(0.0).run()
    grouped = [r for r in _chart_values(at) if r.get("key") == "reward/mean"]
    assert {r["series"] for r in grouped} == {"train-and-eval-1"}
    assert sorted((r["step"], r["value"], r["lo"], r["hi"], r["n"]) for r in grouped) == \
        sorted((s, v, v, v, 1) for s, v in raw)


def test_benchmarks_page_shows_bf16_and_int8_of_one_checkpoint(app_env):
    at = _app("benchmarks")
    table = at.dataframe[0].value.set_index("evaluation")
    for prec, key in [("bf16", "bf16"), ("int8", "int8")]:
        row = table.loc[f"train-and-eval-1 @ step 2 [{prec}]"]
        assert row["arithmetic"].startswith(f"{100 * app_env['evals'][key]['avg@k']:.1f} [")
        assert row["correction"] == "dual" and row["precision"] == prec
    bars = [r for r in _chart_values(at) if str(r.get("evaluation", "")).startswith("train-and-eval-1 @ step 2")]
    assert len(bars) == 2 and all(r["lo"] <= r["pct"] <= r["hi"] for r in bars)
    # the registry keeps the evaluation's table row (fractions to 4 decimals); the bars carry metrics.json's value
    assert sorted(r["pct"] for r in bars) == pytest.approx(sorted(100 * app_env["evals"][k]["avg@k"]
                                                                 for k in ("bf16", "int8")), abs=0.0051)


def test_regression_page_highlights_flagged_drop(app_env):
    at = _app("regression")
    assert any("1 of 2 checks flagged" in t or "2 of 2 checks flagged" in t for t in _texts(at.error))
    df = at.dataframe[0].value
    assert df.iloc[0]["flagged"] and df.iloc[0]["delta"] == pytest.approx(-25.0)
    assert bool(df.iloc[1]["flagged"]) == (not app_env["real_check_passed"])


def test_precision_page_reads_only_report_files(tmp_path, monkeypatch):
    """Report files only: a kept report under validations/ is listed; an unreadable file there and a JSON that is
    not a report are named in a warning; the checkpoint's own JSON files beside them are never opened."""
    folder = tmp_path / "precision_validation" / "tiny_qwen3-W8A8-INT8"
    (folder / "validations").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 1000000000000000019884624838656}')
    (folder / "generation_config.json").write_text("{not json")
    (folder / "validations" / "wint8-aint8-kvbf16-20261202-101530.json").write_text(json.dumps({
        "report": "parity.precision_validation", "created_at": "2026-12-02T10:15:30+00:00",
        "precision": {"weights": "int8", "activations": "int8", "kv_cache": "bf16"}, "quant": {"engine": "torch"},
        "precision_spec": "wint8-aint8-kvbf16", "metrics": {"abs_prob_diff_mean": 0.012, "k3_kl": 0.003},
        "thresholds": {"max_k3_kl": 0.01}, "failures": [], "passed": True}))
    (folder / "validations" / "broken.json").write_text("{not json")
    (folder / "validations" / "notes.json").write_text('{"hello": 1}')
    monkeypatch.setenv("PARITY_OUTPUTS", str(tmp_path))
    at = _app("precision")
    df = at.dataframe[0].value
    assert df["precision"].tolist() == ["int8"] and df["verdict"].tolist() == ["passed"]
    assert df["k3_kl"].tolist() == pytest.approx([0.003]) and df["threshold.max_k3_kl"].tolist() == [0.01]
    warnings = _texts(at.warning)
    assert any("broken.json" in t for t in warnings) and any("notes.json: not a validation report" in t for t in warnings)
    assert not any("tokenizer_config" in t or "generation_config" in t for t in warnings)


def test_precision_page_shows_a_real_validation_report(app_env):
    rep = app_env["validation"]
    if rep is None:
        pytest.skip("parity.precision.validate is not available")
    at = _app("precision")
    df = at.dataframe[0].value
    row = df[df["checkpoint"] == "tiny_qwen3-W8A8-INT8"].iloc[0]
    assert row["precision"] == "int8" and (row["verdict"] == "passed") == rep["passed"]
    for k in ("abs_prob_diff_mean", "k3_kl", "top1_agreement", "ppl_ratio"):
        assert row[k] == pytest.approx(rep["metrics"][k])


@pytest.mark.parametrize("page", [None, "compare", "benchmarks", "regression", "precision"])
def test_empty_stores_give_messages(page, tmp_path, monkeypatch):
    monkeypatch.setenv("PARITY_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("PARITY_REGISTRY_URL", f"sqlite:///{tmp_path}/registry.db")
    monkeypatch.setenv("PARITY_OUTPUTS", str(tmp_path))
    at = _app(page)
    assert _texts(at.info) + _texts(at.warning), "an empty store must say so"
    assert not list(tmp_path.iterdir()), "the dashboard created files"


def test_unreachable_mlflow_server(monkeypatch, tmp_path):
    monkeypatch.setenv("PARITY_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("PARITY_OUTPUTS", str(tmp_path))
    at = _app("compare")
    assert any("unreachable" in t for t in _texts(at.warning))


def test_store_untouched_by_the_dashboard(app_env):
    paths = [Path(app_env["tracking_uri"].removeprefix("sqlite:///")), Path(app_env["registry_url"].removeprefix("sqlite:///"))]
    before = [(p.stat().st_mtime_ns, p.stat().st_size) for p in paths]
    for page in [None, "compare", "benchmarks", "regression"]:
        _app(page)
    assert [(p.stat().st_mtime_ns, p.stat().st_size) for p in paths] == before
    assert os.environ["PARITY_TRACKING_URI"] == app_env["tracking_uri"]


def test_sql_fast_path_matches_the_mlflow_client(app_env):
    from dashboards import curves, data, mlflow_sql

    uri = app_env["tracking_uri"]
    client_runs = data.fetch_runs(data.mlflow_client(uri))
    eng = mlflow_sql.engine(uri)
    sql_runs = mlflow_sql.fetch_runs(eng)
    assert [r.__dict__ for r in sql_runs] == [r.__dict__ for r in client_runs]
    assert len(client_runs) == 4 and any(r.params for r in sql_runs) and any(r.metrics for r in sql_runs)
    ids, keys = [r.run_id for r in client_runs], curves.CURVE_METRICS
    a, b = data.metric_history(data.mlflow_client(uri), ids, keys), mlflow_sql.metric_history(eng, ids, keys)
    assert len(a) > 0 and a.equals(b)


def test_runs_table_tells_a_failed_run_and_its_rerun_apart(outputs_dir, prepared_model, tmp_path, monkeypatch):
    """One configuration trained twice through `python -m parity train tracking.enabled=true`'s code: the first run
    fails at step 2 (the loop raises), the second resumes it and finishes at step 3. MLflow names them apart, and
    the Runs page shows each with its status, the steps it got through, its duration, its last mismatch and, for
    the failed one, why; every cell it has no value for reads '—'."""
    from parity.commands.train import train
    from parity.config import load_config
    from parity.tracking.train_run import tracked_train
    from tests.conftest import QUICK

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [f"outputs_dir={tmp_path}", *QUICK, f"model.path={prepared_model}", "trainer.total_steps=3",
            "trainer.run_name=twice", "tracking.enabled=true", f"tracking.tracking_uri={uri}"]

    class DiskFull:
        def on_step(self, step, metrics):
            if step == 2:
                raise RuntimeError("disk full at step 2")

    with pytest.raises(RuntimeError, match="disk full"):
        tracked_train(load_config(args), lambda c, cbs: train(c, callbacks=[*cbs, DiskFull()]))
    out = tracked_train(load_config([*args, "trainer.resume=true"]), lambda c, cbs: train(c, callbacks=cbs))
    monkeypatch.setenv("PARITY_TRACKING_URI", uri)
    monkeypatch.setenv("PARITY_REGISTRY_URL", f"sqlite:///{tmp_path}/none.db")
    monkeypatch.setenv("PARITY_OUTPUTS", str(tmp_path))
    at = _app()
    df = displayed(at.dataframe[0]).set_index("run")
    name = "arith_tiny / bf16 / none / seed 0 / train"
    assert sorted(df.index) == [name, f"{name} #2"]  # two runs of one configuration, two names
    failed, done = df.loc[name], df.loc[f"{name} #2"]
    assert failed["status"] == "FAILED" and done["status"] == "FINISHED"
    assert failed["steps"] == "2" and done["steps"] == "3"
    assert failed["failure"] == "RuntimeError: disk full at step 2" and done["failure"] == "—"
    rows = [json.loads(x) for x in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert number(done["mismatch"]) == pytest.approx(rows[-1]["mismatch/abs_prob_diff_mean"], rel=5e-3)
    assert failed["mismatch"] != "—" and failed["duration"].endswith(" s") and done["duration"].endswith(" s")
    assert failed["benchmark_avg"] == "—" and done["benchmark_avg"] == "—"  # never measured: a dash, not None
    assert "None" not in df.to_string() and "nan" not in df.to_string()
