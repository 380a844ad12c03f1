"""parity.moe capture (RoutingRecorder) and replay (R3) on a tiny HF Qwen3-MoE built here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from parity.moe import (
    DISAGREEMENT,
    DISAGREEMENT_REPLAYED,
    RoutingBatch,
    RoutingRecorder,
    enable_routing_replay,
    replayed_routing,
    rollout_replay_inputs,
    routing_disagreement,
    routing_disagreement_metrics,
    set_replay_routing,
)

E, TOPK, H, V = 8, 2, 64, 40
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")


def tiny_moe(layers: int = 2, mlp_only: list[int] | None = None, seed: int = 0) -> torch.nn.Module:
    cfg = Qwen3MoeConfig(num_hidden_layers=layers, num_experts=E, num_experts_per_tok=TOPK,
                         moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=mlp_only or [], **COMMON)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF's router init (std 0.02) makes near-ties; spread the logits a little
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.3)
    return model.eval()


def _moe_with_experts(n: int) -> torch.nn.Module:
    cfg = Qwen3MoeConfig(num_hidden_layers=2, num_experts=n, num_experts_per_tok=TOPK, moe_intermediate_size=32,
                         **COMMON)
    return AutoModelForCausalLM.from_config(cfg)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (device, model dtype): CPU in both training dtypes, and a GPU in bf16 where one is present
DEVICE_DTYPES = [("cpu", torch.float32), ("cpu", torch.bfloat16), pytest.param("cuda", torch.bfloat16, marks=CUDA)]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def random_routing(b: int, t: int, n_layers: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    perm = torch.rand(b, t, n_layers, E, generator=g).argsort(-1)
    return perm[..., :TOPK]  # distinct experts per (token, layer)


def experts_inputs(model: torch.nn.Module) -> tuple[list[tuple[int, torch.Tensor]], list]:
    """Independent witness: (MoE layer, top_k_index) for every call of an experts module, in call order."""
    seen: list[tuple[int, torch.Tensor]] = []
    experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    handles = [e.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, a[1].clone())))
               for i, e in enumerate(experts)]
    return seen, handles


def test_recorder_shapes_and_ids_match_the_routers_choice() -> None:
    model = tiny_moe()
    ids = torch.randint(0, V, (3, 5))
    with RoutingRecorder(model) as rec:
        assert (rec.n_layers, rec.top_k, rec.num_experts) == (2, TOPK, E)
        rec.start()
        out = model(ids, use_cache=True, output_router_logits=True)
        pre = rec.pop()
        assert pre.shape == (3, 5, 2, TOPK) and pre.dtype == torch.uint8
        # the router's own rule applied to the logits HF returns
        for layer, logits in enumerate(out.router_logits):
            want = torch.topk(F.softmax(logits, -1, dtype=torch.float), TOPK, -1).indices
            assert torch.equal(pre[:, :, layer].reshape(-1, TOPK).long(), want)
        dec_out = model(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
        assert dec_out is not None
        assert rec.pop().shape == (3, 1, 2, TOPK)
        with pytest.raises(RuntimeError, match="no forward ran"):
            rec.pop()
        model(ids)
        with pytest.raises(RuntimeError, match="MoE layer 0 ran a second forward before pop"):
            model(ids)
        rec.stop()
        model(ids)  # not recording: no error, nothing kept
        with pytest.raises(RuntimeError, match="outside start"):
            rec.pop()


def test_dense_model_and_layer_count_errors() -> None:
    dense = AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=1, **COMMON))
    with pytest.raises(ValueError, match="has no MoE routers"):
        enable_routing_replay(dense)
    model = tiny_moe(layers=3, mlp_only=[1])  # 2 MoE layers out of 3 decoder layers
    replay = enable_routing_replay(model)
    assert replay.n_layers == 2
    with pytest.raises(ValueError, match="replay routing has 3 MoE layers, the model has 2"):
        set_replay_routing(model, random_routing(2, 4, 3))
    with pytest.raises(ValueError, match="top_k=3, the model's routers use top_k=2"):
        set_replay_routing(model, torch.zeros(2, 4, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 5\), ids cover \[B=2, T=4\]"):
        set_replay_routing(model, random_routing(2, 4, 2), torch.ones(2, 5, dtype=torch.bool))
    bad = random_routing(2, 4, 2)
    bad[1, 2, 0, 0] = E
    with pytest.raises(ValueError, match=r"out of range \[0, 8\)"):
        set_replay_routing(model, bad)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 2] = False  # the same bad id on an unmarked token is ignored
    bad[0, 3] = -1  # as is padding from a decode with pad_value=-1
    mask[0, 3] = False
    set_replay_routing(model, bad, mask)
    with RoutingRecorder(model) as rec:
        rec.start()
        model(torch.randint(0, V, (2, 4)))
        used = rec.pop()
    assert torch.equal(used[mask].long(), bad[mask])
    dup = random_routing(2, 4, 2)
    dup[0, 0, 1, 1] = dup[0, 0, 1, 0]
    with pytest.raises(ValueError, match="same expert twice"):
        set_replay_routing(model, dup)
    set_replay_routing(model, random_routing(2, 4, 2))
    with pytest.raises(ValueError, match=r"covers 2x4 = 8 tokens, but router model.layers.0.mlp.gate sees 10"):
        model(torch.randint(0, V, (2, 5)))
    set_replay_routing(model, None)
    model(torch.randint(0, V, (2, 5)))  # live routing again
    replay.remove()
    with pytest.raises(RuntimeError, match="enable_routing_replay"):
        set_replay_routing(model, None)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_replay_forces_every_marked_token_and_layer(device: str, dtype: torch.dtype) -> None:
    model = tiny_moe().to(device, dtype)
    ids = torch.randint(0, V, (3, 7), device=device)
    forced = random_routing(3, 7, 2).to(device)
    mask = (torch.rand(3, 7, generator=torch.Generator().manual_seed(0)) < 0.7).to(device)
    with RoutingRecorder(model) as rec:
        rec.start()
        model(ids)
        live = rec.pop()
        assert routing_disagreement(live, forced, mask) > 0.5  # random routing differs: the test can fail
        enable_routing_replay(model)
        seen, handles = experts_inputs(model)
        with replayed_routing(model, forced, mask):
            model(ids)
        used = rec.pop()
        for h in handles:
            h.remove()
    assert [i for i, _ in seen] == [0, 1]
    for layer in range(2):
        received = seen[layer][1].reshape(3, 7, TOPK)
        assert torch.equal(received[mask], forced[:, :, layer][mask])  # what the experts computed with
        assert torch.equal(received[~mask], live[:, :, layer][~mask].long())  # unmarked: live routing
    assert torch.equal(used.long(), seen_stack(seen))
    assert routing_disagreement(used, forced, mask) == 0.0


def seen_stack(seen: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    return torch.stack([t for _, t in seen], 1).reshape(3, 7, 2, TOPK)


def _reference_block(block: torch.nn.Module, x: torch.Tensor, forced: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 reference of a Qwen3-MoE sparse block with forced experts, written from the formula."""
    wr, gu, down = block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj
    xs = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(xs)
    for n in range(xs.shape[0]):
        if bool(mask.reshape(-1)[n]):
            p = torch.softmax(wr @ xs[n], -1)
            sel = forced.reshape(-1, TOPK)[n]
            w = p[sel] / p[sel].sum()
        else:  # live routing: HF's router works in fp32 whatever the model dtype
            p32 = torch.softmax((wr @ xs[n]).float(), -1)
            sel = torch.topk(p32, TOPK).indices
            w = (p32[sel] / p32[sel].sum()).double()
        for k, e in enumerate(sel.tolist()):
            g, u = (gu[e] @ xs[n]).chunk(2)
            out[n] += w[k] * (down[e] @ (F.silu(g) * u))
    return out.reshape(x.shape)


