"""Loss aggregation: values against a float64 reference, and micro-batch invariance of value and gradient."""

from __future__ import annotations

import pytest
import torch

from parity.algorithms import AGG_MODES, aggregate_loss, loss_denominators
from tests.tolerances import U32, token_coefficients

LENGTHS = [5, 1, 0, 7, 3, 7, 2, 4]
R = 7


def _mask() -> torch.Tensor:
    return torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]


def _per_token(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * x + 0.5 * x * x  # any smooth per-token loss


def _error_scales(x: torch.Tensor, mask: torch.Tensor, mode: str) -> tuple[float, torch.Tensor]:
    """float64 (sum_i c_i (|x sin x| + x^2 / 2), c_i (|x cos x| + |sin x| + |x|)): the magnitudes of the terms of the
    aggregated loss and of each gradient entry, which float32 rounding errors scale with (c: token_coefficients)."""
    x, c = x.detach().double(), token_coefficients(mask, mode)
    terms = (x * torch.sin(x)).abs() + 0.5 * x * x
    return float((c * terms).sum()), c * ((x * torch.cos(x)).abs() + torch.sin(x).abs() + x.abs())


def _reference(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    v = _per_token(x.double())
    rows = [v[i, : int(n)] for i, n in enumerate(mask.sum(-1))]
    nonempty = [t for t in rows if t.numel()]
    if mode == "token-mean":
        return torch.cat(rows).sum() / sum(t.numel() for t in rows)
    if mode == "seq-mean-token-mean":
        return torch.stack([t.mean() for t in nonempty]).mean()
    return torch.stack([t.sum() for t in nonempty]).sum() / (len(nonempty) * R)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_and_grad_match_float64_reference(mode: str) -> None:
    mask = _mask()
    x = torch.randn(len(LENGTHS), R, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x32 = x.float().requires_grad_(True)
    x64 = x.clone().requires_grad_(True)
    loss = aggregate_loss(_per_token(x32), mask, mode, loss_denominators(mask))
    ref = _reference(x64, mask, mode)
    loss.backward()
    ref.backward()
    # float32 against float64: a token's loss is sin (1 ulp), two products and a sum, within 4 u of its terms'
    # magnitude; the aggregation's sums have at most 29 terms (the tokens) in any order, plus two divisions:
    # (29 + 6) u sum_i c_i |terms_i|. A gradient entry: cos, sin (1 ulp each), products, sums, the coefficient:
    # within 8 u of c_i (|x cos x| + |sin x| + |x|).
    loss_scale, grad_scale = _error_scales(x, mask, mode)
    assert abs(loss.item() - ref.item()) <= (sum(LENGTHS) + 6) * U32 * loss_scale
    assert ((x32.grad.double() - x64.grad).abs() <= 8 * U32 * grad_scale).all()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("split", [[8], [1] * 8, [3, 1, 4], [2, 6]])
def test_micro_batch_invariance(mode: str, split: list[int]) -> None:
    mask = _mask()
    denom = loss_denominators(mask)
    x = torch.randn(len(LENGTHS), R, generator=torch.Generator().manual_seed(1))
    full_x = x.clone().requires_grad_(True)
    full = aggregate_loss(_per_token(full_x), mask, mode, denom)
    full.backward()

    micro_x = x.clone().requires_grad_(True)
    total = torch.zeros(())
    start = 0
    for size in split:
        rows = slice(start, start + size)
        part = aggregate_loss(_per_token(micro_x[rows]), mask[rows], mode, denom)
        part.backward()
        total = total + part.detach()
        start += size
    # two float32 evaluations (each as in the float64 test above: sin may take the vector body for a token in one
    # and the scalar tail in the other, and the sums another order), plus the float32 sum of the parts: twice the bound
    loss_scale, grad_scale = _error_scales(x, mask, mode)
    assert abs(total.item() - full.item()) <= 2 * (sum(LENGTHS) + 6 + len(split)) * U32 * loss_scale
    assert ((micro_x.grad - full_x.grad).double().abs() <= 2 * 8 * U32 * grad_scale).all()


def test_local_denominators_would_break_invariance() -> None:
    # the guard this design exists for: per-micro-batch token means do not add up to the global mean
    mask = _mask()
    x = torch.randn(len(LENGTHS), R, generator=torch.Generator().manual_seed(2))
    full = aggregate_loss(_per_token(x), mask, "token-mean", loss_denominators(mask))
    halves = [slice(0, 2), slice(2, 8)]
    local = sum(aggregate_loss(_per_token(x[s]), mask[s], "token-mean", loss_denominators(mask[s])) for s in halves)
    assert abs(float(local) / 2 - float(full)) > 1e-3  # a real change (0.06 here), ~400 times the rounding bound


def test_padding_garbage_is_ignored_and_counts_are_ints() -> None:
    mask = _mask()
    per_token = torch.where(mask, torch.ones(mask.shape), torch.full(mask.shape, float("nan")))
    denom = loss_denominators(mask)
    assert (denom.num_tokens, denom.num_seqs, denom.max_response_len) == (sum(LENGTHS), 7, R)
    assert aggregate_loss(per_token, mask, "token-mean", denom).item() == 1.0
    # sums of ones are exact; a division or two (1 u each) is inside pytest.approx's default 1e-6 relative
    assert aggregate_loss(per_token, mask, "seq-mean-token-mean", denom).item() == pytest.approx(1.0)
    budget = loss_denominators(mask, max_response_len=16)
    assert aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", budget).item() == pytest.approx(29 / (7 * 16))


def test_bad_inputs() -> None:
    mask = _mask()
    with pytest.raises(TypeError, match="bool"):
        loss_denominators(mask.float())
    with pytest.raises(ValueError, match="algorithm.loss_agg_mode: unknown mode 'sum'"):
        aggregate_loss(torch.zeros(mask.shape), mask, "sum", loss_denominators(mask))
    with pytest.raises(ValueError, match="shorter than the longest response"):
        loss_denominators(mask, max_response_len=3)
