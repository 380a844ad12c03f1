"""Rollout precision: the numerics of a low-precision inference stack, reproduced in torch.

    formats   INT8 / FP8 E4M3 row-wise quantization (per output channel, per token) and error bounds
    linear    QuantLinear: W8A8 INT8 (torch._int_mm on CUDA, exact simulation elsewhere), FP8, weight-only
    kv        KV-cache codecs: bf16, int8, fp8, fp8_per_token_head, int4_per_token_head (vLLM's numerics)
    kv_packed the codecs' codes and scales as a device cache (CUDA decode path), Triton write / dequantize kernels
    apply     quantize_model_ (HF Qwen3 / Qwen3-MoE in place), load_weights_ (streamed weight sync)
    config    resolve_precision (rollout.precision or the seed block), quantized checkpoint config file
    export    compressed-tensors checkpoint that vLLM loads; load_compressed_checkpoint_
    validate  quantized vs BF16 metrics, thresholds, JSON + Markdown report
    sampler   Engine.generate for a plain HF model (validation)

Submodules are imported explicitly (nothing here), so `import parity.precision.kv` stays light.
"""
