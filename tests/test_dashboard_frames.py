"""The dashboard's table transforms against hand computations, and its read-only store access."""

from __future__ import annotations

import io
import math
import sqlite3

import numpy as np
import pandas as pd
import pytest

from dashboards import data, figures, frames


def test_ema_matches_hand_computation():
    # w = 0.5: s1 = 0.5*1 = 0.5 -> /0.5 = 1; s2 = 0.25 + 0.5*3 = 1.75 -> /0.75 = 2.333..; s3 = 0.875 + 0 -> /0.875 = 1
    got = frames.ema([1.0, 3.0, 0.0], 0.5)
    assert got == pytest.approx([1.0, 1.75 / 0.75, 0.875 / 0.875])
    assert frames.ema([2.0, 5.0], 0.0).tolist() == [2.0, 5.0]
    with pytest.raises(ValueError, match="smoothing weight"):
        frames.ema([1.0], 1.0)


def _runs(*rows: tuple[str, str, str, str]) -> pd.DataFrame:
    return pd.DataFrame([{"run_id": rid, "run_name": name, "correction": corr, "precision": "bf16", "model": "m",
                          "config": cfg} for rid, name, corr, cfg in rows])


def test_curves_group_seeds_mean_and_band():
    runs = _runs(("a", "s0", "dual", "c1"), ("b", "s1", "dual", "c1"), ("c", "x", "none", "c2"))
    hist = pd.DataFrame([("a", "reward/mean", 1, 0.2), ("a", "reward/mean", 2, 0.4),
                         ("b", "reward/mean", 1, 0.6), ("b", "reward/mean", 2, 0.8),
                         ("c", "reward/mean", 1, 0.5)], columns=["run_id", "key", "step", "value"])
    plain = frames.curves(hist, runs)
    assert sorted(plain["series"].unique()) == ["s0", "s1", "x"]
    assert (plain["lo"] == plain["value"]).all()
    grouped = frames.curves(hist, runs, group_seeds=True)
    g1 = grouped[grouped["series"].str.startswith("dual")].sort_values("step")
    assert g1["value"].tolist() == pytest.approx([0.4, 0.6])
    assert g1["lo"].tolist() == pytest.approx([0.2, 0.4]) and g1["hi"].tolist() == pytest.approx([0.6, 0.8])
    assert g1["n"].tolist() == [2, 2]
    assert grouped[grouped["series"].str.startswith("none")]["n"].tolist() == [1]
    # smoothing is applied per run before averaging: run a smoothed with w=0.5 is [0.2, (0.05+0.2)/0.75]
    sm = frames.curves(hist, runs, smoothing=0.5)
    a = sm[sm["series"] == "s0"].sort_values("step")["value"].tolist()
    assert a == pytest.approx([0.2, (0.5 * 0.5 * 0.2 + 0.5 * 0.4) / 0.75])


def test_config_key_ignores_seed_and_names_only():
    base = {"algorithm.correction.name": "dual", "trainer.seed": "0", "trainer.run_name": "a", "outputs_dir": "/x"}
    other_seed = {**base, "trainer.seed": "1", "trainer.run_name": "b", "outputs_dir": "/y"}
    other_corr = {**base, "algorithm.correction.name": "tis"}
    assert frames.config_key(base) == frames.config_key(other_seed)
    assert frames.config_key(base) != frames.config_key(other_corr)


def test_precision_label():
    assert frames.precision_label({}) == "bf16"
    assert frames.precision_label({"rollout.precision.weights": "int8", "rollout.precision.activations": "int8",
                                   "rollout.precision.kv_cache": "int4_per_token_head"}) == \
        "wint8-aint8-kvint4_per_token_head"
    assert frames.precision_label({"actor_rollout_ref.rollout.quantization": "int8",
                                   "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype": "int4_per_token_head"}) \
        == "wint8-aint8-kvint4_per_token_head"
    assert frames.precision_label({"actor_rollout_ref.rollout.quantization": "None"}) == "bf16"


def test_side_by_side_puts_bf16_first_with_intervals():
    rows = [{"run": "r", "correction": "dual", "precision": p, "benchmark": "aime24", "metric": "avg@k",
             "value": v, "ci_low": v - 0.1, "ci_high": v + 0.1} for p, v in [("wfp8-afp8-kvbf16", 0.3), ("bf16", 0.5)]]
    t = frames.side_by_side(pd.DataFrame(rows), "avg@k")
    assert list(t.columns) == ["run", "benchmark", "bf16", "wfp8-afp8-kvbf16"]
    assert t.iloc[0]["bf16"] == "50.0 [40.0, 60.0]" and t.iloc[0]["wfp8-afp8-kvbf16"] == "30.0 [20.0, 40.0]"
    assert frames.side_by_side(pd.DataFrame(rows), "pass@k").empty


