"""The collapse-and-rescue study: the table's statistics against a hand computation, and the laptop preset's
smallest variant end to end (2 steps, 1 seed): study.json, the table and the figures are written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from parity.study.report import arm_rows, mean_se, table
from parity.study.runs import late_mean, smoothed_peak

PIN = "model.dtype=float32"  # the end-to-end study's dtype, whatever model.dtype=auto resolves to on this CPU


def _run(arm: str, seed: int, final: float, held: float | None, collapse: int | None) -> dict:
    return {"name": f"{arm}-{seed}", "arm": arm, "seed": seed, "labels": {}, "initial_reward": 0.2, "steps": 40,
            "final_reward": final, "peak_reward": final + 0.1, "heldout_initial": 0.3, "heldout_final": held,
            "heldout_engine_final": held, "collapse_step": collapse, "mismatch_mean": 0.01,
            "delta_cosine_final": None, "curves": {}, "evals": {}}


def test_mean_and_standard_error_by_hand() -> None:
    m, se, n = mean_se([0.5, 0.7, 0.9, None])
    # sample std of (0.5, 0.7, 0.9) = 0.2; se = 0.2 / sqrt(3)
    assert (m, n) == (pytest.approx(0.7), 3) and se == pytest.approx(0.2 / math.sqrt(3))
    assert mean_se([0.4]) == (0.4, None, 1) and mean_se([None, float("nan")]) == (None, None, 0)
    assert late_mean([1.0] * 18 + [0.0, 0.5]) == pytest.approx(0.25)  # the last 10% (2 of 20)
    assert smoothed_peak([0, 1, 1, 1, 1, 1, 0, 0], window=5) == pytest.approx(1.0)
    assert smoothed_peak([0.2, 0.4], window=5) == 0.4


def test_arm_rows_and_table_by_hand() -> None:
    runs = [_run("a", 0, 0.5, 0.40, None), _run("a", 1, 0.7, 0.50, 12), _run("a", 2, 0.9, 0.60, 20),
            _run("b", 0, 0.1, None, 5), {"name": "b-1", "arm": "b", "seed": 1, "error": "boom\nValueError: bad"}]
    rows = {r["arm"]: r for r in arm_rows(runs)}
    a = rows["a"]
    assert a["seeds"] == [0, 1, 2] and a["collapsed"] == 2 and a["collapse_step_mean"] == 16
    assert a["final_reward"]["mean"] == pytest.approx(0.7)
    assert a["final_reward"]["se"] == pytest.approx(0.2 / math.sqrt(3))
    assert a["heldout_final"]["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert rows["b"]["heldout_final"] == {"mean": None, "se": None, "n": 0} and rows["b"]["collapsed"] == 1
    md = table(runs)
    assert "| a | 3 | 40 | 0.200 ± 0.000 → 0.700 ± 0.115 (0.800 ± 0.115) | 0.300 ± 0.000 → 0.500 ± 0.058 |" in md
    assert "| 2/3 (step 16) |" in md and "| 1/1 (step 5) |" in md
    assert "| b | seed 1 failed | | ValueError: bad |" in md


def test_laptop_quick_study_end_to_end(tmp_path) -> None:
    from parity.commands.study import main

    out = tmp_path / "study"
    # float32 pinned: with model.dtype=auto (bf16 on AVX512-BF16 CPUs) the unperturbed arm's trainer and engine
    # differ by bf16 rounding too, and the ratio below measures that instead of the dial
    res = main(["--preset", "laptop-reinforce", "--quick", "--arms", "bf16 / none,sigma=0.2 / none", "--extra", PIN,
                "--outputs-dir", str(tmp_path / "outputs"), "--out", str(out)])
    assert res["failed"] == 0 and res["runs"] == 2
    study = json.loads((out / "study.json").read_text())
    assert study["preset"] == "laptop-reinforce" and study["quick"] and study["steps"] == 2 and study["seeds"] == [0]
    runs = {r["arm"]: r for r in study["runs"]}
    assert set(runs) == {"bf16 / none / reinforce_raw", "sigma=0.2 / none / reinforce_raw"}
    for r in runs.values():
        assert r["steps"] == 2 and len(r["curves"]["reward/mean"]) == 2
        assert r["collapse_step"] is None and r["heldout_final"] is not None
        assert "rollout.precision.perturbation.sigma=0.2" in r["overrides"] or r["arm"].startswith("bf16")
    # the dial makes the sampler differ (the barely warm-started quick model is near-uniform: small |p - q|)
    dialled, exact = runs["sigma=0.2 / none / reinforce_raw"], runs["bf16 / none / reinforce_raw"]
    assert dialled["mismatch_mean"] > 100 * exact["mismatch_mean"]
    assert len(runs["sigma=0.2 / none / reinforce_raw"]["curves"]["drift/delta_cosine"]) == 2
    assert {a["arm"] for a in study["arms"]} == set(runs)
    assert "| sigma=0.2 / none / reinforce_raw | 1 | 2 |" in (out / "study.md").read_text()
    for name in ("reward_curves.png", "drift_curves.png", "final_accuracy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second call reads the finished runs back instead of training them again
    again = main(["--preset", "laptop-reinforce", "--quick", "--arms", "bf16 / none", "--extra", PIN, "--outputs-dir",
                  str(tmp_path / "outputs"), "--out", str(tmp_path / "again")])
    assert again["failed"] == 0


def test_cluster_preset_resolves_every_arm_and_its_quick_variant_runs(tmp_path) -> None:
    """The cluster study (a real checkpoint with vLLM) is not run here: each arm's config must compose and
    validate, and its quick variant (the seed's quick preset, tiny model substituted) must run."""
    from parity.commands.study import main
    from parity.config import load_config
    from parity.study.presets import PRESETS

    p = PRESETS["cluster"]
    for a in (*p.search, *p.arms):
        cfg = load_config([f"experiment={p.experiment}", *p.base, *a.overrides(p.topk), "trainer.seed=0"])
        assert cfg.rollout.name == "vllm" and cfg.model.source == "hf"
    res = main(["--preset", "cluster", "--quick", "--arms", "int8+int4kv / score_centering+tis", "--outputs-dir",
                str(tmp_path / "outputs"), "--out", str(tmp_path / "study")])
    assert res["failed"] == 0 and res["runs"] == 1


def test_a_finished_run_of_other_steps_is_refused_not_read_back(tmp_path) -> None:
    """Another stage (or --steps) writes the same run names: a finished run is read back only if it ran the
    steps asked for; otherwise the error names the run and --tag, and the run is left as it is."""
    from parity.errors import ParityError
    from parity.study.runs import RunSpec, check_finished_matches

    run = tmp_path / "runs" / "study-laptop-bf16-none-grpo-s0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"steps": 40}))
    spec = RunSpec(run.name, "bf16 / none / grpo", 0, ("trainer.total_steps=20", "trainer.seed=0"))
    with pytest.raises(ParityError, match=r"finished with 40 steps, this study asks for 20 .*--tag"):
        check_finished_matches(spec, run)
    assert json.loads((run / "summary.json").read_text()) == {"steps": 40}
    check_finished_matches(RunSpec(run.name, spec.arm, 0, ("trainer.total_steps=40",)), run)  # the same: read back
    check_finished_matches(spec, tmp_path / "runs" / "not-run-yet")


def test_objective_swaps_every_arm_and_keeps_the_selection() -> None:
    from parity.commands.study import _parser, select_arms
    from parity.study.presets import LAPTOP_REINFORCE as LAPTOP

    assert all(x.objective == "reinforce_raw" for x in LAPTOP.arms)
    a = _parser().parse_args(["--preset", "laptop-reinforce", "--objective", "grpo"])
    arms = select_arms(a, LAPTOP)
    assert [x.name for x in arms] == [x.name.replace("/ reinforce_raw", "/ grpo") for x in LAPTOP.arms]
    assert all("algorithm.adv_estimator=grpo" in x.overrides() for x in arms)
    assert select_arms(_parser().parse_args(["--preset", "laptop-reinforce"]), LAPTOP) == list(LAPTOP.arms)
    # search: the grpo and reinforce_raw forms of one source become one arm
    a = _parser().parse_args(["--preset", "laptop-reinforce", "--stage", "search", "--objective", "reinforce_raw",
                              "--arms", "bf16 /"])
    assert [x.name for x in select_arms(a, LAPTOP)] == ["bf16 / none / reinforce_raw"]


def test_members_every_arm_once_per_seed_by_hand() -> None:
    """The one expansion of a sweep's members (the study's and the Prefect sweep's): common overrides, the arm's,
    then the seed; the run name the caller's; no seed override when no seeds are given."""
    from flows.sweep import member_overrides
    from parity.study.members import correction_arm, expand

    def name(arm: str, seed: int | None) -> str:
        return f"x-{arm}" + ("" if seed is None else f"-s{seed}")

    specs = expand([("a", ["k=1"]), ("b", ["k=2", "j=3"])], [0, 7], ["c=0"], name, {"a": {"correction": "tis"}})
    assert [(s.name, s.arm, s.seed, s.overrides, s.labels) for s in specs] == [
        ("x-a-s0", "a", 0, ("c=0", "k=1", "trainer.seed=0"), {"correction": "tis"}),
        ("x-a-s7", "a", 7, ("c=0", "k=1", "trainer.seed=7"), {"correction": "tis"}),
        ("x-b-s0", "b", 0, ("c=0", "k=2", "j=3", "trainer.seed=0"), {}),
        ("x-b-s7", "b", 7, ("c=0", "k=2", "j=3", "trainer.seed=7"), {})]
    assert specs[1].override_list() == ["c=0", "k=1", "trainer.seed=7", "trainer.run_name=x-a-s7"]
    (one,) = expand([correction_arm("score_centering+tis")], None, [], name)
    assert one.override_list() == ["algorithm.correction.name=score_centering+tis",
                                   "trainer.run_name=x-score_centering+tis"]
    # the Prefect sweep's members are this expansion over one arm per correction
    assert member_overrides(["none", "tis"], ["trainer.total_steps=3"], "S", seeds=[1]) == [
        ["trainer.total_steps=3", "algorithm.correction.name=none", "trainer.seed=1", "trainer.run_name=sweep-S-none-s1"],
        ["trainer.total_steps=3", "algorithm.correction.name=tis", "trainer.seed=1", "trainer.run_name=sweep-S-tis-s1"]]


def test_study_runs_are_the_member_expansion_of_its_arms(monkeypatch, tmp_path) -> None:
    """`parity study` turns its preset's arms and seeds into runs through parity.study.members.expand."""
    import parity.commands.study as cmd
    from parity.study import members

    seen = []

    def spy(arms, seeds, common, run_name, labels=None, **kw):
        specs = members.expand(arms, seeds, common, run_name, labels, **kw)
        seen.extend(specs)
        raise SystemExit(0)  # stop before anything trains

    monkeypatch.setattr(cmd, "expand", spy)
    with pytest.raises(SystemExit):
        cmd.main(["--preset", "laptop", "--seeds", "0,1", "--arms", "bf16 /", "--outputs-dir", str(tmp_path)])
    assert [(s.name, s.seed) for s in seen] == [("study-laptop-bf16-none-grpo-s0", 0),
                                                ("study-laptop-bf16-none-grpo-s1", 1)]
    assert seen[0].overrides[0] == "experiment=countdown_tiny" and seen[0].overrides[-1] == "trainer.seed=0"
    assert seen[0].labels == {"source": "bf16", "correction": "none", "objective": "grpo", "extra": ""}


def test_gpu_preset_core_arms_run_five_seeds_each_seed_from_its_own_warm_start(monkeypatch, tmp_path) -> None:
    """The long-horizon preset: the three core arms on seeds 0-4, the other 13 on 0-2, and every run's warm start
    follows its seed (model.warm_start.seed), so seeds share nothing."""
    import parity.commands.study as cmd
    from parity.study import members

    seen = []

    def spy(*a, **kw):
        seen.extend(members.expand(*a, **kw))
        raise SystemExit(0)

    monkeypatch.setattr(cmd, "expand", spy)
    with pytest.raises(SystemExit):
        cmd.main(["--preset", "gpu", "--outputs-dir", str(tmp_path)])
    by_arm: dict = {}
    for s in seen:
        by_arm.setdefault(s.arm, []).append(s.seed)
        assert f"trainer.seed={s.seed}" in s.overrides and f"model.warm_start.seed={s.seed}" in s.overrides
        assert "trainer.total_steps=150" in s.overrides and "trainer.micro_batch_size=32" in s.overrides
    core = ["bf16 / none / grpo", "w4a4+int4kv / none / grpo", "w4a4+int4kv / score_centering / grpo"]
    assert len(by_arm) == 16 and all(by_arm[a] == [0, 1, 2, 3, 4] for a in core)
    assert all(v == [0, 1, 2] for a, v in by_arm.items() if a not in core) and len(seen) == 3 * 5 + 13 * 3
    seen.clear()
    with pytest.raises(SystemExit):  # one part: one seed's arms
        cmd.main(["--preset", "gpu", "--seeds", "3", "--outputs-dir", str(tmp_path)])
    assert sorted(s.arm for s in seen) == sorted(core)


def test_gains_at_the_common_step_by_hand() -> None:
    """Arms cut at different steps are compared at the last evaluation every run has; gains are per seed (a
    run's step-k accuracy minus its own start) and against the reference arm seed by seed."""
    from parity.study.report import common_eval_step, gains_at, gains_table

    def run(arm, seed, evals, source="w4a4", correction="none"):
        return {"arm": arm, "seed": seed, "labels": {"source": source, "correction": correction, "extra": ""},
                "evals": {"heldout_unquantized": evals}, "collapse_step": None}

    runs = [run("ref", 0, [[0, 0.30], [10, 0.40], [20, 0.45]], "bf16"), run("ref", 1, [[0, 0.20], [10, 0.26], [20, 0.36]], "bf16"),
            run("a", 0, [[0, 0.30], [10, 0.35]], correction="tis"), run("a", 1, [[0, 0.20], [10, 0.30]], correction="tis")]
    assert common_eval_step(runs) == 10
    rows = {r["arm"]: r for r in gains_at(runs, 10)}
    assert rows["ref"]["gain"]["mean"] == pytest.approx((0.10 + 0.06) / 2)
    assert rows["ref"]["gain"]["se"] == pytest.approx(abs(0.10 - 0.06) / 2)  # stdev of 2 values / sqrt(2)
    assert rows["a"]["vs_reference"]["mean"] == pytest.approx(((0.35 - 0.40) + (0.30 - 0.26)) / 2)
    assert rows["ref"]["vs_reference"] is None
    assert rows["a"]["gain_per_seed"] == {0: pytest.approx(0.05), 1: pytest.approx(0.10)}
    md = gains_table(runs)
    assert "at step 10" in md and "| a | 32.5 ± 2.5 | +7.5 ± 2.5 | +5.0, +10.0 | -0.5 ± 4.5 |" in md


def test_grpo_laptop_quick_study_with_the_duals(tmp_path) -> None:
    """The headline's quick form: GRPO, W4A4 + INT4 KV under the published dual and the centred one; held-out evaluated at every step, the duals' diagnosis logged and drawn; the runs read back by
    --merge into one study."""
    from parity.commands.study import main

    out = tmp_path / "study"
    res = main(["--preset", "laptop", "--quick", "--arms", "w4a4+int4kv / dual", "--outputs-dir",
                str(tmp_path / "outputs"), "--out", str(out)])
    assert res["failed"] == 0 and res["runs"] == 2
    study = json.loads((out / "study.json").read_text())
    runs = {r["arm"]: r for r in study["runs"]}
    assert set(runs) == {"w4a4+int4kv / dual / grpo", "w4a4+int4kv / dual_centered / grpo"}
    for r in runs.values():
        assert [s for s, _ in r["evals"]["heldout_unquantized"]] == [0, 1, 2]
        assert "algorithm.adv_estimator=grpo" in r["overrides"] and "data.countdown.min_attempts=1" in r["overrides"]
    dual, centred = runs["w4a4+int4kv / dual / grpo"], runs["w4a4+int4kv / dual_centered / grpo"]
    assert "eval/accuracy" not in dual["evals"]  # trainer.eval_through_rollout=false: the plain engine only
    assert dual["curves"]["correction/dual_c"][0][1] == pytest.approx(0.0037)
    # the shift is logged at every step; its ratio to |A| only where some advantage is non-zero (a 0-reward
    # quick run has none, and the published dual starts at lambda = 0)
    assert [s for s, _ in dual["curves"]["correction/adv_shift_mean"]] == [1, 2]
    assert all(v >= 0 for _, v in dual["curves"]["correction/adv_shift_mean"])
    c = centred["curves"]["correction/dual_c"][0][1]  # a quantile of the first step's gaps
    assert 0 < c < 1 and c != pytest.approx(0.0037)
    assert {g["arm"] for g in study["gains"]} == set(runs) and study["gains"][0]["step"] == 2
    assert (out / "dual_diagnosis.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    merged = main(["--preset", "laptop", "--merge", str(out / "study.json"), "--arms", "dual_centered", "--out",
                   str(tmp_path / "merged")])
    assert merged["runs"] == 1
    merged_study = json.loads((tmp_path / "merged" / "study.json").read_text())
    assert [r["arm"] for r in merged_study["runs"]] == ["w4a4+int4kv / dual_centered / grpo"]
    assert merged_study["date"] == study["date"] and merged_study["wall_s"] == round(study["wall_s"], 1)


