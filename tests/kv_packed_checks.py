"""Checks of the packed KV cache and the decode-attention kernel, shared by the CUDA tests
(tests/test_kv_packed_cuda.py) and the same checks under Triton's CPU interpreter (test_kv_packed_interpret.py).

- the write kernel gives the codec's codes and scales bit for bit (prefill writes from a strided tensor, then
  decode-step writes at a slot read from the device), and the tile loader the codec's values bit for bit;
- the attention kernel, on random lengths, head counts, left padding and split counts, matches a float64
  attention over the codec's values (relative error of the output's norm, per format and dtype).
"""

from __future__ import annotations

import torch

from parity.precision.kv import KVState, make_kv_codec
from parity.precision.kv_packed import PackedKVCache

# (kind, hadamard) of every packed format
FORMATS = [("int8", False), ("fp8", False), ("fp8_per_token_head", False), ("int4_per_token_head", False),
           ("int4_per_token_head", True)]


def kv_inputs(B: int, n_kv: int, T: int, D: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[B, n_kv, T, D] with the rows that exercise the edge cases: all zero, one-signed (int4's grid must hold
    0), an outlier channel, values past fp8's 448 (per-tensor saturation) and tiny ones (fp8 subnormals, the
    1e-6 scale floor); the rest Gaussian of varied scale. Strided like a prefill's k (a transposed view)."""
    x = torch.randn(B, T, n_kv, D, generator=g) * torch.logspace(-2, 1, T)[None, :, None, None]
    x[0, 0] = 0.0
    if T > 2:
        x[0, 1] = x[0, 1].abs() + 0.5
        x[0, 2] = -x[0, 2].abs() - 0.5
    if T > 3:
        x[0, 3, :, 5] = 40.0
    if T > 4:
        x[0, 4] = x[0, 4] / x[0, 4].abs().amax() * 1000.0
    if T > 5:
        x[0, 5] *= 1e-7
    return x.to(dtype).transpose(1, 2)


def _codes(st: KVState) -> torch.Tensor:
    return st.codes.view(torch.uint8) if st.codes.element_size() == 1 else st.codes


def check_write_and_values(kind: str, hadamard: bool, D: int, dtype: torch.dtype, device: torch.device,
                           seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    B, n_kv, T, S = 2, 3, 21, 40
    codec = make_kv_codec(kind, D, hadamard=hadamard)
    cache = PackedKVCache(codec, 1, B, n_kv, S, dtype, device)
    layer = cache.layers[0]
    k, v = kv_inputs(B, n_kv, T, D, dtype, g).to(device), kv_inputs(B, n_kv, T, D, dtype, g).to(device)
    cache.write(layer, k, v, torch.zeros(1, dtype=torch.long, device=device))
    steps = [(kv_inputs(B, n_kv, 1, D, dtype, g)[:, :, 0].to(device) * 3,
              kv_inputs(B, n_kv, 1, D, dtype, g)[:, :, 0].to(device)) for _ in range(2)]
    for t, (ks, vs) in enumerate(steps):  # decode steps: [B, n_kv, D] at slot T + t
        cache.write(layer, ks, vs, torch.tensor([T + t], device=device))
    allk = torch.cat([k] + [s[0][:, :, None] for s in steps], 2)
    allv = torch.cat([v] + [s[1][:, :, None] for s in steps], 2)
    n = T + len(steps)
    for which, x in (("k", allk), ("v", allv)):
        ref, got = codec.pack(x), cache.state(layer, which, 0, n)
        assert torch.equal(_codes(got), _codes(ref)), (
            f"{kind} {which}: {int((_codes(got) != _codes(ref)).sum())} of {ref.codes.numel()} codes differ")
        if ref.scale is not None:
            assert torch.equal(got.scale, ref.scale), f"{kind} {which}: scales differ"
        if ref.zero is not None:
            assert torch.equal(got.zero, ref.zero), f"{kind} {which}: zero points differ"
    kh, vh = cache.values(layer, n)
    assert kh.dtype == dtype and kh.shape == allk.shape
    for name, got, x in (("k", kh, allk), ("v", vh, allv)):
        want = codec.roundtrip(x)
        assert torch.equal(got, want), (f"{kind} {name}: {int((got != want).sum())} of {want.numel()} dequantized "
                                        f"values differ from the codec's")
    k2, _ = cache.values(layer, n, lo=7)  # a window that starts inside a tile
    assert torch.equal(k2, kh[:, :, 7:])
    assert (cache.state(layer, "k", n, S).codes.view(torch.uint8) == 0).all()  # nothing written past the slots


def attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kmask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """float64 grouped-query attention: q [B, H, D], k/v [B, n_kv, L, D], kmask [B, L] -> [B, H * D]."""
    B, H, D = q.shape
    G = H // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("bhd,bhld->bhl", q.double(), kk) * scale
    s = s.masked_fill(~kmask[:, None, :], float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), vv).reshape(B, H * D)


# (B, n_kv, G, S, L, slot): heads and lengths of the attention checks (L a multiple of the tile or not, slot
# below L - 1 so that later slots must stay unseen)
SHAPES = [(2, 2, 3, 150, 150, 149), (3, 1, 4, 96, 70, 51), (1, 4, 1, 300, 256, 255), (5, 2, 2, 64, 64, 13)]


def check_attention(kind: str | None, hadamard: bool, D: int, dtype: torch.dtype, device: torch.device,
                    shape: tuple, seed: int = 0) -> float:
    """Relative error (norm) of the kernel against float64 over the codec's values; kind None = the kernel over
    a plain cache of `dtype` values (raw_decode_attention)."""
    from parity.rollout import decode_attention as da
    g = torch.Generator().manual_seed(seed)
    B, n_kv, G, S, L, slot = shape
    H = n_kv * G
    k = (torch.randn(B, n_kv, S, D, generator=g) * 2).to(dtype).to(device)
    v = torch.randn(B, n_kv, S, D, generator=g).to(dtype).to(device)
    q = torch.randn(B, H, D, generator=g).to(dtype).to(device)
    key_ok = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):  # left padding of random length
        key_ok[b, :int(torch.randint(0, slot + 1, (1,), generator=g))] = False
    key_ok = key_ok.to(device)
    st = torch.tensor([slot], device=device)
    scale = D ** -0.5
    if kind is None:
        out = da.raw_decode_attention(q, k, v, key_ok, st, L, scale)
        kh, vh = k, v
    else:
        cache = PackedKVCache(make_kv_codec(kind, D, hadamard=hadamard), 1, B, n_kv, S, dtype, device)
        cache.write(cache.layers[0], k, v, torch.zeros(1, dtype=torch.long, device=device))
        out = da.packed_decode_attention(q, cache, cache.layers[0], key_ok, st, L, scale)
        kh, vh = cache.values(cache.layers[0], L)
    assert out.shape == (B, H * D) and out.dtype == dtype
    assert torch.isfinite(out).all()
    kmask = (torch.arange(L, device=device)[None, :] <= slot) & key_ok[:, :L]
    want = attention_f64(q, kh[:, :, :L], vh[:, :, :L], kmask, scale)
    return float((out.double() - want).norm() / want.norm())


def attention_bound(dtype: torch.dtype) -> float:
    """float32 arithmetic far under 1e-3 (2e-7 seen under the interpreter); bf16 operands, a bf16 output and bf16
    probabilities in the P V product: 2e-3 seen (an indexing or masking error gives errors of order 1)."""
    return 1e-5 if dtype == torch.float32 else 5e-3
