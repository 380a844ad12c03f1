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
    rl_objective,
)
from parity.config.schema import AlgorithmConfig, parity_schema
from parity.types import RolloutBatch

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
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(h32.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(w32.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


def test_ppo_clip_by_hand() -> None:
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))  # ratios against old = 0
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = get_policy_loss("ppo_clip")(lp, torch.zeros(1, 4), adv, torch.ones(1, 4), AlgorithmConfig())
    # A>0: min(r, 1.2) -> -1.2, -0.5 ; A<0: max(r, 0.8) -> 1.1, 0.8
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
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)  # at ratio 1 both are the plain PG


@pytest.mark.parametrize("name", ["none", "tis", "icepop", "mis", "dual"])
def test_objective_is_micro_batch_invariant(name: str) -> None:
    batch, hidden, weight, old = make_problem(2)
    cfg = type(parity_schema()().algorithm)(loss_agg_mode="seq-mean-token-mean")  # with the corrections' sections
    cfg.correction.name = name
    cfg.correction.mis.threshold = 0.02
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
    assert total == pytest.approx(full.item(), rel=1e-5)
    assert torch.allclose(w_micro.grad, w_full.grad, rtol=1e-5, atol=1e-7)
    a, b = m_full.compute(), m_micro.compute()
    assert a.keys() == b.keys() and "mismatch/k3_kl" in a
    for k in a:
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
