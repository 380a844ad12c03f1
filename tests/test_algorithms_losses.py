"""The GRPO objective (rl_objective with ppo_clip / reinforce) against a float64 reference, loss and gradient,
and its invariance to the micro-batch split."""

from __future__ import annotations

import pytest
import torch

from parity.algorithms import (
    AGG_MODES,
    StepMetrics,
    build_corrections,
    compute_advantages,
    get_policy_loss,
    loss_denominators,
)
from parity.config.schema import AlgorithmConfig
from parity.types import RolloutBatch
from tests.helpers import rl_objective
from tests.tolerances import U32, logprob_bound, logprob_grad_scales, token_coefficients

B, R, H, V, T = 8, 6, 5, 19, 0.9


def make_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 3, 1, 5, 6, 2, 4, 6])
    mask = torch.arange(R)[None] < lengths[:, None]
    hidden = torch.randn(B, R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    responses = torch.randint(0, V, (B, R), generator=g)
    rollout_lp = torch.log_softmax(hidden @ weight.T / T + 0.2 * torch.randn(B, R, V, generator=g, dtype=torch.float64),
                                   -1).gather(-1, responses[..., None])[..., 0]
    rollout_lp = torch.where(mask, rollout_lp, torch.nan).float()  # padding garbage must never leak
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    batch = RolloutBatch(prompts=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.bool),
                         responses=responses, response_mask=mask, rollout_logprobs=rollout_lp, rewards=rewards,
                         truncated=torch.zeros(B, dtype=torch.bool), group_ids=groups, prompt_ids=groups)
    # old log-probs 0.3 nats off either way, so some ratios leave [0.8, 1.2] on both sides
    cur = torch.log_softmax(hidden @ weight.T / T, -1).gather(-1, responses[..., None])[..., 0]
    old = (cur + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)).float()
    return batch, hidden, weight, torch.where(mask, old, torch.nan)  # NaN padding: must not reach any gradient


def reference_loss(hidden, weight, batch, adv, old, policy, mode, clip=(0.2, 0.2)):
    lp = torch.log_softmax(hidden @ weight.T / T, -1).gather(-1, batch.responses[..., None])[..., 0]
    a = adv.double()[:, None]
    if policy == "ppo_clip":
        ratio = torch.exp(lp - old.double().nan_to_num(0.0))
        per = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip[0], 1 + clip[1]))
    else:
        per = -a * lp
    mask = batch.response_mask
    per = torch.where(mask, per, 0.0)
    n = mask.sum(-1)
    if mode == "token-mean":
        return per.sum() / n.sum()
    if mode == "seq-mean-token-mean":
        return (per.sum(-1)[n > 0] / n[n > 0]).mean()
    return per.sum() / ((n > 0).sum() * R)


def error_scales(batch, hidden, weight, adv, old, policy, mode, weight_max=None, adv_shift=0.0):
    """float64 magnitudes the float32 objective's rounding errors scale with (first order, any summation order):
    per token a = c |A| w max(r, 1 + eps) (ppo_clip) or c |A| |lp| (reinforce) bounds the token's share of the loss,
    and g = c |A| w max(r, 1 + eps) (ppo_clip) or c |A| (reinforce) its share's derivative in lp. Returns
    (sum a, sum g, G_W [V, H], G_h [B, R, H]) (tolerances.logprob_grad_scales). weight_max(ratio p_train / p_inf)
    bounds a correction's IS weight, adv_shift a correction's |shift|."""
    mask = batch.response_mask
    lp = torch.log_softmax(hidden.double() @ weight.double().T / T, -1).gather(-1, batch.responses[..., None])[..., 0]
    a_abs = adv.double().abs()[:, None] + adv_shift
    c = token_coefficients(mask, mode)
    if old is None or policy == "reinforce":
        r = torch.ones_like(lp)
    else:
        r = torch.exp(lp - old.double().nan_to_num(0.0)).clamp_min(1 + 0.2)
    w = torch.ones_like(lp)
    if weight_max is not None:
        w = weight_max(torch.exp(old.double().nan_to_num(0.0) - batch.rollout_logprobs.double().nan_to_num(0.0)))
    g = torch.where(mask, c * a_abs * w * r, 0.0)
    a = torch.where(mask, c * a_abs * (lp.abs() if policy == "reinforce" else w * r), 0.0)
    g_h, g_w = logprob_grad_scales(hidden, weight, batch.responses, g, T)
    return float(a.sum()), float(g.sum()), g_w, g_h.reshape(hidden.shape)


