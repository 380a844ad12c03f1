"""QuantLinear: every kernel path against a float64 reference built from the same codes.

The activations of the reference tests are in the dtype the suite checks (tests/conftest.py: float32, or
bfloat16 with PARITY_TEST_DTYPE=bfloat16), and the tolerance is that dtype's, entry by entry (`_bound`): the
float32 accumulation in any order (none for INT8 codes, whose products add exactly), the scales, and the output's
rounding in its dtype, again after adding the bias. The fp8 path is `fp8_scaled_mm` where torch._scaled_mm takes the row-wise call exactly (the probe,
`_scaled_mm_works`), else the exact simulation."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from parity.precision import linear as linear_mod
from parity.precision.formats import quantize_rowwise
from parity.precision.linear import QuantLinear, quant_linear_forward, select_path
from tests.conftest import TEST_DTYPE
from tests.tolerances import U32, UBF16, matmul_bound

DTYPE = getattr(torch, TEST_DTYPE)
FP8_PATH = "fp8_scaled_mm" if linear_mod._scaled_mm_works("cpu", None) else "fp8_simulated"


def _bound(xh: torch.Tensor, wh: torch.Tensor, bias: torch.Tensor | None = None, exact_products: bool = False,
           dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """Entry-wise bound of |y - y64| for y = xh @ wh^T (+ bias) (xh, wh the dequantized operands, float64) computed
    as the layer does: the K products summed in float32 in any order (matmul_bound; INT8 codes' sums are exact
    integers), times the two scales (2 u |y|), cast to the output dtype (u_out |y|) and the bias added in it
    (u_out |b| for its cast, u_out |y + b| for the sum). u_out = 2^-24 (float32) or 2^-8 (bfloat16)."""
    y = xh @ wh.t()
    b = torch.zeros_like(y) if bias is None else bias.detach().double().expand_as(y)
    u_out = U32 if dtype == torch.float32 else UBF16
    acc = torch.zeros_like(y) if exact_products else matmul_bound(xh, wh.t())
    return acc + 2 * U32 * y.abs() + u_out * (y.abs() + b.abs() + (y + b).abs())


def _assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double().reshape(bound.shape) - ref.reshape(bound.shape)).abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} entries beyond the bound, worst {(err / bound).max():.3g}x"


def _linear(k: int = 96, n: int = 40, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(-1, 1, n).unsqueeze(1))
    return lin


def _w8a8_reference(x: torch.Tensor, lin: nn.Linear, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: per-token codes of x times per-channel codes of W, both scaled; and the bound (`_bound`)."""
    xq, xs = quantize_rowwise(x.reshape(-1, x.shape[-1]), fmt)
    wq, ws = quantize_rowwise(lin.weight.detach(), fmt)
    xh, wh = xq.double() * xs.double(), wq.double() * ws.double()
    y = xh @ wh.t()
    if lin.bias is not None:
        y = y + lin.bias.detach().double()
    return y.reshape(*x.shape[:-1], -1), _bound(xh, wh, lin.bias, exact_products=fmt == "int8")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_w8a8_matches_float64_reference(fmt: str) -> None:
    lin = _linear(bias=True)
    q = QuantLinear.from_linear(lin, fmt, fmt)
    assert q.path == ("int8_simulated" if fmt == "int8" else FP8_PATH)
    x = torch.randn(3, 7, 96).to(DTYPE)
    y = q(x)
    assert y.dtype == DTYPE and y.shape == (3, 7, 40)
    ref, bound = _w8a8_reference(x, lin, fmt)
    _assert_within(y, ref, bound)
    # and it is really quantized: far from the float64 product of the unquantized tensors
    exact = x.double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
    assert (y.double() - exact).abs().max() > 1e-3


