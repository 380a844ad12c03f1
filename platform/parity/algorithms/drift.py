"""Drift telemetry of one RL step: the statistics that say whether the sampler's bias can move the policy.

Score centering removes the term E_q[A | prefix] * sum_v q_v grad log p_v of the policy gradient, which pulls
p toward the sampler q and carries no reward information. Under a token-mean loss every token of response i
carries its advantage A_i, so the term's weight over a step is the token-weighted mean advantage
sum_i A_i L_i / sum_i L_i: zero when a group's responses have one length (group-centred A sums to zero), and
away from zero when length and advantage covary. These functions are pure and cheap (one pass over the batch,
float64 sums); names in METRICS.md."""

from __future__ import annotations

import torch


def advantage_length_stats(advantages: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """drift/adv_token_mean = sum_i A_i L_i / sum_i L_i and drift/adv_length_cov = the (population) covariance
    of A_i and L_i over the step's responses."""
    a, L = advantages.detach().to(torch.float64).cpu(), lengths.detach().to(torch.float64).cpu()
    out: dict[str, float] = {}
    if L.numel() == 0:
        return out
    if float(L.sum()) > 0:
        out["drift/adv_token_mean"] = float((a * L).sum() / L.sum())
    out["drift/adv_length_cov"] = float(((a - a.mean()) * (L - L.mean())).mean())
    return out


def length_stats(lengths: torch.Tensor, group_ids: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Response-length spread: the (population) std over the step, the mean over groups of the within-group
    coefficient of variation std/mean, and the mean length of correct (reward > 0.5) and incorrect responses."""
    L = lengths.detach().to(torch.float64).cpu()
    g, r = group_ids.detach().cpu(), rewards.detach().to(torch.float64).cpu()
    out = {"response/length_std": float(L.std(unbiased=False)) if L.numel() else 0.0}
    cvs = []
    for gid in torch.unique(g):
        x = L[g == gid]
        if x.numel() > 1 and float(x.mean()) > 0:
            cvs.append(float(x.std(unbiased=False) / x.mean()))
    if cvs:
        out["response/length_cv_within_group"] = sum(cvs) / len(cvs)
    ok = r > 0.5
    if bool(ok.any()):
        out["response/length_correct_mean"] = float(L[ok].mean())
    if bool((~ok).any()):
        out["response/length_incorrect_mean"] = float(L[~ok].mean())
    return out


def sampled_entropy(rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> float | None:
    """The sampler's per-token entropy, estimated by the mean of -log pi_inf(y_t) over the sampled tokens (an
    unbiased Monte-Carlo estimate of E_t[H(pi_inf(. | prefix_t))], at the sampling temperature)."""
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return None
    return float(-(torch.where(m, rollout_logprobs.detach().to(torch.float64), 0.0)).sum() / n)


def repeated_ngram_frac(responses: torch.Tensor, mask: torch.Tensor, n: int = 4) -> float | None:
    """Degeneration: of each response's token n-grams, the fraction that already occurred earlier in the same
    response; averaged over the responses that have at least one n-gram."""
    fracs = []
    lengths = mask.bool().sum(-1).tolist()
    rows = responses.detach().cpu().tolist()
    for row, L in zip(rows, lengths):
        grams = [tuple(row[i:i + n]) for i in range(L - n + 1)]
        if not grams:
            continue
        seen: set[tuple] = set()
        rep = 0
        for gram in grams:
            rep += gram in seen
            seen.add(gram)
        fracs.append(rep / len(grams))
    return sum(fracs) / len(fracs) if fracs else None


def drift_metrics(advantages: torch.Tensor, batch: object) -> dict[str, float]:
    """Every per-step drift statistic of a graded RolloutBatch with its per-response advantages."""
    lengths = batch.response_lengths()  # type: ignore[attr-defined]
    out = advantage_length_stats(advantages, lengths)
    out.update(length_stats(lengths, batch.group_ids, batch.rewards))  # type: ignore[attr-defined]
    ent = sampled_entropy(batch.rollout_logprobs, batch.response_mask)  # type: ignore[attr-defined]
    if ent is not None:
        out["response/entropy"] = ent
    rep = repeated_ngram_frac(batch.responses, batch.response_mask)  # type: ignore[attr-defined]
    if rep is not None:
        out["response/repeat_4gram_frac"] = rep
    return out
