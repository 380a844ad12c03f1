"""The RL objective of one micro-batch: the single entry point the trainer calls.

    objective = Objective(cfg.algorithm, corrections)   # once: the policy loss and aggregation looked up, checked
    loss = objective(hidden, lm_head.weight, batch=mb, advantages=adv, old_logprobs=old_lp, temperature=T,
                     denom=denom, metrics=metrics)
    loss.backward()          # once per micro-batch; the sum over micro-batches is the mini-batch loss

Order: trainer log-probs (sampled token, plus the rollout's top-K when a correction needs them, in one
chunked full-vocabulary pass) -> per-token advantages and their shifts -> IS weights and masks -> the
policy loss plus the corrections' loss terms -> aggregation with the mini-batch denominators ->
telemetry into `metrics`."""

from __future__ import annotations

import torch

from parity.algorithm_config import AlgorithmConfig
from parity.algorithms.aggregation import AGGREGATIONS, LossDenominators, aggregate_loss
from parity.algorithms.corrections import CorrectionContext, CorrectionStack
from parity.algorithms.corrections.base import gather_rows, scatter_rows, token_rows
from parity.algorithms.logprobs import chunked_token_logprobs
from parity.algorithms.losses import get_policy_loss
from parity.algorithms.mismatch import StepMetrics, record_mismatch
from parity.types import RolloutBatch


def _gather_ids(batch: RolloutBatch, rows: torch.Tensor, top_k: int, with_head: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """ids [n, 1 (+K)] to score, the head's rollout log-probs [n, K] and validity [n, K]."""
    sampled = gather_rows(batch.responses, rows).long().unsqueeze(-1)
    if not with_head:
        return sampled, None, None
    assert batch.topk_ids is not None and batch.topk_logprobs is not None
    k = top_k or batch.topk_ids.shape[-1]
    head_ids = gather_rows(batch.topk_ids[..., :k], rows).long()
    head_lq = gather_rows(batch.topk_logprobs[..., :k], rows).float()
    # a rollout may pad its head (vocabulary smaller than K): such entries carry a -inf log-prob
    valid = torch.isfinite(head_lq) & (head_ids >= 0)
    head_ids = torch.where(valid, head_ids, torch.zeros_like(head_ids))
    head_lq = torch.where(valid, head_lq, torch.full_like(head_lq, float("-inf")))
    return torch.cat([sampled, head_ids], dim=-1), head_lq, valid


def _check_inputs(hidden: torch.Tensor, batch: RolloutBatch, advantages: torch.Tensor,
                  old_logprobs: torch.Tensor | None) -> None:
    b, r = batch.responses.shape
    if hidden.dim() != 3 or hidden.shape[:2] != (b, r):
        raise ValueError(f"hidden must be [b, R, H] with [b, R] = {(b, r)}, got {tuple(hidden.shape)}")
    if advantages.shape != (b,):
        raise ValueError(f"advantages must be [b] = [{b}] (one per response), got {tuple(advantages.shape)}")
    if advantages.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"advantages must be float32 or wider, got {advantages.dtype}")
    if old_logprobs is not None and old_logprobs.shape != (b, r):
        raise ValueError(f"old_logprobs must be [b, R] = {(b, r)}, got {tuple(old_logprobs.shape)}")


def _shift_ratio(sums: dict[str, float]) -> float | None:
    den = sums.get("correction/#adv_abs", 0.0)
    return sums.get("correction/#shift_abs", 0.0) / den if den > 0 else None


