"""Unit roundoffs and worst-case error bounds for the numerical tests' tolerances (tests/README.md gives the rule).

A tolerance is the first-order worst-case error of the operation in its dtype, for any summation order a kernel
may pick (MKL, oneDNN and ATen choose other blockings and vector widths on AVX2, AVX512 and AMX, and an
element-wise loop runs its vector body and its scalar tail through different exp/log implementations)."""

from __future__ import annotations

import math

import torch

U32 = 2.0 ** -24  # float32 unit roundoff: one correctly rounded operation is within U32 (relative)
U64 = 2.0 ** -53  # float64
UBF16 = 2.0 ** -8  # bfloat16 (8 significant bits)


def sum_bound(abs_sum: float, n: int, u: float = U32) -> float:
    """|fl(sum of n terms) - exact sum| in any order: (n - 1) u sum|x_i|. Two orders differ by twice that."""
    return max(n - 1, 0) * u * abs_sum


def logprob_bound(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0,
                  logits_dtype: torch.dtype = torch.float32, same_logits: bool = False) -> float:
    """Largest first-order error of one evaluation of lp = log_softmax(hidden @ weight.T / T)[y] whose log-softmax is
    float32, any row, any token, any summation order. With S = max_j sum_k |h_k w_jk| / T, L = max |z| (<= S), K = H:
      z_j = fl(h . w_j) / T   K-term dot product accumulated in float32, rounded to logits_dtype (u_out: U32 or
                              UBF16), the float32 division: |dz| <= K U32 S + (u_out + U32) L
      lse = m + log sum_j exp(z_j - m)   subtraction <= 2 U32 L, exp 1 ulp (2 U32), V-term positive sum (V - 1) U32
                              relative, log 1 ulp of log V, + m: U32 |lse| <= U32 (L + log V); the dz_j enter weighted
                              by p_j
      lp = z_y - lse          dz_y - sum_j p_j dz_j <= 2 max |dz|; the subtraction U32 |lp| <= U32 (2L + log V)
    sum: 2 |dz| + U32 (5 L + V + 1 + 4 log V). same_logits: the logits are given (two evaluations that share them
    differ only in the log-softmax: dz = 0). Two evaluations in other orders differ by up to twice this."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    s = float((h.abs() @ w.abs().T).max()) / temperature
    big_l = float((h @ w.T).abs().max()) / temperature
    k, v = h.shape[-1], w.shape[0]
    u_out = U32 if logits_dtype == torch.float32 else UBF16
    dz = 0.0 if same_logits else k * U32 * s + (u_out + U32) * big_l
    return 2 * dz + U32 * (5 * big_l + v + 1 + 4 * math.log(v))


def logprob_grad_scales(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, g: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (G_h [n, H], G_W [V, H]) that the errors of the gradients of sum_m g_m lp[ids_m] scale with: the
    gradient is (sum_m g_m (onehot_m - p)) W / T for a row's hidden state and its sum over rows, times h / T, for W;
    G replaces every factor by its magnitude, (sum_m |g_m| onehot_m + sum_m |g_m| p) |W| / T and so on. A float32
    gradient is then within (2 dlp + (n + c) u) G, dlp = logprob_bound (g and p each carry a log-prob's error), n
    the terms of its sum (V for G_h, rows for G_W), c its few roundings. hidden [n, H], ids and g [n, M]."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    ids = ids.reshape(h.shape[0], -1)
    g = g.detach().double().abs().reshape(ids.shape)
    p = torch.softmax(h @ w.T / temperature, -1)
    dz = torch.zeros_like(p).scatter_add_(1, ids, g) + g.sum(-1, keepdim=True) * p
    return dz @ w.abs() / temperature, dz.T @ h.abs() / temperature


def token_coefficients(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """float64 c [B, R] with loss = sum over tokens of c * per-token loss for each aggregation mode (0 on padding):
    what each token's error is weighted with in an aggregated loss's bound."""
    n = mask.sum(-1, keepdim=True).double()
    seqs = int((n > 0).sum())
    c = {"token-mean": torch.ones_like(n) / mask.sum(), "seq-mean-token-mean": 1 / (n.clamp_min(1) * seqs),
         "seq-mean-token-sum-norm": torch.ones_like(n) / (seqs * mask.shape[-1])}[mode]
    return torch.where(mask, c.expand(mask.shape), 0.0)


def first_order_bound(value: torch.Tensor, leaves: list[torch.Tensor], errors: list[torch.Tensor]) -> float:
    """sum_i |d value / d leaf_i| * error_i: how far `value` (a float64 formula of the leaves, with autograd) can move
    when each leaf is off by up to its error, to first order."""
    grads = torch.autograd.grad(value, leaves, retain_graph=True, allow_unused=True)
    return sum(float((g.abs() * e).sum()) for g, e in zip(grads, errors, strict=True) if g is not None)


def float32_prob_error(p: torch.Tensor) -> torch.Tensor:
    """Bound on |p' - p| for a probability p that a computation receives as a float32 log-prob and exponentiates:
    p rounded to float32 (u p), its log (1 ulp: 2 u |log p|), exp (1 ulp: 2 u) -> (3 + 2 |log p|) u p."""
    p = p.detach().double()
    return (3 + 2 * p.log().abs()) * U32 * p


def matmul_bound(a: torch.Tensor, b: torch.Tensor, roundings: int = 0, u: float = U32) -> torch.Tensor:
    """Entry-wise |fl(a @ b) - a @ b| for any summation order: K u (|a| @ |b|), K the inner dimension (K products and
    K - 1 additions, each rounded once), plus `roundings` further roundings of the terms (a dequantization, a bias
    add, a scale). float64 [M, N]; in float32 accumulation (bf16 operands included) u = U32."""
    k = a.shape[-1]
    return (k + roundings) * u * (a.detach().double().abs() @ b.detach().double().abs())
