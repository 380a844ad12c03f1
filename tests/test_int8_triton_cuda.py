"""INT8 W8A8 decode on CUDA (skipped without a GPU; run on an H200, docs/PERFORMANCE.md): a pinned tile
configuration gives the reference product eagerly and inside a compiled graph, and the INT8 fast decode path
(CUDA graphs, compiled layers, pinned tiles or the compiled graph's own pick) gives the plain loop's tokens and
log-probs."""

from __future__ import annotations

import pytest
import torch

from parity.config.schema import PrecisionConfig, TinyModelConfig
from parity.core.sampling import SamplingSpec
from parity.models.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")


def _usable() -> None:
    from parity.precision import int8_triton
    if not int8_triton.usable():
        pytest.skip(f"Triton int8 kernels not usable: {int8_triton.unusable_reason}")


def test_the_kernels_pass_their_check_on_an_sm80_gpu_and_leave_no_tile_pinned() -> None:
    """usable() checks the kernels' bits with one tile a shape (not the autotuner over every candidate, which cost
    tens of seconds at a process's start) and unpins those tiles after."""
    import time

    from parity.precision import int8_triton as it
    if it.triton is None or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs Triton and an sm_80+ GPU")
    it.usable.cache_clear()
    pinned = dict(it._PINNED)
    t0 = time.perf_counter()
    assert it.usable(), it.unusable_reason
    print(f"int8_triton.usable(): {time.perf_counter() - t0:.2f} s")
    assert it.unusable_reason is None and it._PINNED == pinned