def run(batch, hidden, weight, adv, old, cfg, rows=None, denom=None, metrics=None):
    rows = list(range(B)) if rows is None else rows
    denom = denom or loss_denominators(batch.response_mask)
    mb = batch.select(rows)
    return rl_objective(hidden[rows], weight, mb, adv[rows], None if old is None else old[rows], T,
                        build_corrections(cfg.correction), cfg, denom, metrics or StepMetrics())


@pytest.mark.parametrize("policy", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_loss_and_gradient_match_float64_reference(policy: str, mode: str) -> None:
    batch, hidden, weight, old = make_problem()
    cfg = AlgorithmConfig(policy_loss=policy, loss_agg_mode=mode)
    adv = compute_advantages("grpo", batch.rewards, batch.group_ids)
    h32, w32 = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    loss = run(batch, h32, w32, adv, old, cfg)
    loss.backward()
    h64, w64 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = reference_loss(h64, w64, batch, adv, old, policy, mode)
    ref.backward()
    # One float32 evaluation against float64 (whose own error is ~1e9 times smaller). Each token's lp is within
    # dlp (tolerances.logprob_bound: a 5-term dot product, a 19-term log-sum-exp); its loss share moves by g dlp
    # plus ~8 roundings of a, and no sum here has more than B R terms: (B R + 8) u sum a (error_scales).
    dlp = logprob_bound(hidden, weight, T)
    a, g, g_w, g_h = error_scales(batch, hidden, weight, adv, old, policy, mode)
    assert abs(loss.item() - ref.item()) <= dlp * g + (B * R + 8) * U32 * a
    # A gradient term is g_i (onehot - p) times h (or W): g_i and p each within dlp relative, a few roundings, and
    # the product's sum over the 33 tokens (W) or the V = 19 logits (h) in any order: (2 dlp + (n + 12) u) G.
    assert ((w32.grad.double() - w64.grad).abs() <= (2 * dlp + (B * R + 12) * U32) * g_w).all()
    assert ((h32.grad.double() - h64.grad).abs() <= (2 * dlp + (V + 12) * U32) * g_h).all()


def test_ppo_clip_by_hand() -> None:
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))  # ratios against old = 0
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = get_policy_loss("ppo_clip")(lp, torch.zeros(1, 4), adv, torch.ones(1, 4), AlgorithmConfig())
    # A>0: min(r, 1.2) -> -1.2, -0.5 ; A<0: max(r, 0.8) -> 1.1, 0.8
    # float32 log, subtraction, exp and a product: ~5 roundings (1 ulp each for log/exp), rel <= 10 u = 6e-7
    assert loss.tolist()[0] == pytest.approx([-1.2, -0.5, 1.1, 0.8], rel=1e-6)
    assert m["actor/pg_clipfrac"].tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_old_logprobs_none_means_ratio_one() -> None:
    batch, hidden, weight, _ = make_problem(1)
    adv = compute_advantages("grpo", batch.rewards, batch.group_ids)
    grads = []
    for policy in ("ppo_clip", "reinforce"):
        w = weight.float().requires_grad_(True)
        run(batch, hidden.float(), w, adv, None, AlgorithmConfig(policy_loss=policy)).backward()
        grads.append(w.grad)
    # at ratio 1 both are the plain PG: r = exp(lp - lp) = 1 exactly, so d loss / d lp is -A c in both (ppo_clip's
    # max of two equal branches passes half the gradient through each, which adds back exactly) and the backward
    # is the same kernels on the same shapes: equal to the last bit on any one machine; 1e-5 is looser than needed.
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["none", "tis", "icepop", "mis", "dual"])
def test_objective_is_micro_batch_invariant(name: str) -> None:
    batch, hidden, weight, old = make_problem(2)
    cfg = AlgorithmConfig(loss_agg_mode="seq-mean-token-mean")
    cfg.correction.name = name
    cfg.correction.mis["threshold"] = 0.02
    adv = compute_advantages("grpo", batch.rewards, batch.group_ids)
    denom = loss_denominators(batch.response_mask)
    w_full = weight.float().requires_grad_(True)
    m_full = StepMetrics()
    full = run(batch, hidden.float(), w_full, adv, old, cfg, denom=denom, metrics=m_full)
    full.backward()
    w_micro = weight.float().requires_grad_(True)
    m_micro = StepMetrics()
    total = 0.0
    for rows in ([0, 1, 2], [3], [4, 5, 6, 7]):
        part = run(batch, hidden.float(), w_micro, adv, old, cfg, rows=rows, denom=denom, metrics=m_micro)
        part.backward()
        total += part.item()
    # The two runs evaluate the same float32 formulas on the same inputs, split differently, so a kernel may sum in
    # another order for a token (another matmul blocking for another row count; the vector body or the scalar tail
    # of an element-wise loop, whose exp/log differ by an ulp). Each run's lp is within dlp of the exact one
    # (tolerances.logprob_bound), so the runs' are within 2 dlp; the rest as in the float64 test above, twice.
    dlp = logprob_bound(hidden, weight, T)
    ratio = {"tis": lambda r: r.clamp(max=2.0), "icepop": lambda r: r}.get(name)  # the IS weight's bound (C = 2)
    a, g, g_w, _ = error_scales(batch, hidden, weight, adv, old, "ppo_clip", "seq-mean-token-mean", ratio,
                                adv_shift=0.1 if name == "dual" else 0.0)  # dual: |shift| <= lambda0 |gap| <= 0.1
    assert abs(total - full.item()) <= 2 * (dlp * g + (B * R + 8) * U32 * a)
    assert ((w_micro.grad - w_full.grad).double().abs() <= 2 * (2 * dlp + (B * R + 12) * U32) * g_w).all()
    a, b = m_full.compute(), m_micro.compute()
    assert a.keys() == b.keys() and "mismatch/k3_kl" in a
    # Step metrics, by how they are computed:
    # - actor/ppo_kl = mean(old - lp): each run's -log ratio within dlp + u |log ratio| of exact, twice for two.
    log_ratio = (torch.log_softmax(hidden @ weight.T / T, -1).gather(-1, batch.responses[..., None])[..., 0]
                 - old.double())[batch.response_mask]
    kl_tol = 2 * (dlp + U32 * float(log_ratio.abs().max()))
    # - actor/pg_clipfrac counts ratios beyond the clip edges 0.8 and 1.2: exact while no ratio lies within the runs'
    #   error of an edge (the nearest is much further away: checked here).
    margin = min((log_ratio - torch.log(torch.tensor(e, dtype=torch.float64))).abs().min() for e in (0.8, 1.2))
    assert margin > 2 * (dlp + 4 * U32)
    # - float64 means of float32 element-wise values of the inputs (an IS weight exp(old - rollout), a probability
    #   gap |e^old - e^rollout|, A - shift): at most two exp (1 ulp each from exact: two implementations 4 u apart)
    #   and correctly rounded +-*, on values of size <= X: per token within 8 u X; shift_over_adv divides a mean of
    #   such values by the exact mean |A| (>= 1/2 here): within 16 u X.
    iw = torch.exp(old.double() - batch.rollout_logprobs.double())[batch.response_mask]
    x = max(float(ratio(iw).max()) if ratio else 1.0, float(adv.abs().max()) + 0.1)  # the weights, |A| + |shift|
    f32_elementwise = {"correction/is_weight_mean", "actor/advantage_mean", "correction/adv_shift_mean",
                       "correction/shift_over_adv"}
    assert float(adv.abs()[:, None].expand(B, R)[batch.response_mask].mean()) >= 0.5
    # - the rest (mismatch/*, masked fractions, counts, lambda) are float64 sums of bitwise the same float32 inputs
    #   in another grouping: n 2^-53 of sum |x|, ~1e-15 relative; 1e-9 is far from both that and any real change.
    for k in a:
        if k == "actor/ppo_kl":
            assert abs(b[k] - a[k]) <= kl_tol, k
        elif k in f32_elementwise:
            assert abs(b[k] - a[k]) <= 16 * U32 * x, k
        else:
            assert b[k] == pytest.approx(a[k], rel=1e-9, abs=1e-12), k


def test_micro_batch_without_response_tokens() -> None:
    batch, hidden, weight, old = make_problem(3)
    empty = batch.select([0, 1])
    empty.response_mask[:] = False
    w = weight.float().requires_grad_(True)
    h = hidden[:2].float().requires_grad_(True)
    m = StepMetrics()
    loss = rl_objective(h, w, empty, torch.ones(2), None, T, build_corrections(None), AlgorithmConfig(),
                        loss_denominators(batch.response_mask), m)
    loss.backward()
    assert loss.item() == 0.0 and not w.grad.any() and not h.grad.any()
    assert "mismatch/k3_kl" not in m.compute()
