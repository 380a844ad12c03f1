"""The warm-started model's task statistics and the rollout-to-trainer mismatch of each precision setting.

Samples from the rollout engine at each setting (temperature 1, float32 compute unless model.dtype says otherwise)
on training-split prompts of the experiment's task, teacher-forces the unperturbed full-precision model on the
samples, and prints mean / p99 / max |p_train - p_rollout| and the k3 KL estimator over the sampled response
tokens (what the trainer logs as mismatch/* at step 1, without training). With --task-stats it first reports
the model's own held-out accuracy (greedy and sampled) and its response lengths: the spread within a prompt's
group (std / mean) and the mean length of correct and incorrect responses.

    .venv/bin/python scripts/mismatch_probe.py bf16,int4,bf16 int4,int4,int4_per_token_head   # W,A,KV each
    .venv/bin/python scripts/mismatch_probe.py --experiment countdown_tiny --task-stats \\
        bf16,bf16,bf16,sigma=0.01 bf16,bf16,bf16,sigma=0.02 int8,int8,int4_per_token_head --out probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def parse_setting(text: str) -> dict:
    """W,A,KV[,sigma=S][,mode=fixed|redraw] -> the precision keys."""
    parts = text.split(",")
    if len(parts) < 3:
        raise ValueError(f"setting {text!r}: expected weights,activations,kv_cache[,sigma=S][,mode=M]")
    out = {"weights": parts[0], "activations": parts[1], "kv_cache": parts[2], "sigma": 0.0, "mode": "fixed"}
    for extra in parts[3:]:
        k, _, v = extra.partition("=")
        if k not in ("sigma", "mode") or not v:
            raise ValueError(f"setting {text!r}: unknown part {extra!r} (sigma=S or mode=fixed|redraw)")
        out[k] = float(v) if k == "sigma" else v
    return out


def task_stats(engine, tok, cfg, grader, n: int, samples: int, seed: int) -> dict:
    from parity.core.sampling import SamplingSpec
    from parity.data.prompts import render_prompt
    from parity.data.tasks import heldout_problems
    from parity.training.heldout import heldout_accuracy

    problems = heldout_problems(cfg, n)
    greedy = heldout_accuracy(engine, tok, problems, cfg.data.prompt_template, grader, int(cfg.rollout.max_new_tokens))
    ids = [tok(render_prompt(cfg.data.prompt_template, p.problem))["input_ids"] for p in problems]
    batch = engine.generate(ids, SamplingSpec(temperature=float(cfg.rollout.temperature), n=samples, seed=seed,
                                              max_new_tokens=int(cfg.rollout.max_new_tokens)))
    texts = tok.batch_decode(batch.responses, skip_special_tokens=True)
    scores = grader.grade(texts, [problems[int(g)].answer for g in batch.group_ids], batch.truncated.tolist())
    L = batch.response_lengths().double()
    cvs = [float(L[batch.group_ids == g].std(unbiased=False) / L[batch.group_ids == g].mean())
           for g in range(len(problems))]
    ok = scores > 0.5
    return {"heldout_greedy_accuracy": greedy, "sampled_accuracy": float(scores.mean()),
            "length_mean": float(L.mean()), "length_min": float(L.min()), "length_max": float(L.max()),
            "length_cv_within_group": statistics.fmean(cvs),
            "length_correct_mean": float(L[ok].mean()) if bool(ok.any()) else None,
            "length_incorrect_mean": float(L[~ok].mean()) if bool((~ok).any()) else None,
            "truncated_frac": float(batch.truncated.float().mean()), "problems": len(problems), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("settings", nargs="*", help="weights,activations,kv_cache[,sigma=S][,mode=M] (e.g. int8,int4,bf16)")
    ap.add_argument("--outputs-dir", default="outputs", help="where `parity prepare` put the warm start")
    ap.add_argument("--experiment", default="arith_tiny")
    ap.add_argument("--overrides", default="", help="more Hydra overrides, space-separated")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-stats", action="store_true", help="also the model's accuracy and response lengths")
    ap.add_argument("--out", default="", help="write the results as JSON here too")
    a = ap.parse_args(argv)
    try:
        settings = [parse_setting(s) for s in a.settings]
    except ValueError as e:
        ap.error(str(e))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.config import load_config
    from parity.config.schema import PerturbationConfig, PrecisionConfig
    from parity.core.sampling import SamplingSpec
    from parity.data.prompts import build_train_stream, render_prompt
    from parity.models.prepare import resolve_model_dir
    from parity.precision.sampler import response_logprobs
    from parity.rewards.grader import GraderPool
    from parity.rollout import build_engine, compute_dtype, resolve_device

    cfg = load_config([f"experiment={a.experiment}", f"outputs_dir={a.outputs_dir}", *a.overrides.split()])
    model_dir = Path(resolve_model_dir(cfg))
    if not (model_dir / "prepare.json").is_file() and cfg.model.source == "tiny":
        ap.error(f"no warm start at {model_dir}: run `python -m parity prepare experiment={a.experiment}` first")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = build_train_stream(cfg.data, seed=a.seed + 7919).take(a.prompts)
    ids = [tok(render_prompt(cfg.data.prompt_template, p.problem))["input_ids"] for p in problems]
    device = resolve_device(cfg.trainer.device)
    dtype = compute_dtype(cfg.model.dtype, device)
    train = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    spec = SamplingSpec(temperature=float(cfg.rollout.temperature), max_new_tokens=int(cfg.rollout.max_new_tokens),
                        n=a.samples, seed=a.seed)
    results: dict = {"model_dir": str(model_dir), "experiment": a.experiment, "dtype": str(dtype).removeprefix("torch."),
                     "prompts": len(ids), "samples": a.samples, "settings": []}
    print(f"model {model_dir} ({results['dtype']}), {len(ids)} prompts x {a.samples} samples", flush=True)
    if a.task_stats:
        with GraderPool(workers=int(cfg.eval.grade_workers), timeout_s=float(cfg.eval.grade_timeout_s)) as grader:
            engine = build_engine(cfg, model_dir, PrecisionConfig())
            results["task"] = task_stats(engine, tok, cfg, grader, int(cfg.trainer.eval_problems), a.samples, a.seed)
            engine.close()
        print("task:", json.dumps(results["task"]), flush=True)
    for s in settings:
        t0 = time.perf_counter()
        precision = PrecisionConfig(weights=s["weights"], activations=s["activations"], kv_cache=s["kv_cache"],
                                    perturbation=PerturbationConfig(sigma=s["sigma"], mode=s["mode"]))
        engine = build_engine(cfg, model_dir, precision, reference_dir=model_dir)
        batch = engine.generate(ids, spec)
        engine.close()
        with torch.no_grad():
            lp = response_logprobs(train, batch.to(device), temperature=spec.temperature)
            lp = lp.gather(-1, batch.responses.to(device)[..., None]).squeeze(-1).cpu()
        m = batch.response_mask
        dp = (lp.exp() - batch.rollout_logprobs.exp())[m].abs().double()
        log_r = (lp - batch.rollout_logprobs)[m].double()
        row = {**s, "abs_prob_diff_mean": float(dp.mean()), "abs_prob_diff_p99": float(dp.quantile(0.99)),
               "abs_prob_diff_max": float(dp.max()), "k3_kl": float((log_r.exp() - 1 - log_r).mean()),
               "frac_tokens_over_0.1": float((dp > 0.1).double().mean()), "tokens": int(m.sum()),
               "seconds": round(time.perf_counter() - t0, 1)}
        results["settings"].append(row)
        print(f"W={s['weights']} A={s['activations']} KV={s['kv_cache']} sigma={s['sigma']} ({s['mode']}): "
              f"mean |dp| {row['abs_prob_diff_mean']:.2e}  p99 {row['abs_prob_diff_p99']:.3f}  "
              f"max {row['abs_prob_diff_max']:.3f}  k3 {row['k3_kl']:.2e}  tokens |dp|>0.1 "
              f"{row['frac_tokens_over_0.1']:.1%}  ({row['seconds']:.0f} s)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
