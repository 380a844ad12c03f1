"""The decode step's draw at top_p = 1, unfused (log-softmax of logits / T, sample_inverse_cdf, the gather of the
drawn token's log-prob: what cuda_decode runs by default) against the two-launch draw of
parity.rollout.sampler_kernel (PARITY_FUSED_SAMPLER=on), timed in the same run as CUDA graphs of 50 calls, at the
Qwen3 vocabulary (151,936) and the Countdown model's (1,028), batch 64 and 240. Also checks that both give the same
tokens on rows whose target is not within float rounding of a boundary. One JSON:

    PYTHONPATH=platform:tests/bench python3 tests/bench/gpu_sampler.py --out sampler.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gpu_bench_common import graph_us

from parity.rollout.sampler_kernel import fused_draw
from parity.rollout.sampling import sample_inverse_cdf


def unfused(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits / temperature, dim=-1)
    tok = sample_inverse_cdf(logp, u)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def one(B: int, V: int, temperature: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(B + V)
    logits = torch.randn(B, V, device="cuda", generator=g) * 3.0
    u = torch.rand(B, device="cuda", generator=g, dtype=torch.float64)
    a_tok, a_lp = unfused(logits, temperature, u)
    b_tok, b_lp = fused_draw(logits, temperature, u)
    same = int((a_tok == b_tok).sum())
    lp_gap = float((a_lp - b_lp).abs()[a_tok == b_tok].max()) if same else None
    t_unfused = graph_us([lambda: unfused(logits, temperature, u)])
    t_fused = graph_us([lambda: fused_draw(logits, temperature, u)])
    out = {"B": B, "V": V, "temperature": temperature, "unfused_us": t_unfused, "fused_us": t_fused,
           "speedup": round(t_unfused / t_fused, 3), "same_tokens": f"{same} of {B}", "logprob_gap_max": lp_gap,
           "logits_GBps_fused": round(logits.numel() * 4 / (t_fused * 1e3), 1)}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sampler.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"{__file__}: needs a CUDA device; nothing measured on this machine")
        return
    t0 = time.perf_counter()
    rows = [one(B, V, T) for V in (151_936, 1_028) for B in (64, 240) for T in (1.0, 0.7)]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "total_s": round(time.perf_counter() - t0, 1)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