def test_deployed_model_evaluated_at_its_steps_and_the_larger_final_evaluation(tmp_path) -> None:
    """With eval_through_rollout=false the rollout's own format (the deployed model) is still measured at the steps
    trainer.eval_deployed_every names and at the last, the exact engine at every evaluation; the last step adds the
    larger evaluation through both; every run records its rollout path, code version and warm-start digest."""
    from parity.commands.study import main

    out = tmp_path / "study"
    res = main(["--preset", "laptop", "--quick", "--arms", "w4a4+int4kv / none", "--steps", "3", "--extra",
                "trainer.eval_deployed_every=2 trainer.final_eval_problems=12", "--outputs-dir",
                str(tmp_path / "outputs"), "--out", str(out)])
    assert res["failed"] == 0 and res["runs"] == 1
    (run,) = json.loads((out / "study.json").read_text())["runs"]
    assert [s for s, _ in run["evals"]["eval/accuracy_unquantized"]] == [0, 1, 2, 3]
    assert [s for s, _ in run["evals"]["eval/accuracy"]] == [0, 2, 3]  # step 0, the multiple of 2, the last
    assert [s for s, _ in run["evals"]["eval/final_accuracy"]] == [3]
    assert [s for s, _ in run["evals"]["eval/final_accuracy_unquantized"]] == [3]
    # 12 problems x the quick form's one greedy sample: a multiple of 1/12
    assert run["heldout_large_final"] * 12 == pytest.approx(round(run["heldout_large_final"] * 12))
    assert run["heldout_large_deployed_final"] == run["evals"]["eval/final_accuracy"][0][1]
    path = run["rollout_path"]
    assert path["engine"] == "torch" and path["decode_path"] == "plain_loop" and path["kv_cache"] == "int4_per_token_head"
    assert path["weights"] == "int4" and run["rollout_paths"] is None
    summary = json.loads((tmp_path / "outputs" / "runs" / run["name"] / "summary.json").read_text())
    prep = json.loads((Path(summary["run_dir"]).parents[1] / "models").joinpath(
        next(p.name for p in (tmp_path / "outputs" / "models").iterdir()), "prepare.json").read_text())
    assert run["start_weights_sha256"] == prep["weights_sha256"] and len(prep["weights_sha256"]) == 64
    assert run["code_version"] is None or len(run["code_version"].split("+")[0]) == 40


