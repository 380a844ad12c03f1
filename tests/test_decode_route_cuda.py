"""The decode step over a plain cache on the device: its attention between the compiled pre-attention and o_proj + MLP
functions (cuda_decode._ATTENTION_PER_L = False, the default) against attention, o_proj and MLP compiled as one
function per attended length L (the route before). The same forced tokens (CudaDecoder.replay) through both routes,
across several L, give log-probs within the format's own decode noise (its distance from a full forward of its format
on the same tokens); and the default compiles its functions once for every L, where the per-L route compiles once
more for each new L (Dynamo's count of compiled graphs over a call of one L and a call of four). BF16 and W8A8 FP8,
the study's plain-cache arms; a packed cache's attention is a Triton kernel outside the compiled functions already.
With PARITY_PLAIN_ATTENTION=kernel a plain cache's attention is that kernel over the raw values."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from parity.config.schema import PrecisionConfig  # noqa: E402
from parity.core.sampling import SamplingSpec  # noqa: E402
from parity.rollout import cuda_decode  # noqa: E402
from parity.rollout.cuda_decode import _L_BUCKET  # noqa: E402
from parity.rollout.torch_engine import TorchEngine  # noqa: E402
from tests.kv_packed_checks import teacher_forced_logprobs  # noqa: E402
from tests.test_cohort_cuda import BF16, model_dir  # noqa: E402, F401, F811  (model_dir: a fixture)

FP8 = PrecisionConfig(weights="fp8", activations="fp8", kv_cache="bf16")
PROMPTS = [[3, 17, 29, 5, 8], [44, 2, 9], [7, 7, 1, 30, 12, 6, 2], [11, 4]]


def _forced(eng: TorchEngine, rows: int, R: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(2, 512, (rows, R), generator=g)
    toks[toks == eng.eos_id] = 3 if eng.eos_id != 3 else 4
    return toks


def _replay(model, precision: PrecisionConfig, per_l: bool, R: int, monkeypatch, compile_prefill: bool = True) -> tuple:
    """A fresh engine's replay of fixed tokens with R new tokens a row on the chosen route: (batch, engine, graphs
    Dynamo compiled during the call)."""
    monkeypatch.setattr(cuda_decode, "_ATTENTION_PER_L", per_l)
    torch._dynamo.reset()
    eng = TorchEngine(model, precision=precision, dtype=torch.bfloat16, device="cuda", share_prefill=False,
                      compile_prefill=compile_prefill)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=R, n=2, topk_logprobs=3, seed=3)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    b = eng.cuda_decoder.replay(PROMPTS, spec, _forced(eng, 2 * len(PROMPTS), R))
    assert eng.cuda_decoder.compile_error is None, eng.cuda_decoder.compile_error
    assert b.meta["decode_path"] == "cuda_graph+inductor_layers" + ("" if compile_prefill else "+eager_prefill"), b.meta
    return b, eng, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def _within_noise(new, old, eng, what: str) -> None:
    """new's log-probs on the forced tokens no further from old's on average than new's decode noise (its distance
    from a full forward of its format on the same tokens)."""
    assert torch.equal(new.response_mask, old.response_mask)
    m = old.response_mask.to(new.rollout_logprobs.device)
    d = (new.rollout_logprobs - old.rollout_logprobs).abs()[m]
    ref = teacher_forced_logprobs(eng, new, 1.0)
    noise = float((new.rollout_logprobs.to(ref.device) - ref).abs()[new.response_mask.to(ref.device)].mean())
    print(f"{what}: log-probs differ by {float(d.mean()):.3g} on average (max {float(d.max()):.3g}); the format's "
          f"decode noise {noise:.3g}")
    assert float(d.mean()) <= noise, (float(d.mean()), noise)


@pytest.mark.parametrize("precision", [BF16, FP8], ids=["bf16", "w8a8-fp8"])
def test_attention_outside_the_compiled_functions(model_dir, precision, monkeypatch) -> None:  # noqa: F811
    long_r = 4 * _L_BUCKET - 16  # prompt (<= 7 tokens) + response: four attended lengths
    graphs = {}
    for per_l in (False, True):
        _, _, graphs[per_l, 1] = _replay(model_dir, precision, per_l, _L_BUCKET // 2, monkeypatch)
        b, eng, graphs[per_l, 4] = _replay(model_dir, precision, per_l, long_r, monkeypatch)
        if not per_l:
            new, noise_eng = b, eng
        else:
            old = b
    print(f"{precision.weights}: graphs compiled over one L / four L: attention outside {graphs[False, 1]} / "
          f"{graphs[False, 4]}, per L {graphs[True, 1]} / {graphs[True, 4]}; set-up of the four-L call (s): attention "
          f"outside {new.meta.get('decode_setup_s')}, per L {old.meta.get('decode_setup_s')}")
    assert graphs[False, 4] == graphs[False, 1] > 0, graphs
    assert graphs[True, 4] > graphs[True, 1], graphs
    _within_noise(new, old, noise_eng, f"{precision.weights}: the two routes")


@pytest.mark.parametrize("precision", [BF16, FP8], ids=["bf16", "w8a8-fp8"])
def test_an_eager_prefill_compiles_two_graphs_less_within_the_decode_noise(model_dir, precision,  # noqa: F811
                                                                          monkeypatch) -> None:
    """rollout.compile_prefill=false: the prompt forward's two layer halves run eagerly (the decode path says
    "+eager_prefill"), Dynamo compiles two graphs fewer, and the log-probs on the same forced tokens stay within
    the format's decode noise of the compiled prefill's."""
    R = _L_BUCKET // 2
    compiled, _, g_compiled = _replay(model_dir, precision, False, R, monkeypatch)
    eager, eng, g_eager = _replay(model_dir, precision, False, R, monkeypatch, compile_prefill=False)
    print(f"{precision.weights}: graphs compiled with the prefill compiled {g_compiled}, eager {g_eager}; set-up "
          f"(s) compiled {compiled.meta.get('decode_setup_s')}, eager {eager.meta.get('decode_setup_s')}")
    assert g_eager == g_compiled - 2, (g_compiled, g_eager)
    _within_noise(eager, compiled, eng, f"{precision.weights}: eager against compiled prefill")


@pytest.mark.parametrize("precision", [BF16, FP8], ids=["bf16", "w8a8-fp8"])
def test_the_plain_cache_kernel_route_within_the_decode_noise(model_dir, precision, monkeypatch) -> None:  # noqa: F811
    """PARITY_PLAIN_ATTENTION=kernel: a plain cache's attention is decode_attention's kernel over the raw values (one
    launch a layer; the call records it as kv_kernel plain_raw); over four attended lengths it compiles no more
    graphs than the batched matmuls' route, and its log-probs on the same forced tokens stay within the format's
    decode noise of that route's."""
    long_r = 4 * _L_BUCKET - 16
    monkeypatch.setenv("PARITY_PLAIN_ATTENTION", "torch")  # whatever the environment chose
    old, _, g_old = _replay(model_dir, precision, False, long_r, monkeypatch)
    assert "kv_kernel" not in old.meta
    monkeypatch.setenv("PARITY_PLAIN_ATTENTION", "kernel")
    new, eng, g_new = _replay(model_dir, precision, False, long_r, monkeypatch)
    assert new.meta["kv_kernel"] == {"name": "plain_raw", "config": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "warp_slots": 0}}
    print(f"{precision.weights}: graphs compiled over four L, batched matmuls {g_old}, kernel {g_new}; set-up (s) "
          f"{old.meta.get('decode_setup_s')} / {new.meta.get('decode_setup_s')}")
    assert g_new <= g_old, (g_old, g_new)
    _within_noise(new, old, eng, f"{precision.weights}: kernel against batched-matmul attention")


