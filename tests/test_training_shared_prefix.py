"""The shared-prefix trainer forward (parity.training.shared_prefix) against the model's own full forward, in
float64: hidden states at every response position and the gradients of every parameter, for dense and MoE Qwen3,
prompts of different lengths (left padding), responses of different lengths (EOS before the end); and a whole
trainer step with it on and off, and on a batch padded to fixed multiples (trainer.pad_to_multiple)."""

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


def test_padded_batch_keeps_every_real_token_in_place() -> None:
    b = _batch()
    b.topk_ids = torch.zeros(9, 6, 2, dtype=torch.int32)
    b.topk_logprobs = torch.full((9, 6, 2), -1.5)
    p = b.padded(4, pad_id=0)
    assert p.prompts.shape == (9, 8) and p.responses.shape == (9, 8) and p.topk_ids.shape == (9, 8, 2)
    assert torch.equal(p.prompts[:, 1:], b.prompts) and not p.prompt_mask[:, 0].any()  # one column on the left
    assert torch.equal(p.responses[:, :6], b.responses) and not p.response_mask[:, 6:].any()  # two on the right
    assert (p.topk_ids[:, 6:] == -1).all() and (p.rollout_logprobs[:, 6:] == 0).all()
    assert torch.equal(p.input_ids[p.attention_mask], b.input_ids[b.attention_mask])
    assert b.padded(2) is not b and b.padded(1) is b  # widths 7 and 6: a multiple of 1 needs nothing
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        b.padded(0)


def test_padded_query_attends_to_itself_and_real_queries_as_before() -> None:
    from parity.training.trainer import attention_mask_4d
    am = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]])
    m = attention_mask_4d(am)
    assert m.shape == (2, 1, 5, 5) and m.dtype == torch.bool
    # row 0: positions 0, 1 are left padding (each sees only itself), 2 and 3 real (causal over the real ones), 4 is
    # right padding (the real prefix, as a 2D mask gives it, and itself)
    assert m[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                      [0, 0, 1, 1, 1]]
    assert m[1, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                      [1, 1, 1, 0, 1]]
    # what a real query sees is the causal mask and the 2D one, exactly; every query sees something
    real = am.bool()
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.equal(m[:, 0][real], (causal[None] & real[:, None, :])[real]) and m.any(-1).all()


def test_trainer_step_same_with_a_padded_batch(quick_cfg, prepared_model):
    """trainer.pad_to_multiple: the step on a batch padded to multiples of 8 tokens (the full forward, shared prefix
    off, the 4D mask whose padding queries see themselves) gives the loss, gradient norm and updated weights of the
    unpadded step, in float64."""
    from parity.training.trainer import build_trainer

    batch = _batch()
    batch.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    out, weights = {}, {}
    for multiple in (0, 8):
        model = _model("qwen3")
        cfg = quick_cfg("model.dtype=float32", "trainer.shared_prefix=off", "trainer.micro_batch_size=4",
                        f"trainer.pad_to_multiple={multiple}")
        tr = build_trainer(model, cfg, torch.device("cpu"))
        tr.compute_dtype = torch.float64
        tr._autocast = contextlib.nullcontext  # type: ignore[method-assign]
        assert batch.prompts.shape == (9, 7)  # the caller's batch is not padded in place
        out[multiple] = tr.step(batch)
        weights[multiple] = {k: p.detach().clone() for k, p in model.named_parameters()}
    # masked keys add exact zeros to the attention (float64); the head's per-token log-probs are float32, and a sum
    # over them meets the padded positions' zeros in other places of its summation tree: a few float32 ulps
    # (2^-24 = 6e-8 relative each) in the loss and the gradient; 1e-6 relative bounds ten of them
    for key in ("train/loss", "train/grad_norm", "mismatch/k1_kl", "response/length_mean"):
        assert out[8][key] == pytest.approx(out[0][key], rel=1e-6, abs=1e-12), key
    for k in weights[0]:
        torch.testing.assert_close(weights[8][k], weights[0][k], rtol=1e-6, atol=1e-9, msg=k)


def test_a_negative_pad_multiple_is_refused_naming_the_key(quick_cfg):
    from parity.config.validate import ConfigError
    with pytest.raises(ConfigError, match="trainer.pad_to_multiple"):
        quick_cfg("trainer.pad_to_multiple=-1")
