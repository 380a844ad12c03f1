"""Rollout-to-trainer mismatch of each precision setting on the warm-start model, one component at a time.

Samples from the torch engine at the given precision (temperature 1, float32 compute) on training-split prompts
and teacher-forces the float32 model on the samples; prints mean / p99 / max |p_train - p_rollout| and the k3 KL
estimator over the sampled response tokens (what the trainer logs as mismatch/* at step 1, without training).

    .venv/bin/python scripts/mismatch_probe.py bf16,int4,bf16 int4,int4,int4_per_token_head   # W,A,KV each
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("settings", nargs="+", help="weights,activations,kv_cache (e.g. int8,int4,bf16)")
    ap.add_argument("--outputs-dir", default="outputs", help="where `parity prepare` put the warm start")
    ap.add_argument("--experiment", default="arith_tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    settings = [s.split(",") for s in a.settings]
    for s, parts in zip(a.settings, settings):
        if len(parts) != 3:
            ap.error(f"setting {s!r}: expected weights,activations,kv_cache")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.config import load_config
    from parity.config.schema import PrecisionConfig
    from parity.data.arithmetic import arithmetic_problems
    from parity.data.prompts import render_prompt
    from parity.models.prepare import resolve_model_dir
    from parity.precision.sampler import response_logprobs
    from parity.rollout.base import SamplingSpec
    from parity.rollout.torch_engine import TorchEngine

    cfg = load_config([f"experiment={a.experiment}", f"outputs_dir={a.outputs_dir}"])
    model_dir = Path(resolve_model_dir(cfg))
    if not (model_dir / "prepare.json").is_file():
        ap.error(f"no warm start at {model_dir}: run `python -m parity prepare experiment={a.experiment}` first")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = arithmetic_problems("train", a.prompts, cfg.data.arithmetic)
    ids = [tok(render_prompt(cfg.data.prompt_template, p.problem))["input_ids"] for p in problems]
    train = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    spec = SamplingSpec(temperature=1.0, max_new_tokens=int(cfg.rollout.max_new_tokens), n=a.samples, seed=a.seed)
    print(f"model {model_dir}, {len(ids)} prompts x {a.samples} samples")
    for w, act, kv in settings:
        t0 = time.perf_counter()
        engine = TorchEngine(model_dir, precision=PrecisionConfig(weights=w, activations=act, kv_cache=kv),
                             dtype=torch.float32)
        batch = engine.generate(ids, spec)
        with torch.no_grad():
            lp = response_logprobs(train, batch).gather(-1, batch.responses[..., None]).squeeze(-1)
        m = batch.response_mask
        dp = (lp.exp() - batch.rollout_logprobs.exp())[m].abs().double()
        log_r = (lp - batch.rollout_logprobs)[m].double()
        print(f"W={w} A={act} KV={kv}: mean |dp| {dp.mean():.2e}  p99 {dp.quantile(0.99):.3f}  max {dp.max():.3f}  "
              f"k3 {(log_r.exp() - 1 - log_r).mean():.2e}  tokens |dp|>0.1 {(dp > 0.1).double().mean():.1%}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
