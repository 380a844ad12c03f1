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


def attention_inputs(shape: tuple, D: int, dtype: torch.dtype, device: torch.device, seed: int) -> tuple:
    """Fresh random (q, k, v, key_ok, slot) of `shape` = (B, n_kv, G, S, L, slot): keys twice the values' scale,
    left padding of random length per row."""
    g = torch.Generator().manual_seed(seed)
    B, n_kv, G, S, L, slot = shape
    k = (torch.randn(B, n_kv, S, D, generator=g) * 2).to(dtype).to(device)
    v = torch.randn(B, n_kv, S, D, generator=g).to(dtype).to(device)
    q = torch.randn(B, n_kv * G, D, generator=g).to(dtype).to(device)
    key_ok = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        key_ok[b, :int(torch.randint(0, slot + 1, (1,), generator=g))] = False
    return q, k, v, key_ok.to(device), torch.tensor([slot], device=device)


def check_attention(kind: str | None, hadamard: bool, D: int, dtype: torch.dtype, device: torch.device,
                    shape: tuple, seed: int = 0) -> float:
    """Relative error (norm) of the kernel against float64 over the codec's values (the simulated cache's; for the
    rotated int4 route the values computed from the codes, which that kernel attends over unrounded); kind None =
    the kernel over a plain cache of `dtype` values (raw_decode_attention)."""
    from parity.rollout import decode_attention as da
    B, n_kv, G, S, L, slot = shape
    H = n_kv * G
    q, k, v, key_ok, st = attention_inputs(shape, D, dtype, device, seed)
    scale = D ** -0.5
    if kind is None:
        out = da.raw_decode_attention(q, k, v, key_ok, st, L, scale)
        kh, vh = k, v
    else:
        cache = PackedKVCache(make_kv_codec(kind, D, hadamard=hadamard), 1, B, n_kv, S, dtype, device)
        cache.write(cache.layers[0], k, v, torch.zeros(1, dtype=torch.long, device=device))
        out = da.packed_decode_attention(q, cache, cache.layers[0], key_ok, st, L, scale)
        kh, vh = cache.values(cache.layers[0], L)
        if da.int4_rotated(cache):  # attends over the codec's values before their rounding to the cache dtype
            kh, vh = codec_values_f64(cache, cache.layers[0], "k", L), codec_values_f64(cache, cache.layers[0], "v", L)
    assert out.shape == (B, H * D) and out.dtype == dtype
    assert torch.isfinite(out).all()
    kmask = (torch.arange(L, device=device)[None, :] <= slot) & key_ok[:, :L]
    want = attention_f64(q, kh[:, :, :L], vh[:, :, :L], kmask, scale)
    return float((out.double() - want).norm() / want.norm())


def attention_bound(dtype: torch.dtype) -> float:
    """float32 arithmetic far under 1e-3 (2e-7 seen under the interpreter); bf16 operands, a bf16 output and bf16
    probabilities in the P V product: 2e-3 seen (an indexing or masking error gives errors of order 1)."""
    return 1e-5 if dtype == torch.float32 else 5e-3


def codec_values_f64(cache: PackedKVCache, layer, which: str, L: int) -> torch.Tensor:
    """The int4 codec's values of slots [0, L) in float64, computed from the stored codes and scale words (the
    simulated cache holds them rounded to its dtype): d (H (n' - z)) s / D, or (n' - z) s without the rotation."""
    from parity.precision.kv import _fwht, _rht_signs, unpack_nibbles
    st = cache.state(layer, which, 0, L)
    n = unpack_nibbles(st.codes).double() - st.zero.double()
    if cache.hadamard:
        n = _fwht(n) * _rht_signs(n.shape[-1], n.device).double() / n.shape[-1]
    return n * st.scale.double()


def check_int4_attention(D: int, dtype: torch.dtype, device: torch.device, shape: tuple, hadamard: bool,
                         seed: int = 0, config: dict | None = None) -> tuple[float, float]:
    """The rotated int4 attention (parity.rollout.int4_attention) on fresh random inputs and a NaN-poisoned output:
    relative error (norm) against a float64 attention over the codec's values computed from the codes, and the
    simulated cache's own distance from that attention (its values rounded to `dtype`). Checks that every output
    element was written and that the merge counters are back at zero."""
    from parity.rollout import int4_attention as ia
    B, n_kv, G, S, L, slot = shape
    H = n_kv * G
    q, k, v, key_ok, st = attention_inputs(shape, D, dtype, device, seed)
    codec = make_kv_codec("int4_per_token_head", D, hadamard=hadamard)
    cache = PackedKVCache(codec, 1, B, n_kv, S, dtype, device)
    layer = cache.layers[0]
    cache.write(layer, k, v, torch.zeros(1, dtype=torch.long, device=device))
    ws = ia.Workspace()
    out = torch.full((B, H, D), float("nan"), dtype=dtype, device=device)
    got = ia.int4_attention(ia.prepare_queries(q, hadamard), layer.k, layer.v, layer.k_scale, layer.v_scale, key_ok,
                            st, L, D ** -0.5, hadamard, dtype, ws, config, out=out)
    assert got.shape == (B, H * D) and got.dtype == dtype
    assert torch.isfinite(got).all(), "output elements left unwritten (NaN poison) or not finite"
    assert int(ws.count.abs().sum()) == 0, "merge counters not reset"
    kmask = (torch.arange(L, device=device)[None, :] <= slot) & key_ok[:, :L]
    want = attention_f64(q, codec_values_f64(cache, layer, "k", L), codec_values_f64(cache, layer, "v", L), kmask,
                         D ** -0.5)
    kh, vh = cache.values(layer, L)
    sim = attention_f64(q, kh, vh, kmask, D ** -0.5)
    return float((got.double() - want).norm() / want.norm()), float((sim - want).norm() / want.norm())


