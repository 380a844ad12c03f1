"""Token log-probs under the full-vocabulary softmax without holding the [tokens x vocab] logits.

chunked_token_logprobs(hidden, weight, ids) = log_softmax(hidden @ weight.T / T)[ids], computed in row
chunks. Forward keeps only the per-row log-normaliser; backward recomputes each chunk's logits. The
largest temporary is one [chunk x V] fp32 block (plus its matmul output in the weight's dtype), so
M = 1 + K gathered ids (sampled token plus a top-K head) cost about as much as M = 1.

The logits are computed the way an HF model computes them (matmul in the weight's dtype, then
.float()), then divided by the temperature in fp32, as the rollout engines do."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

# On CUDA with a bf16/fp16 head the element-wise work over each [chunk x V] block runs in two Triton kernels
# (parity.algorithms.head_triton) that read the low-precision logits once; eager torch makes about ten passes
# over an fp32 copy of the block. False keeps the eager ops everywhere (the benchmark's A/B).
HEAD_KERNELS = True


def _row_logsumexp_ref(low: torch.Tensor, temperature: float) -> torch.Tensor:
    """What head_triton.row_logsumexp computes, in torch (CPU tests; the kernels are checked against it)."""
    return torch.logsumexp(low.float() / temperature, dim=-1)


def _softmax_times_ref(low: torch.Tensor, lse: torch.Tensor, factor: torch.Tensor, temperature: float) -> torch.Tensor:
    return ((low.float() / temperature - lse[:, None]).exp() * factor.reshape(-1, 1)).to(low.dtype)


def _kernels(low: torch.Tensor) -> tuple[Any, Any] | None:
    """(row_logsumexp, softmax_times) for this block, or None for the eager ops."""
    if not (HEAD_KERNELS and low.is_cuda and low.dtype in (torch.bfloat16, torch.float16)):
        return None
    from parity.algorithms import head_triton
    return (head_triton.row_logsumexp, head_triton.softmax_times) if head_triton.available() else None


def _picked(low: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    z = low.gather(1, ids).float()
    return z / temperature if temperature != 1.0 else z


def _add_onehot(dl: torch.Tensor, low: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                neg_gsum: torch.Tensor, temperature: float) -> None:
    """dl[ids] = softmax part + every g_m whose id is there, computed in fp32 and rounded once (repeated ids, e.g.
    the sampled token inside the top-K, add up as scatter_add does)."""
    at_id = g if ids.shape[1] == 1 else ((ids[:, :, None] == ids[:, None, :]) * g[:, None, :]).sum(-1)
    val = (_picked(low, ids, temperature) - lse[:, None]).exp() * neg_gsum + at_id
    dl.scatter_(1, ids, val.to(dl.dtype))


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float,
                chunk_size: int) -> torch.Tensor:
        n = hidden.shape[0]
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            low = hidden[s:e].to(weight.dtype) @ weight.T
            kern = _kernels(low)
            if kern is not None:
                lse[s:e] = kern[0](low, temperature)
                out[s:e] = _picked(low, ids[s:e], temperature) - lse[s:e, None]
                continue
            logits = low.float()
            del low
            if temperature != 1.0:
                logits.div_(temperature)
            picked = logits.gather(1, ids[s:e])
            # log-sum-exp in place: no second [chunk x V] temporary
            top = logits.amax(dim=-1, keepdim=True)
            lse_c = logits.sub_(top).exp_().sum(dim=-1, keepdim=True).log_().add_(top)
            out[s:e] = picked - lse_c
            lse[s:e] = lse_c[:, 0]
            del logits
        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, ids, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, chunk = hidden.shape[0], ctx.chunk_size
        grad_h = torch.empty_like(hidden) if need_h else None
        # summing chunk partials in bf16 would lose the low bits, so accumulate in fp32 (or wider)
        acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        grad_w: torch.Tensor | None = None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            g = grad_out[s:e].float() / ctx.temperature  # the 1/T of z / T, folded into the [chunk x M] side
            # d/dz of sum_m g_m (z[id_m] - lse) = onehot-scatter(g) - softmax(z) * sum_m g_m
            neg_gsum = -g.sum(dim=-1, keepdim=True)
            low = hidden[s:e].to(weight.dtype) @ weight.T
            kern = _kernels(low)
            if kern is not None:
                dl = kern[1](low, lse[s:e], neg_gsum, ctx.temperature)
                _add_onehot(dl, low, ids[s:e], lse[s:e], g, neg_gsum, ctx.temperature)
            else:
                dlogits = low.float()
                if ctx.temperature != 1.0:
                    dlogits.div_(ctx.temperature)
                dlogits.sub_(lse[s:e, None]).exp_().mul_(neg_gsum)
                dlogits.scatter_add_(1, ids[s:e], g)
                dl = dlogits.to(weight.dtype)
                del dlogits
            del low
            if grad_h is not None:
                grad_h[s:e] = (dl @ weight).to(hidden.dtype)
            if need_w:
                h = hidden[s:e].to(weight.dtype)
                if grad_w is None:
                    grad_w = (dl.T @ h).to(acc_dtype)
                elif acc_dtype == weight.dtype:
                    grad_w.addmm_(dl.T, h)
                else:
                    grad_w.add_((dl.T @ h).to(acc_dtype))
        if need_w and grad_w is None:  # no rows: a zero gradient, not a missing one
            grad_w = torch.zeros_like(weight)
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                           chunk_size: int = 1024, check_ids: bool = True) -> torch.Tensor:
    """log_softmax(hidden @ weight.T / temperature)[ids] -> [N, M] fp32, gradients to hidden and weight.

    hidden [N, H] (any float dtype), weight [V, H] (the lm_head), ids [N, M] int64."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids must be [N, M] with N={hidden.shape[0]}, got {tuple(ids.shape)}")
    if ids.dtype != torch.int64:
        raise TypeError(f"ids must be int64, got {ids.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    vocab = weight.shape[0]
    # an out-of-range id is a device-side assert on CUDA; say which instead (one host sync: callers that checked
    # the ids on the host already pass check_ids=False, the trainer among them)
    if check_ids and ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"ids must lie in [0, {vocab}), got min {int(ids.min())} max {int(ids.max())}")
    return _ChunkedTokenLogprobs.apply(hidden, weight, ids, float(temperature), int(chunk_size))


def masked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                          temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Log-probs of ids [b, R] (or [b, R, M]) predicted by hidden [b, R, H], computed on mask positions
    only; padding positions hold 0. Use under torch.no_grad() for old/reference log-probs."""
    squeeze = ids.dim() == 2
    ids3 = ids.unsqueeze(-1) if squeeze else ids
    flat = chunked_token_logprobs(hidden[mask], weight, ids3[mask].long(), temperature, chunk_size)
    out = flat.new_zeros(ids3.shape).masked_scatter(mask.unsqueeze(-1).expand_as(ids3), flat)
    return out.squeeze(-1) if squeeze else out