def test_w8a8_int8_error_within_analytic_bound() -> None:
    """|y - x W^T| <= sum_k |x_k| e_w + e_x |W_jk| + e_x e_w, with e = s / 2 per row (float64)."""
    lin = _linear()
    q = QuantLinear.from_linear(lin, "int8", "int8")
    x = torch.randn(16, 96)
    y = q(x).double()
    w = lin.weight.detach().double()
    exact = x.double() @ w.t()
    ex = x.double().abs().amax(1, keepdim=True) / 127 / 2
    ew = w.abs().amax(1, keepdim=True) / 127 / 2
    bound = x.double().abs() @ ew.expand(-1, 96).t() + ex * w.abs().sum(1) + ex * ew.t() * 96
    err = (y - exact).abs()
    assert (err <= bound * 1.0001 + 1e-6).all()
    assert (err / bound).max() > 0.01


def test_int8_paths_give_identical_results() -> None:
    lin = _linear(k=2048 + 8, n=24)  # K beyond one float32-exact chunk: the simulated path sums 2 chunks + a rest
    wq, ws = quantize_rowwise(lin.weight.detach(), "int8")
    x = torch.randn(5, 2056, dtype=torch.bfloat16)
    from parity.precision.int8_gemm import cpu_int_mm_exact

    if cpu_int_mm_exact():  # the selectable torch._int_mm path: the same integers, so the same bf16 outputs
        outs = [quant_linear_forward(x, wq, ws, None, "int8", "int8", p) for p in ("int8_mm_cpu", "int8_simulated")]
        assert torch.equal(outs[0], outs[1]) and outs[0].dtype == torch.bfloat16
    else:  # this CPU's torch._int_mm saturates: the path refuses, naming the default
        with pytest.raises(RuntimeError, match="int8_simulated"):
            quant_linear_forward(x, wq, ws, None, "int8", "int8", "int8_mm_cpu")
    assert select_path("int8", "int8", torch.device("cpu"), 2056, 24) == "int8_simulated"
    # and the accumulator equals the int64 product of the codes
    from parity.precision.linear import _int8_gemm
    xq, _ = quantize_rowwise(x, "int8")
    assert torch.equal(_int8_gemm(xq, wq, "int8_simulated").long(), xq.long() @ wq.long().t())


def test_fp8_paths_agree() -> None:
    lin = _linear()
    wq, ws = quantize_rowwise(lin.weight.detach(), "fp8")
    x = torch.randn(9, 96).to(DTYPE)
    b = quant_linear_forward(x, wq, ws, None, "fp8", "fp8", "fp8_simulated")
    try:
        a = quant_linear_forward(x, wq, ws, None, "fp8", "fp8", "fp8_scaled_mm")
    except (RuntimeError, NotImplementedError) as e:  # this torch's CPU _scaled_mm refuses the row-wise call
        assert FP8_PATH == "fp8_simulated", f"the probe passed, but the call fails: {e}"
        return
    if FP8_PATH == "fp8_scaled_mm":  # two float32 accumulations of the same products, each within _bound
        xq, xs = quantize_rowwise(x, "fp8")
        _assert_within(a, b.double(), 2 * _bound(xq.double() * xs.double(), wq.double() * ws.double()))
    else:  # the probe said no for a dtype this torch computes wrongly; the layer never takes this path
        assert select_path("fp8", "fp8", torch.device("cpu"), 96, 40) == "fp8_simulated"


class _PerTensorScaledMM:
    """Stand-in for a torch build whose CPU _scaled_mm takes per-tensor scales only: it either refuses row-wise
    scales or applies the first one to every row (what uniform probe scales would not reveal)."""

    def __init__(self, real, refuse: bool) -> None:
        self.real, self.refuse = real, refuse

    def __call__(self, a, b, scale_a, scale_b, out_dtype=None, **kw):
        if scale_a.numel() > 1 or scale_b.numel() > 1:
            if self.refuse:
                raise RuntimeError("Only per-tensor scaling is supported on CPU")
            scale_a, scale_b = scale_a.reshape(-1)[:1].reshape(()), scale_b.reshape(-1)[:1].reshape(())
        return self.real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kw)