def test_replayed_block_matches_float64_reference_and_gradcheck() -> None:
    model = tiny_moe().double()
    model.set_experts_implementation("eager")  # the fused default kernels take fp32/bf16 only
    block = model.model.layers[0].mlp
    x = torch.randn(2, 3, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    forced = random_routing(2, 3, 2, seed=5)
    mask = torch.tensor([[True, False, True], [True, True, False]])
    enable_routing_replay(model)
    with replayed_routing(model, forced, mask), torch.no_grad():
        got = block(x)
    # float64 both (the router's softmax in float32 picks no weights here: forced routing): ~K 2^-53 ~ 1e-14
    assert torch.allclose(got, _reference_block(block, x, forced[:, :, 0], mask), atol=1e-12, rtol=0)

    # router weight W0 + z_e * D_e on each expert row e: 8 inputs keep the full (not fast-mode) check cheap
    w0 = block.gate.weight.detach().clone()
    d = torch.randn(w0.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def block_of_router_weight(z: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(block, {"gate.weight": w0 + z[:, None] * d}, (x,))

    z = torch.zeros(E, dtype=torch.float64, requires_grad=True)
    with replayed_routing(model, forced):  # all tokens replayed: the whole path is float64
        y = block_of_router_weight(z)
        (grad,) = torch.autograd.grad(y.square().sum(), z)
        assert bool((grad != 0).all())  # every expert's router row gets a gradient
        assert torch.autograd.gradcheck(block_of_router_weight, (z,), eps=1e-6, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_router_receives_gradients_under_replay_also_with_checkpointing(device: str) -> None:
    model = tiny_moe(seed=3).to(device)
    ids = torch.randint(0, V, (2, 6), device=device)
    forced = random_routing(2, 6, 2, seed=9).to(device)

    def router_grads(m: torch.nn.Module) -> list[torch.Tensor]:
        m.zero_grad()
        enable_routing_replay(m)
        with replayed_routing(m, forced):
            logits = m(ids).logits
            F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
        return [layer.mlp.gate.weight.grad.clone() for layer in m.model.layers]

    grads = router_grads(model)
    for g in grads:
        assert torch.isfinite(g).all() and g.abs().sum() > 0
    # the copy of a model with replay installed replays on its own, independently of the original
    ckpt = copy.deepcopy(model).train()
    seen_orig, _ = experts_inputs(model)
    with replayed_routing(ckpt, forced), torch.no_grad():
        model(ids)
    assert not any(torch.equal(t.reshape(2, 6, TOPK), forced[:, :, i]) for i, t in seen_orig)
    ckpt.gradient_checkpointing_enable()
    seen, _ = experts_inputs(ckpt)
    grads_ckpt = router_grads(ckpt)
    # the recomputation inside backward replays too: layers 0, 1 forward, then 1, 0 recomputed
    assert [i for i, _ in seen] == [0, 1, 1, 0]
    assert all(torch.equal(t.reshape(2, 6, TOPK), forced[:, :, i]) for i, t in seen)
    for g, gc in zip(grads, grads_ckpt):  # the recomputation runs the same float32 ops on the same shapes
        assert torch.allclose(g, gc, atol=1e-6)


def test_routing_disagreement_hand_computed() -> None:
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # [token, layer, k]
    b = torch.tensor([[[1, 0], [2, 4]], [[4, 5], [7, 6]]])
    assert routing_disagreement(a, b) == 0.25  # only token 0 layer 1 differs as a set
    assert routing_disagreement(a, b, torch.tensor([False, True])) == 0.0
    assert routing_disagreement(a, b, torch.tensor([True, False])) == 0.5
    assert routing_disagreement(a, b, torch.tensor([False, False])) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        routing_disagreement(a, b[:1])


def _rollout(model: torch.nn.Module, prompts: torch.Tensor, lengths: list[int], steps: int):
    """A minimal greedy decode loop used the way an engine uses the recorder."""
    kept, tokens = [], []
    with torch.no_grad(), RoutingRecorder(model) as rec:
        rec.start()
        out = model(prompts, use_cache=True)
        kept.append(rec.pop()[:, -1])
        for t in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            if t == steps - 1:
                break
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            kept.append(rec.pop()[:, 0])
        rec.stop()
    responses = torch.cat(tokens, 1)
    mask = (torch.arange(steps)[None, :] < torch.tensor(lengths)[:, None]).to(responses.device)
    return responses.masked_fill(~mask, 0), mask, RoutingBatch.from_steps(kept, lengths, E)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_rollout_to_training_replay_end_to_end(device: str, dtype: torch.dtype) -> None:
    train_model = tiny_moe(seed=4).to(device, dtype)
    rollout_model = copy.deepcopy(train_model)  # a perturbed rollout policy, as after quantization
    with torch.no_grad():
        for layer in rollout_model.model.layers:
            layer.mlp.gate.weight.add_(0.2 * torch.randn_like(layer.mlp.gate.weight))
    prompts = torch.randint(1, V, (4, 5), device=device)
    lengths, r = [6, 0, 3, 6], 6
    responses, resp_mask, routing = _rollout(rollout_model, prompts, lengths, r)
    routing = RoutingBatch.from_bytes(routing.to_bytes()).select([0, 1, 2, 3])
    ids, mask = rollout_replay_inputs(routing, resp_mask, prompt_len=5, device=device, model=train_model)
    assert ids.device.type == mask.device.type == device
    assert ids.shape == (4, 11, 2, TOPK) and mask.sum().item() == sum(lengths)
    assert not bool(mask[:, :4].any()) and not bool(mask[:, -1].any())  # prompt (but its last) and last column
    seq = torch.cat([prompts, responses], 1)
    attn = torch.cat([torch.ones_like(prompts, dtype=torch.bool), resp_mask], 1)
    enable_routing_replay(train_model)
    with RoutingRecorder(train_model) as rec, torch.no_grad():
        rec.start()
        with replayed_routing(train_model, ids, mask):
            train_model(input_ids=seq, attention_mask=attn)
        used = rec.pop()
    assert torch.equal(used[mask], ids[mask])  # every response token, every layer
    metrics = routing_disagreement_metrics(train_model, ids, mask, input_ids=seq, attention_mask=attn)
    assert metrics[DISAGREEMENT_REPLAYED] == 0.0
    assert metrics[DISAGREEMENT] > 0.05  # the perturbed rollout routes differently without replay
    if (device, dtype) != ("cpu", torch.float32):
        return  # the exact-zero claim below is about fp32 CPU numerics
    # same model for rollout and training: KV-cache decode and full forward route identically here
    responses2, _, same = _rollout(train_model, prompts, lengths, r)
    ids2, mask2 = rollout_replay_inputs(same, resp_mask, prompt_len=5)
    seq2 = torch.cat([prompts, responses2], 1)
    metrics2 = routing_disagreement_metrics(train_model, ids2, mask2, input_ids=seq2, attention_mask=attn)
    assert metrics2 == {DISAGREEMENT: 0.0, DISAGREEMENT_REPLAYED: 0.0}


def test_rollout_replay_inputs_errors() -> None:
    routing = RoutingBatch.from_responses([torch.zeros(3, 2, TOPK, dtype=torch.long),
                                           torch.zeros(1, 2, TOPK, dtype=torch.long)], E)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    with pytest.raises(ValueError, match="row 1: routing for 1 tokens, the response has 2 sampled tokens"):
        rollout_replay_inputs(routing, mask, prompt_len=4)
    with pytest.raises(ValueError, match="holds 2 responses, the batch has 1 rows"):
        rollout_replay_inputs(routing, mask[:1], prompt_len=4)
    with pytest.raises(ValueError, match="not right-padded"):
        rollout_replay_inputs(routing, torch.tensor([[True, True, True], [False, True, False]]), prompt_len=4)
    with pytest.raises(ValueError, match="routed_experts has num_experts=8, the training model has 16"):
        rollout_replay_inputs(routing, mask, prompt_len=4, model=_moe_with_experts(16))
    with pytest.raises(ValueError, match=r"routed_experts has n_layers \(MoE layers\)=2, the training model has 3"):
        rollout_replay_inputs(routing, mask, prompt_len=4, model=tiny_moe(layers=3))
    with pytest.raises(ValueError, match="prompt_len must be >= 1"):
        rollout_replay_inputs(routing, torch.tensor([[True, True, True], [True, False, False]]), prompt_len=0)
