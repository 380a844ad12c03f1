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
)
from parity.algorithms.corrections.score_centering import centering_coefficients
from parity.config.schema import AlgorithmConfig
from parity.types import RolloutBatch
from tests.helpers import rl_objective
from tests.tolerances import U32, logprob_bound, logprob_grad_scales

B, R, H, V, T, C = 3, 4, 6, 13, 0.8, 2.0
LENGTHS = [4, 2, 3]


def tis_rule(ratio: torch.Tensor) -> torch.Tensor:
    return ratio.clamp(max=C)


def ones_rule(ratio: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(ratio)


def make(seed: int, k: int, on_policy: bool = False, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = scale * torch.randn(B, R, H, generator=g, dtype=torch.float64)
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
    # Error bound of the float32 gradients: the loss is sum_v g_v lp_v per token with g = -A (w_y onehot_y - qhat w)
    # / tokens, which the code computes on the head as q w - alpha p (alpha = rho w(1 / rho); K = V: rho is 1 while
    # the float32 1 - P_H stays under tail_floor = 1e-6, i.e. while the log-probs' errors average under 1e-6, a few
    # ulps, not the worst case dlp), so tolerances.logprob_grad_scales of |A| (w_y
    # onehot_y + |qhat w| + alpha p) / tokens bounds the terms. p carries a log-prob's error dlp, and so do the
    # coefficients, times 1 + kappa where rho = (1 - Q_H) / (1 - P_H) divides by 1 - P_H (kappa = P_H / (1 - P_H));
    # the head's and the vocabulary's sums add (V + K + 12) u.
    rho = ((1 - q_head.sum(-1)).clamp_min(1e-6) / (1 - p.gather(-1, ids).sum(-1)).clamp_min(1e-6)) if tail_model \
        else torch.ones(B, R, dtype=torch.float64)
    alpha = rho * rule(1 / rho)
    g = (adv.double().abs()[:, None, None] * ((qhat * what).abs() + alpha[..., None] * p
         + w_y[..., None] * torch.nn.functional.one_hot(batch.responses, V)) * mask[..., None]) / mask.sum()
    p_head = p.gather(-1, ids).sum(-1)[mask]
    kappa = float((p_head / (1 - p_head)).max()) if tail_model else 0.0
    dlp = logprob_bound(hidden, weight, T)
    scale = (2 + kappa) * dlp + (V + ids.shape[-1] + 12) * U32
    all_ids = torch.arange(V).expand(B * R, V)
    g_h, g_w = logprob_grad_scales(hidden, weight, all_ids, g.detach().reshape(B * R, V), T)
    return h.grad, w.grad, scale * g_h.reshape(B, R, H), scale * g_w


def assert_close(a: torch.Tensor, b: torch.Tensor, bound: torch.Tensor) -> None:
    """a (float32, as float64) within `bound` of the float64 reference b, entry by entry."""
    assert ((a - b).abs() <= bound).all(), ((a - b).abs() / bound).max()


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
    rh, rw, bh, bw = reference(batch, hidden, weight, adv, rule, tail_model=False)
    assert_close(gh, rh, bh)
    assert_close(gw, rw, bw)
    # and the correction is not vacuous: plain REINFORCE differs
    _, gh0, _ = ours(batch, hidden, weight, adv, "tis" if "tis" in name else "none")
    assert (gh0 - rh).abs().max() > 1e-2


@pytest.mark.parametrize(("name", "rule"), [("score_centering", ones_rule), ("score_centering+tis", tis_rule)])
def test_top_k_head_gives_the_rho_p_tail_model(name: str, rule) -> None:
    # logits flat enough that the tail keeps >= 17% of p's mass: rho = (1 - Q_H) / (1 - P_H) is then well conditioned
    # in float32 (kappa <= 5 in the bound); at scale 1 the head holds up to 99.8% and 1 - P_H amplifies the float32
    # log-probs' error up to 500 times
    batch, hidden, weight, adv = make(2, k=4, scale=0.35)
    _, gh, gw = ours(batch, hidden, weight, adv, name)
    rh, rw, bh, bw = reference(batch, hidden, weight, adv, rule, tail_model=True)
    assert_close(gh, rh, bh)
    assert_close(gw, rw, bw)
    exact_h, *_ = reference(batch, hidden, weight, adv, rule, tail_model=False)  # head only, tail dropped
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
    # float32 against float64: each lp within dlp (tolerances.logprob_bound); the gradients of sum up * lp with the
    # exact upstream: p within dlp, and the sums over V logits or the tokens
    dlp = logprob_bound(hidden, weight, T)
    assert torch.allclose(out.double(), ref, rtol=0, atol=dlp)
    g_h, g_w = logprob_grad_scales(hidden, weight, ids.reshape(B * R, -1), (up * mask[..., None]).reshape(B * R, -1), T)
    assert_close(h.grad.double(), h64.grad, (dlp + (V + 12) * U32) * g_h.reshape(B, R, H))
    assert_close(w.grad.double(), w64.grad, (dlp + (B * R + 12) * U32) * g_w)


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
    # logits flat enough that the tail keeps >= 15% of p's mass (at scale 1 the head of 5 holds 99.96%, and rho =
    # (1 - Q_H) / (1 - P_H) would amplify the float32 log-probs' error 2000 times: see the bound below)
    hidden = 0.35 * torch.randn(1, 1, H, generator=g, dtype=torch.float64)
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
    # What is left is float32 rounding alone (0 in exact arithmetic). At each y the gradient is within ((2 + kappa)
    # dlp + (2V + 12) u) G_y of exact, as in reference() above (A = 1, w = 1: g = onehot_y + qhat + alpha p, alpha =
    # rho), and the q-average of that bounds the residual.
    p = lp.exp()
    in_head = torch.zeros(V, dtype=torch.bool).scatter(0, head, True)
    p_head = float(p[head].sum())
    rho = float((1 - q[head].sum()).clamp_min(1e-6)) / max(1 - p_head, 1e-6) if k < V else 1.0
    kappa = p_head / (1 - p_head) if k < V else 0.0
    g_v = torch.where(in_head, q, rho * p) + rho * p
    bound_h, bound_w = torch.zeros(H, dtype=torch.float64), torch.zeros(V, H, dtype=torch.float64)
    for y in range(V):
        gh, gw = logprob_grad_scales(hidden.reshape(1, H), weight, torch.arange(V)[None],
                                     (g_v + torch.nn.functional.one_hot(torch.tensor(y), V))[None], T)
        bound_h, bound_w = bound_h + q[y] * gh[0], bound_w + q[y] * gw
    scale = (2 + kappa) * logprob_bound(hidden, weight, T) + (2 * V + 12) * U32
    bound = scale * max(float(bound_h.max()), float(bound_w.max()))
    print(f"k={k}: drift {drift:.3e}, after centring {left:.3e} (rounding bound {bound:.3e})")
    assert drift > 1e-3  # uncentred REINFORCE drifts under a constant reward
    assert left <= bound < 1e-2 * drift  # centring leaves rounding, well under 1% of the drift


def test_padded_head_entries_are_ignored() -> None:
    batch, hidden, weight, adv = make(5, k=6)
    loss_a, gh_a, _ = ours(batch, hidden, weight, adv, "score_centering")
    pad_ids = torch.cat([batch.topk_ids, torch.zeros(B, R, 2, dtype=torch.int32)], -1)
    pad_lq = torch.cat([batch.topk_logprobs, torch.full((B, R, 2), float("-inf"))], -1)
    padded = RolloutBatch(**{**batch.__dict__, "topk_ids": pad_ids, "topk_logprobs": pad_lq})
    loss_b, gh_b, _ = ours(padded, hidden, weight, adv, "score_centering")
    # The two runs score the same ids (the padding adds columns of zero weight) and compute the same float64
    # coefficients; only the float32 sums over a token's 1 + K or 1 + K + 2 columns may take another order, each
    # within (K + 2) u of its terms: the loss within 2 (K + 2) u of sum |A| (|lp_y| + sum |c_v lp_v|) / tokens, a
    # hidden state's gradient within 2 (K + 3) u of the magnitudes of its terms (tolerances.logprob_grad_scales).
    mask, k = batch.response_mask, batch.topk_ids.shape[-1]
    lp = torch.log_softmax(hidden @ weight.T / T, -1)
    ids = torch.cat([batch.responses[..., None], batch.topk_ids.long()], -1)[mask]
    coef = centering_coefficients(lp[mask].gather(-1, ids[:, 1:]), batch.topk_logprobs[mask],
                                  torch.ones(ids.shape[0], k, dtype=torch.bool))["coef"]
    a_abs = adv.double()[:, None].expand(B, R)[mask].abs() / mask.sum()
    g = a_abs[:, None] * torch.cat([torch.ones(ids.shape[0], 1, dtype=torch.float64), coef.abs()], -1)
    terms = float((g * lp[mask].gather(-1, ids).abs()).sum())
    assert abs(loss_a.item() - loss_b.item()) <= 2 * (k + 2) * U32 * terms
    g_h, _ = logprob_grad_scales(hidden[mask], weight, ids, g, T)
    assert ((gh_a[mask] - gh_b[mask]).abs() <= 2 * (k + 3) * U32 * g_h).all() and (gh_a[~mask] == gh_b[~mask]).all()
