"""KV-cache codecs: INT4 pack/unpack exact on its grid, nibble layout, INT8/FP8 bounds, errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from parity.precision.kv import (
    KV_KINDS,
    hadamard_rotate,
    make_kv_codec,
    pack_nibbles,
    unpack_nibbles,
)


def test_nibble_pack_unpack_exact_for_every_pair() -> None:
    pairs = torch.tensor(list(itertools.product(range(16), range(16))), dtype=torch.uint8)  # [256, 2]
    packed = pack_nibbles(pairs)
    assert packed.shape == (256, 1) and packed.dtype == torch.uint8
    assert sorted(packed.flatten().tolist()) == list(range(256))  # a bijection onto bytes
    assert torch.equal(unpack_nibbles(packed), pairs)
    # layout: element 2i in the low nibble, 2i + 1 in the high nibble (vLLM's)
    assert pack_nibbles(torch.tensor([3, 10], dtype=torch.uint8)).item() == 0xA3


@pytest.mark.parametrize("scale", [2.0 ** -3, 0.75, 3.0, 2.0 ** -12])
def test_int4_exact_for_every_representable_value(scale: float) -> None:
    """x = (q - z) s for every code q in 0..15 and every zero point z in 0..15 comes back exactly."""
    codec = make_kv_codec("int4_per_token_head", 32, hadamard=False)
    g = torch.Generator().manual_seed(0)
    q = torch.stack([torch.randperm(32, generator=g) % 16 for _ in range(16)]).float()  # each row holds 0..15 twice
    z = torch.arange(16).float().unsqueeze(1)
    x = (q - z) * scale  # [16 zero points, 32]
    state = codec.pack(x)
    assert state.codes.dtype == torch.uint8 and state.codes.shape == (16, 16)
    assert torch.equal(state.zero.flatten().long(), torch.arange(16))
    assert torch.equal(unpack_nibbles(state.codes).float(), q)
    assert torch.equal(codec.unpack(state), x)
    assert torch.equal(codec.roundtrip(x), x)


@pytest.mark.parametrize("hadamard", [False, True])
def test_int4_roundtrip_equals_pack_unpack(hadamard: bool) -> None:
    codec = make_kv_codec("int4_per_token_head", 64, hadamard=hadamard)
    x = torch.randn(2, 3, 5, 64, dtype=torch.bfloat16)
    xh = codec.roundtrip(x)
    assert xh.dtype == torch.bfloat16 and xh.shape == x.shape
    assert torch.equal(xh, codec.unpack(codec.pack(x)))


def test_int4_error_within_half_step_float64() -> None:
    codec = make_kv_codec("int4_per_token_head", 16, hadamard=False)
    # rows of every sign pattern: centred, all positive (offset), all negative, tiny and huge
    x = torch.randn(300, 16) * torch.logspace(-2, 2, 300).unsqueeze(1) + 3 * torch.randn(300, 1)
    err = (codec.roundtrip(x).double() - x.double()).abs()
    x64 = x.double()
    step = (x64.amax(1, keepdim=True).clamp_min(0) - x64.amin(1, keepdim=True).clamp_max(0)) / 15
    # half a step, plus vLLM's clearing of the scale's 4 low mantissa bits (<= 15 codes * 2^-19 relative)
    bound = step * (0.5 + 15 * 2.0 ** -19) * (1 + 2.0 ** -20)
    assert (err <= bound).all()
    assert (err / bound).max() > 0.9
    assert ((x64.amin(1) > 0).any() and (x64.amax(1) < 0).any())  # one-signed rows were exercised


def test_int4_hadamard_roundtrip_is_inverse_rotation_of_quantized_rotated() -> None:
    x = torch.randn(4, 48)  # 48 = 3 blocks of 16 (largest power-of-two divisor)
    y = hadamard_rotate(x)
    # a 16-point Hadamard transform is 4 butterfly levels, each rounding once: within 4 u of the sum of the 16
    # |x| (~13 for N(0, 1)), ~3e-6 each way, 6e-6 there and back, under atol 1e-5; the norms below: 4 levels then
    # a 48-term sum of squares, (4 + 48) u = 3e-6 relative, under rtol 1e-5
    torch.testing.assert_close(hadamard_rotate(y, inverse=True), x, rtol=1e-5, atol=1e-5)
    # the rotation is orthogonal up to sqrt(b): norms scale by sqrt(16)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1) * 4, rtol=1e-5, atol=1e-5)
    plain = make_kv_codec("int4_per_token_head", 48, hadamard=False)
    rot = make_kv_codec("int4_per_token_head", 48, hadamard=True)
    expected = hadamard_rotate(plain.roundtrip(hadamard_rotate(x)), inverse=True)
    torch.testing.assert_close(rot.roundtrip(x), expected, rtol=1e-5, atol=1e-5)  # the same ops composed: as above


def test_int4_hadamard_helps_on_outlier_vectors() -> None:
    """One large channel per head (typical of keys) wastes the 16 levels; the rotation spreads it."""
    x = torch.randn(256, 64) * 0.1
    x[:, 5] = 8.0
    e_plain = (make_kv_codec("int4_per_token_head", 64, hadamard=False).roundtrip(x) - x).pow(2).mean()
    e_rot = (make_kv_codec("int4_per_token_head", 64, hadamard=True).roundtrip(x) - x).pow(2).mean()
    assert e_rot < e_plain / 4


def test_int8_round_half_away_and_bound() -> None:
    codec = make_kv_codec("int8", 4)
    s = 2.0 ** -4
    x = torch.tensor([[127 * s, 0.5 * s, -0.5 * s, 1.5 * s]])
    st = codec.pack(x)
    assert st.codes.tolist() == [[127, 1, -1, 2]] and st.scale.item() == s
    y = torch.randn(300, 64, dtype=torch.float64).float()
    err = (make_kv_codec("int8_per_token_head", 64).roundtrip(y).double() - y.double()).abs()
    assert (err <= y.double().abs().amax(1, keepdim=True) / 127 / 2 * (1 + 2 ** -20)).all()


def test_fp8_kinds() -> None:
    x = torch.tensor([[1000.0, -3.3, 0.01, 0.0]])
    assert make_kv_codec("fp8", 4).roundtrip(x)[0, 0].item() == 448.0  # saturates at the per-tensor scale 1
    per = make_kv_codec("fp8_per_token_head", 4).roundtrip(x)
    assert per[0, 0].item() == pytest.approx(1000.0, rel=2 ** -4)  # e4m3: 3 mantissa bits, half a step is 2^-4
    y = torch.randn(100, 32) * 10
    err = (make_kv_codec("fp8_per_token_head", 32).roundtrip(y) - y).abs()
    assert (err <= torch.maximum(y.abs() * 2 ** -4, y.abs().amax(1, keepdim=True) / 448 * 2 ** -10) * 1.0001).all()


@pytest.mark.parametrize("kind", KV_KINDS)
def test_every_kind_preserves_shape_dtype_and_is_close(kind: str) -> None:
    codec = make_kv_codec(kind, 32)
    x = torch.randn(2, 2, 3, 32, dtype=torch.bfloat16)
    y = codec.roundtrip(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y.float() - x.float()).abs().max() < 0.6
    assert codec.bytes_per_token_head() <= 64


def test_bad_kv_inputs() -> None:
    with pytest.raises(ValueError, match=r"even head_dim .*head_dim=33"):
        make_kv_codec("int4_per_token_head", 33)
    with pytest.raises(ValueError, match="unknown KV cache kind 'int2'"):
        make_kv_codec("int2", 16)
    with pytest.raises(ValueError, match="last dim 8 != head_dim 16"):
        make_kv_codec("int8", 16).roundtrip(torch.zeros(2, 8))