def test_pinned_decode_configuration_equals_the_reference() -> None:
    """tune_decode pins one tile configuration per (M, N, K); w8a8_mm then launches it alone, eagerly and
    inside a compiled function, with torch._int_mm + rescale's result."""
    _usable()
    from parity.precision import int8_triton as it
    pinned = it.tune_decode(48, [(512, 1024), (1024, 1536)], torch.device("cuda"))
    assert set(pinned) == {(48, 512, 1024), (48, 1024, 1536)}
    assert all(c.kwargs["BLOCK_M"] <= 64 for c in pinned.values())
    fn = torch.compile(lambda xq, wq, xs, ws: it.w8a8_mm(xq, wq, xs, ws, torch.bfloat16), fullgraph=True,
                       dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(6)
    for n, k in [(512, 1024), (1024, 1536)]:
        xq = torch.randint(-127, 128, (48, k), generator=g, device="cuda", dtype=torch.int8)
        wq = torch.randint(-127, 128, (n, k), generator=g, device="cuda", dtype=torch.int8)
        xs = torch.rand(48, 1, generator=g, device="cuda") * 3e-2
        ws = torch.rand(n, 1, generator=g, device="cuda") * 3e-2
        ref = it._reference(xq, wq, xs, ws, torch.bfloat16)
        assert torch.equal(it.w8a8_mm(xq, wq, xs, ws, torch.bfloat16), ref)
        assert torch.equal(fn(xq, wq, xs, ws), ref)


def test_a_tile_from_the_table_is_pinned_after_one_check_and_gives_the_reference(tmp_path, monkeypatch) -> None:
    """tune_decode takes this device's tile from the table (source "table", no timing), launches it alone with the
    torch path's bits; a tile the kernel does not offer for the shape is timed like a shape without an entry."""
    import json

    _usable()
    from parity.precision import int8_triton as it
    name = torch.cuda.get_device_name()
    f = tmp_path / "int8_tiles.json"
    f.write_text(json.dumps({"devices": {name: {"tiles": {"40,512,1024": [32, 32, 256, 4, 4],
                                                          "40,1024,1536": [64, 64, 4096, 1, 4]}}}}))
    monkeypatch.setattr(it, "TILES_FILE", f)
    monkeypatch.setattr(it, "_PINNED", {})
    monkeypatch.setattr(it, "PIN_SOURCE", {})
    it._table.cache_clear()
    try:
        pinned = it.tune_decode(40, [(512, 1024), (1024, 1536)], torch.device("cuda"))
    finally:
        it._table.cache_clear()
    assert it._tile(pinned[(40, 512, 1024)]) == (32, 32, 256, 4, 4)
    assert it.PIN_SOURCE == {(40, 512, 1024): "table", (40, 1024, 1536): "timed"}
    g = torch.Generator(device="cuda").manual_seed(3)
    xq = torch.randint(-127, 128, (40, 1024), generator=g, device="cuda", dtype=torch.int8)
    wq = torch.randint(-127, 128, (512, 1024), generator=g, device="cuda", dtype=torch.int8)
    xs, ws = torch.rand(40, 1, generator=g, device="cuda") * 3e-2, torch.rand(512, 1, generator=g, device="cuda") * 3e-2
    assert torch.equal(it.w8a8_mm(xq, wq, xs, ws, torch.bfloat16), it._reference(xq, wq, xs, ws, torch.bfloat16))


def test_the_shipped_table_serves_this_gpus_study_shapes_without_timing(monkeypatch) -> None:
    """On a GPU the shipped table has (the H200), a decode state of the gpu preset's model takes every product's
    tile from it: no shape is timed, and the set-up is a few compiles."""
    import time

    _usable()
    from parity.precision import int8_triton as it
    name = torch.cuda.get_device_name()
    it._table.cache_clear()
    if not it._table(name):
        pytest.skip(f"the shipped table has no tiles for {name}")
    monkeypatch.setattr(it, "_PINNED", {})
    monkeypatch.setattr(it, "PIN_SOURCE", {})
    t0 = time.perf_counter()
    for m in (128, 64, 32):
        it.tune_decode(m, [(1024, 512), (512, 512), (3072, 512), (512, 1536)], torch.device("cuda"))
    print(f"the study model's 12 products from the table: {time.perf_counter() - t0:.2f} s")
    assert set(it.PIN_SOURCE.values()) == {"table"} and len(it.PIN_SOURCE) == 12


@pytest.mark.parametrize("pin", [True, False])
def test_int8_fast_decode_equals_the_plain_loop(tmp_path, monkeypatch, pin: bool) -> None:
    """Float32 model, INT8 W8A8 weights: the captured, compiled fast path equals the plain loop (greedy tokens
    identical; log-probs to float32 rounding, where one activation code may round the other way)."""
    _usable()
    import parity.rollout.cuda_decode as cd
    from parity.precision import int8_triton as it
    monkeypatch.setattr(cd, "_PIN_INT8", pin)
    monkeypatch.setattr(it, "_PINNED", {})
    torch._dynamo.reset()  # compiled layer functions of the other route must not be reused
    eng, n_rows = _fast_equals_plain(tmp_path, "int8", "int8", "int8_triton")
    pinned = eng.cuda_decoder.state.extras.get("int8_pinned", {})
    assert bool(pinned) == pin and all(k[0] == n_rows for k in pinned)


def _fast_equals_plain(model_dir, weights: str, activations: str, path: str):
    """A float32 tiny model with `weights` x `activations` products on `path`: the captured, compiled fast path's
    greedy tokens are the plain loop's (log-probs to float32 rounding, where one activation code may round the
    other way). Returns the engine and the call's rows."""
    from parity.rollout.torch_engine import TorchEngine
    build_tiny_model("qwen3", TinyModelConfig(), seed=4).save_pretrained(str(model_dir))
    prec = PrecisionConfig(weights=weights, activations=activations, kv_cache="bf16")
    eng = TorchEngine(model_dir, precision=prec, device="cuda", dtype=torch.float32)
    assert eng.linear_path == path
    prompts = [[5, 9, 12, 3, 7], [4, 4], [11, 2, 8, 30, 1, 6, 6, 2]] * 3
    spec = SamplingSpec(temperature=0.0, max_new_tokens=20, n=1, seed=0)
    eng.fast_decode = False
    plain = eng.generate(prompts, spec)
    eng.fast_decode = True
    fast = eng.generate(prompts, spec)
    assert fast.meta["decode_path"] == "cuda_graph+inductor_layers", eng.cuda_decoder.compile_error
    assert torch.equal(fast.responses, plain.responses)
    torch.testing.assert_close(fast.rollout_logprobs, plain.rollout_logprobs, atol=1e-3, rtol=0)
    return eng, len(prompts)


@pytest.mark.parametrize("pin", [True, False])
def test_batched_product_equals_each_runs_product(pin: bool, monkeypatch) -> None:
    """w8a8_bmm (a cohort's runs in one launch) gives each run's product the bits of w8a8_mm and of torch._int_mm +
    rescale, on INT4 codes as W4A4 gives them, eagerly and inside a compiled function, with a pinned tile and
    with the autotuner's."""
    _usable()
    from parity.precision import int8_triton as it
    monkeypatch.setattr(it, "_PINNED", {})
    runs, m = 7, 128
    if pin:
        it.tune_decode(m, [(1536, 512), (512, 1536)], torch.device("cuda"))
    fn = torch.compile(lambda xq, wq, xs, ws: it.w8a8_bmm(xq, wq, xs, ws, torch.bfloat16), fullgraph=True,
                       dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(8)
    for n, k in [(1536, 512), (512, 1536)]:
        xq = torch.randint(-7, 8, (runs, m, k), generator=g, device="cuda", dtype=torch.int8)
        wq = torch.randint(-7, 8, (runs, n, k), generator=g, device="cuda", dtype=torch.int8)
        xs = torch.rand(runs, m, 1, generator=g, device="cuda") * 3e-2
        ws = torch.rand(runs, n, 1, generator=g, device="cuda") * 3e-2
        want = torch.stack([it._reference(xq[i], wq[i], xs[i], ws[i], torch.bfloat16) for i in range(runs)])
        assert torch.equal(torch.stack([it.w8a8_mm(xq[i], wq[i], xs[i], ws[i], torch.bfloat16)
                                        for i in range(runs)]), want)
        assert torch.equal(it.w8a8_bmm(xq, wq, xs, ws, torch.bfloat16), want)
        assert torch.equal(fn(xq, wq, xs, ws), want)


def test_w4a4_integer_codes_fast_decode_equals_the_plain_loop(tmp_path) -> None:
    """W4A4 on CUDA multiplies its integer codes through the INT8 kernel (`int_codes_triton`): a layer's output
    equals torch._int_mm + rescale on the same codes bit for bit, and the captured, compiled fast path gives the
    plain loop's greedy tokens (log-probs to float32 rounding, where one activation code may round the other way)."""
    _usable()
    from parity.precision import int8_triton as it
    from parity.precision.formats import quantize_rowwise
    from parity.precision.linear import QuantLinear
    torch._dynamo.reset()
    lin = torch.nn.Linear(512, 256).cuda()
    q = QuantLinear.from_linear(lin, "int4", "int4")
    assert q.path == "int_codes_triton"
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_rowwise(x.float(), "int4")
    want = it._reference(xq, q.weight, xs, q.weight_scale, torch.bfloat16) + lin.bias.detach().to(torch.bfloat16)
    assert torch.equal(q(x), want)
    _fast_equals_plain(tmp_path, "int4", "int4", "int_codes_triton")
