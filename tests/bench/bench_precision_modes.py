"""Mismatch of every rollout precision mode against the BF16 trainer forward, on the default model.

For each mode the torch engine is built at that precision (weights/activations quantized in place, KV
cache through its codec) and compared with the BF16 model by parity.precision.validate on held-out
arithmetic prompts (the `validate` command's metrics, without writing a checkpoint). Prints one JSON
line per mode, then a Markdown table. Run after `python -m parity prepare`:

    .venv/bin/python tests/bench/bench_precision_modes.py [hydra overrides, e.g. model=tiny_qwen3_moe]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

MODES = [  # (label, weights, activations, kv_cache)
    ("BF16 engine", "bf16", "bf16", "bf16"),
    ("W8A8 INT8", "int8", "int8", "bf16"),
    ("W8A8 INT8 + INT4 KV (seed)", "int8", "int8", "int4_per_token_head"),
    ("W8A8 FP8", "fp8", "fp8", "bf16"),
    ("W8A8 FP8 + FP8 KV", "fp8", "fp8", "fp8"),
    ("W8A16 INT8 (weight-only)", "int8", "bf16", "bf16"),
    ("BF16 + INT8 KV", "bf16", "bf16", "int8"),
    ("BF16 + INT4 KV", "bf16", "bf16", "int4_per_token_head"),
    ("W4A16 INT4 (weight-only, torch engine only)", "int4", "bf16", "bf16"),
    ("W4A8 INT4/INT8 + INT4 KV (harsh)", "int4", "int8", "int4_per_token_head"),
]
COLUMNS = ["abs_prob_diff_mean", "abs_prob_diff_p99", "k3_kl", "top1_agreement", "greedy_prefix_fraction",
           "greedy_identical_fraction", "ppl_ratio", "accuracy_bf16", "accuracy_quant"]


def main(overrides: list[str]) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.commands.validate import _grade, heldout_prompts
    from parity.config import load_config
    from parity.config.schema import PrecisionValidationConfig
    from parity.models.prepare import resolve_model_dir
    from parity.precision.validate import validate_precision
    from parity.rollout import build_engine, compute_dtype, resolve_device

    cfg = load_config(overrides)
    model_dir = Path(resolve_model_dir(cfg))
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"no prepared model at {model_dir}: run `python -m parity prepare` first")
    v = cfg.rollout.precision.validation
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    device = resolve_device(cfg.trainer.device)
    dtype = compute_dtype(cfg.model.dtype, device)
    bf16 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    problems = heldout_prompts(cfg, int(v.num_prompts), int(v.seed))
    prompts = [tok(text)["input_ids"] for text, _ in problems]
    rows = []
    for label, w, a, kv in MODES:
        mode_cfg = load_config([*overrides, f"rollout.precision.weights={w}", f"rollout.precision.activations={a}",
                                f"rollout.precision.kv_cache={kv}"])
        t0 = time.perf_counter()
        engine = build_engine(mode_cfg, model_dir)
        try:
            rep = validate_precision(
                bf16, engine, prompts, PrecisionValidationConfig(), samples_per_prompt=int(v.samples_per_prompt),
                max_new_tokens=int(v.max_new_tokens), temperature=float(v.temperature), seed=int(v.seed),
                pad_token_id=int(tok.pad_token_id), eos_token_id=tok.eos_token_id, answers=[x for _, x in problems],
                decode=lambda ids: tok.decode(ids, skip_special_tokens=True), accuracy_fn=_grade)
        finally:
            engine.close()
        row = {"mode": label, "weights": w, "activations": a, "kv_cache": kv, "dtype": str(dtype),
               "path": rep["quant"].get("linear_path"), "n_tokens": rep["metrics"]["n_tokens"],
               **{c: rep["metrics"][c] for c in COLUMNS}, "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| mode | " + " | ".join(COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS))
    for r in rows:
        cells = [f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS]
        print(f"| {r['mode']} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))
    main(sys.argv[1:])
