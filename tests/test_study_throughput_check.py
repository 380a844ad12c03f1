"""The side-by-side bench's step-0 check (tests/bench/gpu_study_throughput.py, step0_exact_eval), by hand: the
held-out evaluation of one warm start is one computation repeated in every run of a phase, so the two phases'
means are compared against their own spread, not for exact equality."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bench"))
from gpu_study_throughput import phase_env, preflight, run_list, start_account, step0_exact_eval  # noqa: E402


def _phase(values: list[float], key: str = "eval/accuracy_unquantized") -> dict:
    return {"runs": [{"rows": {"0": {key: v}}} for v in values]}


def test_step0_check_by_hand() -> None:
    u = 1 / 512  # one sample of 128 problems x 4
    old = _phase([160 * u, 160 * u, 159 * u, 161 * u])
    new = _phase([160 * u, 158 * u, 160 * u, 160 * u])
    r = step0_exact_eval(old, new)
    # means 160u and 159.5u; sample variances (0 + 0 + 1 + 1) u^2 / 3 = 2/3 u^2 and (.25 + 2.25 + .25 + .25) u^2 / 3
    # = 1 u^2; se of the difference sqrt(2/3 / 4 + 1 / 4) u = sqrt(5/12) u; the grid's step u; the bound
    # 2 sqrt(5/12) u + u = 2.29u against a difference of 0.5u
    assert r["diff"] == pytest.approx(-0.5 * u) and r["se_diff"] == pytest.approx((5 / 12) ** 0.5 * u)
    assert r["one_sample"] == pytest.approx(u) and r["within_noise"] is True
    # the same spread around a mean five samples lower: a changed computation
    shifted = _phase([155 * u, 153 * u, 155 * u, 155 * u])
    assert step0_exact_eval(old, shifted)["within_noise"] is False
    # the bf16 arm logs its exact-engine evaluation as eval/accuracy: read too
    mixed = {"runs": old["runs"] + _phase([160 * u], "eval/accuracy")["runs"]}
    assert len(step0_exact_eval(mixed, new)["old"]) == 5
    # fewer than two evaluations a phase: no verdict, and a reason
    r = step0_exact_eval(_phase([160 * u]), new)
    assert r["within_noise"] is None and "fewer than two" in r["why"]


def test_step0_check_against_a_seeds_sampling_spread_by_hand() -> None:
    """Where the new code computes otherwise (its repeats all one shared value), the yardstick is the sampler's: two
    evaluations of accuracy p over n draws differ by sqrt(2 p (1 - p) / n) in standard error."""
    u = 1 / 512
    old = _phase([176 * u] * 13 + [174 * u, 175 * u, 175 * u])
    new = _phase([173 * u] * 16)
    r = step0_exact_eval(old, new)
    p = (176 * 13 + 174 + 175 * 2 + 173 * 16) / 32 * u
    assert r["seed_se_diff"] == pytest.approx((2 * p * (1 - p) / 512) ** 0.5)  # 0.0297 at p = 0.34
    assert r["within_noise"] is False and r["within_seed_spread"] is True  # 2.75 samples apart: 0.0054 < 0.059
    far = _phase([143 * u] * 16)  # 32.75 samples (0.064) below: beyond two standard errors (0.059)
    assert step0_exact_eval(old, far)["within_seed_spread"] is False


def test_step0_check_on_a_measured_side_by_side() -> None:
    """The phases of 2026-12-03 on one H200 (old tree 5aee8cb, new 483ca94 under MPS): not one step-0 value equal in
    the exact sense for several runs, yet the means within the phases' own noise."""
    d = json.loads((ROOT / "docs" / "perf_runs" / "2026-12-03_study_throughput_mps.json").read_text())
    r = step0_exact_eval(d["old"], d["new"])
    assert not d["fixed_inputs"]["all_equal"] and len(r["old"]) == len(r["new"]) == 16
    assert r["within_noise"] is True and r["one_sample"] == pytest.approx(1 / 512)


