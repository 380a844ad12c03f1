"""The side-by-side bench's trainer-side fixed-input check (tests/bench/fixed_trainer_step.py): its comparison by
hand, and one trainer step on a fixed batch sampled by a small model on CPU, the same step computed another way
(the batch padded to a multiple of tokens) within the bound and a changed step (twice the learning rate) outside it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from fixed_trainer_step import (  # noqa: E402
    F32_REL,
    REL,
    TAIL_CONDITIONED,
    compare,
    float32_check,
    main,
    make_batch,
    run_step,
)
from gpu_study_throughput import run_list  # noqa: E402
from kv_packed_checks import write_small_qwen3  # noqa: E402


def test_compare_by_hand() -> None:
    a = {"metrics": {"train/loss": 1.0, "train/grad_norm": 4.0, "adv/mean": 1e-9, "mismatch/k3_kl": float("nan")},
         "update": {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0])}}
    # loss off by half the bound, grad norm by twice it, a near-zero mean by 5e-7 (absolute bound 1e-6)
    b = {"metrics": {"train/loss": 1.0 + REL / 2, "train/grad_norm": 4.0 * (1 + 2 * REL), "adv/mean": -4e-7,
                     "mismatch/k3_kl": float("nan")},
         "update": {"w": torch.tensor([3.0, 4.0 + 5 * REL / 2]), "b": torch.tensor([0.0])}}
    r = compare(a, b)
    rows = {x["key"]: x for x in r["metrics"]}
    assert rows["train/loss"]["within"] and rows["adv/mean"]["within"] and rows["mismatch/k3_kl"]["within"]
    assert not rows["train/grad_norm"]["within"] and r["differ"] == ["train/grad_norm"]
    # ||a - b|| / ||a|| = (5 REL / 2) / 5 = REL / 2
    assert r["update_norm"] == pytest.approx(5.0) and r["update_rel_l2"] == pytest.approx(REL / 2)
    assert r["update_within"] and not r["metrics_within"] and r["within"] is False
    # an update twice the size: relative difference 1; a parameter one side lacks: not within
    assert compare(a, {**a, "update": {"w": 2 * a["update"]["w"], "b": a["update"]["b"]}})["update_rel_l2"] == 1.0
    lacking = compare(a, {**a, "update": {"w": a["update"]["w"]}})
    assert lacking["missing_parameters"] == ["b"] and lacking["within"] is False


def test_compare_gradient_log_probs_and_sign_changes_by_hand() -> None:
    g = {"w": torch.tensor([1.0, -2.0, 1e-6]), "b": torch.tensor([0.5])}
    lp = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64)
    roll = torch.tensor([-1.1, -0.4, -2.0], dtype=torch.float64)
    a = {"metrics": {"mismatch/k1_kl": 0.0}, "grad": g, "token_logprobs": lp, "rollout_logprobs": roll,
         "update": {"w": torch.tensor([-1e-3, 1e-3, -1e-3]), "b": torch.tensor([-1e-3])}}
    # the third element's gradient (1e-6) changed sign: its update flips, the rest agree; the gradient moved by
    # REL / 4 of its norm; each log-prob by 1e-3, k1 by 1e-3 (bound 2 x 1 x 1e-3)
    gb = {"w": g["w"] + torch.tensor([0.0, 0.0, -2e-6]) + REL / 4 * torch.tensor([0.6, 0.0, 0.0]) * 2.5,
          "b": g["b"]}
    b = {"metrics": {"mismatch/k1_kl": 1e-3}, "grad": gb, "token_logprobs": lp + 1e-3, "rollout_logprobs": roll,
         "update": {"w": torch.tensor([-1e-3, 1e-3, 1e-3]), "b": torch.tensor([-1e-3])}}
    r = compare(a, b)
    assert r["update_sign_changes"] == 1 and r["update_same_sign_rel_l2"] == 0.0
    assert r["update_sign_change_grad_mass"] == pytest.approx(1e-6 / 3.500001)
    # the whole update differs by 2e-3 of its norm 2e-3: relative L2 1, shown but not the check
    assert r["update_rel_l2"] == pytest.approx(1.0) and r["update_within"]
    assert r["grad_within"] and r["grad_rel_l2"] < REL and r["logprob_within"]
    assert r["logprob_mean_abs_diff"] == pytest.approx(1e-3) and r["within"], r
    k1 = {x["key"]: x for x in r["metrics"]}["mismatch/k1_kl"]
    assert k1["bound"] == pytest.approx(2e-3) and k1["within"]
    # k1 moved by three times the log-probs' change: outside; the gradient by 4 REL: outside
    assert not compare(a, {**b, "metrics": {"mismatch/k1_kl": 3e-3}})["within"]
    far = compare(a, {**b, "grad": {"w": g["w"] * (1 + 4 * REL), "b": g["b"] * (1 + 4 * REL)}})
    assert not far["grad_within"] and not far["within"]
    # with the float32 reference: b as far from it as a is, within; three and 21 times as far (beyond REL x the
    # mean |log-prob| too), not
    ref = {**a, "grad": {"w": g["w"] * (1 + REL), "b": g["b"] * (1 + REL)}, "token_logprobs": lp - 1e-3}
    assert compare(a, b, ref=ref)["grad_within"]
    r3 = compare(a, {**b, "grad": {"w": g["w"] * (1 + 4 * REL), "b": g["b"] * (1 + 4 * REL)},
                     "token_logprobs": lp + 2e-2}, ref=ref)
    assert not r3["grad_within"] and not r3["logprob_within"]
    assert r3["logprob_mean_abs_to_ref"] == {"a": pytest.approx(1e-3), "b": pytest.approx(2.1e-2)}
    # with the reference, a logged number that moved is reported, not judged; the whole update is held to the
    # reference's: b's update three times as far from it as a's is outside, even where every sign agrees
    moved = compare(a, {**b, "metrics": {"mismatch/k1_kl": 3e-3}}, ref=ref)
    assert moved["differ"] == ["mismatch/k1_kl"] and not moved["metrics_judged"] and moved["within"], moved
    u = a["update"]
    ref_u = {**ref, "update": {n: t * (1 + REL) for n, t in u.items()}}
    assert compare(a, b, ref=ref_u)["update_within"]
    far_u = compare(a, {**b, "update": {n: t * (1 + 4 * REL) for n, t in u.items()}}, ref=ref_u)
    assert far_u["update_rel_l2_to_ref"]["b"] == pytest.approx(3 * REL, rel=1e-5) and not far_u["update_within"]
    assert far_u["update_same_sign_rel_l2"] == pytest.approx(4 * REL, rel=1e-5) and not far_u["within"]


def test_float32_check_by_hand() -> None:
    """float32_check: logged numbers within 2^-10, 1e-6 or 2 / tokens; log-probs, gradient, same-sign update within
    2^-10; b32 in the result of compare when given with the reference."""
    g = {"w": torch.tensor([1.0, -2.0, 3.0, 0.5])}
    ref = {"metrics": {"train/loss": 0.5, "correction/clipped_frac": 1e-3, "tiny": 1e-8},
           "grad": g, "update": {"w": -1e-5 * torch.sign(g["w"])}, "token_logprobs": torch.full((1000,), -2.0,
                                                                                                  dtype=torch.float64)}
    same = {**ref, "metrics": {"train/loss": 0.5 * (1 + F32_REL / 2), "correction/clipped_frac": 1e-3 + 1 / 1000,
                               "tiny": 5e-7}}
    assert float32_check(ref, same)["within"]
    for bad in ({**ref, "metrics": {**ref["metrics"], "train/loss": 0.5 * (1 + 2 * F32_REL)}},
                {**ref, "metrics": {**ref["metrics"], "correction/clipped_frac": 1e-3 + 3 / 1000}},
                {**ref, "grad": {"w": g["w"] * (1 + 2 * F32_REL)}},
                {**ref, "update": {"w": ref["update"]["w"] * 2}},
                {**ref, "token_logprobs": ref["token_logprobs"] - 2 * 2 * F32_REL}):
        assert not float32_check(ref, bad)["within"], bad
    r = float32_check(ref, {**ref, "metrics": {**ref["metrics"], "train/loss": 0.6}})
    assert r["differ"] == [{"key": "train/loss", "ref": 0.5, "b32": 0.6}]


def test_centering_diagnostics_are_conditioned_by_the_tail_mass() -> None:
    """Why TAIL_CONDITIONED numbers are reported, not judged, in float32: in float64, log-probs moved by float32's
    rounding (2^-23 relative, a fixed pattern) move score centering's coefficient L1 by far more than 2^-10 where the
    head holds all but 3e-6 of the mass (floor 1e-6), while the centring term's gradient with respect to the logits
    (sum_H c_v (e_v - p)) moves by less than 2^-14; with 1% in the tail both stay within 2^-10."""
    from parity.algorithms.corrections.score_centering import centering_coefficients

    g = torch.Generator().manual_seed(0)
    n, V, K = 64, 64, 8

    def batch(tail: float) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.randn(n, V, generator=g, dtype=torch.float64)
        z[:, K:] -= 12
        t = z.softmax(-1)[:, K:].sum(-1, keepdim=True)
        z[:, K:] += (tail / t).log()
        lq = (z + 0.05 * torch.randn(n, V, generator=g, dtype=torch.float64)).log_softmax(-1)
        return z.log_softmax(-1), lq

    def l1_and_grad(lp: torch.Tensor, lq: torch.Tensor) -> tuple[float, torch.Tensor]:
        c = centering_coefficients(lp[:, :K], lq[:, :K], torch.ones(n, K, dtype=torch.bool))["coef"]
        grad = -c.sum(-1, keepdim=True) * lp.exp()
        grad[:, :K] += c
        return float(c.abs().sum()), grad

    sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(V // 2)
    for tail, ill in ((3e-6, True), (1e-2, False)):
        lp, lq = batch(tail)
        l1a, ga = l1_and_grad(lp, lq)
        l1b, gb = l1_and_grad(lp * (1 + 2.0 ** -23 * sign), lq)
        coef_rel, grad_rel = abs(l1b - l1a) / l1a, float((gb - ga).norm() / ga.norm())
        assert grad_rel < 2.0 ** -14, (tail, grad_rel)
        assert (coef_rel > F32_REL) == ill, (tail, coef_rel)
    # float32_check reports those keys and judges the rest: a 2% move in them alone is within, in rho it is not
    ref = {"metrics": {"correction/sc_coef_l1": 0.0125, "correction/sc_term_abs": 9.0e-4, "correction/sc_rho_mean": 1.0},
           "grad": {"w": torch.ones(4)}, "update": {"w": -1e-5 * torch.ones(4)}}
    moved = {**ref, "metrics": {**ref["metrics"], **{k: ref["metrics"][k] * 1.02 for k in TAIL_CONDITIONED}}}
    r = float32_check(ref, moved)
    assert r["within"] and r["differ"] == [] and [x["key"] for x in r["reported"]] == list(TAIL_CONDITIONED)
    assert r["reported"][0]["rel"] == pytest.approx(0.02 / 1.02)
    assert not float32_check(ref, {**moved, "metrics": {**moved["metrics"], "correction/sc_rho_mean": 1.02}})["within"]


@pytest.fixture(scope="module")
def fixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    d = tmp_path_factory.mktemp("fixed_step")
    write_small_qwen3(d / "model")
    batch = make_batch(str(d / "model"), rows=16, group=8, prompt_len=16, max_new=24, topk=8, temperature=1.0,
                       seed=0, device="cpu")
    torch.save(batch, d / "batch.pt")
    overrides = [*run_list("gpu", 0, 1, 0, str(d / "model"), "w4a4+int4kv / score_centering / ")[0]["overrides"],
                 "trainer.device=cpu", "model.dtype=float32", "trainer.prompts_per_step=2",
                 "trainer.micro_batch_size=8", "rollout.topk_logprobs=8"]
    return d / "model", d / "batch.pt", overrides


def test_fixed_batch_is_the_models_own(fixed: tuple[Path, Path, list[str]]) -> None:
    _, batch_file, _ = fixed
    b = torch.load(batch_file, weights_only=False)
    assert b["prompts"].shape == (16, 16) and b["responses"].shape[0] == 16 and b["responses"].shape[1] <= 24
    # the groups share their prompt; left padding; rewards 0/1; the rollout's log-probs within 6 sd of the
    # model's own (their noise is N(0, 0.02): beyond 6 sd about 2e-9 a token, whatever tokens a CPU samples), and
    # the top-K's first column at least the sampled token's
    assert torch.equal(b["prompts"][:8], b["prompts"][:1].expand(8, -1))
    assert b["prompt_mask"][:, -1].all() and set(b["rewards"].tolist()) <= {0.0, 1.0}
    m = b["response_mask"]
    assert (b["rollout_logprobs"][m] <= 0).all() and (b["rollout_logprobs"][~m] == 0).all()
    assert (b["topk_logprobs"][..., 0][m] + 6 * 0.02 >= b["rollout_logprobs"][m]).all()
    assert b["topk_ids"].dtype == torch.int32 and (b["topk_ids"][~m] == -1).all()


def test_same_step_another_way_within_and_a_changed_step_outside(fixed: tuple[Path, Path, list[str]]) -> None:
    model, batch_file, overrides = fixed
    base = run_step(str(model), str(batch_file), overrides, seed=0)
    assert base["tree"] == str(ROOT / "platform") and "train/loss" in base["metrics"]
    assert "correction/sc_term_abs" in base["metrics"]  # the score-centering arm saw the top-K
    padded = run_step(str(model), str(batch_file), [*overrides, "trainer.pad_to_multiple=16"], seed=0)
    r = compare(base, padded)
    assert r["within"] is True and r["update_same_sign_rel_l2"] <= REL and r["grad_within"], r["differ"]
    assert r["logprob_within"] and r["logprob_mean_abs_diff"] <= REL
    # Adam's first update is lr x g / (|g| + eps) elementwise: twice the lr, twice the update (relative L2 1)
    doubled = run_step(str(model), str(batch_file), [*overrides, "trainer.lr=1e-4"], seed=0)
    r2 = compare(base, doubled)
    assert r2["within"] is False and math.isclose(r2["update_rel_l2"], 1.0, rel_tol=1e-3)
    assert r2["metrics_within"]  # the logged numbers are of the step's start, which the lr does not move


def test_compare_command_exit_status(tmp_path: Path) -> None:
    a = {"metrics": {"train/loss": 1.0}, "update": {"w": torch.ones(3)}}
    torch.save(a, tmp_path / "a.pt")
    torch.save({**a, "update": {"w": 2 * torch.ones(3)}}, tmp_path / "b.pt")
    with pytest.raises(SystemExit) as same:
        main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "a.pt"), "--json", str(tmp_path / "same.json")])
    assert same.value.code == 0
    assert json.loads((tmp_path / "same.json").read_text())["within"] is True
    with pytest.raises(SystemExit) as e:
        main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])
    assert e.value.code == 1


def test_float32_settings_are_the_reference_function(fixed: tuple[Path, Path, list[str]]) -> None:
    """The float32 side of the check on real steps: padding to 16 tokens and the shared-prefix forward compute the
    reference's function (within float32's bounds); a doubled lr does not."""
    model, batch_file, overrides = fixed
    ref = run_step(str(model), str(batch_file), overrides, seed=0)
    for extra in (["trainer.pad_to_multiple=16"], ["trainer.shared_prefix=on"]):
        b32 = run_step(str(model), str(batch_file), [*overrides, *extra], seed=0)
        r = float32_check(ref, b32)
        assert r["within"] and r["grad_rel_l2"] < 1e-5, (extra, r)
        assert compare(ref, b32, ref=ref, b32=b32)["within"]
    doubled = run_step(str(model), str(batch_file), [*overrides, "trainer.lr=1e-4"], seed=0)
    r = float32_check(ref, doubled)
    assert not r["within"] and r["update_same_sign_rel_l2"] == pytest.approx(1.0, rel=1e-3)