class Objective:
    """The objective of one configuration: `algorithm.policy_loss` and `algorithm.loss_agg_mode` looked up, the
    corrections checked against the policy loss and `algorithm.logprob_chunk_size` checked, once; each call is
    one micro-batch's scalar loss."""

    def __init__(self, alg_cfg: AlgorithmConfig, corrections: CorrectionStack) -> None:
        self.alg_cfg, self.corrections = alg_cfg, corrections
        self.policy_loss = get_policy_loss(str(alg_cfg.policy_loss))
        corrections.check(policy_loss=str(alg_cfg.policy_loss))
        self.aggregate = AGGREGATIONS.get(str(alg_cfg.loss_agg_mode))
        self.chunk = int(alg_cfg.logprob_chunk_size)
        if self.chunk < 1:
            raise ValueError(f"algorithm.logprob_chunk_size must be >= 1, got {self.chunk}")

    def __call__(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, *, batch: RolloutBatch,
                 advantages: torch.Tensor, old_logprobs: torch.Tensor | None, temperature: float,
                 denom: LossDenominators, metrics: StepMetrics, rows: torch.Tensor | None = None,
                 ids_checked: bool = False) -> torch.Tensor:
        """Scalar loss of one micro-batch; hidden[:, t] is the final-norm hidden state predicting responses[:, t].
        rows: token_rows(response_mask) when the caller has them (computed on the host they cost the device no
        sync); ids_checked: the caller has checked every token id against the vocabulary (skips a device sync)."""
        _check_inputs(hidden, batch, advantages, old_logprobs)
        corrections, chunk = self.corrections, self.chunk
        with_head = corrections.needs_topk
        if with_head:
            corrections.check_batch(batch)
        mask = batch.response_mask.bool()

        if rows is None:  # integer indices of the response tokens, once: every x[mask] would sync the device
            rows = token_rows(mask)
        ids, head_lq, head_valid = _gather_ids(batch, rows, corrections.top_k, with_head)
        flat = chunked_token_logprobs(gather_rows(hidden, rows), lm_head_weight, ids, temperature, chunk,
                                      check_ids=not ids_checked)
        logprobs = scatter_rows(flat[:, 0], rows, mask)
        # padding of old log-probs may hold garbage: keep it out of ratios (a NaN there would poison backward)
        train_lp = logprobs.detach() if old_logprobs is None else torch.where(mask, old_logprobs.float(), 0.0)
        ctx = CorrectionContext(mask=mask, logprobs=logprobs, train_logprobs=train_lp,
                                rollout_logprobs=batch.rollout_logprobs.float(),
                                head_logprobs=flat[:, 1:] if with_head else None,
                                head_rollout_logprobs=head_lq, head_valid=head_valid, rows=rows,
                                group_ids=batch.group_ids)

        adv = torch.where(mask, advantages.float()[:, None], 0.0)
        weights = mask.float()
        keep = mask.clone()
        shifted = False
        for c in corrections:
            shift = c.advantage_shift(ctx)
            if shift is not None:
                if not shifted:  # the size of the advantages the shifts act on, once
                    metrics.add_sum("correction/#adv_abs", torch.where(mask, adv.abs(), 0.0).double().sum())
                    shifted = True
                shift = torch.where(mask, shift.detach(), 0.0)
                metrics.add_masked_mean("correction/adv_shift_mean", shift, mask)
                metrics.add_sum("correction/#shift_abs", shift.abs().double().sum())
                adv = adv - shift
            w = c.weights(ctx)
            if w is not None:
                weights = weights * w.detach()
            k = c.keep_mask(ctx)
            if k is not None:
                keep = keep & k

        per_token, pg_metrics = self.policy_loss(logprobs, train_lp, adv, weights, self.alg_cfg)
        for c in corrections:
            extra = c.extra_loss(ctx, adv, corrections.is_weight)
            if extra is not None:
                per_token = per_token + extra
        per_token = torch.where(keep, per_token, 0.0)
        loss = aggregate_loss(per_token, mask, self.aggregate, denom)

        if shifted:  # how much of the advantage the corrections' shifts amount to: mean |shift| / mean |A|
            metrics.add_derived("correction/shift_over_adv", _shift_ratio)
        record_mismatch(metrics, train_lp, batch.rollout_logprobs, mask, corrections.tolerance)
        metrics.add_masked_mean("correction/masked_frac", (~keep | (weights == 0)).float(), mask)
        metrics.add_masked_mean("correction/is_weight_mean", weights, mask)
        metrics.add_masked_mean("actor/advantage_mean", adv, mask)
        for name, values in pg_metrics.items():
            metrics.add_masked_mean(name, values, mask)
        for c in corrections:
            c.record(ctx, metrics)
        return loss
