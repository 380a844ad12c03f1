"""INT8 / FP8 row-wise formats against float64 references and their documented error bounds."""

from __future__ import annotations

import pytest
import torch

from parity.precision.formats import (
    FP8_MAX,
    dequantize,
    fake_quantize,
    quantize_rowwise,
)
from tests.tolerances import U32, matmul_bound

F32_SLACK = 2.0 ** -20  # float32 rounding of x / s and of the scale itself (a few u = 2^-24 each, 16 u here)


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64).unsqueeze(1)
    w[3] = 0.0  # an all-zero channel
    w[5, 7] = 40.0  # an outlier channel
    w[9] = torch.linspace(-1e-3, 1e-3, 96)  # values in FP8's subnormal range relative to the row max
    w[9, 0] = 1.0
    return w


def test_int8_per_channel_within_bound_against_float64() -> None:
    w = _weights()
    q, s = quantize_rowwise(w, "int8")
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (64, 1)
    w64 = w.double()
    amax = w64.abs().amax(1, keepdim=True)
    s_ref = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    torch.testing.assert_close(s.double(), s_ref, rtol=2 ** -23, atol=0)  # one float32 division: <= u = 2^-24
    assert int(q.abs().max()) == 127 and q[3].eq(0).all()
    err = (w64 - q.double() * s.double()).abs()
    bound = s_ref / 2
    assert (err <= bound * (1 + F32_SLACK)).all()
    # the bound is tight: some element sits near half a step away (so the test can fail)
    assert (err / bound).max() > 0.95


def test_int8_codes_are_round_half_even_of_float64_division() -> None:
    w = _weights()
    q, s = quantize_rowwise(w, "int8")
    ref = torch.round(w.double() / s.double()).clamp(-127, 127)
    # float32 division may land on the other side of a .5 tie only when within 2^-20 of it
    diff = (q.double() - ref).abs()
    near_tie = ((w.double() / s.double()).abs() % 1 - 0.5).abs() < 1e-4
    assert (diff[~near_tie] == 0).all() and (diff <= 1).all()


def test_int8_on_grid_values_are_exact() -> None:
    q0 = torch.randint(-127, 128, (8, 32), generator=torch.Generator().manual_seed(1)).float()
    q0[:, 0] = 127
    s0 = torch.tensor([2.0 ** -k for k in range(8)]).unsqueeze(1)
    x = q0 * s0
    q, s = quantize_rowwise(x, "int8")
    assert torch.equal(s, s0) and torch.equal(q.float(), q0) and torch.equal(dequantize(q, s), x)


def test_fp8_per_channel_within_bound_against_float64() -> None:
    w = _weights()
    q, s = quantize_rowwise(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1)
    assert float(q.float().abs().max()) == FP8_MAX
    w64 = w.double()
    err = (w64 - q.double() * s.double()).abs()
    amax = w64.abs().amax(1, keepdim=True)
    s_ref = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    bound = torch.maximum(w64.abs() * 2 ** -4, s_ref * 2 ** -10)
    assert (err <= bound * (1 + F32_SLACK) + 1e-300).all()
    assert (err / bound).max() > 0.9
    # row 9 exercises the subnormal branch: its absolute error exceeds the relative bound somewhere
    sub = err[9] > w64[9].abs() * 2 ** -4
    assert sub.any()


def test_fp8_per_token_shapes_and_saturation_free() -> None:
    x = torch.randn(2, 5, 48, dtype=torch.bfloat16) * 1000
    q, s = quantize_rowwise(x, "fp8")
    assert q.shape == x.shape and s.shape == (2, 5, 1)
    assert torch.isfinite(q.float()).all()
    xh = fake_quantize(x, "fp8")
    assert xh.dtype == torch.bfloat16 and xh.shape == x.shape


def test_unknown_format_is_named() -> None:
    with pytest.raises(ValueError, match="'int2'"):
        quantize_rowwise(torch.ones(2, 2), "int2")


@pytest.mark.parametrize(("fmt", "qmax"), [("int4", 7), ("int3", 3)])
def test_int4_int3_per_channel_within_bound_against_float64(fmt: str, qmax: int) -> None:
    w = _weights()
    q, s = quantize_rowwise(w, fmt)
    assert q.dtype == torch.int8 and s.shape == (64, 1)
    w64 = w.double()
    amax = w64.abs().amax(1, keepdim=True)
    s_ref = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    torch.testing.assert_close(s.double(), s_ref, rtol=2 ** -23, atol=0)
    assert int(q.abs().max()) == qmax and int(q.min()) >= -qmax and q[3].eq(0).all()
    assert set(q.unique().tolist()) == set(range(-qmax, qmax + 1))  # every level is used, none beyond
    err = (w64 - q.double() * s.double()).abs()
    assert (err <= s_ref / 2 * (1 + F32_SLACK)).all()
    assert (err / (s_ref / 2)).max() > 0.95  # tight: the test can fail