@pytest.mark.parametrize("refuse", [True, False])
def test_probe_falls_back_to_the_exact_simulation_on_a_per_tensor_only_build(monkeypatch, refuse: bool) -> None:
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    monkeypatch.setattr(torch, "_scaled_mm", _PerTensorScaledMM(torch._scaled_mm, refuse))
    linear_mod._scaled_mm_works.cache_clear()
    try:
        assert not linear_mod._scaled_mm_works("cpu", None)
        lin = _linear(bias=True)
        q = QuantLinear.from_linear(lin, "fp8", "fp8")
        assert q.path == "fp8_simulated"
        x = torch.randn(5, 96).to(DTYPE)
        _assert_within(q(x), *_w8a8_reference(x, lin, "fp8"))
    finally:
        monkeypatch.undo()
        linear_mod._scaled_mm_works.cache_clear()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_weight_only_is_linear_of_dequantized_weight(fmt: str) -> None:
    lin = _linear()
    q = QuantLinear.from_linear(lin, fmt, "bf16")
    assert q.path == f"{fmt}_weight_only"
    x = torch.randn(4, 96)
    assert torch.equal(q(x), nn.functional.linear(x, q.dequantized_weight()))


def test_mixed_formats_use_simulation() -> None:
    lin = _linear()
    q = QuantLinear.from_linear(lin, "int8", "fp8")
    assert q.path == "wint8afp8_simulated"
    x = torch.randn(4, 96).to(DTYPE)
    xq, xs = quantize_rowwise(x, "fp8")
    xh, wh = xq.double() * xs.double(), q.dequantized_weight(torch.float64)
    _assert_within(q(x), xh @ wh.t(), _bound(xh, wh))  # fake-quantized float32 operands: float32 accumulation


@pytest.mark.parametrize("fmts", [("int8", "int8"), ("fp8", "fp8"), ("int8", "bf16"), ("bf16", "bf16")])
def test_set_weight_matches_from_linear_exactly(fmts: tuple[str, str]) -> None:
    a, b = _linear(seed=0, bias=True), _linear(seed=1, bias=True)
    qa = QuantLinear.from_linear(a, *fmts)
    ptr = qa.weight.data_ptr()
    qa.set_weight(b.weight.detach())
    qa.set_bias(b.bias.detach())
    qb = QuantLinear.from_linear(b, *fmts)
    assert qa.weight.data_ptr() == ptr  # in place: an engine holding the buffer sees the update
    for name in ("weight", "weight_scale", "bias"):
        assert torch.equal(getattr(qa, name).float(), getattr(qb, name).float()), name
    x = torch.randn(3, 96)
    assert torch.equal(qa(x), qb(x))


def test_set_rows_equals_full_requantization() -> None:
    a, b = _linear(seed=0), _linear(seed=1)
    q = QuantLinear.from_linear(a, "int8", "int8")
    q.set_rows(8, b.weight.detach()[8:20])
    w = a.weight.detach().clone()
    w[8:20] = b.weight.detach()[8:20]
    ref = QuantLinear.from_linear(nn.Linear(96, 40, bias=False).requires_grad_(False), "int8", "int8")
    ref.set_weight(w)
    assert torch.equal(q.weight, ref.weight) and torch.equal(q.weight_scale, ref.weight_scale)


def test_dtype_cast_keeps_codes_and_scales() -> None:
    q = QuantLinear.from_linear(_linear(bias=True), "fp8", "fp8")
    codes = q.weight.clone()
    q.to(torch.bfloat16)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight_scale.dtype == torch.float32
    assert q.bias.dtype == torch.bfloat16 and torch.equal(q.weight.float(), codes.float())
    assert q(torch.randn(2, 96, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="precision.weights"):
        QuantLinear.from_linear(_linear(), "int2", "bf16")
    with pytest.raises(ValueError, match="precision.activations"):
        QuantLinear.from_linear(_linear(), "int8", "int16")
    q = QuantLinear.from_linear(_linear(), "int8", "int8")
    with pytest.raises(ValueError, match=r"shape \(40, 95\)"):
        q.set_weight(torch.zeros(40, 95))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 33])
