"""Which part of the fused pre-attention step moves the packed INT4 path away from the simulated cache (the
"one format" measure of tests/test_kv_packed_cuda.py, on the same small random Qwen3: head_dim 128, 4 heads, 2 KV
heads, six prompts x 2 samples x 80 tokens).

For each route of the packed cache's decode step, eager layer functions (`graphs`) and Inductor's (`graphs+inductor`):
the packed path's own tokens replayed through the same route with the simulated cache (CudaDecoder.replay), mean
|log-prob difference|, against the bf16 decode's own gap from its full forward on the same route (the criterion
holds it to twice that). Routes:
  rotated            the rotated INT4 kernel, the compiled pre-attention function (the default)
  fused              + the fused pre-attention kernel (cuda_decode._FUSED_PRE; the simulated replay takes the same
                       kernel's norms and rotary, rollout/fused_step.py), the residual add fused into the next
                       layer's norm (_o_proj_mlp_project)
  fused, apart       + the fused kernel, o_proj + MLP and the next q/k/v product as two functions
                       (cuda_decode._FUSED_RESIDUAL = False: the residual stored in bf16 before the norm reads it)
  dequant            the dequantizing kernel (PARITY_INT4_ATTENTION=dequant), for scale

    python3 tests/bench/gpu_fused_pre_one_format.py --out fused_pre_one_format.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

# (INT4_ROTATED, _FUSED_PRE, _FUSED_RESIDUAL) of each route
ROUTES = {"rotated": (True, False, True), "fused": (True, True, True), "fused, apart": (True, True, False),
          "dequant": (False, False, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_fused_pre_one_format: needs a CUDA device")

    import parity.rollout.cuda_decode as cd
    import parity.rollout.decode_attention as da
    from parity.core.sampling import SamplingSpec
    from tests.kv_packed_checks import write_small_qwen3
    from tests.test_kv_packed_cuda import PROMPTS, _gap, _run_with_engine

    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=80, n=2, seed=3, topk_logprobs=4)
    model_dir = Path(tempfile.mkdtemp(prefix="fused_pre_model_"))
    write_small_qwen3(model_dir)
    rows: dict = {}
    for compile_layers in (False, True):
        route_name = "graphs+inductor" if compile_layers else "graphs"
        t = time.time()
        eng_bf16, b_bf16 = _run_with_engine(model_dir, "bf16", torch.bfloat16, True, spec, compile_layers)
        g_bf16 = float(_gap(eng_bf16, b_bf16, 1.0).mean())
        rows[route_name] = {"bf16_decode_vs_forward": g_bf16}
        for name, (rotated, fused, residual) in ROUTES.items():
            da.INT4_ROTATED, cd._FUSED_PRE, cd._FUSED_RESIDUAL = rotated, fused, residual
            eng, packed = _run_with_engine(model_dir, "int4_per_token_head", torch.bfloat16, True, spec,
                                           compile_layers)
            keep, cd._PACKED_KV = cd._PACKED_KV, False
            try:
                sim = eng.cuda_decoder.replay(PROMPTS, spec, packed.responses)
            finally:
                cd._PACKED_KV = keep
            m = packed.response_mask.to(eng.device)
            d = (packed.rollout_logprobs.to(eng.device) - sim.rollout_logprobs.to(eng.device)).abs()[m]
            rows[route_name][name] = {"mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
                                      "tokens": int(d.numel()), "over_bf16": float(d.mean()) / g_bf16,
                                      "within_twice": float(d.mean()) <= 2 * g_bf16,
                                      "kv_kernel": packed.meta.get("kv_kernel")}
            print(f"{route_name:16s} {name:14s} packed vs simulated {float(d.mean()):.4f} "
                  f"({float(d.mean()) / g_bf16:.2f}x bf16's {g_bf16:.4f})", flush=True)
        print(f"{route_name}: {time.time() - t:.0f} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