def test_lost_the_gain_by_hand() -> None:
    """The rule written in docs/study/grpo_study.md before the long-horizon arms ran, on curves worked by hand."""
    from parity.study.report import arm_lost_gain_step, lost_gain_step, lost_gain_tables

    curve = [[0, .30], [10, .34], [20, .38], [30, .40], [40, .36], [50, .30], [60, .28]]
    # three-evaluation means ending at 20..60: .340, .3733, .380, .3533, .3133. At 30 the best earlier mean's gain
    # is .04 (threshold .30 + .02); at 40 .0733 (.3367); at 50 .08 (.34); at 60 .08 (.34) and .3133 <= .34: lost.
    assert lost_gain_step(curve) == 60
    # the same fall with a best gain under 3 points: never had a gain to lose
    assert lost_gain_step([[0, .30], [10, .31], [20, .32], [30, .33], [40, .30], [50, .28], [60, .27]]) is None
    # a fall before step 30 is not read: .30, .40, .40 then .30 at 30 -> means .3667 (20), .3667 (30) > .30 + .0333
    assert lost_gain_step([[0, .30], [10, .40], [20, .40], [30, .30]]) is None
    # no step 0 (a run whose start was not evaluated): no rule
    assert lost_gain_step([[10, .30], [20, .40], [30, .20]]) is None
    # the arm's rule reads the seeds' mean curve at the steps all seeds have
    rs = [{"arm": "w / none", "seed": s, "labels": {"source": "w", "correction": "none"}, "collapse_step": None,
           "evals": {"heldout_unquantized": [[st, v + d] for st, v in curve]}} for s, d in ((0, -.01), (1, .01))]
    assert arm_lost_gain_step(rs) == 60
    assert "at step 60, where the uncorrected arm w / none lost its gain" in lost_gain_tables(rs)
    # a second uncorrected arm that loses its gain at the same step shares the one table of that step
    rs2 = rs + [{**r, "arm": "d / none", "labels": {"source": "d", "correction": "none"}} for r in rs]
    text = lost_gain_tables(rs2)
    assert text.count("| arm | held-out at step 60 |") == 1
    assert "where the uncorrected arms w / none and d / none lost their gain" in text


