"""The embedded default models: a tiny Qwen3 and a tiny Qwen3-MoE built from transformers configs."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from parity.models.tokenizer import EOS, PAD, build_char_tokenizer


def tiny_config(arch: str, tiny: Any, tok: Any = None) -> PretrainedConfig:
    """The transformers config of a tiny model for tokenizer `tok` (default: the character tokenizer)."""
    tok = build_char_tokenizer() if tok is None else tok
    vocab = int(tiny.vocab_size) or len(tok)
    common = dict(
        vocab_size=vocab, hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim, max_position_embeddings=tiny.max_position_embeddings,
        rope_theta=tiny.rope_theta, tie_word_embeddings=tiny.tie_word_embeddings,
        pad_token_id=tok.convert_tokens_to_ids(PAD), eos_token_id=tok.convert_tokens_to_ids(EOS),
        bos_token_id=tok.convert_tokens_to_ids(EOS), rms_norm_eps=1e-6, torch_dtype="bfloat16",
    )
    if arch == "qwen3":
        return Qwen3Config(intermediate_size=tiny.intermediate_size, **common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=tiny.intermediate_size, num_experts=tiny.num_experts,
                              num_experts_per_tok=tiny.num_experts_per_tok,
                              moe_intermediate_size=tiny.moe_intermediate_size,
                              norm_topk_prob=tiny.norm_topk_prob, decoder_sparse_step=1,
                              mlp_only_layers=[], output_router_logits=False, **common)
    raise ValueError(f"config key `model.arch`: unknown tiny architecture {arch!r}; known: qwen3, qwen3_moe")


def build_tiny_model(arch: str, tiny: Any, seed: int = 0, tok: Any = None) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tiny, tok), dtype=torch.float32)
    return model


def config_hash(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