def test_the_int4_attention_as_a_dependent_launch_changes_nothing(model_dir, monkeypatch) -> None:  # noqa: F811
    """int4_attention.CONFIG["pdl"]: the INT4 attention launched as a programmatic dependent of the fused
    pre-attention (which lets it launch as it starts; the attention waits for its writes before its first load),
    captured in the decode step's CUDA graph over four attended lengths: the same log-probs on the same forced
    tokens, bit for bit, as the ordinary launch (uncompiled layers, so that no autotuning differs between the two
    engines), and the call records the setting."""
    from parity.rollout import int4_attention as ia
    int4 = PrecisionConfig(weights="bf16", activations="bf16", kv_cache="int4_per_token_head")
    R, got = 4 * _L_BUCKET - 16, {}
    for pdl in (False, True):
        monkeypatch.setitem(ia.CONFIG, "pdl", pdl)
        eng = TorchEngine(model_dir, precision=int4, dtype=torch.bfloat16, device="cuda", share_prefill=False)
        eng.cuda_decoder.compile = False
        spec = SamplingSpec(temperature=1.0, max_new_tokens=R, n=2, topk_logprobs=3, seed=3)
        got[pdl] = eng.cuda_decoder.replay(PROMPTS, spec, _forced(eng, 2 * len(PROMPTS), R))
        meta = got[pdl].meta
        assert meta["decode_path"].startswith("cuda_graph") and meta["kv_cache_layout"] == "packed", meta
        assert meta["kv_kernel"]["fused_pre_attention"] and meta["kv_kernel"]["config"]["pdl"] is pdl, meta
    assert torch.equal(got[True].response_mask, got[False].response_mask)
    assert torch.equal(got[True].rollout_logprobs, got[False].rollout_logprobs)