def test_early_warning_leads_and_false_alarms_by_hand() -> None:
    """A signal's onset: the 3-step mean departs from steps 1-10 by more than 4 of their standard deviations."""
    from parity.study.report import early_warning, early_warning_table, signal_onset

    base = [[s, 0.010 + (0.001 if s % 2 else -0.001)] for s in range(1, 11)]  # mean .010, sd .001054
    rising = base + [[11, .010], [12, .020], [13, .020], [14, .020], [15, .020]]
    # 3-step means: step 11 .0100, 12 (.009 + .010 + .020)/3 = .0130 (2.8 sd), 13 (.010 + .020 + .020)/3 = .0167
    # (6.3 sd): the onset is step 13
    assert signal_onset(rising) == 13
    assert signal_onset(base + [[11, .0105], [12, .0110]]) is None
    # a flat zero baseline (a truncated fraction of 0): any move is an onset (the floor only keeps sd > 0)
    assert signal_onset([[1, 0.0], [2, 0.0], [3, 0.0], [11, 1e-9]]) == 11
    assert signal_onset([[1, 0.0], [2, 0.0], [3, 0.0], [11, 0.3]]) == 11
    assert signal_onset(base[:2]) is None  # a series shorter than its baseline

    def run(name, k3, collapse):
        return {"name": name, "arm": name, "seed": 0, "labels": {}, "collapse_step": collapse,
                "curves": {"mismatch/k3_kl": k3}}

    runs = [run("a", rising, 20), run("b", rising, 12), run("c", base + [[11, .010], [12, .010]], None),
            run("d", rising, None), run("e", base, 30)]
    ew = early_warning(runs)["mismatch/k3_kl"]
    # a: alarm at 20, onset 13 -> lead 7; b: onset 13 after the alarm at 12 -> none; e: no onset -> none
    assert ew["leads"] == {"a": 7, "b": None, "e": None} and ew["lead_mean"] == 7
    assert ew["false_alarms"] == ["d"] and ew["runs_without_alarm"] == 2 and not ew["led_every_collapse"]
    assert "| k3 | 1/3 | 7.0 | 1/2 |" in early_warning_table(runs)
    assert early_warning_table([run("c", base, None)]) == ""