def test_int3_hand_computed_row() -> None:
    """max |row| = 1.5 -> s = 0.5; x / s = [3, -1.25, 0.5, 1.5, -2.5, 0] (exact in binary) rounds half to even."""
    x = torch.tensor([[1.5, -0.625, 0.25, 0.75, -1.25, 0.0]])
    q, s = quantize_rowwise(x, "int3")
    assert s.tolist() == [[0.5]]
    assert q.tolist() == [[3, -1, 0, 2, -2, 0]]


@pytest.mark.parametrize("fmt", ["int4", "int3"])
def test_int4_int3_weight_only_linear_is_the_dequantized_product(fmt: str) -> None:
    from parity.precision.linear import QuantLinear

    lin = torch.nn.Linear(96, 64, bias=True)
    with torch.no_grad():  # every input seeded: the bias was drawn from the process's unseeded generator
        lin.weight.copy_(_weights())
        lin.bias.copy_(torch.randn(64, generator=torch.Generator().manual_seed(4)))
    q = QuantLinear.from_linear(lin, fmt, "bf16")
    assert q.path == f"{fmt}_weight_only"
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    qw, sw = quantize_rowwise(lin.weight.detach(), fmt)
    w_hat = qw.double() * sw.double()
    ref = x.double() @ w_hat.t() + lin.bias.detach().double()
    # the float32 layer against float64: the dequantized weight (1 rounding), a K = 96 dot product in any order, the
    # bias add: (96 + 2) u (|x| @ |W|^T + |b|) entry by entry (up to 4.6e-3 on the row with the outlier 40)
    bound = matmul_bound(x, w_hat.t(), roundings=2) + 2 * U32 * lin.bias.detach().double().abs()
    assert ((q(x).double() - ref).abs() <= bound).all()


def test_int4_activation_fake_quant_hand_computed_per_token() -> None:
    """Activations [B, T, K]: one scale max|token| / 7 per token (dynamic), codes round-half-even in [-7, 7].
    Token 0: max 3.5 -> s 0.5, x / s = [7, -2.5, 1.5, 0.5, -7, 0] -> [7, -2, 2, 0, -7, 0];
    token 1: max 7 -> s 1, [7, 2.5, -3.5, 6.25, -0.5, 1.25] -> [7, 2, -4, 6, 0, 1]; token 2 all zero -> s 1, q 0."""
    from parity.precision.formats import ACTIVATION_FORMATS

    assert "int4" in ACTIVATION_FORMATS
    x = torch.tensor([[[3.5, -1.25, 0.75, 0.25, -3.5, 0.0],
                       [7.0, 2.5, -3.5, 6.25, -0.5, 1.25],
                       [0.0] * 6]])
    q, s = quantize_rowwise(x, "int4")
    assert q.dtype == torch.int8 and s.shape == (1, 3, 1)
    assert s.flatten().tolist() == [0.5, 1.0, 1.0]
    assert q.tolist() == [[[7, -2, 2, 0, -7, 0], [7, 2, -4, 6, 0, 1], [0] * 6]]
    xh = fake_quantize(x, "int4")
    assert xh.dtype == x.dtype
    assert xh.tolist() == [[[3.5, -1.0, 1.0, 0.0, -3.5, 0.0], [7.0, 2.0, -4.0, 6.0, 0.0, 1.0], [0.0] * 6]]
    # random tokens: each row's scale is its own max / 7, its extreme maps to +-7, error <= s / 2
    y = torch.randn(4, 5, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 5)[:, None]
    qy, sy = quantize_rowwise(y, "int4")
    amax = y.double().abs().amax(-1, keepdim=True)
    torch.testing.assert_close(sy.double(), amax / 7, rtol=2 ** -23, atol=0)
    assert int(qy.min()) >= -7 and int(qy.max()) <= 7 and (qy.abs().amax(-1) == 7).all()
    assert ((y.double() - fake_quantize(y, "int4").double()).abs() <= amax / 14 * (1 + F32_SLACK)).all()
