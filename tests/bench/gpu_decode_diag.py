"""Where a captured decode step spends its time, BF16 against INT8 W8A8 (device-machine diagnostic, one call).

    python3 tests/bench/gpu_decode_diag.py --out $OUT/diag.json

Builds the 0.6B-shaped model, runs one generate per engine (compiles, captures the step graphs), then profiles
replays of one captured step (kernels inside a graph are recorded by CUPTI) and writes every kernel's device
time per step, so the two steps can be compared kernel by kernel; also the tokens/s of a generate call.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, "platform")
from gpu_bench_common import BATCH, P_TOKENS, R_TOKENS, build_model_dir, prompts, sync, timed  # noqa: E402


def replay_profile(eng, steps: int = 8) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from parity.rollout.cuda_decode import attended_length
    st = eng.cuda_decoder.state
    L = attended_length(P_TOKENS, 100, st.key_ok.shape[1])
    g = st.graphs[L]
    st.t.fill_(100)
    t, _ = timed(lambda: [g.replay() for _ in range(steps)], 3)
    st.t.fill_(100)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        sync()
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    kern = {e.key[:110]: [round(e.device_time_total / steps, 2), e.count // steps] for e in ev if e.count}
    return {"attended_slots": L, "replay_ms_per_step": t * 1e3 / steps,
            "kernel_us_per_step": round(sum(v[0] for v in kern.values()), 1),
            "kernels_per_step": sum(v[1] for v in kern.values()), "kernels_us_count": kern}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag.json")
    ap.add_argument("--modes", default="bf16,int8_w8a8,int8_unpinned")
    args = ap.parse_args()
    from parity.core.sampling import SamplingSpec
    from parity.rollout.torch_engine import TorchEngine
    d = build_model_dir()
    ps = prompts(BATCH)
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=R_TOKENS, n=1, seed=0)
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import parity.rollout.cuda_decode as cd
    from parity.precision import int8_triton as it
    w8a8 = SimpleNamespace(weights="int8", activations="int8", kv_cache="bf16")
    # mode -> (precision, pinned tiles)
    modes = {"bf16": (None, True), "int8_w8a8": (w8a8, True), "int8_unpinned": (w8a8, False)}
    for mode in args.modes.split(","):
        prec, cd._PIN_INT8 = modes[mode]
        if not cd._PIN_INT8:
            it._PINNED.clear()
        torch._dynamo.reset()
        eng = TorchEngine(d, precision=prec, device="cuda", dtype=torch.bfloat16)
        eng.generate(ps, spec)
        t, _ = timed(lambda eng=eng: eng.generate(ps, spec), 3)
        out[mode] = r = {"tok_s": BATCH * R_TOKENS / t, "linear_path": getattr(eng, "linear_path", None),
                         "pinned": {str(k): str(v) for k, v in eng.cuda_decoder.state.extras.get("int8_pinned", {}).items()},
                         **replay_profile(eng)}
        print(mode, {k: v for k, v in r.items() if k != "kernels_us_count"}, flush=True)
        for k, v in list(r["kernels_us_count"].items())[:25]:
            print(f"   {v[0]:8.1f} us x{v[1]:<4} {k}", flush=True)
        del eng
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    for mode in modes:
        if mode != "bf16" and mode in out and "bf16" in out:
            print(f"{mode}/bf16 tok/s {out[mode]['tok_s'] / out['bf16']['tok_s']:.4f}")


if __name__ == "__main__":
    main()