def test_phase_env_takes_the_presets_environment(tmp_path: Path) -> None:
    """The gpu preset sets PYTORCH_CUDA_ALLOC_CONF, which the bench's base environment sets too: the preset's value
    and the --env values win, and the base keys remain."""
    from parity.study.presets import PRESETS
    extra = {**PRESETS["gpu"].env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False", "X_ONLY_HERE": "1"}
    env = phase_env("/p", tmp_path, extra)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False" and env["X_ONLY_HERE"] == "1"
    assert env["PYTHONPATH"] == "/p" and env["OMP_NUM_THREADS"] == "1"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    for k, v in PRESETS["gpu"].env.items():
        assert k == "PYTORCH_CUDA_ALLOC_CONF" or env[k] == v


def test_preflight_names_a_bad_key_of_the_new_phase_before_any_phase(tmp_path: Path) -> None:
    """The bench checks the new phase's configs before the old phase runs: the gpu preset's runs with the compiled
    trainer pass; a misspelt extra key is an error naming it."""
    from parity.errors import ConfigError
    runs = run_list("gpu", 3, 20, 10, str(tmp_path / "model"), "")
    assert len(runs) == 16
    preflight(runs, ["trainer.share_step0_eval=true", "trainer.compile_layers=true",
                     "trainer.compile_mode=reduce-overhead"])
    with pytest.raises(ConfigError, match="trainer.compile_layer"):
        preflight(runs, ["trainer.compile_layer=true"])


def test_the_start_account_of_a_measured_phase() -> None:
    """start_account on the 2026-12-05 side-by-side's new phase (its JSON as committed): a line a run with its
    startup marks and first rollout's set-up, a line a cohort server with its engines' build and first call; a run
    that records its compile seconds shows them."""
    record = json.loads((ROOT / "docs/perf_runs/2026-12-05_study_throughput_compact_tail.json").read_text())
    new = record["new"]
    lines = start_account(new)
    assert len(lines) == len(new["runs"]) + len(new["cohorts"]) == 16 + 4
    bf16 = lines[0]
    assert bf16.startswith("new bf16 / none / grpo") and "first_step 100.2" in bf16 and "'capture': 23.933" in bf16
    w4a4 = lines[16 + 1]
    assert w4a4.startswith("new cohort 1 (4 runs): 4 engines built in 48.1 s")
    assert "call 1: 4 of 4 members, 128 rows each, 284 steps, 46.24 s" in w4a4
    run = dict(new["runs"][0], startup_detail={"compile_s": {"imports": 0.0, "first_step": 41.5}})
    assert "compile by first step 41.5 s" in start_account({"name": "new", "runs": [run]})[0]


def test_the_start_account_shows_warm_ups_and_late_compiles() -> None:
    """On the preloaded side-by-side of 2026-12-05: a run that warmed its evaluation engine while another computed
    the step-0 number shows the seconds; each cohort shows the later call that compiled (its 17th, at a tail of an
    eighth of its rows); a warm-up's turn shows where the run records it."""
    record = json.loads((ROOT / "docs/perf_runs/2026-12-05_study_throughput_preload.json").read_text())
    new = record["new"]
    lines = start_account(new)
    w4a4 = next(ln for ln in lines if ln.startswith("new w4a4+int4kv / none / grpo"))
    assert w4a4.endswith("| warm-up 23.05 s")
    fp8_cohort = next(ln for ln in lines if ln.startswith("new cohort 0 (3 runs)"))
    assert fp8_cohort.endswith("compiled later: call 17 7.24 s"), fp8_cohort
    assert sum("compiled later: call 17" in ln for ln in lines) == 4
    shared = new["runs"][6]["step0_eval_shared"]["eval/accuracy_unquantized"]
    run = dict(new["runs"][6], step0_eval_shared={"eval/accuracy_unquantized": {
        **shared, "warm_turn": {"first": False, "waited_s": 6.5}}})
    assert start_account({"name": "new", "runs": [run]})[0].endswith(
        "| warm-up 23.05 s (after the first, waited 6.5 s)")
