"""`python -m parity validate [overrides]`: compare the quantized rollout with BF16 before training.

Reads the checkpoint `quantize` wrote (its config.json is checked first: a missing or malformed file is
one clear error), runs it in the configured rollout engine at the rollout precision (torch: the BF16
model quantized in place, then the checkpoint's codes and scales loaded verbatim, KV-cache format
included; vllm: the checkpoint folder as vLLM loads it), and compares it with the BF16 model on
held-out prompts (parity.precision.validate). Every validation keeps its report, named by the full precision
spec and the time: validations/<spec>-<YYYYmmdd-HHMMSS>.json + .md beside config.json, never overwritten; the
latest is also validation.json + .md there (config.json itself stays where the seed's
quantization_config_file points). A threshold in `rollout.precision.validation` that is exceeded stops the command
with a non-zero exit naming it, so a pipeline stops before training on a broken model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.data.prompts import build_train_stream, render_prompt
from parity.data.tasks import synthetic_task
from parity.precision.config import (
    load_quantization_config_file,
    quantization_config_path,
    resolve_precision,
    spec_of,
)
from parity.precision.export import load_compressed_checkpoint_, quantized_checkpoint_dir
from parity.precision.validate import (
    PrecisionValidationError,
    enforce_thresholds,
    precision_record,
    record_report,
    validate_precision,
)
from parity.rewards.grader import grade_answer
from parity.rollout import build_engine, compute_dtype, is_perturbed, resolve_device
from parity.training.warm_start import prepare_model

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig, PrecisionConfig

GROUPS = ["precision", "model", "rollout"]
KEYS = [
    "rollout.precision.validation.num_prompts, .samples_per_prompt, .max_new_tokens: the held-out check",
    "rollout.precision.validation.max_mean_abs_prob_diff, .max_k3_kl, .min_top1_agreement: the thresholds",
]
EXAMPLES = [
    "python -m parity validate +precision=w8a8_int8",
    "python -m parity validate +precision=w8a8_int8_kv_int4 rollout.precision.validation.max_k3_kl=0.02",
]


def heldout_prompts(cfg: ParityConfig, n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt text, reference answer): the synthetic task's test split, or problems of the configured data
    (the quantization is calibration-free, so any prompts are held out from it)."""
    if cfg.data.name in ("arithmetic", "countdown"):
        problems = synthetic_task(cfg.data).test_problems(n, seed_offset=seed)
    else:
        problems = build_train_stream(cfg.data, seed=seed + 7919).take(n)
    return [(render_prompt(cfg.data.prompt_template, p.problem), p.answer) for p in problems]


def _quant_side(cfg: ParityConfig, source: Path, ckpt_dir: Path, precision: PrecisionConfig) -> Any:
    if is_perturbed(precision):  # the rollout's perturbation (theta_0 + Delta, then quantized) is what is validated
        return build_engine(cfg, ckpt_dir if cfg.rollout.name == "vllm" else source, precision, reference_dir=source)
    if cfg.rollout.name == "vllm":
        return build_engine(cfg, ckpt_dir, precision)
    engine = build_engine(cfg, source, precision)  # BF16 weights quantized in place, KV codec set up
    load_compressed_checkpoint_(engine.model, ckpt_dir)  # then exactly what the checkpoint holds
    return engine


def _grade(texts: list[str], answers: list[str]) -> list[float]:
    return [grade_answer(t, a)[0] for t, a in zip(texts, answers)]


def run(cfg: ParityConfig) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    precision = resolve_precision(cfg)
    seed_file = quantization_config_path(cfg)
    config_file = Path(str(seed_file)) if seed_file else quantized_checkpoint_dir(cfg, precision) / "config.json"
    key = "actor_rollout_ref.rollout.quantization_config_file" if seed_file else "rollout.precision.export_dir"
    info = load_quantization_config_file(config_file, expect=(precision.weights, precision.activations), key=key)
    v = cfg.rollout.precision.validation
    source = Path(prepare_model(cfg)["model_dir"])
    tok = AutoTokenizer.from_pretrained(str(source))
    device = resolve_device(cfg.trainer.device)
    bf16 = AutoModelForCausalLM.from_pretrained(str(source), dtype=compute_dtype(cfg.model.dtype, device)).to(device).eval()
    problems = heldout_prompts(cfg, int(v.num_prompts), int(v.seed))
    prompts = [tok(text)["input_ids"] for text, _ in problems]
    quant = _quant_side(cfg, source, info.checkpoint_dir, precision)
    try:
        with torch.no_grad():
            report = validate_precision(
                bf16, quant, prompts, v, samples_per_prompt=int(v.samples_per_prompt),
                max_new_tokens=int(v.max_new_tokens), temperature=float(v.temperature), seed=int(v.seed),
                pad_token_id=int(tok.pad_token_id), eos_token_id=tok.eos_token_id, answers=[a for _, a in problems],
                decode=lambda ids: tok.decode(ids, skip_special_tokens=True), accuracy_fn=_grade)
    finally:
        quant.close()
    report.update(checkpoint_dir=str(info.checkpoint_dir), source_model=str(source),
                  precision=precision_record(precision))
    kept = record_report(report, info.checkpoint_dir, spec_of(precision))
    try:
        enforce_thresholds(report)  # after writing: the report says why
    except PrecisionValidationError as e:
        e.report_json, e.report_md = str(kept["json"]), str(kept["md"])
        raise
    m = report["metrics"]
    return {"command": "validate", "passed": True, "report_json": str(kept["json"]), "report_md": str(kept["md"]),
            "latest_json": str(kept["latest_json"]), "precision_spec": kept["report"]["precision_spec"],
            **{k: m[k] for k in ("abs_prob_diff_mean", "abs_prob_diff_p99", "k3_kl", "top1_agreement",
                                 "greedy_prefix_mean", "ppl_ratio", "accuracy_bf16", "accuracy_quant")}}
