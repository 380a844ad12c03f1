"""How far a decode's log-probs sit from a full forward of the same tokens, with and without a low-precision KV
cache, on any device (the CPU plain loop included): the reference for "one INT4 format" (docs/INT4_DECODE.md).

For each KV format, the rollout engine of a prepared model samples held-out prompts; the same engine's full
forward with the simulated cache (tests/kv_packed_checks.teacher_forced_logprobs: every K/V through the codec's
round trip) scores the sampled tokens; printed: mean, p99 and max |decode log-prob - forward log-prob|. With bf16
the gap is the arithmetic's own (a decode step and a full forward round differently); a codec can only widen it,
by flipping the code of a value near a rounding boundary.

Second measure, the "one INT4 format" criterion: the same tokens replayed through the plain loop
(TorchEngine.replay: teacher-forced decoding, the simulated cache step by step), mean / p99 / max |decode log-prob -
replay log-prob|. On CUDA the decode is the fast path (for a low-precision cache its packed codes and kernel), so
the bf16 row is the fast path's own gap from the plain loop and an INT4 row the packed path's; the "simulated
cache" row is the fast path with the codec's round trip in place of the packed cache, the same compiled layers
and the same codes, so the packed row against it is the packed cache's own share; `one_format` says whether each
low-precision row stays within twice the bf16 row's mean. For a packed row, its tokens are also replayed through
the same path with the simulated cache (CudaDecoder.replay: the same compiled layers and codes), which isolates the
packed cache's own arithmetic; `one_format` holds that to twice the bf16 decode's gap from its forward. On CPU
both are the plain loop (gap 0).

    python3 tests/bench/int4_decode_vs_forward.py --model-dir MODEL --device cpu --dtype bfloat16
    python3 tests/bench/int4_decode_vs_forward.py --model-dir MODEL --device cuda --out packed_kv_countdown.json
    python3 tests/bench/int4_decode_vs_forward.py --model-dir MODEL --device cuda \
        --rows "int4_per_token_head, dequantizing kernel;int4_per_token_head, rotated kernel"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]

FORMATS = {"bf16": [], "int4_per_token_head": ["rollout.precision.kv_cache=int4_per_token_head"],
           # the same format through the decode path with the simulated cache (cuda_decode._PACKED_KV off): the
           # packed cache's own share of the INT4 row's distance from the replay
           "int4_per_token_head, simulated cache": ["rollout.precision.kv_cache=int4_per_token_head"],
           "int4_per_token_head, no rotation": ["rollout.precision.kv_cache=int4_per_token_head",
                                                "rollout.precision.kv_hadamard=false"],
           "fp8_per_token_head": ["rollout.precision.kv_cache=fp8_per_token_head"],
           # the same format on the other routes of the packed cache, whatever the defaults (decode_attention.
           # INT4_ROTATED, cuda_decode._FUSED_PRE: ROUTES below): the packed cache's share on each
           "int4_per_token_head, dequantizing kernel": ["rollout.precision.kv_cache=int4_per_token_head"],
           "int4_per_token_head, rotated kernel": ["rollout.precision.kv_cache=int4_per_token_head"],
           "int4_per_token_head, rotated kernel + fused pre-attention": [
               "rollout.precision.kv_cache=int4_per_token_head"]}
# (INT4_ROTATED, _FUSED_PRE) of the rows that set them; the others run the defaults (PARITY_INT4_ATTENTION,
# PARITY_FUSED_PRE_ATTENTION)
ROUTES = {"int4_per_token_head, dequantizing kernel": (False, False),
          "int4_per_token_head, rotated kernel": (True, False),
          "int4_per_token_head, rotated kernel + fused pre-attention": (True, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--experiment", default="countdown_gpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rows", default=";".join(FORMATS),
                    help=f"labels of the rows to run separated by ';', bf16 always (default all: {'; '.join(FORMATS)})")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    wanted = ["bf16", *(r.strip() for r in a.rows.split(";") if r.strip() and r.strip() != "bf16")]
    if bad := [r for r in wanted if r not in FORMATS]:
        ap.error(f"--rows: unknown row(s) {bad}; expected among {list(FORMATS)}")

    import torch
    from transformers import AutoTokenizer

    from parity.config import load_config
    from parity.core.sampling import SamplingSpec
    from parity.data.prompts import render_prompt
    from parity.data.tasks import heldout_problems
    from parity.rollout import build_engine, cuda_decode
    from parity.rollout import decode_attention as da
    from tests.kv_packed_checks import teacher_forced_logprobs

    def gap(lp: torch.Tensor, other: torch.Tensor, m: torch.Tensor) -> dict:
        d = (lp.to(m.device) - other.to(m.device)).abs()[m].float()
        return {"tokens": int(d.numel()), "mean_abs_dlogp": float(d.mean()), "p99": float(d.quantile(0.99)),
                "max": float(d.max())}

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    rows = {}
    defaults = (da.INT4_ROTATED, cuda_decode._FUSED_PRE)
    for label in wanted:
        over = FORMATS[label]
        da.INT4_ROTATED, cuda_decode._FUSED_PRE = ROUTES.get(label, defaults)
        cfg = load_config([f"experiment={a.experiment}", f"model.path={a.model_dir}", f"trainer.device={a.device}",
                           f"model.dtype={a.dtype}", *over])
        eng = build_engine(cfg, a.model_dir)
        cuda_decode._PACKED_KV = "simulated cache" not in label
        ids = [tok(render_prompt(cfg.data.prompt_template, p.problem))["input_ids"]
               for p in heldout_problems(cfg, a.prompts)]
        t = time.time()
        spec = SamplingSpec(temperature=1.0, max_new_tokens=a.tokens, n=a.samples, seed=3)
        b = eng.generate(ids, spec, prompt_ids=list(range(len(ids))))
        ref = teacher_forced_logprobs(eng, b, 1.0)
        m = b.response_mask.to(ref.device)
        rep = eng.replay(ids, spec, b.responses, prompt_ids=list(range(len(ids))))
        assert torch.equal(rep.responses, b.responses), "the replay recorded other tokens than it was given"
        same_route = None
        if b.meta.get("kv_cache_layout") == "packed":  # the packed tokens through the simulated cache, same route
            cuda_decode._PACKED_KV = False
            try:
                sim = eng.cuda_decoder.replay(ids, spec, b.responses, prompt_ids=list(range(len(ids))))
            finally:
                cuda_decode._PACKED_KV = True
            same_route = {**gap(b.rollout_logprobs, sim.rollout_logprobs, m),
                          "replay_kv_cache_layout": sim.meta.get("kv_cache_layout")}
            print(f"{'':34s} packed vs the simulated cache on the same route and tokens: mean "
                  f"{same_route['mean_abs_dlogp']:.5f} max {same_route['max']:.3f}", flush=True)
        vs_replay = gap(b.rollout_logprobs, rep.rollout_logprobs, m)
        rows[label] = {**gap(b.rollout_logprobs, ref, m), "vs_replay": vs_replay,
                       "vs_simulated_cache_same_route": same_route,
                       "decode_path": b.meta.get("decode_path", "plain loop"),
                       "kv_cache_layout": b.meta.get("kv_cache_layout"), "kv_kernel": b.meta.get("kv_kernel")}
        print(f"{label:34s} tokens {rows[label]['tokens']:5d}  vs forward: mean {rows[label]['mean_abs_dlogp']:.5f}  "
              f"p99 {rows[label]['p99']:.4f}  max {rows[label]['max']:.3f};  vs replay: mean "
              f"{vs_replay['mean_abs_dlogp']:.5f}  max {vs_replay['max']:.3f}  [{rows[label]['decode_path']}, "
              f"{rows[label]['kv_cache_layout']}]  ({time.time() - t:.0f} s)", flush=True)
    bf16 = rows["bf16"]["vs_replay"]["mean_abs_dlogp"]
    bf16_forward = rows["bf16"]["mean_abs_dlogp"]
    one_format = {label: {"mean_abs_dlogp_vs_replay": r["vs_replay"]["mean_abs_dlogp"], "bf16_same_measure": bf16,
                          "ratio_to_bf16": r["vs_replay"]["mean_abs_dlogp"] / bf16 if bf16 else None,
                          "within_twice_bf16": r["vs_replay"]["mean_abs_dlogp"] <= 2 * bf16,
                          # the packed cache against the simulated one on its own tokens, the same compiled route,
                          # held to twice the bf16 decode's own gap from its forward
                          "packed_vs_simulated_same_route": (r["vs_simulated_cache_same_route"] or {}).get(
                              "mean_abs_dlogp"),
                          "bf16_decode_vs_forward": bf16_forward,
                          "packed_within_twice_bf16_forward": None if not r["vs_simulated_cache_same_route"] else
                          r["vs_simulated_cache_same_route"]["mean_abs_dlogp"] <= 2 * bf16_forward}
                  for label, r in rows.items() if label != "bf16"}
    for label, v in one_format.items():
        ratio = "n/a (bf16 gap 0)" if v["ratio_to_bf16"] is None else f"{v['ratio_to_bf16']:.2f}x bf16's"
        same = v["packed_vs_simulated_same_route"]
        packed = ("" if same is None else f"; packed vs simulated on the same route {same:.5f} = "
                  f"{same / v['bf16_decode_vs_forward']:.2f}x the bf16 decode's gap from its forward, within twice: "
                  f"{v['packed_within_twice_bf16_forward']}")
        print(f"one format, {label}: decode vs replay {v['mean_abs_dlogp_vs_replay']:.5f} = {ratio}, within twice: "
              f"{v['within_twice_bf16']}{packed}", flush=True)
    if a.out:
        import os
        import platform
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else None
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                           "device": a.device, "dtype": a.dtype, "cpu": cpu, "cpus": os.cpu_count(),
                                           "torch": torch.__version__, "rows": rows,
                                           "one_format": one_format}, indent=1))


if __name__ == "__main__":
    main()