def test_flag_checks_and_missing_metrics():
    checks = pd.DataFrame({"passed": [True, False], "delta": [0.01, -0.2], "ci_low": [-0.02, -0.3],
                           "ci_high": [0.03, -0.1], "margin": [0.05, 0.05], "benchmark": ["a", "a"]})
    f = frames.flag_checks(checks)
    assert f["flagged"].tolist() == [True, False]  # newest first
    assert f["delta"].tolist() == pytest.approx([-20.0, 1.0])
    hist = pd.DataFrame([("a", "reward/mean", 1, 0.1)], columns=["run_id", "key", "step", "value"])
    assert frames.missing_metrics(hist, {"a": "run-a"}, ["reward/mean", "correction/lambda"]) == \
        ["run-a: correction/lambda"]


def test_wide_csv_and_png():
    plot = pd.DataFrame({"series": ["s", "s"], "key": ["k", "k"], "step": [1, 2], "value": [0.5, 0.25],
                         "lo": [0.4, 0.2], "hi": [0.6, 0.3], "n": [2, 2]})
    csv = pd.read_csv(io.StringIO(frames.wide_csv(plot)))
    assert csv.columns.tolist() == ["series", "step", "k", "k (min)", "k (max)"]
    assert csv["k (max)"].tolist() == [0.6, 0.3]
    png = figures.curves_png(plot, ["k"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_report_rows_per_mode_and_flat():
    rows = frames.report_rows("m-W8A8-INT8", {"modes": {"int8": {"mean_abs_prob_diff": 0.01, "accuracy": {"quant": 0.5}}},
                                              "passed": True})
    assert rows == [{"report": "m-W8A8-INT8", "mode": "int8", "mean_abs_prob_diff": 0.01, "accuracy.quant": 0.5}]
    flat = frames.report_rows("d", {"precision": "w8a8", "metrics": {"k3_kl": 0.002}, "passed": False})
    assert flat[0]["mode"] == "w8a8" and flat[0]["k3_kl"] == 0.002 and flat[0]["passed"] is False
    # the layout of parity.precision.validate: quant side described, metrics, thresholds, failures
    v = frames.report_rows("m", {"quant": {"engine": "torch", "weights": "int8", "activations": "int8", "kv_cache": "bf16"},
                                 "metrics": {"abs_prob_diff_mean": 0.01, "accuracy_drop": None}, "n_prompts": 8,
                                 "thresholds": {"max_k3_kl": 0.01}, "failures": ["k3_kl 0.02 > 0.01"], "passed": False})
    assert v == [{"report": "m", "mode": "wint8-aint8-kvbf16", "engine": "torch", "passed": False, "failures": "k3_kl 0.02 > 0.01",
                  "abs_prob_diff_mean": 0.01, "accuracy_drop": None, "threshold.max_k3_kl": 0.01, "n_prompts": 8}]


def test_readonly_url_never_creates_and_refuses_writes(tmp_path):
    missing = tmp_path / "none" / "mlflow.db"
    with pytest.raises(data.SourceUnavailable, match="does not exist"):
        data.readonly_url(f"sqlite:///{missing}", "MLflow store")
    assert not missing.parent.exists()
    db = tmp_path / "r.db"
    sqlite3.connect(db).execute("create table t (x int)").connection.commit()
    import sqlalchemy as sa

    eng = sa.create_engine(data.readonly_url(f"sqlite:///{db}", "registry"))
    with eng.connect() as c:
        assert c.execute(sa.text("select count(*) from t")).scalar() == 0
        with pytest.raises(sa.exc.OperationalError, match="readonly"):
            c.execute(sa.text("insert into t values (1)"))
    assert data.readonly_url("postgresql://u@h/db", "registry") == "postgresql://u@h/db"


def test_unreachable_server_is_a_message_not_a_hang():
    with pytest.raises(data.SourceUnavailable, match="unreachable"):
        data.mlflow_client("http://127.0.0.1:9")  # discard port: connection refused at once


def test_bench_average_prefers_macro():
    assert frames.bench_average({"eval/macro/avg@k": 0.4, "eval/arith/avg@k": 0.9}) == 0.4
    assert frames.bench_average({"reward/mean": 1.0}) is None
    assert math.isclose(float(np.float64(frames.bench_average({"eval/macro/avg@k": 0.25}))), 0.25)
