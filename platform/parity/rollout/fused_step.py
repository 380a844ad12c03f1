"""A decode step's layers on the fused pre-attention route (parity.rollout.cuda_decode, `_FUSED_PRE`).

Per layer: the q/k/v product (a compiled function, joined to the previous layer's o_proj and MLP when `residual`),
one Triton kernel for the q/k norms and the rotary (parity.rollout.pre_attention), the attention, o_proj and the MLP.

- A packed cache: the kernel also quantizes K and V into the cache and prepares the rotated INT4 queries; the
  attention is the packed cache's kernel.
- A simulated cache (the codec's round trip in a bf16 cache): the same kernel's norms and rotary
  (`fused_norm_rope`), then the codec's round trip and the write in torch, and the plain cache's attention. Its K
  reaches the codec as the packed route's does, so that "packed against simulated on the same route" compares the
  caches alone: the compiled pre-attention function rounds otherwise than any kernel can
  (tests/bench/inductor_rounding.py), which is the model's arithmetic, not the cache's format.

`eager`: the step's layer functions run uncompiled, and the kernel rounds the rotary as they do.
"""

from __future__ import annotations

import torch

from parity.precision.kv_packed import kernel_shape_ok, triton_backend


def simulated_applies(codec, head_dim: int, device: torch.device) -> bool:
    """Whether a simulated cache's step can take the fused route: a codec, Triton on the device, a kernel shape."""
    return codec is not None and triton_backend(device) and kernel_shape_ok(head_dim)


def applies(packed, codec, head_dim: int, device: torch.device) -> bool:
    """Whether a step's cache can take the fused route: a Triton-backed packed cache (`packed`), or a simulated one
    (`codec`) that simulated_applies."""
    if packed is not None:
        from parity.rollout import pre_attention
        return pre_attention.usable(packed)
    return simulated_applies(codec, head_dim, device)


def fused_layers(st, h: torch.Tensor, L: int, pos: torch.Tensor, slot: torch.Tensor, packed, rotated: bool,
                 codec, residual: bool) -> torch.Tensor:
    """The hidden state after the last layer of one decode step (st: the call's DecodeState; packed: its
    PackedKVCache, or None for a simulated cache with `codec`)."""
    from parity.rollout import pre_attention
    from parity.rollout.decode_attention import packed_decode_attention
    from parity.rollout.decode_layers import _pre_attention, plain_decode_attention
    pre_fn, _, _, o_mlp_fn, proj_fn, mid_fn = st.extras["fns"]
    eager = pre_fn is _pre_attention  # layer functions not compiled: the kernel rounds the rotary as they do
    layers = st.extras["layers"]
    B = h.shape[0]
    if packed is None:
        kmask = (torch.arange(L, device=h.device)[None, :] <= slot) & st.key_ok[:, :L]
    qr, kr, vr = proj_fn(h, *layers[0][0][:4])
    for i, ((pre, post), cache) in enumerate(zip(layers, st.caches)):
        if packed is not None:
            qs = pre_attention.fused_pre_attention(qr, kr, vr, pre[4], pre[5], pre[6], st.cos, st.sin, pos,
                                                   packed, cache, slot, rotated, eager_rounding=eager)
            out = packed_decode_attention(None if rotated else qs, packed, cache, st.key_ok, slot, L, post[0],
                                          queries=qs if rotated else None)
        else:
            ck, cv = cache
            n_kv, D = ck.shape[1], ck.shape[3]
            q, k = pre_attention.fused_norm_rope(qr, kr, pre[4], pre[5], pre[6], st.cos, st.sin, pos, n_kv, D,
                                                 eager_rounding=eager)
            k, v = codec.roundtrip(k), codec.roundtrip(vr.reshape(B, n_kv, D))
            ck.index_copy_(2, slot, k[:, :, None].to(ck.dtype))
            cv.index_copy_(2, slot, v[:, :, None].to(cv.dtype))
            out = plain_decode_attention(q, ck, cv, st.key_ok, kmask, slot, L, post[0]).to(h.dtype)
        last = i + 1 == len(layers)
        if not last and residual:  # the residual add goes into the next layer's input norm
            h, qr, kr, vr = mid_fn(h, out[:, None], *post[1:], *layers[i + 1][0][:4])
            continue
        h = o_mlp_fn(h, out[:, None], *post[1:])
        if not last:
            qr, kr, vr = proj_fn(h, *layers[i + 1][0][:4])
    return h
