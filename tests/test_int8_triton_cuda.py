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


@pytest.mark.parametrize("pin", [True, False])
def test_int8_fast_decode_equals_the_plain_loop(tmp_path, monkeypatch, pin: bool) -> None:
    """Float32 model, INT8 W8A8 weights: the captured, compiled fast path equals the plain loop (greedy tokens
    identical; log-probs to float32 rounding, where one activation code may round the other way)."""
    _usable()
    import parity.rollout.cuda_decode as cd
    from parity.precision import int8_triton as it
    from parity.rollout.torch_engine import TorchEngine
    monkeypatch.setattr(cd, "_PIN_INT8", pin)
    monkeypatch.setattr(it, "_PINNED", {})
    torch._dynamo.reset()  # compiled layer functions of the other route must not be reused
    build_tiny_model("qwen3", TinyModelConfig(), seed=4).save_pretrained(str(tmp_path))
    prec = PrecisionConfig(weights="int8", activations="int8", kv_cache="bf16")
    eng = TorchEngine(tmp_path, precision=prec, device="cuda", dtype=torch.float32)
    assert eng.linear_path == "int8_triton"
    prompts = [[5, 9, 12, 3, 7], [4, 4], [11, 2, 8, 30, 1, 6, 6, 2]] * 3
    spec = SamplingSpec(temperature=0.0, max_new_tokens=20, n=1, seed=0)
    eng.fast_decode = False
    plain = eng.generate(prompts, spec)
    eng.fast_decode = True
    fast = eng.generate(prompts, spec)
    assert fast.meta["decode_path"] == "cuda_graph+inductor_layers", eng.cuda_decoder.compile_error
    pinned = eng.cuda_decoder.state.extras.get("int8_pinned", {})
    assert bool(pinned) == pin and all(k[0] == len(prompts) for k in pinned)
    assert torch.equal(fast.responses, plain.responses)
    torch.testing.assert_close(fast.rollout_logprobs, plain.rollout_logprobs, atol=1e-3, rtol=0)
