"""The dashboard's table transforms against hand computations (runs, legend labels, curves, benchmarks), the
run naming they share with MLflow, and the read-only store access."""

from __future__ import annotations

import io
import json
import math
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dashboards import bench, curves, data, figures, frames
from parity.tracking import naming


def test_ema_matches_hand_computation():
    # w = 0.5: s1 = 0.5*1 = 0.5 -> /0.5 = 1; s2 = 0.25 + 0.5*3 = 1.75 -> /0.75 = 2.333..; s3 = 0.875 + 0 -> /0.875 = 1
    got = curves.ema([1.0, 3.0, 0.0], 0.5)
    assert got == pytest.approx([1.0, 1.75 / 0.75, 0.875 / 0.875])
    assert curves.ema([2.0, 5.0], 0.0).tolist() == [2.0, 5.0]
    with pytest.raises(ValueError, match="smoothing weight"):
        curves.ema([1.0], 1.0)


def test_curves_group_seeds_mean_and_band():
    labels = {"a": "dual", "b": "dual", "c": "none"}  # a and b: two seeds of one configuration
    hist = pd.DataFrame([("a", "reward/mean", 1, 0.2), ("a", "reward/mean", 2, 0.4),
                         ("b", "reward/mean", 1, 0.6), ("b", "reward/mean", 2, 0.8),
                         ("c", "reward/mean", 1, 0.5), ("z", "reward/mean", 1, 9.0)],
                        columns=["run_id", "key", "step", "value"])
    plain = curves.curves(hist, {"a": "s0", "b": "s1", "c": "x"})
    assert sorted(plain["series"].unique()) == ["s0", "s1", "x"]  # z was not chosen
    assert (plain["lo"] == plain["value"]).all()
    grouped = curves.curves(hist, labels, group_seeds=True)
    g1 = grouped[grouped["series"] == "dual"].sort_values("step")
    assert g1["value"].tolist() == pytest.approx([0.4, 0.6])
    assert g1["lo"].tolist() == pytest.approx([0.2, 0.4]) and g1["hi"].tolist() == pytest.approx([0.6, 0.8])
    assert g1["n"].tolist() == [2, 2]
    assert grouped[grouped["series"] == "none"]["n"].tolist() == [1]
    # smoothing is applied per run before averaging: run a smoothed with w=0.5 is [0.2, (0.05+0.2)/0.75]
    sm = curves.curves(hist, {"a": "s0", "b": "s1"}, smoothing=0.5)
    a = sm[sm["series"] == "s0"].sort_values("step")["value"].tolist()
    assert a == pytest.approx([0.2, (0.5 * 0.5 * 0.2 + 0.5 * 0.4) / 0.75])
    # an evaluation every 10 steps is left as measured: its last point is where the run ended
    sparse = pd.DataFrame([("a", "eval/accuracy", s, v) for s, v in [(0, 0.1), (10, 0.3), (20, 0.5)]],
                          columns=["run_id", "key", "step", "value"])
    assert curves.curves(sparse, {"a": "s0"}, smoothing=0.6)["value"].tolist() == [0.1, 0.3, 0.5]


def test_collapse_markers_first_flagged_step_or_recorded_step():
    hist = pd.DataFrame([("a", "train/collapsed", s, v) for s, v in [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]]
                        + [("b", "train/collapsed", 1, 0.0), ("b", "reward/mean", 1, 0.3)],
                        columns=["run_id", "key", "step", "value"])
    m = curves.collapse_markers(hist, {"a": "none", "b": "tis", "c": "dual"}, {"b": None, "c": 7.0})
    assert m.to_dict("records") == [{"series": "none", "run_id": "a", "step": 3},
                                    {"series": "dual", "run_id": "c", "step": 7}]
    spec = curves.curve_spec("reward/mean", banded=True, points=True, series=["none", "tis"], markers=m)
    rule = spec["layer"][-1]
    assert rule["mark"]["type"] == "rule" and rule["data"]["values"][0] == {"series": "none", "step": 3}
    assert spec["layer"][0]["mark"]["type"] == "area" and spec["layer"][1]["mark"]["type"] == "line"
    assert curves.collapse_markers(hist.iloc[:0], {"a": "x"}).empty


