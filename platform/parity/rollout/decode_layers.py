"""The arithmetic of one decoder layer on the CUDA decode path (parity.rollout.cuda_decode), as pure tensor
functions that Inductor compiles once and every layer shares: HF Qwen3's order of operations, QuantLinear's
forward for quantized projections, q/k/v and gate/up as one product each when stacked."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parity.precision.formats import fake_quantize, quantize_rowwise
from parity.precision.linear import PREPARED, is_simulated, quant_linear_forward, simulated_weight


def _decode_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, kmask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [B, H, D] against the cache [B, n_kv, S, D]; query head h reads KV head h // (H / n_kv) as in HF."""
    B, H, D = q.shape
    n_kv = ck.shape[1]
    qg = q.view(B, n_kv, H // n_kv, D)
    scores = torch.matmul(qg, ck.transpose(-1, -2)).float() * scale  # [B, n_kv, g, S]
    scores = scores.masked_fill(~kmask[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(cv.dtype)
    return torch.matmul(p, cv).reshape(B, H * D)


def plain_decode_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, key_ok: torch.Tensor,
                           kmask: torch.Tensor, slot: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    """q [B, H, D] against a plain cache [B, n_kv, S, D]'s first L slots (kmask [B, L]: slot <= `slot` and key_ok),
    [B, H * D]: _decode_attention, or with decode_attention.plain_kernel() on CUDA its raw_decode_attention (the same
    masks from key_ok and slot)."""
    if q.is_cuda:
        from parity.rollout.decode_attention import plain_kernel, raw_decode_attention
        if plain_kernel():
            return raw_decode_attention(q.to(ck.dtype), ck, cv, key_ok, slot, L, scale)
    return _decode_attention(q.to(ck.dtype), ck[:, :, :L], cv[:, :, :L], kmask, scale)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm's arithmetic: float32 normalisation, cast back, then the weight. A weight [N, d] is a
    cohort's (parity.rollout.cohort): x's rows are grouped by run, run i's through w[i]."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w.dim() == 2:
        return cohort_rms_weight(xf.to(x.dtype), w)
    return w * xf.to(x.dtype)


def cohort_rms_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N * B, ..., d] (rows grouped by run) times run i's weight w[i] [d] on its rows."""
    N = w.shape[0]
    return (w.reshape(N, *(1,) * (x.dim() - 1), x.shape[-1]) * x.reshape(N, -1, *x.shape[1:])).reshape(x.shape)


def _linear(x: torch.Tensor, lin: tuple) -> torch.Tensor:
    """lin = (weight, scale | None, bias | None, kind): kind None = plain nn.Linear, else QuantLinear's
    (weights, activations, path), computed by its own forward function. A weight [N, out, in] is a cohort's:
    `cohort_linear`."""
    w, scale, bias, kind = lin
    if w.dim() == 3:
        return cohort_linear(x, lin)
    if kind is None:
        return F.linear(x, w, bias)
    return quant_linear_forward(x, w, scale, bias, *kind)


def cohort_linear(x: torch.Tensor, lin: tuple) -> torch.Tensor:
    """A cohort's projection (parity.rollout.cohort): x [N * B, ..., in] with rows grouped by run, weight
    [N, out, in] (scales [N, out, 1], bias [N, out]): run i's rows through its own weight, as one batched product
    where the format is plain or simulated (fake-quantized activations, row by row, times a float32 weight), else
    through one batched integer product where both sides are integer codes (int8_triton.w8a8_bmm on CUDA: each
    run's product the bits of its own), else through QuantLinear's forward run by run (the FP8 kernels and
    cuBLASLt's int8 GEMM have no batched form here)."""
    w, scale, bias, kind = lin
    N, lead, k = w.shape[0], x.shape[:-1], x.shape[-1]
    xs = x.reshape(N, -1, k)
    if kind is None:
        y = torch.bmm(xs, w.transpose(1, 2))
    elif kind[2] == PREPARED:
        y = torch.bmm(fake_quantize(xs.float(), kind[1]), w.transpose(1, 2)).to(x.dtype)
    elif is_simulated(kind[2], kind[0], kind[1]):
        y = torch.bmm(fake_quantize(xs.float(), kind[1]), simulated_weight(w, scale, kind[0]).transpose(1, 2)).to(x.dtype)
    elif kind[2] in ("int8_triton", "int_codes_triton"):
        xq, xsc = (quantize_rowwise(xs, "int8") if kind[2] == "int8_triton"
                   else quantize_rowwise(xs.float(), kind[1]))
        y = torch.ops.parity.w8a8_bmm(xq, w, xsc, scale, x.dtype)
    else:
        y = torch.stack([quant_linear_forward(xs[i], w[i], scale[i], None, *kind) for i in range(N)])
    if bias is not None:
        y = y + bias[:, None, :].to(y.dtype)
    return y.reshape(*lead, y.shape[-1])


def _project(x: torch.Tensor, lins: tuple, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """One product per entry of `lins`; a single (fused) entry's output is split into `sizes` columns."""
    if len(lins) == 1:
        return _linear(x, lins[0]).split(sizes, dim=-1)
    return tuple(_linear(x, lin) for lin in lins)


def _pre_attention(h: torch.Tensor, ln: torch.Tensor, eps: float, lqkv: tuple, sizes: tuple[int, ...],
                   qn: torch.Tensor, kn: torch.Tensor, eps_qk: float, cos: torch.Tensor, sin: torch.Tensor, D: int):
    """h [B, 1, hidden] -> rotated q [B, H, D], rotated k and v [B, n_kv, D] (HF Qwen3Attention's order)."""
    B = h.shape[0]
    x = _rms(h, ln, eps)[:, 0]
    q, k, v = _project(x, lqkv, sizes)
    q = _rope(_rms(q.reshape(B, -1, D), qn, eps_qk), cos, sin)
    k = _rope(_rms(k.reshape(B, -1, D), kn, eps_qk), cos, sin)
    return q, k, v.reshape(B, -1, D)


def _project_qkv(h: torch.Tensor, ln: torch.Tensor, eps: float, lqkv: tuple, sizes: tuple[int, ...]):
    """The first half of _pre_attention: input norm and the q/k/v product(s), raw q [B, H * D], k, v [B, n_kv * D]
    (the fused pre-attention kernel does the rest)."""
    return _project(_rms(h, ln, eps)[:, 0], lqkv, sizes)


def _o_proj_mlp_project(h: torch.Tensor, attn: torch.Tensor, lo: tuple, ln: torch.Tensor, eps: float, lgu: tuple,
                        sizes: tuple[int, ...], ld: tuple, ln_next: torch.Tensor, eps_next: float, lqkv_next: tuple,
                        sizes_next: tuple[int, ...]):
    """_o_proj_mlp of one layer and _project_qkv of the next in one compiled function, so that the layer's last
    residual add is fused into the next layer's input norm (and its activation quantization) instead of being a
    kernel of its own: (h, q, k, v of the next layer)."""
    h = _o_proj_mlp(h, attn, lo, ln, eps, lgu, sizes, ld)
    return (h, *_project_qkv(h, ln_next, eps_next, lqkv_next, sizes_next))


def _pre_attention_write(h: torch.Tensor, ln: torch.Tensor, eps: float, lqkv: tuple, sizes: tuple[int, ...],
                         qn: torch.Tensor, kn: torch.Tensor, eps_qk: float, cos: torch.Tensor, sin: torch.Tensor,
                         D: int, ck: torch.Tensor, cv: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """_pre_attention that also writes k and v into the caches at `slot` and returns q: compiled, the rotary
    and the cache writes are one kernel instead of three (bf16 cache, no codec)."""
    q, k, v = _pre_attention(h, ln, eps, lqkv, sizes, qn, kn, eps_qk, cos, sin, D)
    ck.index_copy_(2, slot, k[:, :, None].to(ck.dtype))
    cv.index_copy_(2, slot, v[:, :, None].to(cv.dtype))
    return q


def _post_attention(h: torch.Tensor, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, kmask: torch.Tensor,
                    scale: float, lo: tuple, ln: torch.Tensor, eps: float, lgu: tuple, sizes: tuple[int, ...],
                    ld: tuple):
    """Attention over the cache, o_proj, residual, post-norm, SiLU-gated MLP, residual."""
    out = _decode_attention(q.to(ck.dtype), ck, cv, kmask, scale).to(h.dtype)
    return _o_proj_mlp(h, out[:, None], lo, ln, eps, lgu, sizes, ld)


def _o_proj_mlp(h: torch.Tensor, attn: torch.Tensor, lo: tuple, ln: torch.Tensor, eps: float, lgu: tuple,
                sizes: tuple[int, ...], ld: tuple) -> torch.Tensor:
    """The rest of a layer after attention (attn [B, T, H * D], h [B, T, hidden]): o_proj, residual, post-norm,
    SiLU-gated MLP (gate/up as one product when stacked), residual. Shared by the decode step and the prefill."""
    h = h + _linear(attn, lo)
    g, u = _project(_rms(h, ln, eps), lgu, sizes)
    return h + _linear(F.silu(g) * u, ld)


def _prefill_pre(h: torch.Tensor, ln: torch.Tensor, eps: float, lqkv: tuple, sizes: tuple[int, ...],
                 qn: torch.Tensor, kn: torch.Tensor, eps_qk: float, cos: torch.Tensor, sin: torch.Tensor, D: int):
    """The prefill's half of a layer before the cache write, TorchEngine's layer arithmetic with q/k/v as one
    product: h [B, T, hidden] -> q [B, H, T, D], k and v [B, n_kv, T, D] (cos/sin [B, 1, T, D])."""
    B, T, _ = h.shape
    q, k, v = _project(_rms(h, ln, eps), lqkv, sizes)
    q = _rope(_rms(q.view(B, T, -1, D), qn, eps_qk).transpose(1, 2), cos, sin)
    k = _rope(_rms(k.view(B, T, -1, D), kn, eps_qk).transpose(1, 2), cos, sin)
    return q, k, v.view(B, T, -1, D).transpose(1, 2)


def _prefill_post(h: torch.Tensor, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, mask: torch.Tensor,
                  scale: float, lo: tuple, ln: torch.Tensor, eps: float, lgu: tuple, sizes: tuple[int, ...],
                  ld: tuple):
    """Attention of the prompt over the cache's first T slots, o_proj, residual, MLP (gate/up as one product)."""
    B, T, _ = h.shape
    out = F.scaled_dot_product_attention(q, ck, cv, attn_mask=mask, scale=scale, enable_gqa=True)
    return _o_proj_mlp(h, out.transpose(1, 2).reshape(B, T, -1), lo, ln, eps, lgu, sizes, ld)