def test_the_deployed_model_gets_its_own_held_out_panel(tmp_path) -> None:
    """A study with a quantized arm (held-out on the exact engine every evaluation and in its own format at some)
    draws a third panel beside reward and exact held-out; a study of exact arms only draws two. The panel's
    curve is the run's `eval/accuracy` points (the exact arm's own engine is the reference)."""
    import struct

    from parity.study.report import _band, figures

    def width(png: Path) -> int:
        return struct.unpack(">I", png.read_bytes()[16:20])[0]  # IHDR width

    exact = _run("bf16 / none", 0, 0.5, 0.4, None)
    exact["curves"] = {"reward/mean": [[s, 0.4] for s in range(1, 31)]}
    exact["evals"] = {"eval/accuracy": [[s, 0.3 + s / 300] for s in range(0, 31, 10)]}
    quant = _run("w4a4 / none", 0, 0.2, 0.1, 25)
    quant["curves"] = {"reward/mean": [[s, 0.3] for s in range(1, 31)]}
    quant["evals"] = {"eval/accuracy_unquantized": [[s, 0.3] for s in range(0, 31, 10)],
                      "eval/accuracy": [[0, 0.31], [30, 0.05]]}
    (tmp_path / "q").mkdir()
    (tmp_path / "e").mkdir()
    figures([exact, quant], tmp_path / "q", "t")
    figures([exact], tmp_path / "e", "t")
    assert width(tmp_path / "q" / "reward_curves.png") == 18 * 110
    assert width(tmp_path / "e" / "reward_curves.png") == 12 * 110
    assert _band([quant], "eval/accuracy", "evals") == ([0, 30], [0.31, 0.05], [0.31, 0.05], [0.31, 0.05])