def test_default_panels_and_smoothing():
    present = ["perf/step_s", "mismatch/k3_kl", "drift/entropy", "eval/accuracy", "reward/mean", "drift/length_std",
               "mismatch/abs_prob_diff_mean", "mismatch/chi2", "correction/lambda"]
    assert curves.default_panels(present) == ["reward/mean", "eval/accuracy", "mismatch/abs_prob_diff_mean",
                                              "mismatch/k3_kl", "drift/entropy", "drift/length_std",
                                              "correction/lambda"]
    assert curves.default_panels(["reward/mean", "eval/accuracy_unquantized", "mismatch/x"]) == [
        "reward/mean", "eval/accuracy_unquantized", "mismatch/x"]
    assert [curves.default_smoothing(n) for n in (2, 9, 10, 19, 20, 500)] == [0.0, 0.0, 0.3, 0.3, 0.6, 0.6]


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
    seed = {"actor_rollout_ref.rollout.quantization": "int8",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype": "int4_per_token_head"}
    assert frames.precision_label(seed) == "wint8-aint8-kvint4_per_token_head"
    assert frames.precision_label({"actor_rollout_ref.rollout.quantization": "None"}) == "bf16"
    # the run names' spelling
    assert frames.precision_short(seed) == "int8+int4kv" and frames.precision_short({}) == "bf16"
    assert frames.short_of_label("wint8-aint8-kvbf16") == "int8" and frames.short_of_label("bf16") == "bf16"
    assert naming.precision_short("int8", "bf16", "fp8") == "wint8-abf16+fp8kv"
    assert naming.precision_short("fp8", "fp8", "bf16", perturbation_sigma="0.01") == "fp8+σ0.01"
    assert naming.precision_short("bf16", "bf16", "bf16", perturbation_sigma=0.0) == "bf16"


def test_precision_labels_of_params_follow_the_library():
    """The labels the dashboard reads from a run's params are the library's: the seed block's names through the
    loader's tables, the spec through precision_spec, the short label through naming.precision_short."""
    from parity.config import flatten, load_config
    from parity.config.seed_block import QUANTIZATION_NAMES
    from parity.precision.config import precision_spec, resolve_precision, spec_of

    seed = "actor_rollout_ref.rollout"
    # every seed-block name the loader knows, as a store of an older layout (the block alone) records it
    for name, (w, a) in QUANTIZATION_NAMES.items():
        params = {f"{seed}.quantization": name}
        assert frames.precision_label(params) == precision_spec(w, a, "bf16"), name
        assert frames.precision_short(params) == naming.precision_short(w, a, "bf16"), name
    # w8a8_int8 + an int4 KV cache in vLLM's name: the formats, not the seed block's spelling
    w8a8 = {f"{seed}.quantization": "w8a8_int8", f"{seed}.engine_kwargs.vllm.kv_cache_dtype": "int4_per_token_head"}
    assert frames.precision_label(w8a8) == "wint8-aint8-kvint4_per_token_head"
    assert frames.precision_short(w8a8) == "int8+int4kv"
    assert frames.precision_label({f"{seed}.quantization": "w8a8_int8"}) == "wint8-aint8-kvbf16"
    # an int4 KV cache without its rotation, a perturbed rollout: as the pipeline names its artifacts and runs
    for overrides, spec, short in (
            (["rollout.precision.kv_hadamard=false"], "wint8-aint8-kvint4_per_token_head-nohadamard",
             "int8+int4kv-nohadamard"),
            (["rollout.precision.perturbation.sigma=0.01"], "wint8-aint8-kvint4_per_token_head-sigma0.01",
             "int8+int4kv+σ0.01"),
            (["rollout.precision.kv_hadamard=false", "rollout.precision.perturbation.sigma=0.02"],
             "wint8-aint8-kvint4_per_token_head-nohadamard-sigma0.02", "int8+int4kv-nohadamard+σ0.02")):
        cfg = load_config(["+precision=w8a8_int8_kv_int4", *overrides])
        params = {k: str(v) for k, v in flatten(cfg).items()}  # MLflow keeps params as text
        assert spec_of(resolve_precision(cfg)) == spec and naming.precision_of(cfg) == short
        assert frames.precision_label(params) == spec and frames.precision_short(params) == short
        assert naming.precision_of_spec(spec) == short  # the registry's spec reads back to the same label
    # the seed block set in the verl spelling and folded by the loader: one label, whichever key is read
    cfg = load_config([f"{seed}.quantization=w8a8_int8",
                       f"{seed}.engine_kwargs.vllm.kv_cache_dtype=int4_per_token_head"])
    params = {k: str(v) for k, v in flatten(cfg).items()}
    assert frames.precision_label(params) == spec_of(resolve_precision(cfg)) == "wint8-aint8-kvint4_per_token_head"
    assert frames.precision_short(params) == naming.precision_of(cfg) == "int8+int4kv"
    # two runs that differ only in the rotation: told apart, under the one `precision` part of their labels
    a = {k: str(v) for k, v in flatten(load_config(["+precision=w8a8_int8_kv_int4"])).items()}
    b = {**a, "rollout.precision.kv_hadamard": "False"}
    assert frames.differing_keys({"a": a, "b": b}) == ["precision"]
    assert frames.config_labels({"a": a, "b": b}, {}) == {"a": "int8+int4kv", "b": "int8+int4kv-nohadamard"}


def test_the_dashboard_reads_precisions_without_torch():
    import subprocess
    import sys

    code = ("import sys; from dashboards import frames, bench; "
            "frames.precision_label({'actor_rollout_ref.rollout.quantization': 'w8a8_int8'}); "
            "frames.short_of_label('wint8-aint8-kvint4_per_token_head-nohadamard'); "
            "print(sorted(m for m in ('torch', 'omegaconf', 'parity.config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_run_names_tags_and_identity_params():
    from parity.config import flatten, load_config

    cfg = load_config(["rollout.precision.weights=int8", "rollout.precision.activations=int8",
                       "rollout.precision.kv_cache=int4_per_token_head", "algorithm.correction.name=score_centering+tis",
                       "algorithm.policy_loss=reinforce", "rollout.topk_logprobs=8",
                       "trainer.seed=3"])
    assert naming.run_title(cfg) == "arith_tiny / int8+int4kv / score_centering+tis / seed 3"
    assert naming.stage_title(naming.run_title(cfg), "train").endswith("seed 3 / train")
    # one label function: the run title is label() of the config's facts; the registry's spec reads back the same
    facts = naming.facts_of(cfg)
    assert facts["precision_spec"] == "wint8-aint8-kvint4_per_token_head" and facts["seed"] == "3"
    assert naming.label_of(facts) == naming.run_title(cfg)
    assert naming.precision_of_spec(facts["precision_spec"]) == facts["precision"] == "int8+int4kv"
    assert naming.label_of(naming.facts_of_tags(naming.tags_of(facts))) == naming.run_title(cfg)
    assert naming.label(None, None, None, None) == "experiment / bf16 / none / seed 0"
    assert naming.precision_of_spec("bf16-sigma0.01") == "bf16+σ0.01" and naming.precision_of_spec("odd") == "odd"
    assert naming.run_tags(cfg)["parity.precision"] == "int8+int4kv"
    ident = naming.identity_params(flatten(cfg))
    assert {"experiment_name", "trainer.lr", "trainer.seed", "algorithm.correction.tis.C",
            "algorithm.correction.score_centering.top_k", "rollout.precision.kv_cache"} <= set(ident)
    assert not any(k.startswith(("algorithm.correction.dual.", "tracking.", "eval.")) for k in ident)


def test_headline_metrics():
    train = {"final_reward": 0.5, "final_accuracy": 0.25, "initial_accuracy": 0.125, "steps": 3}
    assert naming.headline_metrics(train, {"avg@k": 0.4, "pass@k": 0.6}) == {
        "final_reward": 0.5, "heldout_accuracy": 0.25, "heldout_accuracy_initial": 0.125, "benchmark_macro_avg": 0.4}
    assert naming.headline_metrics({**train, "collapse_step": None})["collapsed"] == 0.0
    fired = naming.headline_metrics({**train, "final_reward": None, "collapse_step": 14,
                                     "final_accuracy_unquantized": 0.3})
    assert (fired["collapsed"], fired["collapse_step"], fired["heldout_accuracy_unquantized"]) == (1.0, 14.0, 0.3)
    assert "final_reward" not in fired and "collapsed" not in naming.headline_metrics(train)


def _params(**kw: str) -> dict[str, str]:
    base = {"experiment_name": "arith_tiny", "algorithm.correction.name": "none", "trainer.seed": "0",
            "trainer.lr": "5e-05", "trainer.run_name": "x", "outputs_dir": "/o", "rollout.precision.weights": "bf16",
            "rollout.precision.activations": "bf16", "algorithm.correction.tis.C": "2.0"}
    return {**base, **{k.replace("__", "."): v for k, v in kw.items()}}


def test_config_labels_name_what_differs():
    runs = {"a": _params(), "b": _params(trainer__seed="1", trainer__run_name="y"),
            "c": _params(algorithm__correction__name="tis", trainer__run_name="z"),
            "d": _params(algorithm__correction__name="tis", trainer__seed="1", outputs_dir="/elsewhere")}
    titles = {k: f"title {k}" for k in runs}
    assert frames.differing_keys(runs) == ["algorithm.correction.name", "trainer.seed"]
    assert frames.config_labels(runs, titles) == {"a": "none / seed 0", "b": "none / seed 1", "c": "tis / seed 0",
                                                  "d": "tis / seed 1"}
    assert frames.config_labels(runs, titles, group_seeds=True) == {"a": "none", "b": "none", "c": "tis", "d": "tis"}
    # the dial's seed, recorded as the run's seed it followed, is the seed: not a key of its own
    dial = {k: {**p, "rollout.precision.perturbation.seed": p["trainer.seed"]} for k, p in runs.items()}
    assert frames.differing_keys(dial) == ["algorithm.correction.name", "trainer.seed"]
    assert frames.config_labels(dial, titles, group_seeds=True) == {"a": "none", "b": "none", "c": "tis", "d": "tis"}
    fixed = {**dial, "d": {**dial["d"], "rollout.precision.perturbation.seed": "7"}}  # set apart from trainer.seed
    assert "rollout.precision.perturbation.seed" in frames.differing_keys(fixed)
    # precision keys fold into one label; other keys by their last name (or more where two would read the same)
    prec = {"a": _params(), "b": _params(rollout__precision__weights="int8", rollout__precision__activations="int8",
                                         trainer__lr="1e-05", algorithm__correction__tis__C="5.0")}
    assert frames.config_labels(prec, titles) == {"a": "bf16 / C=2.0 / lr=5e-05", "b": "int8 / C=5.0 / lr=1e-05"}
    # nothing differs: the run's own title; repeats of one configuration kept apart by their id unless grouped
    assert frames.config_labels({"a": _params()}, titles) == {"a": "title a"}
    same = {"run1aaaa": _params(), "run2bbbb": _params(trainer__run_name="other")}
    assert frames.config_labels(same, {"run1aaaa": "t", "run2bbbb": "t"}) == {"run1aaaa": "t (run1aa)",
                                                                             "run2bbbb": "t (run2bb)"}
    assert set(frames.config_labels(same, {"run1aaaa": "t", "run2bbbb": "t"}, group_seeds=True).values()) == {"t"}


def test_compare_labels_short_and_distinct_with_the_whole_list_beside():
    """The second run of another shape (BF16, TIS, the defaults) against the first (the whole chain): thirteen keys
    differ; the legend names the run label's parts and the two keys that most shape a curve, counts the rest, and
    the hover and the table hold them all."""
    chain = {**_params(), "rollout.precision.weights": "int8", "rollout.precision.activations": "int8",
             "rollout.precision.kv_cache": "int4_per_token_head", "algorithm.correction.name": "score_centering",
             "algorithm.policy_loss": "reinforce", "trainer.total_steps": "40", "model.warm_start.steps": "700",
             "eval.suite": "['arithmetic', 'aime24', 'aime25']", "eval.bootstrap": "200", "eval.limit": "8",
             "eval.benchmarks.arithmetic.limit": "64"}
    other = {**_params(), "algorithm.correction.name": "tis", "algorithm.policy_loss": "ppo_clip",
             "trainer.total_steps": "100", "model.warm_start.steps": "1000", "eval.suite": "['arithmetic']",
             "eval.bootstrap": "1000", "eval.limit": "None"}
    runs = {"a": chain, "b": other}
    labels = frames.config_labels(runs, {})
    # (`steps=40` would make the first label 66 characters: past MAX_LABEL_CHARS, the last extra key is left out)
    assert labels == {"a": "int8+int4kv / score_centering / loss=reinforce +6 more",
                      "b": "bf16 / tis / loss=ppo_clip +6 more"}
    assert max(map(len, labels.values())) <= frames.MAX_LABEL_CHARS
    assert frames.label_keys(runs)[1] == ["trainer.total_steps", "model.warm_start.steps",
                                          "eval.benchmarks.arithmetic.limit", "eval.bootstrap", "eval.limit",
                                          "eval.suite"]
    details = frames.config_details(runs)
    assert details["b"] == ("precision=bf16, algorithm.correction.name=tis, algorithm.policy_loss=ppo_clip, "
                            "trainer.total_steps=100, model.warm_start.steps=1000, "
                            "eval.benchmarks.arithmetic.limit=—, eval.bootstrap=1000, eval.limit=None, "
                            "eval.suite=['arithmetic']")
    table = frames.differences_table(runs, labels, {"a": "run a", "b": "run b"})
    assert list(table.columns)[:4] == ["label", "run", "precision", "algorithm.correction.name"]
    assert len(table.columns) == 2 + 9 and table.loc[1, "eval.suite"] == "['arithmetic']"
    # the same two with seeds and a repeat: grouped, the seed is neither named nor counted
    seeds = {"a": chain, "a1": {**chain, "trainer.seed": "1"}, "b": other}
    grouped = frames.config_labels(seeds, {}, group_seeds=True)
    assert grouped["a"] == grouped["a1"] == labels["a"] and grouped["b"] == labels["b"]
    assert "seed" not in frames.config_details(seeds, group_seeds=True)["a1"]
    # keys beyond the label's parts are added while two configurations still read alike, the one splitting most
    three = {"x": _params(trainer__lr="1e-05"), "y": _params(trainer__lr="2e-05"),
             "z": _params(trainer__lr="2e-05", eval__limit="8")}
    # (eval.limit ranks after lr, which shapes the curves, and is named because y and z differ only in it)
    assert frames.config_labels(three, {}) == {"x": "lr=1e-05 / limit=—", "y": "lr=2e-05 / limit=—",
                                               "z": "lr=2e-05 / limit=8"}
    # a long value is cut in the label, whole in the hover
    long = {"p": _params(eval__suite="['arithmetic', 'aime24']"), "q": _params(eval__suite="['arithmetic']")}
    lab = frames.config_labels(long, {})
    assert lab["p"] == "eval=['arithmetic'…" and len(lab["p"]) == len("eval=") + frames.LABEL_VALUE_CHARS
    assert frames.config_details(long)["p"] == "eval.suite=['arithmetic', 'aime24']"


def test_runs_name_the_benchmark_set_of_each_average():
    """A pipeline evaluated on one benchmark beside one evaluated on seven: each average with the set it is over and
    its problems (from the evaluate stage's metrics), two sets that read alike in short told apart."""
    def pipeline(i: int, problems: dict[str, int], avg: float) -> list[data.RunRecord]:
        top = data.RunRecord(f"p{i}", f"run {i}", "1", "arith_tiny", "FINISHED", 1000 + i,
                             metrics={"benchmark_macro_avg": avg}, tags={naming.KIND_TAG: "pipeline"})
        ev = data.RunRecord(f"e{i}", f"run {i} / evaluate", "1", "arith_tiny", "FINISHED", 2000 + i,
                            metrics={**{f"eval/{b}/problems": float(n) for b, n in problems.items()},
                                     naming.STAGE_BENCHMARK_AVG_METRIC: avg},
                            tags={"mlflow.parentRunId": f"p{i}", naming.KIND_TAG: "stage", naming.STAGE_TAG: "evaluate"})
        return [top, ev]

    quick = {"arithmetic": 64, **{b: 8 for b in ("aime24", "aime25", "amc23", "math500", "minerva_math",
                                                  "olympiadbench")}}
    other7 = {f"b{i}": 16 for i in range(7)}  # 112 problems too
    df = frames.runs_frame([*pipeline(1, {"arithmetic": 4}, 0.375), *pipeline(2, quick, 0.078),
                            *pipeline(3, other7, 0.1)], "http://ui")
    top = frames.top_level(df).set_index("run")
    assert top.loc["run 1", "benchmark_avg"] == 0.375 and top.loc["run 1", "bench_set"] == "arithmetic (4)"
    assert top.loc["run 1", "bench_set_full"] == "arithmetic (4 problems)"
    assert top.loc["run 2", "bench_set"] == "7 benchmarks (112)"
    assert top.loc["run 2", "bench_set_full"] == ("7 benchmarks, 112 problems: aime24 8, aime25 8, amc23 8, "
                                                  "arithmetic 64, math500 8, minerva_math 8, olympiadbench 8")
    assert top.loc["run 3", "bench_set"] == "7 benchmarks (112) #2"  # another set of seven
    assert frames.bench_sets(top) == {"arithmetic (4)": "arithmetic (4 problems)",
                                      "7 benchmarks (112)": top.loc["run 2", "bench_set_full"],
                                      "7 benchmarks (112) #2": top.loc["run 3", "bench_set_full"]}
    stage = df[df["run_id"] == "e1"].iloc[0]
    assert stage["bench_set"] == "arithmetic (4)" and stage["benchmark_avg"] == 0.375
    # the tag the pipeline carries in MLflow spells the set the same way
    assert naming.benchmark_set(naming.benchmark_problems({b: {"problems": n} for b, n in quick.items()})) == \
        top.loc["run 2", "bench_set_full"]


def test_bench_labels_and_one_row_per_evaluation():
    assert bench.eval_key("/abs/outputs/eval/x-20261201-101500") == bench.eval_key("outputs/eval/x-20261201-101500") \
        == "eval/x-20261201-101500"
    assert bench.stamp_of("eval/x-20261201-101500") == "2026-12-01 10:15:00" and bench.stamp_of("eval/x") == ""
    assert bench.model_label({"path": "outputs/runs/r1/checkpoints/step_000040"}, "e") == "r1 @ step 40"
    assert bench.model_label({"registered_model": {"name": "parity-arith_tiny", "version": 3}}, "e") == \
        "parity-arith_tiny v3"
    hub = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0123456789abcdef0123"
    assert bench.model_label({"path": hub}, "e") == "Qwen/Qwen3-8B"
    assert bench.model_label({"path": "/models/exported/6d22da0e1f2a3b4c5d6e"}, "e") == "exported"
    assert bench.model_label({}, "outputs/eval/Qwen3-8B-20261201-101500") == "Qwen3-8B"
    row = {"correction": "tis", "benchmark": "aime24", "metric": "avg@k", "k": 4, "problems": 30, "ci_low": 0.2,
           "ci_high": 0.4, "value": 0.3}
    rows = pd.DataFrame([
        {**row, "model": "m @ step 2", "precision": "bf16", "source": "registry", "key": "eval/a", "stamp": "s1",
         "out_dir": "/o/eval/a"},
        {**row, "model": "m @ step 2", "precision": "bf16", "source": "file", "key": "eval/a", "stamp": "s1",
         "out_dir": "/o/eval/a"},  # the same evaluation found as a folder
        {**row, "model": "m @ step 2", "precision": "int8", "source": "registry", "key": "eval/b", "stamp": "s2",
         "out_dir": "/o/eval/b", "value": 0.25},
        {**row, "model": "other", "precision": "bf16", "source": "file", "key": "eval/c", "stamp": "s3",
         "out_dir": "/o/eval/c"},
        {**row, "model": "other", "precision": "bf16", "source": "file", "key": "eval/d", "stamp": "s4",
         "out_dir": "/o/eval/d"}], columns=bench.BENCH_COLUMNS)
    one = bench.one_per_evaluation(rows)
    assert one["evaluation"].tolist() == ["m @ step 2 [bf16]", "m @ step 2 [int8]", "other (s3)", "other (s4)"]
    assert one.iloc[0]["source"] == "registry"
    t = bench.benchmark_table(one, "avg@k")
    assert t["evaluation"].tolist() == ["other (s4)", "other (s3)", "m @ step 2 [int8]", "m @ step 2 [bf16]"]
    assert t.loc[2, "aime24"] == "25.0 [20.0, 40.0]" and list(t.columns) == [
        "evaluation", "aime24", "average", "set", "correction", "precision", "out_dir"]
    # one benchmark: its average is its value (what the Runs page and MLflow show), over the set it names with its n
    assert t["average"].tolist() == t["aime24"].tolist() and set(t["set"]) == {"aime24 (30)"}
    assert bench.benchmark_table(one, "pass@k").empty
    bars = bench.chart_rows(one, "avg@k")  # no average bar: of one benchmark it repeats the benchmark's
    assert bars["pct"].tolist() == pytest.approx([30.0, 25.0, 30.0, 30.0]) and bars["lo"].iloc[0] == pytest.approx(20.0)
    # several benchmarks, a registry evaluation whose folder is gone (no macro row): the mean of its values, no
    # interval (a mean's interval needs the bootstrap replicates); the folder's own average where it has one
    two = pd.DataFrame([{**row, "model": "m", "precision": "bf16", "source": "registry", "key": "eval/e", "stamp": "s5",
                         "out_dir": "/o/eval/e", "benchmark": b, "value": v, "problems": n}
                        for b, v, n in (("aime24", 0.3, 30), ("arithmetic", 0.5, 64))]
                       + [{**row, "model": "f", "precision": "bf16", "source": "file", "key": "eval/f", "stamp": "s6",
                           "out_dir": "/o/eval/f", "benchmark": b, "value": v, "problems": n, "ci_low": lo,
                           "ci_high": hi}
                          for b, v, n, lo, hi in (("aime24", 0.1, 30, 0.0, 0.2), ("arithmetic", 0.7, 64, 0.6, 0.8),
                                                  ("macro", 0.4, None, 0.35, 0.45))], columns=bench.BENCH_COLUMNS)
    t2 = bench.benchmark_table(bench.one_per_evaluation(two), "avg@k").set_index("evaluation")
    assert t2.loc["m", "average"] == "40.0" and t2.loc["f", "average"] == "40.0 [35.0, 45.0]"  # (30 + 50) / 2
    assert t2.loc["m", "set"] == t2.loc["f", "set"] == "aime24 + arithmetic (94)"
    bars2 = bench.chart_rows(bench.one_per_evaluation(two), "avg@k")
    assert sorted(bars2["benchmark"]) == ["aime24", "aime24", "arithmetic", "arithmetic", "average"]


def test_flag_checks_and_missing_metrics():
    sc = {"experiment": "arith_tiny", "precision": "int8+int4kv", "correction": "score_centering", "seed": "1"}
    champ = {**sc, "seed": "0"}
    checks = pd.DataFrame({"passed": [True, False], "delta": [0.01, -0.2], "ci_low": [-0.02, -0.3],
                           "ci_high": [0.03, -0.1], "margin": [0.05, 0.05], "benchmark": ["a", "a"],
                           "candidate_result_id": [7, 9], "baseline_result_id": [3, 3],
                           "precision": ["wint8-aint8-kvbf16", "wint8-aint8-kvint4_per_token_head"],
                           "candidate_eval_precision": [None, "bf16"],
                           "candidate_facts": [None, json.dumps(sc)], "candidate_version": [None, "2"],
                           "baseline_facts": [None, champ], "baseline_version": [None, "1"],
                           # as the registry's SQLite rows read back: microseconds
                           "created_at": ["2026-12-02 10:15:30.389117", "2026-12-02 10:15:31.012000"]})
    f = frames.flag_checks(checks)
    assert f["flagged"].tolist() == [True, False]  # newest first
    # shown to the second
    assert f["checked"].tolist() == ["2026-12-02 10:15:31", "2026-12-02 10:15:30"]
    assert f["created_at"].tolist() == [pd.Timestamp("2026-12-02 10:15:31"), pd.Timestamp("2026-12-02 10:15:30")]
    # the time axis spans an hour at least, on whole minutes, the checks inside it (not one millisecond tick)
    lo, hi = frames.time_window(f["created_at"])
    assert (lo, hi) == ({"year": 2026, "month": 12, "date": 2, "hours": 9, "minutes": 45},
                        {"year": 2026, "month": 12, "date": 2, "hours": 10, "minutes": 46})
    # a longer history: its own span and 5 % either side (two days: 2.4 h)
    lo, hi = frames.time_window(pd.Series(pd.to_datetime(["2026-12-01 00:00:00", "2026-12-03 00:00:00"])))
    assert (lo["date"], lo["hours"], lo["minutes"], hi["date"], hi["hours"], hi["minutes"]) == (30, 21, 36, 3, 2, 24)
    assert f["delta"].tolist() == pytest.approx([-20.0, 1.0])
    # both sides labelled with naming.label (what each was trained as) and their version; the evaluation's precision
    assert f["candidate"].tolist() == ["arith_tiny / int8+int4kv / score_centering / seed 1 v2", "result 7"]
    assert f["champion"].tolist() == ["arith_tiny / int8+int4kv / score_centering / seed 0 v1", "result 3"]
    assert f["precision"].tolist() == ["bf16", "int8"]  # an older check: its artifact's precision
    hist = pd.DataFrame([("a", "reward/mean", 1, 0.1)], columns=["run_id", "key", "step", "value"])
    assert curves.missing_metrics(hist, {"a": "run-a"}, ["reward/mean", "correction/lambda"]) == \
        {"correction/lambda": ["run-a"]}
    # labels shared by seeds once, each label and the metric set apart in the note (a label holds slashes)
    missing = curves.missing_metrics(hist, {"a": "none / seed 0", "b": "tis", "c": "tis"},
                                     ["reward/mean", "eval/accuracy_unquantized"])
    assert missing == {"reward/mean": ["tis"], "eval/accuracy_unquantized": ["none / seed 0", "tis"]}
    assert curves.missing_text(missing).splitlines()[2:] == [
        "- `reward/mean`: not logged by **tis**",
        "- `eval/accuracy_unquantized`: not logged by **none / seed 0**, **tis**"]


def test_wide_csv_and_png():
    plot = pd.DataFrame({"series": ["s", "s"], "key": ["k", "k"], "step": [1, 2], "value": [0.5, 0.25],
                         "lo": [0.4, 0.2], "hi": [0.6, 0.3], "n": [2, 2]})
    csv = pd.read_csv(io.StringIO(curves.wide_csv(plot)))
    assert csv.columns.tolist() == ["series", "step", "k", "k (min)", "k (max)"]
    assert csv["k (max)"].tolist() == [0.6, 0.3]
    png = figures.curves_png(plot, ["k"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_report_rows_and_validation_history():
    """One row per report of parity.precision.validate: time, checkpoint, precision labelled like every page, verdict,
    metrics and thresholds; `latest` marks the newest of each checkpoint and precision."""
    rep = {"quant": {"engine": "torch", "weights": "int8", "activations": "int8", "kv_cache": "int4_per_token_head"},
           "precision": {"weights": "int8", "activations": "int8", "kv_cache": "int4_per_token_head"},
           "precision_spec": "wint8-aint8-kvint4_per_token_head", "created_at": "2026-12-02T10:15:30.123456+00:00",
           "metrics": {"abs_prob_diff_mean": 0.01, "accuracy_drop": None}, "n_prompts": 8,
           "thresholds": {"max_k3_kl": 0.01}, "failures": ["k3_kl 0.02 > 0.01"], "passed": False}
    (row,) = frames.report_rows("m-W8A8-INT8", rep, "a.json")
    assert row == {"validated": "2026-12-02 10:15:30", "checkpoint": "m-W8A8-INT8", "precision": "int8+int4kv",
                   "spec": "wint8-aint8-kvint4_per_token_head", "engine": "torch", "verdict": "FAILED",
                   "passed": False, "failures": "k3_kl 0.02 > 0.01", "abs_prob_diff_mean": 0.01, "accuracy_drop": None,
                   "threshold.max_k3_kl": 0.01, "file": "a.json", "created_at": rep["created_at"]}
    older = frames.report_rows("m-W8A8-INT8", {**rep, "created_at": "2026-12-01T09:00:00+00:00", "passed": True,
                                               "failures": []}, "b.json")[0]
    legacy = frames.report_rows("m-W8A8-INT8", {"quant": {"weights": "int8", "activations": "int8", "kv_cache": "bf16"},
                                                "metrics": {"k3_kl": 0.002}, "passed": True}, "validation.json")[0]
    assert legacy["precision"] == "int8" and legacy["validated"] == "" and legacy["spec"] == ""
    h = frames.validation_history([older, legacy, row])
    assert h["file"].tolist() == ["a.json", "b.json", "validation.json"]
    assert h["latest"].tolist() == [True, False, True] and h["verdict"].tolist() == ["FAILED", "passed", "passed"]
    assert "created_at" not in h.columns


def test_two_validations_in_one_second_list_the_later_first():
    """Reports of one second are named `<spec>-<time>.json` then `<spec>-<time>-2.json`; the name sorts the first
    after the second, so the history orders by the microsecond time the report carries."""
    rep = {"quant": {"weights": "int8", "activations": "int8", "kv_cache": "int4_per_token_head"},
           "precision_spec": "s", "metrics": {}, "failures": []}
    first = frames.report_rows("ck", {**rep, "created_at": "2026-12-02T10:15:30.100000+00:00", "passed": True},
                               "s-20261202-101530.json")[0]
    second = frames.report_rows("ck", {**rep, "created_at": "2026-12-02T10:15:30.900000+00:00", "passed": False},
                                "s-20261202-101530-2.json")[0]
    h = frames.validation_history([first, second])
    assert h["verdict"].tolist() == ["FAILED", "passed"] and h["latest"].tolist() == [True, False]


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


def test_bench_average_reads_what_the_writers_log():
    from parity.tracking.mlflow_log import metric_key

    # an evaluate stage logs eval/<benchmark>/avg@k and eval/macro/avg@k (tasks/records.py), stored as avg_at_k
    stage = {metric_key(k): v for k, v in {"eval/macro/avg@k": 0.4, "eval/arith/avg@k": 0.9}.items()}
    assert frames.bench_average(stage) == 0.4
    # a pipeline's headline (naming.headline_metrics) wins over a stage's number it also carries
    headline = naming.headline_metrics({}, {"avg@k": 0.3})
    assert frames.bench_average({**stage, **headline}) == 0.3
    assert frames.bench_average({"reward/mean": 1.0, "eval/arith/avg_at_k": 0.9}) is None
    assert math.isclose(float(np.float64(frames.bench_average(headline))), 0.3)