def int4_attention_outputs(shape: tuple, D: int, device: torch.device, configs: list, seed: int = 0,
                           left_pad: int = 0) -> list:
    """The rotated int4 attention's bf16 output under each launch configuration in `configs`, on one set of random
    inputs (attention_inputs) written to a packed INT4 cache; `left_pad`: the first row's first slots masked too."""
    from parity.rollout import int4_attention as ia
    B, n_kv, G, S, L, slot = shape
    q, k, v, key_ok, st = attention_inputs(shape, D, torch.bfloat16, device, seed)
    key_ok[0, :left_pad] = False
    cache = PackedKVCache(make_kv_codec("int4_per_token_head", D), 1, B, n_kv, S, torch.bfloat16, device)
    layer = cache.layers[0]
    cache.write(layer, k, v, torch.zeros(1, dtype=torch.long, device=device))
    qs = ia.prepare_queries(q, True)
    return [ia.int4_attention(qs, layer.k, layer.v, layer.k_scale, layer.v_scale, key_ok, st, L, D ** -0.5, True,
                              torch.bfloat16, ia.Workspace(), cfg) for cfg in configs]


def check_pre_attention(kind: str, hadamard: bool, D: int, dtype: torch.dtype, device: torch.device,
                        rotated: bool, seed: int = 0, eager: bool = False) -> dict:
    """The fused pre-attention kernel (parity.rollout.pre_attention) against the decode step's torch functions on
    random projections: q/k norms and rotary (the kernel rounds the rotary once, from float32, as Inductor does;
    `eager`: the kernel's eager rounding against decode_layers' eager _rms and _rope), the codec's codes of k and v
    in the cache, and the query side (the rotated query of the torch q, or q itself). Returns the figures; asserts
    what must hold everywhere (v's codes exact, every output finite)."""
    from parity.precision.kv import _fwht, _rht_signs
    from parity.rollout.cuda_decode import _rms, _rope
    from parity.rollout.pre_attention import fused_pre_attention
    g = torch.Generator().manual_seed(seed)
    B, H, n_kv, S, P = 3, 4, 2, 24, 40
    codec = make_kv_codec(kind, D, hadamard=hadamard)
    cache = PackedKVCache(codec, 1, B, n_kv, S, dtype, device)
    layer = cache.layers[0]
    qkv = (torch.randn(B, (H + 2 * n_kv) * D, generator=g) * 3).to(dtype).to(device)
    q, k, v = qkv.split([H * D, n_kv * D, n_kv * D], dim=1)  # strided views, as the stacked product's split
    qn = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(device)
    kn = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(device)
    ang = torch.arange(P)[:, None] * (10000.0 ** (-torch.arange(D // 2) / (D // 2)))[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], 1).to(dtype).to(device)
    sin = torch.cat([ang.sin(), ang.sin()], 1).to(dtype).to(device)
    pos = torch.randint(0, P, (B,), generator=g).to(device)
    slot = torch.tensor([7], device=device)
    eps = 1e-6
    got = fused_pre_attention(q, k, v, qn, kn, eps, cos, sin, pos, cache, layer, slot, rotated, eager_rounding=eager)

    def norm_rope(x, w, heads):
        if eager:  # the step's own functions, run eagerly in the model dtype
            return _rope(_rms(x.reshape(B, heads, D), w, eps), cos[pos][:, None], sin[pos][:, None])
        y = _rms(x.reshape(B, heads, D), w, eps).float()
        c, s = cos[pos][:, None].float(), sin[pos][:, None].float()
        rot = torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1)
        return (y * c + rot * s).to(dtype)

    q_ref, k_ref, v_ref = norm_rope(q, qn, H), norm_rope(k, kn, n_kv), v.reshape(B, n_kv, D)
    out = {}
    for name, x_ref in (("k", k_ref), ("v", v_ref)):
        st_ref, st_got = codec.pack(x_ref), cache.state(layer, name, 7, 8)
        c_ref = st_ref.codes.view(torch.uint8).reshape(B, n_kv, -1)
        c_got = st_got.codes.view(torch.uint8).reshape(B, n_kv, -1)
        out[f"{name}_codes_differing"] = float((c_ref != c_got).float().mean())
        vals = cache.values(layer, 8, lo=7)[0 if name == "k" else 1][:, :, 0]
        want = codec.roundtrip(x_ref)
        out[f"{name}_value_max_rel"] = float((vals.float() - want.float()).abs().max() / want.float().abs().max())
    assert out["v_codes_differing"] == 0.0, "v's codes differ from the codec's"
    if rotated:
        assert torch.isfinite(got.rotated).all() and torch.isfinite(got.factors).all()
        qr = q_ref.double()
        if hadamard:
            qr = _fwht(qr * _rht_signs(D, qr.device).double())
        out["q_rotated_rel"] = float((got.rotated.double() - qr).norm() / qr.norm())
    else:
        assert got.shape == (B, H, D) and torch.isfinite(got).all()
        out["q_rel"] = float((got.double() - q_ref.double()).norm() / q_ref.double().norm())
    return out


def pre_attention_rounding_modes(device: torch.device, seed: int = 0) -> float:
    """Fraction of the normed, rotated bf16 queries (64 rows x 8 heads x 64) on which the fused pre-attention
    kernel's two roundings of the rotary (once, as Inductor; three times, as the eager functions) disagree: that the
    mode the decode step passes matters."""
    from parity.rollout.pre_attention import fused_pre_attention
    g = torch.Generator().manual_seed(seed)
    B, H, n_kv, D, P = 64, 8, 2, 64, 40
    cache = PackedKVCache(make_kv_codec("fp8_per_token_head", D), 1, B, n_kv, 8, torch.bfloat16, device)
    qkv = (torch.randn(B, (H + 2 * n_kv) * D, generator=g) * 3).to(torch.bfloat16).to(device)
    q, k, v = qkv.split([H * D, n_kv * D, n_kv * D], dim=1)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16).to(device)
    ang = torch.arange(P)[:, None] * (10000.0 ** (-torch.arange(D // 2) / (D // 2)))[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], 1).to(torch.bfloat16).to(device)
    sin = torch.cat([ang.sin(), ang.sin()], 1).to(torch.bfloat16).to(device)
    pos = torch.randint(0, P, (B,), generator=g).to(device)
    slot = torch.tensor([3], device=device)
    once, eager = (fused_pre_attention(q, k, v, w, w, 1e-6, cos, sin, pos, cache, cache.layers[0], slot, False,
                                       eager_rounding=e) for e in (False, True))
    return float((once != eager).float().mean())


def teacher_forced_logprobs(eng, b, temperature: float, rows_per_forward: int = 4) -> torch.Tensor:
    """[B, R] log-probs of `b`'s own response tokens under `eng`'s arithmetic with the simulated cache (every K/V
    through the codec's round trip; no codec: the plain forward), all positions in one full-sequence forward per
    group of rows: the reference a decode path is scored against on the tokens it sampled itself, so that one
    early difference does not decide every later token (tests/test_kv_packed_cuda.py, tests/bench/gpu_bench_kv.py)."""
    from parity.core.layout import positions, prefill_mask
    out = []
    P = b.prompts.shape[1]
    inner = eng.model.model
    dtype = eng.model.lm_head.weight.dtype
    for rows in torch.arange(b.input_ids.shape[0]).split(rows_per_forward):
        ids, am = b.input_ids[rows].to(eng.device), b.attention_mask[rows].to(eng.device)
        B, T = ids.shape
        with torch.no_grad():
            h = inner.embed_tokens(ids)
            cos, sin = inner.rotary_emb(h, positions(am))
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            mask = prefill_mask(am)[:, None]
            for layer in inner.layers:
                cache = tuple(torch.zeros(B, eng.n_kv, T, eng.head_dim, dtype=dtype, device=eng.device) for _ in "kv")
                h = eng._layer(layer, h, cos, sin, cache, 0, mask)
            logits = eng.model.lm_head(inner.norm(h[:, P - 1:-1])).float()
            resp = b.responses[rows].to(eng.device)
            lp = torch.log_softmax(logits / temperature, -1).gather(-1, resp[..., None])[..., 0]
        out.append(lp * b.response_mask[rows].to(eng.device))
    return torch.cat(out)


def write_small_qwen3(d) -> None:
    """A small random Qwen3 with the 0.6B model's head_dim (128) and grouped-query attention (4 heads, 2 KV) saved
    to folder `d` (the CUDA tests' model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    # initializer_range 0.1: logits of a few units, so a wrong attention moves log-probs by far more than rounding
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=0,
                      initializer_range=0.1)
    Qwen3ForCausalLM(cfg).save_pretrained(str(d))
