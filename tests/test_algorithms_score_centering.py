"""Score centering against float64 autograd references, through rl_objective.

References are written from the definitions: the centred REINFORCE loss
    -A (w_y log p_y - sum_v sg(qhat_v w_v) log p_v)
over the whole vocabulary, with qhat = q (K = V) or q on the head and rho * p on the tail (K < V)."""

from __future__ import annotations

import pytest
import torch

from parity.algorithms import (
    StepMetrics,
    build_corrections,
    loss_denominators,
    masked_token_logprobs,
    rl_objective,
)
from parity.config.schema import AlgorithmConfig
from parity.types import RolloutBatch

B, R, H, V, T, C = 3, 4, 6, 13, 0.8, 2.0
LENGTHS = [4, 2, 3]


def tis_rule(ratio: torch.Tensor) -> torch.Tensor:
    return ratio.clamp(max=C)


def ones_rule(ratio: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(ratio)


def make(seed: int, k: int, on_policy: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    mask = torch.arange(R)[None] < torch.tensor(LENGTHS)[:, None]
    responses = torch.randint(0, V, (B, R), generator=g)
    z = hidden @ weight.T / T
    lq = torch.log_softmax(z + (0 if on_policy else 0.7 * torch.randn(B, R, V, generator=g, dtype=torch.float64)), -1)
    head = torch.argsort(lq, dim=-1, descending=True)[..., :k]
    if on_policy:  # q is the trainer's own fp32 computation, bit for bit
        ids = torch.cat([responses[..., None], head], -1)
        lp = masked_token_logprobs(hidden.float(), weight.float(), ids, mask, T)
        rollout_lp, head_lq = lp[..., 0], lp[..., 1:]
    else:
        rollout_lp, head_lq = lq.gather(-1, responses[..., None])[..., 0].float(), lq.gather(-1, head).float()
    batch = RolloutBatch(prompts=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.bool),
                         responses=responses, response_mask=mask, rollout_logprobs=rollout_lp.float(),
                         rewards=torch.zeros(B), truncated=torch.zeros(B, dtype=torch.bool),
                         group_ids=torch.zeros(B, dtype=torch.long), prompt_ids=torch.zeros(B, dtype=torch.long),
                         topk_ids=head.int(), topk_logprobs=head_lq)
    adv = torch.tensor([1.3, -0.7, 0.4])
    return batch, hidden, weight, adv


def ours(batch, hidden, weight, adv, name: str, metrics: StepMetrics | None = None):
    cfg = AlgorithmConfig(policy_loss="reinforce")
    cfg.correction.name = name
    h, w = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    loss = rl_objective(h, w, batch, adv, None, T, build_corrections(cfg.correction), cfg,
                        loss_denominators(batch.response_mask), metrics or StepMetrics())
    loss.backward()
    return loss, h.grad.double(), w.grad.double()


def reference(batch, hidden, weight, adv, rule, tail_model: bool):
    """float64 autograd of the centred loss with qhat over the full vocabulary (token-mean)."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = torch.log_softmax(h @ w.T / T, -1)  # [B, R, V]
    p = logp.detach().exp()
    ids = batch.topk_ids.long()
    q_head = batch.topk_logprobs.double().exp()
    in_head = torch.zeros(B, R, V, dtype=torch.bool).scatter(-1, ids, True)
    qhat = torch.zeros(B, R, V, dtype=torch.float64).scatter(-1, ids, q_head)
    what = torch.zeros(B, R, V, dtype=torch.float64).scatter(-1, ids, rule(p.gather(-1, ids) / q_head))
    if tail_model:
        rho = (1 - q_head.sum(-1)).clamp_min(1e-6) / (1 - p.gather(-1, ids).sum(-1)).clamp_min(1e-6)
        qhat = torch.where(in_head, qhat, rho[..., None] * p)
        what = torch.where(in_head, what, rule(1 / rho)[..., None].expand_as(p))
    y = batch.responses[..., None]
    w_y = rule(p.gather(-1, y)[..., 0] / batch.rollout_logprobs.double().exp())
    per = -adv.double()[:, None] * (w_y * logp.gather(-1, y)[..., 0] - ((qhat * what) * logp).sum(-1))
    mask = batch.response_mask
    loss = torch.where(mask, per, 0.0).sum() / mask.sum()
    loss.backward()
    return h.grad, w.grad


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, rtol=2e-4, atol=2e-6), (a - b).abs().max()


@pytest.mark.parametrize("name", ["score_centering", "score_centering+tis", "score_centering+icepop"])
def test_zero_correction_on_policy(name: str) -> None:
    batch, hidden, weight, adv = make(0, k=5, on_policy=True)
    m = StepMetrics()
    loss_sc, gh_sc, gw_sc = ours(batch, hidden, weight, adv, name, m)
    loss_pg, gh_pg, gw_pg = ours(batch, hidden, weight, adv, name.replace("score_centering+", "").replace(
        "score_centering", "none"))
    assert m.compute()["correction/sc_coef_l1"] == 0.0 and m.compute()["correction/sc_term_abs"] == 0.0
    assert loss_sc.item() == loss_pg.item()
    assert torch.equal(gh_sc, gh_pg) and torch.equal(gw_sc, gw_pg)


@pytest.mark.parametrize(("name", "rule"), [("score_centering", ones_rule), ("score_centering+tis", tis_rule)])
def test_full_vocabulary_head_gives_the_exact_centred_score(name: str, rule) -> None:
    batch, hidden, weight, adv = make(1, k=V)
    _, gh, gw = ours(batch, hidden, weight, adv, name)
    rh, rw = reference(batch, hidden, weight, adv, rule, tail_model=False)
    assert_close(gh, rh)
    assert_close(gw, rw)
    # and the correction is not vacuous: plain REINFORCE differs
    _, gh0, _ = ours(batch, hidden, weight, adv, "tis" if "tis" in name else "none")
    assert (gh0 - rh).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "rule"), [("score_centering", ones_rule), ("score_centering+tis", tis_rule)])
def test_top_k_head_gives_the_rho_p_tail_model(name: str, rule) -> None:
    batch, hidden, weight, adv = make(2, k=4)
    _, gh, gw = ours(batch, hidden, weight, adv, name)
    rh, rw = reference(batch, hidden, weight, adv, rule, tail_model=True)
    assert_close(gh, rh)
    assert_close(gw, rw)
    exact_h, _ = reference(batch, hidden, weight, adv, rule, tail_model=False)  # head only, tail dropped
    assert (exact_h - rh).abs().max() > 1e-3


def test_chunked_normaliser_with_head_equals_log_softmax_gather() -> None:
    batch, hidden, weight, _ = make(3, k=6)
    ids = torch.cat([batch.responses[..., None], batch.topk_ids.long()], -1)
    mask = batch.response_mask
    up = torch.randn(B, R, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    h, w = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    out = masked_token_logprobs(h, w, ids, mask, T, chunk_size=2)
    (out.double() * up).sum().backward()
    h64, w64 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = torch.log_softmax(h64 @ w64.T / T, -1).gather(-1, ids) * mask[..., None]
    (ref * up).sum().backward()
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert_close(h.grad.double(), h64.grad)
    assert_close(w.grad.double(), w64.grad)


def _expected_gradient(name: str, lq: torch.Tensor, head: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor):
    """E_{y ~ q}[grad of the loss] for a constant reward A = 1 at one position, summed exactly over y."""
    total_h = torch.zeros(1, 1, H, dtype=torch.float64)
    total_w = torch.zeros(V, H, dtype=torch.float64)
    for y in range(V):
        batch = RolloutBatch(prompts=torch.zeros(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                             responses=torch.tensor([[y]]), response_mask=torch.ones(1, 1, dtype=torch.bool),
                             rollout_logprobs=lq[y].reshape(1, 1).float(), rewards=torch.ones(1),
                             truncated=torch.zeros(1, dtype=torch.bool), group_ids=torch.zeros(1, dtype=torch.long),
                             prompt_ids=torch.zeros(1, dtype=torch.long), topk_ids=head.reshape(1, 1, -1).int(),
                             topk_logprobs=lq[head].reshape(1, 1, -1).float())
        _, gh, gw = ours(batch, hidden, weight, torch.ones(1), name)
        total_h += lq[y].exp() * gh
        total_w += lq[y].exp() * gw
    return total_h, total_w


@pytest.mark.parametrize("k", [V, 5])
def test_constant_reward_drift_cancels(k: int) -> None:
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 1, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    lp = torch.log_softmax((hidden @ weight.T / T).reshape(V), -1)
    # q: a different head, and a tail that is exactly rho * p (what the tail model assumes)
    lq_raw = torch.log_softmax(lp + 0.8 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    head = torch.argsort(lq_raw, descending=True)[:k]
    q = lq_raw.exp()
    if k < V:
        tail = torch.ones(V, dtype=torch.bool)
        tail[head] = False
        q[tail] = lp.exp()[tail] * (1 - q[head].sum()) / lp.exp()[tail].sum()
    lq = q.log()
    drift_h, drift_w = _expected_gradient("none", lq, head, hidden, weight)
    sc_h, sc_w = _expected_gradient("score_centering", lq, head, hidden, weight)
    drift = max(drift_h.abs().max().item(), drift_w.abs().max().item())
    left = max(sc_h.abs().max().item(), sc_w.abs().max().item())
    print(f"k={k}: drift {drift:.3e}, after centring {left:.3e}")
    assert drift > 1e-3  # uncentred REINFORCE drifts under a constant reward
    assert left < 1e-4 * drift


def test_padded_head_entries_are_ignored() -> None:
    batch, hidden, weight, adv = make(5, k=6)
    loss_a, gh_a, _ = ours(batch, hidden, weight, adv, "score_centering")
    pad_ids = torch.cat([batch.topk_ids, torch.zeros(B, R, 2, dtype=torch.int32)], -1)
    pad_lq = torch.cat([batch.topk_logprobs, torch.full((B, R, 2), float("-inf"))], -1)
    padded = RolloutBatch(**{**batch.__dict__, "topk_ids": pad_ids, "topk_logprobs": pad_lq})
    loss_b, gh_b, _ = ours(padded, hidden, weight, adv, "score_centering")
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    assert torch.allclose(gh_a, gh_b, atol=1e-7)