def test_final_evaluation_and_the_harmless_rule_by_hand() -> None:
    """The larger final evaluation per arm, paired with the reference seed by seed, and the harmless rule of
    docs/study/grpo_study.md on constructed runs."""
    from parity.study.report import final_rows, final_table

    def run(arm, seed, large, deployed=None, collapse=None, lost=None, source="w", correction="none"):
        return {"arm": arm, "seed": seed, "labels": {"source": source, "correction": correction, "extra": ""},
                "heldout_large_final": large, "heldout_large_deployed_final": deployed, "collapse_step": collapse,
                "lost_gain_step": lost, "evals": {}}

    ref = [run("ref", s, v, v, source="bf16") for s, v in ((0, .30), (1, .20), (2, .25))]
    runs = [*ref,
            # differences +.01, -.01, +.00: mean 0, s.e. = stdev(.01, -.01, 0) / sqrt 3 = .01 / sqrt 3: harmless
            run("same", 0, .31, .30), run("same", 1, .19, .18), run("same", 2, .25, .24),
            # -.05, -.06, -.04: mean -.05, s.e. .01 / sqrt 3 = .0058: below -2 s.e.
            run("worse", 0, .25), run("worse", 1, .14), run("worse", 2, .21),
            # one seed lost the gain: not harmless whatever the difference
            run("lost", 0, .30), run("lost", 1, .20, lost=60), run("lost", 2, .25),
            # two seeds with the final evaluation, the third stopped early: undecided
            run("short", 0, .30), run("short", 1, .20), run("short", 2, None),
            # +.05, +.06, +.04: above
            run("better", 0, .35), run("better", 1, .26), run("better", 2, .29)]
    rows = {r["arm"]: r for r in final_rows(runs)}
    s = rows["same"]
    assert s["vs_reference"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert s["vs_reference"]["se"] == pytest.approx(0.01 / math.sqrt(3))
    assert s["per_seed"] == {0: pytest.approx(.01), 1: pytest.approx(-.01), 2: pytest.approx(0.0, abs=1e-12)}
    assert s["deployed"]["mean"] == pytest.approx(.24) and s["verdict"] == "harmless"
    assert rows["worse"]["vs_reference"]["mean"] == pytest.approx(-.05) and rows["worse"]["verdict"] == "not harmless"
    assert rows["lost"]["failed_seeds"] == [1] and rows["lost"]["verdict"] == "not harmless"
    assert rows["short"]["vs_reference"]["n"] == 2 and rows["short"]["verdict"] == "undecided (2 seeds)"
    assert rows["better"]["verdict"] == "above" and rows["ref"]["verdict"] == "reference"
    md = final_table(runs)
    assert "| same | 25.0 ± 3.5 | 24.0 ± 3.5 | +0.0 ± 0.6 | s0 +1.0, s1 -1.0, s2 +0.0 | — | harmless |" in md
    assert "| lost | 25.0 ± 2.9 | — | +0.0 ± 0.0 | s0 +0.0, s1 +0.0, s2 +0.0 | 1 | not harmless |" in md
    assert final_table([run("ref", 0, None, source="bf16")]) == ""