def test_cuda_int8_gemm_matches_cpu(m: int) -> None:
    lin = _linear(k=128, n=64, bias=True)
    q_cpu = QuantLinear.from_linear(lin, "int8", "int8")
    q_gpu = QuantLinear.from_linear(lin, "int8", "int8").cuda()
    assert q_gpu.path in ("int8_triton", "int8_mm_cuda")  # Triton's fused kernel where it checked out bit-identical
    x = torch.randn(m, 128)
    # the same integer products (exact) and scales in float32: the rescale may round in another order, a few u
    torch.testing.assert_close(q_gpu(x.cuda()).cpu(), q_cpu(x), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_scaled_mm_matches_simulation() -> None:
    lin = _linear(k=128, n=64)
    q = QuantLinear.from_linear(lin, "fp8", "fp8").cuda()
    expected = "fp8_scaled_mm" if torch.cuda.get_device_capability() >= (8, 9) else "fp8_simulated"
    assert q.path == expected == select_path("fp8", "fp8", torch.device("cuda"), 128, 64)
    x = torch.randn(20, 128, dtype=torch.bfloat16, device="cuda")
    sim = quant_linear_forward(x, q.weight, q.weight_scale, None, "fp8", "fp8", "fp8_simulated")
    # bf16 outputs of two float32 accumulations: each rounded to 8 bits (2^-8 relative), 2 ulp apart at most
    torch.testing.assert_close(q(x).float(), sim.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("weights", ["int8", "int4", "fp8", "bf16"])
def test_int4_activations_fake_quantize_both_sides(weights: str) -> None:
    """W<any>A4: per-token INT4 codes of x (dynamic scale) times the weight; with integer weights (W4A4, W8A4) the
    codes' exact integer product then the two scales (`int_codes`, W8A8's arithmetic), otherwise the dequantized
    weight in float32 (the simulated path)."""
    lin = _linear(bias=True)
    q = QuantLinear.from_linear(lin, weights, "int4")
    assert q.path == ("int_codes" if weights in ("int8", "int4") else f"w{weights}aint4_simulated")
    assert select_path(weights, "int4", torch.device("cpu"), 96, 40) == q.path
    x = torch.randn(3, 5, 96)
    xq, xs = quantize_rowwise(x.reshape(-1, 96), "int4")
    assert int(xq.abs().max()) == 7
    exact = q.path == "int_codes"  # the integer sums are exact: only the two scales and the casts round
    # the simulated path multiplies by the float32 w_hat (codes x scales rounded once); the integer one by the codes
    wh = q.weight.double() * q.weight_scale.double() if exact else q.dequantized_weight(torch.float64)
    xh = xq.double() * xs.double()
    ref = xh @ wh.t() + lin.bias.detach().double()
    y = q(x)
    assert y.shape == (3, 5, 40)
    _assert_within(y, ref, _bound(xh, wh, lin.bias, exact_products=exact, dtype=torch.float32))  # float32 x and layer
    a8 = QuantLinear.from_linear(lin, weights, "int8" if weights != "fp8" else "fp8")(x)
    assert (y - a8).abs().max() > 1e-2  # INT4 activations are visibly coarser than 8-bit ones


@pytest.mark.parametrize("weights,activations", [("int4", "int4"), ("int8", "int4"), ("int4", "int8")])
def test_integer_codes_product_is_the_formats_exact_value(weights: str, activations: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer codes on both sides: y = bf16(float32(acc) * sx * sw) with acc the exact integer sum, against float64
    (acc exact, then two float32 roundings and one bf16 cast: within one bf16 unit of the float64 value, and equal
    to the float64 value's own path through those roundings everywhere). PARITY_INT_CODES=0 gives the float32
    product of the dequantized codes (the form before): within its float32 bound of the same value, and not always
    the same bits."""
    lin = _linear(k=512, n=64, seed=3)
    q = QuantLinear.from_linear(lin, weights, activations)
    assert q.path == "int_codes"
    x = torch.randn(33, 512).to(torch.bfloat16)
    xq, xs = quantize_rowwise(x.float(), activations)
    acc = xq.double() @ q.weight.double().t()  # integers below 2^53: exact
    assert acc.abs().max() < 2 ** 24 and torch.equal(acc, acc.round())
    want = ((acc.float() * xs) * q.weight_scale.t()).to(torch.bfloat16)  # the exact sum through the epilogue
    y = q(x)
    assert torch.equal(y, want)
    y64 = acc * xs.double() * q.weight_scale.double().t()
    assert ((y.double() - y64).abs() <= UBF16 * y64.abs() * (1 + 4 * U32) + 1e-30).all()
    monkeypatch.setenv("PARITY_INT_CODES", "0")
    old = QuantLinear.from_linear(lin, weights, activations)
    assert old.path == f"w{weights}a{activations}_simulated"
    y_old = old(x)
    xh, wh = xq.double() * xs.double(), q.dequantized_weight(torch.float64)
    _assert_within(y_old, y64, _bound(xh, wh, dtype=torch.bfloat16))


def test_unknown_activation_format_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"precision.activations: unknown format 'int3'; known: bf16, int8, fp8, int4"):
        QuantLinear.from_linear(_linear(), "int4", "int3")


def test_an_engine_without_integer_products_tunes_nothing_and_checks_no_kernel(monkeypatch) -> None:
    """A bf16 or FP8 engine's decode state asks tune_decode for no shape: it returns at once, without the Triton
    kernels' device check (which every bf16 process paid at its first decode state)."""
    from parity.precision import int8_triton

    def check(*_a):
        raise AssertionError("usable() called for an engine without integer products")
    monkeypatch.setattr(int8_triton, "usable", check)
    assert int8_triton.tune_decode(128, [], torch.device("cuda")) == {}
    with pytest.raises(AssertionError, match="without integer products"):  # a shape to tune: the check comes first
        int8_triton.tune_decode(128, [(256, 512)], torch.device("cuda"))


def test_the_tile_table_reads_its_devices_tiles_and_names_a_bad_entry(tmp_path, monkeypatch) -> None:
    """int8_tiles.json: a device's tiles by 'M,N,K'; another device's name gives nothing; PARITY_INT8_TILES=timed
    ignores the table; a malformed tile is an error naming the file, the device and the key."""
    from parity.precision import int8_triton
    f = tmp_path / "int8_tiles.json"
    f.write_text(json.dumps({"devices": {"GPU A": {"tiles": {"128,1024,512": [64, 16, 256, 4, 4]}},
                                         "GPU B": {"tiles": {"64,512,512": [64, 32, "x", 4, 4]}}}}))
    monkeypatch.setattr(int8_triton, "TILES_FILE", f)
    int8_triton._table.cache_clear()
    assert int8_triton._table("GPU A") == {(128, 1024, 512): (64, 16, 256, 4, 4)}
    assert int8_triton._table("GPU C") == {}
    with pytest.raises(ValueError, match=r"int8_tiles.json: device 'GPU B', tile '64,512,512'"):
        int8_triton._table("GPU B")
    int8_triton._table.cache_clear()
    monkeypatch.setenv("PARITY_INT8_TILES", "timed")
    assert int8_triton._table("GPU A") == {}
    int8_triton._table.cache_clear()


def test_the_kernels_candidates_by_hand() -> None:
    """candidates(M_KEY, K): decode sizes (<= 256 rows) the narrow tiles, prefill the wide ones, none deeper than K
    rounded up to a power of two (at least 64); no tile left gives all of them."""
    from parity.precision.int8_triton import TILES, candidates
    narrow_256 = [(64, 16, 256, 4, 4), (64, 32, 256, 4, 4), (64, 64, 256, 4, 4), (32, 32, 256, 4, 4),
                  (16, 32, 256, 4, 4), (64, 16, 256, 4, 8), (64, 32, 256, 4, 8), (64, 64, 128, 4, 4)]
    assert candidates(16, 256) == candidates(256, 200) == narrow_256
    assert candidates(64, 100) == [(64, 64, 128, 4, 4)]
    assert candidates(512, 64) == candidates(4096, 33) == [(128, 128, 64, 5, 4)]
    assert len(candidates(16, 1024)) == 13 and len(candidates(1024, 4096)) == 4
    assert candidates(16, 32) == TILES  # no narrow tile is 64 deep or less


def test_the_shipped_tile_table_holds_only_candidates_with_its_provenance() -> None:
    """platform/parity/precision/int8_tiles.json: each device's entry says when, with which Triton and torch and by
    which command it was written, and every tile is one the autotuner could pick for its shape (a decode state takes
    it only then; anything else would be timed)."""
    from parity.precision import int8_triton
    table = json.loads(int8_triton.TILES_FILE.read_text())
    assert table["devices"], "the table lists no device"
    for name, entry in table["devices"].items():
        assert entry["date"] and entry["triton"] and entry["torch"], name
        assert "tests/bench/gpu_pin_int8_tiles.py" in entry["command"], name
        assert entry["tiles"], name
        for key, tile in entry["tiles"].items():
            m, n, k = (int(v) for v in key.split(","))
            assert m <= 256 and n > 0, (name, key)
            assert tuple(tile) in int8_triton.candidates(m, k), (name, key, tile)
        int8_triton._table.cache_clear()
        assert len(int8_triton._table(name)) == len(entry["tiles"])
    int8_triton._table.cache_clear()


def _int8_triton_usable() -> bool:
    from parity.precision import int8_triton
    return int8_triton.usable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_int8_triton_kernel_is_bit_identical_to_int_mm(out_dtype: torch.dtype) -> None:
    """The fused Triton W8A8 kernel against torch._int_mm + the eager rescale, bit for bit, on fresh random
    codes and scales for decode-sized and ragged shapes (rows, columns and depth off every tile size)."""
    if not _int8_triton_usable():
        pytest.skip("Triton int8 kernel not usable on this device")
    from parity.precision.int8_triton import _reference, w8a8_mm
    g = torch.Generator(device="cuda").manual_seed(1)
    for m, n, k in [(1, 64, 64), (7, 72, 200), (16, 1024, 1024), (33, 136, 1048), (64, 4096, 1024),
                    (64, 1024, 3072), (64, 6144, 1024), (100, 1024, 2048), (256, 520, 384), (1000, 3072, 1024),
                    (8192, 1024, 3072)]:
        xq = torch.randint(-127, 128, (m, k), generator=g, device="cuda", dtype=torch.int8)
        wq = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)
        xs = torch.rand(m, 1, generator=g, device="cuda") * 3e-2
        ws = torch.rand(n, 1, generator=g, device="cuda") * 3e-2
        y = w8a8_mm(xq, wq, xs, ws, out_dtype)
        assert torch.equal(y, _reference(xq, wq, xs, ws, out_dtype)), (m, n, k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")
def test_int8_triton_quantization_equals_torch() -> None:
    """The one-pass Triton activation quantization gives quantize_int8_rowwise's codes and scales exactly:
    random rows of many magnitudes, an all-zero row, a one-value row, and exact .5 ties (half to even)."""
    if not _int8_triton_usable():
        pytest.skip("Triton int8 kernel not usable on this device")
    from parity.precision.int8_triton import quant_rows
    g = torch.Generator(device="cuda").manual_seed(2)
    for m, k in [(1, 8), (64, 1024), (300, 3072), (8192, 2048), (3, 5000)]:
        x = torch.randn(m, k, generator=g, device="cuda") * torch.rand(m, 1, generator=g, device="cuda").pow(4) * 50
        x = x.to(torch.bfloat16)
        x[0] = 0
        if m > 1:
            x[1] = 0
            x[1, -1] = -3.0
        q, s = quant_rows(x)
        rq, rs = quantize_rowwise(x, "int8")
        assert torch.equal(q, rq) and torch.equal(s, rs), (m, k)
    ties = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, 126.5]], device="cuda", dtype=torch.bfloat16)
    assert quant_rows(ties)[0].tolist() == [[127, 0, 2, 2, 0, -2, 4, 126]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")
def test_int8_triton_path_inside_a_compiled_function_equals_the_cublas_path() -> None:
    """QuantLinear's int8_triton path gives the int8_mm_cuda path's output bit for bit, eagerly (Triton
    quantization and product, decode and prefill sizes) and compiled with Inductor in one graph as the decode
    layers are (compared with the cuBLASLt path compiled the same way: inside a graph the quantization is torch
    ops that Inductor fuses for both)."""
    if not _int8_triton_usable():
        pytest.skip("Triton int8 kernel not usable on this device")
    lin = _linear(k=1024, n=3072).cuda()
    q = QuantLinear.from_linear(lin, "int8", "int8")
    assert q.path == "int8_triton"
    args = (q.weight, q.weight_scale, None, "int8", "int8")
    fn = torch.compile(lambda x, p: quant_linear_forward(x, *args, p), fullgraph=True, dynamic=False)
    for m in (64, 3000):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(quant_linear_forward(x, *args, "int8_triton"), quant_linear_forward(x, *args, "int8_mm_cuda"))
        assert torch.equal(fn(x, "int8_triton"), fn(x, "int8_mm_cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")
def test_int8_triton_every_tile_configuration_is_bit_identical() -> None:
    """Each tile configuration the autotuner may choose for a product (decode tiles deep in K included) equals
    torch._int_mm + rescale bit for bit on decode-sized and ragged shapes: the choice depends on timing, the
    result must not."""
    if not _int8_triton_usable():
        pytest.skip("Triton int8 kernel not usable on this device")
    import triton

    from parity.precision import int8_triton as it
    g = torch.Generator(device="cuda").manual_seed(3)
    for m, n, k in [(64, 4096, 1024), (64, 1024, 3072), (1, 80, 200), (37, 136, 1048), (200, 520, 384),
                    (1000, 264, 1024)]:
        xq = torch.randint(-127, 128, (m, k), generator=g, device="cuda", dtype=torch.int8)
        wq = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)
        xs = torch.rand(m, 1, generator=g, device="cuda") * 3e-2
        ws = torch.rand(n, 1, generator=g, device="cuda") * 3e-2
        ref = it._reference(xq, wq, xs, ws, torch.bfloat16)
        configs = it._prune(it._CONFIGS, {"M_KEY": it._m_key(m), "K": k})
        assert configs
        for c in configs:
            kw = c.kwargs
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            grid = (triton.cdiv(n, kw["BLOCK_N"]), triton.cdiv(m, kw["BLOCK_M"]))
            it._w8a8_kernel[grid](xq, wq, xs, ws, y, m, n, k, xq.stride(0), wq.stride(0), y.stride(0), m,
                                  num_stages=c.num_stages, num_warps=c.num_warps, **kw)
            assert torch.equal(y, ref), ((m, n, k), kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")
def test_int8_triton_product_replays_in_a_cuda_graph() -> None:
    """The autotuned product captured in a CUDA graph (as the decode step is) and replayed over new inputs
    written into the captured buffers gives the reference each time."""
    if not _int8_triton_usable():
        pytest.skip("Triton int8 kernel not usable on this device")
    from parity.precision.int8_triton import _reference, w8a8_mm
    g = torch.Generator(device="cuda").manual_seed(4)
    m, n, k = 64, 1024, 2048

    def fresh():
        return (torch.randint(-127, 128, (m, k), generator=g, device="cuda", dtype=torch.int8),
                torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8),
                torch.rand(m, 1, generator=g, device="cuda") * 3e-2, torch.rand(n, 1, generator=g, device="cuda") * 3e-2)
    bufs = fresh()
    w8a8_mm(*bufs, torch.bfloat16)  # tunes and sizes the workspace outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a8_mm(*bufs, torch.bfloat16)
    for _ in range(3):
        for b, new in zip(bufs, fresh()):
            b.copy_(new)
        graph.replay()
        assert torch.equal(y, _reference(*bufs, torch.bfloat16))
