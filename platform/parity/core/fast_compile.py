"""Opt-in trainer speed-up on CUDA (`trainer.compile_layers=true`): compile each decoder layer with torch.compile.

Why per layer and not the whole model: the layers share one code object, so Dynamo compiles the layer once
and reuses it for all of them (seconds instead of minutes), and the embedding / log-prob head stay eager
(the head is parity.algorithms.logprobs' chunked kernel, which must never build [tokens x vocab]).
What Inductor buys at batch 8 x 1024 on a 0.6B model: the RMSNorms, rotary embedding, SiLU-gate and
residual adds are ~20 element-wise kernels a layer that each read and write the whole activation; fused
they are a handful, which is the gap between the matmul time and the step time.

The numerics are the same operations in the same dtype (autocast bf16, float32 norms); fused kernels may
round intermediate results differently at bf16 level (measured against the eager step in bench_gpu.py).
"""

from __future__ import annotations

import torch


def raise_recompile_limit(at_least: int) -> None:
    """Let Dynamo keep at least this many specialisations of one function: past its limit (8 by default) it
    silently runs the function uncompiled."""
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), at_least))


def compile_decoder_layers_(model: torch.nn.Module, mode: str | None = None, dynamic: bool | None = None) -> int:
    """Compile every decoder layer of an HF causal LM in place; returns how many were compiled.
    dynamic=None: the first shapes compile static, a later change of batch shape recompiles once with dynamic
    sizes (RL batches vary in length). Raises ValueError when the model has no `model.layers` (config key
    `trainer.compile_layers`: nothing this function knows how to compile)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"trainer.compile_layers: {type(model).__name__} has no .model.layers to compile")
    # the layers share one code object: any per-layer specialisation counts against the recompile limit
    raise_recompile_limit(2 * len(layers) + 8)
    for layer in layers:
        layer.compile(mode=mode, dynamic=dynamic)
    return len(layers)
