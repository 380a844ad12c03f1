"""The trainer's forward with each prompt computed once for all of its responses, and no padded columns.

An RL batch holds G responses per prompt, and the plain forward runs every row over [prompt width + R] positions:
the prompt G times, the left padding of short prompts, and the columns after the longest response's EOS. Only the
hidden states that predict response tokens are needed, and the prompt's keys and values are the same for every row
of its group. So, per decoder layer:

    prompt pass     the distinct prompts [g, P'] (P' = the longest real prompt; causal over real tokens)
    response pass   every row's response inputs that predict one of its tokens (tokens 0..len-2), packed into one
                    [N, H] block for the projections, norms and MLP; for attention scattered into [b, L - 1]
                    (L = the longest response), attending to its prompt's keys/values (gathered, differentiable)
                    and causally to its own earlier response tokens

and the hidden state that predicts response token 0 is the prompt's last one, shared by its rows. The arithmetic is
the model's own (its modules and weights, rope positions counted over real tokens, the same masks): the result
equals the full forward's hidden states at every response position up to rounding, gradients included (the
gathered prompt keys/values and last hidden state receive the sum of their rows' gradients). Positions that
predict no response token (past each row's end) come back as zeros; no loss reads them.

`shared_prefix_hidden` returns None where it does not apply (nothing shared, a model other than the dense or MoE
Qwen3 layout, MoE routing to replay), and the trainer then runs the plain forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import rotate_half  # the model's own rope helper

from parity.core.layout import positions, prefill_mask

SUPPORTED = ("qwen3", "qwen3_moe")


def _qkv(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, heads, T, D], k and v [B, kv heads, T, D] of the layer's normed input, rope applied (as the model)."""
    attn, (B, T, _) = layer.self_attn, x.shape
    q = attn.q_norm(attn.q_proj(x).view(B, T, -1, head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(B, T, -1, head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, -1, head_dim).transpose(1, 2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def _finish(layer: torch.nn.Module, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual + output projection, then the MLP block."""
    B, _, T, _ = attn_out.shape
    h = h + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(B, T, -1))
    mlp_out = layer.mlp(layer.post_attention_layernorm(h))
    if isinstance(mlp_out, tuple):  # MoE blocks may also return router logits
        mlp_out = mlp_out[0]
    return h + mlp_out


def _qkv_packed(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, heads, D], k and v [N, kv heads, D] of packed tokens' normed input [N, H], rope applied."""
    attn, N = layer.self_attn, x.shape[0]
    q = attn.q_norm(attn.q_proj(x).view(N, -1, head_dim))
    k = attn.k_norm(attn.k_proj(x).view(N, -1, head_dim))
    v = attn.v_proj(x).view(N, -1, head_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def _unpack(t: torch.Tensor, packed: torch.Tensor, b: int, T: int) -> torch.Tensor:
    """[N, heads, D] at row-major slots `packed` of [b * T] -> [b, heads, T, D], zeros elsewhere."""
    full = t.new_zeros(b * T, *t.shape[1:]).index_copy(0, packed, t)
    return full.view(b, T, *t.shape[1:]).transpose(1, 2)


def _finish_packed(layer: torch.nn.Module, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual + output projection, then the MLP block, on packed tokens [N, H]."""
    h = h + layer.self_attn.o_proj(attn_out)
    mlp_out = layer.mlp(layer.post_attention_layernorm(h)[None])  # [1, N, H]: MoE blocks take [batch, seq, H]
    if isinstance(mlp_out, tuple):
        mlp_out = mlp_out[0]
    return h + mlp_out.reshape(h.shape)


def prompt_groups(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of one row per distinct prompt [g], each row's distinct-prompt index [b]); rows share a prompt when
    their tokens and mask are equal."""
    key = torch.cat([prompts, prompt_mask.long()], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    g = int(inverse.max()) + 1
    first = torch.full((g,), key.shape[0], dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(key.shape[0]), reduce="amin")
    # number the groups in order of first appearance, so the distinct prompts keep the batch's order
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(g)
    return first[order], rank[inverse]


def shared_prefix_hidden(model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                         responses: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor | None:
    """Final-norm hidden states [b, R, H] at the positions predicting each response token (those of
    `model.model(cat(prompts, responses))[:, P - 1:-1]` up to rounding, zeros past each row's response), or None
    where the shared-prefix forward does not apply. The batch's tensors on any device (the grouping and the index
    arithmetic run on the host: a copy of b x (P + R) token ids), hidden on the model's device out; call it under the
    trainer's autocast."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED or getattr(cfg, "use_sliding_window", False):
        return None
    # the trainer hands the micro-batch already on its device; the index tensors below are built on the host
    prompts, prompt_mask, responses, response_mask = (t.cpu() for t in (prompts, prompt_mask, responses, response_mask))
    b, R = responses.shape
    first, row_group = prompt_groups(prompts, prompt_mask)
    lengths = response_mask.sum(-1)
    L = int(lengths.max()) if b else 0
    if L == 0 or len(first) == b:  # nothing to predict, or no prompt shared: the plain forward is as good
        return None
    inner, dev = model.model, model.lm_head.weight.device
    umask = prompt_mask[first]
    width = int(umask.sum(-1).max())
    uprompts, umask = prompts[first][:, -width:], umask[:, -width:]
    if bool(prompt_mask[:, :prompt_mask.shape[1] - width].any()):  # not left-padded: leave it to the plain forward
        return None
    rows = row_group.to(dev)
    # prompt pass inputs: the distinct prompts, causal over their real tokens
    hp = inner.embed_tokens(uprompts.to(dev))
    cos_p, sin_p = (t.unsqueeze(1) for t in inner.rotary_emb(hp, positions(umask).to(dev)))
    mask_p = prefill_mask(umask)[:, None].to(dev)
    # response pass inputs: each row's tokens 0..len-2 (token t's hidden state predicts token t + 1; the last one
    # predicts nothing trained), packed into one [N, H] block for the linear layers, norms and MLP (no padded
    # column computed), at rope positions after their prompt's real tokens; for attention they are scattered into
    # [b, T = L - 1] (keys = the prompt's real tokens, then the row's own tokens causally: a real token attends
    # only to real ones) and gathered back
    T = L - 1
    D = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    packed = None
    if T:
        need = torch.arange(T)[None] < (lengths - 1)[:, None]  # [b, T]
        packed = need.flatten().nonzero().squeeze(1).to(dev)  # row-major index into [b * T]
        pos_r = (umask.sum(-1)[row_group][:, None] + torch.arange(T)[None]).flatten().to(dev)[packed]
        hr = inner.embed_tokens(responses[:, :T].flatten().to(dev)[packed])  # [N, H]
        cos_r, sin_r = (t[0][:, None] for t in inner.rotary_emb(hr[None], pos_r[None]))  # [N, 1, D]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask_r = torch.cat([umask[row_group][:, None, :].expand(b, T, width), causal[None].expand(b, T, T)], dim=-1)
        mask_r = mask_r[:, None].to(dev)
    for layer in inner.layers:
        scale = layer.self_attn.scaling
        q, k, v = _qkv(layer, layer.input_layernorm(hp), cos_p, sin_p, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_p, scale=scale, enable_gqa=True)
        if packed is not None:
            qr, kr, vr = (_unpack(t, packed, b, T) for t in _qkv_packed(layer, layer.input_layernorm(hr), cos_r, sin_r, D))
            keys = torch.cat([k.index_select(0, rows), kr], dim=2)
            vals = torch.cat([v.index_select(0, rows), vr], dim=2)
            out_r = F.scaled_dot_product_attention(qr, keys, vals, attn_mask=mask_r, scale=scale, enable_gqa=True)
            hr = _finish_packed(layer, hr, out_r.transpose(1, 2).reshape(b * T, -1).index_select(0, packed))
        hp = _finish(layer, hp, out)
    first_h = inner.norm(hp[:, -1]).index_select(0, rows)[:, None]
    parts = [first_h]
    if packed is not None:
        hn = inner.norm(hr)
        parts.append(hn.new_zeros(b * T, hn.shape[-1]).index_copy(0, packed, hn).view(b, T, -1))
    if R > L:
        parts.append(first_h.new_zeros(b, R - L, first_h.shape[-1]))
    return torch.cat(parts, dim=1)
