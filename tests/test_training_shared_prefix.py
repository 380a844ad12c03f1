"""The shared-prefix trainer forward (parity.training.shared_prefix) against the model's own full forward, in
float64: hidden states at every response position and the gradients of every parameter, for dense and MoE Qwen3,
prompts of different lengths (left padding), responses of different lengths (EOS before the end); and a whole
trainer step with it on and off."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from parity.core.layout import left_pad
from parity.training.shared_prefix import prompt_groups, shared_prefix_hidden
from parity.types import RolloutBatch

COMMON = dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)


def _norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's RMSNorm computes in float32 whatever its input; in float64 here, so the comparison is float64's."""
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


@pytest.fixture(autouse=True)
def float64_norms(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _norm_in_input_dtype)
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeRMSNorm, "forward", _norm_in_input_dtype)


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = (Qwen3Config(intermediate_size=48, **COMMON) if arch == "qwen3" else
           Qwen3MoeConfig(intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          **COMMON))
    model = AutoModelForCausalLM.from_config(cfg).double()
    if arch == "qwen3_moe":
        model.set_experts_implementation("eager")  # the fused default kernels take fp32/bf16 only
    return model


def _batch(n: int = 3) -> RolloutBatch:
    """Three prompts of lengths 5, 3 and 7, n responses each, of lengths R, 4, 1, 6, ... (EOS-terminated)."""
    g = torch.Generator().manual_seed(1)
    plens, R = [5, 3, 7], 6
    texts = [torch.randint(2, 37, (p,), generator=g).tolist() for p in plens]
    prompts, pmask = left_pad([texts[i] for i in range(3) for _ in range(n)], 0)
    b = 3 * n
    lengths = torch.tensor([R, 4, 1, 6, 2, 5, 3, 6, 1][:b])
    responses = torch.randint(2, 37, (b, R), generator=g)
    rmask = torch.arange(R)[None] < lengths[:, None]
    responses = torch.where(rmask, responses, 0)
    z = torch.zeros(b)
    return RolloutBatch(prompts=prompts, prompt_mask=pmask, responses=responses, response_mask=rmask,
                        rollout_logprobs=z.float()[:, None].expand(b, R).contiguous(), rewards=z.float(),
                        truncated=torch.zeros(b, dtype=torch.bool), group_ids=torch.arange(b) // n,
                        prompt_ids=torch.arange(b) // n)


def _full(model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
    am = batch.attention_mask
    pos = (am.long().cumsum(-1) - 1).clamp_min(0)
    out = model.model(input_ids=batch.input_ids, attention_mask=am, position_ids=pos, use_cache=False)
    return out.last_hidden_state[:, batch.prompts.shape[1] - 1:-1]


def test_prompt_groups_in_batch_order():
    p = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9]])
    first, rows = prompt_groups(p, p != 0)
    assert first.tolist() == [0, 2] and rows.tolist() == [0, 0, 1, 0, 1]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_hidden_and_gradients_equal_the_full_forward_float64(arch):
    model, batch = _model(arch), _batch()
    m = batch.response_mask
    w = torch.randn(*m.shape, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def grads(h: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (torch.where(m[..., None], h * w, 0.0)).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    ref = _full(model, batch)
    g_ref = grads(ref)
    got = shared_prefix_hidden(model, batch.prompts, batch.prompt_mask, batch.responses, m)
    assert got is not None and got.shape == ref.shape and got.dtype == torch.float64
    assert torch.allclose(got[m], ref[m], atol=1e-12, rtol=0), (got[m] - ref[m]).abs().max()
    assert (got[:, int(m.sum(-1).max()):] == 0).all()
    g_got = grads(got)
    assert g_got.keys() == g_ref.keys()
    # the MoE router's softmax runs in float32 whatever the model's dtype: its rounding reaches the gradients
    rel = 1e-12 if arch == "qwen3" else 1e-7
    for k in g_ref:
        err = float((g_got[k] - g_ref[k]).abs().max())
        assert err <= rel * float(g_ref[k].abs().max()) + 1e-13, (k, err)


def test_not_applicable_cases_fall_back():
    model, batch = _model("qwen3"), _batch(n=1)  # every prompt distinct: nothing shared
    assert shared_prefix_hidden(model, batch.prompts, batch.prompt_mask, batch.responses, batch.response_mask) is None
    b = _batch()
    empty = torch.zeros_like(b.response_mask)
    assert shared_prefix_hidden(model, b.prompts, b.prompt_mask, b.responses, empty) is None


def test_trainer_step_same_with_and_without_shared_prefix(quick_cfg, prepared_model):
    """One trainer step in float64 from the same weights: loss, gradient norm and every updated weight agree."""
    from parity.training.trainer import build_trainer

    batch = _batch()
    batch.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    out, weights = {}, {}
    for mode in ("on", "off"):
        model = _model("qwen3")
        cfg = quick_cfg("model.dtype=float32", f"trainer.shared_prefix={mode}", "trainer.micro_batch_size=4")
        tr = build_trainer(model, cfg, torch.device("cpu"))
        tr.compute_dtype = torch.float64  # the head and the forward in float64 too (no autocast, no cast)
        tr._autocast = contextlib.nullcontext  # type: ignore[method-assign]
        assert tr.shared_prefix == (mode == "on")
        out[mode] = tr.step(batch)
        weights[mode] = {k: p.detach().clone() for k, p in model.named_parameters()}
    # float64 (head and forward): the shared prefix regroups sums only, ~1e-14 relative of their terms
    for key in ("train/loss", "train/grad_norm", "mismatch/k1_kl", "actor/ppo_kl"):
        assert out["on"][key] == pytest.approx(out["off"][key], rel=1e-9, abs=1e-12), key
    for k in weights["on"]:
        assert torch.allclose(weights["on"][k], weights["off"][k], atol=1e-12, rtol=0), k
