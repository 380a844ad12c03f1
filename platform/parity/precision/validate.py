"""Validate a quantized policy against BF16 before training on it.

Responses are sampled from the quantized side (it is the rollout policy pi_inf = q) and scored
teacher-forced by the BF16 model (pi_train = p), at the sampling temperature. On the sampled response
tokens x (float64 statistics):

    abs_prob_diff   |p(x) - q(x)|: mean, p99, max       (the dual correction's delta)
    k1_kl           mean(log q - log p)                  (KL(q || p) estimator)
    k3_kl           mean(r - 1 - log r), r = p / q       (non-negative KL(q || p) estimator)
    kl_exact        mean over positions of sum_v q_v log(q_v / p_v)  (when q's full logits are known)
    top1_agreement  share of positions where argmax p == argmax q
    ppl_bf16, ppl_quant, ppl_ratio = ppl_bf16 / ppl_quant   (token-level, on q's samples)
    greedy prefix   tokens the two greedy decodes share before the first difference (mean, share of the
                    BF16 decode's length, share of prompts decoded identically)
    accuracy        of both greedy decodes, through an `accuracy_fn` hook (the math-verify grader)

`quant` is either an nn.Module (an HF model quantized in place: full distributions are available) or
an Engine (rollout_logprobs and top-1 come from the engine, so its KV-cache format counts too).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parity.config.schema import PrecisionValidationConfig
from parity.core.sampling import SamplingSpec
from parity.errors import ParityError
from parity.precision.reports import HISTORY_DIR, LATEST_STEM, REPORT_KIND, reports_of
from parity.precision.sampler import ModelSampler, response_logprobs
from parity.types import RolloutBatch

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig, PrecisionConfig

AccuracyFn = Callable[[list[str], list[str]], list[float]]


class PrecisionValidationError(ParityError):
    """A validation threshold was exceeded; the message lists every failed check with its numbers."""


# threshold field -> (metric key, "max" or "min")
_CHECKS = {"max_mean_abs_prob_diff": ("abs_prob_diff_mean", "max"), "max_p99_abs_prob_diff": ("abs_prob_diff_p99", "max"),
           "max_k3_kl": ("k3_kl", "max"), "min_top1_agreement": ("top1_agreement", "min"),
           "max_ppl_ratio": ("ppl_ratio", "max"), "max_accuracy_drop": ("accuracy_drop", "max")}


def thresholds_of(settings: PrecisionValidationConfig | None = None) -> dict[str, float | None]:
    """The thresholds of `rollout.precision.validation` (the schema's defaults when None), by field."""
    node = PrecisionValidationConfig() if settings is None else settings
    return {name: getattr(node, name) for name in _CHECKS}


def token_metrics(logp_p: torch.Tensor, logp_q: torch.Tensor, mask: torch.Tensor,
                  top1_p: torch.Tensor, top1_q: torch.Tensor) -> dict[str, float]:
    """Mismatch statistics over the masked sampled tokens; log-probs [B, R], argmaxes [B, R]."""
    m = mask.bool()
    if not m.any():
        raise ValueError("validation: no response tokens to compare (every response is empty)")
    lp, lq = logp_p[m].double(), logp_q[m].double()
    d = (lp.exp() - lq.exp()).abs()
    log_r = lp - lq
    n = int(m.sum())
    return {
        "n_tokens": n,
        "abs_prob_diff_mean": float(d.mean()),
        "abs_prob_diff_p99": float(torch.quantile(d, 0.99)) if n > 1 else float(d.max()),
        "abs_prob_diff_max": float(d.max()),
        "k1_kl": float((-log_r).mean()),
        "k3_kl": float((log_r.exp() - 1 - log_r).mean()),
        "top1_agreement": float((top1_p[m] == top1_q[m]).double().mean()),
        "ppl_bf16": math.exp(float(-lp.mean())),
        "ppl_quant": math.exp(float(-lq.mean())),
        "ppl_ratio": math.exp(float((lq - lp).mean())),
    }


def exact_kl(full_p: torch.Tensor, full_q: torch.Tensor, mask: torch.Tensor) -> float:
    """mean over masked positions of KL(q || p) from full distributions [B, R, V] (log-probs)."""
    m = mask.bool()
    lp, lq = full_p[m].double(), full_q[m].double()
    return float((lq.exp() * (lq - lp)).sum(-1).mean())


def greedy_prefix(ref: RolloutBatch, other: RolloutBatch) -> dict[str, float]:
    """Common prefix of two greedy decodes of the same prompts (EOS included): mean length in tokens,
    mean share of the reference (BF16) decode's length, and share of prompts decoded identically."""
    same = (ref.responses == other.responses) & ref.response_mask & other.response_mask
    prefix = same.long().cumprod(-1).sum(-1).double()
    ref_len = ref.response_mask.sum(-1).double().clamp_min(1)
    full = (ref.response_mask == other.response_mask).all(-1) & ((ref.responses == other.responses)
                                                                 | ~ref.response_mask).all(-1)
    return {"greedy_prefix_mean": float(prefix.mean()), "greedy_prefix_fraction": float((prefix / ref_len).mean()),
            "greedy_identical_fraction": float(full.double().mean())}


def _is_engine(quant: Any) -> bool:
    return hasattr(quant, "generate") and not isinstance(quant, nn.Module)


def _accuracy(batch: RolloutBatch, decode: Callable[[list[int]], str], answers: Sequence[str],
              accuracy_fn: AccuracyFn) -> float:
    texts = [decode(row[m].tolist()) for row, m in zip(batch.responses, batch.response_mask)]
    scores = accuracy_fn(texts, [answers[int(i)] for i in batch.group_ids])
    return float(sum(scores) / max(len(scores), 1))


def validate_precision(bf16_model: nn.Module, quant: Any, prompts: list[list[int]],
                       thresholds: PrecisionValidationConfig | None = None, *, samples_per_prompt: int = 2,
                       max_new_tokens: int = 16, temperature: float = 1.0, seed: int = 0,
                       pad_token_id: int = 0, eos_token_id: int | None = None,
                       answers: Sequence[str] | None = None, decode: Callable[[list[int]], str] | None = None,
                       accuracy_fn: AccuracyFn | None = None, enforce: bool = False) -> dict:
    """Compare `quant` (model or engine) with `bf16_model` on `prompts`; returns the report (see module
    doc). Thresholds are checked into report['failures']; with enforce=True a failure raises."""
    if temperature <= 0:
        raise ValueError(f"validation temperature must be > 0 (it samples), got {temperature}")
    limits = thresholds_of(thresholds)
    bf16_model.eval()
    q_engine = quant if _is_engine(quant) else ModelSampler(quant, pad_token_id, eos_token_id)
    p_engine = ModelSampler(bf16_model, pad_token_id, eos_token_id)
    spec = SamplingSpec(temperature=temperature, max_new_tokens=max_new_tokens, n=samples_per_prompt,
                        topk_logprobs=1, seed=seed)
    batch = q_engine.generate(prompts, spec)
    full_p = response_logprobs(bf16_model, batch, temperature)
    lp = full_p.gather(-1, batch.responses[..., None]).squeeze(-1)
    if isinstance(quant, nn.Module):  # full q: exact KL and argmax from the logits
        full_q = response_logprobs(quant, batch, temperature)
        lq, top1_q = full_q.gather(-1, batch.responses[..., None]).squeeze(-1), full_q.argmax(-1)
    else:
        full_q, lq = None, batch.rollout_logprobs
        if batch.topk_ids is None:
            raise ValueError("validation: the engine returned no top-1 ids (topk_logprobs=1 was requested)")
        top1_q = batch.topk_ids[..., 0].long()
    metrics: dict[str, Any] = token_metrics(lp, lq, batch.response_mask, full_p.argmax(-1), top1_q)
    metrics["kl_exact"] = exact_kl(full_p, full_q, batch.response_mask) if full_q is not None else None
    if isinstance(quant, nn.Module):  # the engine path reuses the engine's own log-probs: check them
        metrics["rollout_vs_rescored_max_abs"] = float((batch.rollout_logprobs - lq)[batch.response_mask].abs().max())
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=max_new_tokens, n=1, seed=seed)
    g_q, g_p = q_engine.generate(prompts, greedy), p_engine.generate(prompts, greedy)
    metrics.update(greedy_prefix(g_p, g_q))
    metrics.update(accuracy_bf16=None, accuracy_quant=None, accuracy_drop=None)
    if accuracy_fn is not None and answers is not None and decode is not None:
        acc_p, acc_q = _accuracy(g_p, decode, answers, accuracy_fn), _accuracy(g_q, decode, answers, accuracy_fn)
        metrics.update(accuracy_bf16=acc_p, accuracy_quant=acc_q, accuracy_drop=acc_p - acc_q)
    report = {"n_prompts": len(prompts), "samples_per_prompt": samples_per_prompt, "max_new_tokens": max_new_tokens,
              "temperature": temperature, "seed": seed, "quant": q_engine.describe(), "metrics": metrics,
              "thresholds": limits}
    report["failures"] = check_thresholds(metrics, limits)
    report["passed"] = not report["failures"]
    if enforce:
        enforce_thresholds(report)
    return report


def check_thresholds(metrics: dict, thresholds: dict[str, float | None]) -> list[str]:
    """One line per failed check, naming the metric, its value and the threshold's config key."""
    out = []
    for name, (key, kind) in _CHECKS.items():
        limit, value = thresholds[name], metrics.get(key)
        if limit is None or value is None:
            continue
        bad = value > limit if kind == "max" else value < limit
        if bad or not math.isfinite(value):
            op = ">" if kind == "max" else "<"
            out.append(f"{key} = {value:.6g} {op} {limit:g} (threshold rollout.precision.validation.{name})")
    return out


def enforce_thresholds(report: dict) -> None:
    if report["failures"]:
        raise PrecisionValidationError("precision validation failed: " + "; ".join(report["failures"]))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def report_markdown(report: dict, title: str = "Precision validation") -> str:
    th = report["thresholds"]
    limit_of = {key: (name, th[name]) for name, (key, _) in _CHECKS.items()}
    lines = [f"# {title}", "", f"{'PASSED' if report['passed'] else 'FAILED'}: {report['n_prompts']} held-out prompts x "
             f"{report['samples_per_prompt']} samples, {report['max_new_tokens']} new tokens, temperature "
             f"{report['temperature']}; quantized side: `{json.dumps(report['quant'])}`", "",
             "| metric | value | threshold |", "|---|---|---|"]
    for key, value in report["metrics"].items():
        name, limit = limit_of.get(key, (None, None))
        lines.append(f"| {key} | {_fmt(value)} | {_fmt(limit) if name else ''} |")
    if report["failures"]:
        lines += ["", "Failures:", *[f"- {f}" for f in report["failures"]]]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path, stem: str = "validation") -> tuple[Path, Path]:
    """<out_dir>/<stem>.json and <stem>.md (replaced atomically: a reader never sees half a report)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    j, md = out / f"{stem}.json", out / f"{stem}.md"
    for path, text in ((j, json.dumps(report, indent=2)), (md, report_markdown(report))):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return j, md


def record_report(report: dict, checkpoint_dir: str | Path, spec: str, now: datetime | None = None) -> dict:
    """Keep one validation: <checkpoint_dir>/validations/<spec>-<UTC time>.json/.md, created once and never
    overwritten, and the same report as <checkpoint_dir>/validation.json/.md, the latest validation of this
    checkpoint (what older readers open). The report gains `report`, `precision_spec` and `created_at`.
    Returns {'report', 'json', 'md', 'latest_json', 'latest_md'}."""
    when = (now or datetime.now(UTC)).astimezone(UTC)
    report = {**report, "report": REPORT_KIND, "precision_spec": spec,
              "created_at": when.isoformat(timespec="microseconds")}
    hist = Path(checkpoint_dir) / HISTORY_DIR
    hist.mkdir(parents=True, exist_ok=True)
    stem = f"{spec}-{when:%Y%m%d-%H%M%S}"
    for n in range(1, 1000):  # two validations within one second: -2, -3 ...
        name = stem if n == 1 else f"{stem}-{n}"
        try:
            with (hist / f"{name}.json").open("x") as f:
                f.write(json.dumps(report, indent=2))
            break
        except FileExistsError:
            continue
    else:
        raise ParityError(f"{hist}: no free report name for {stem}")
    md = hist / f"{name}.md"
    md.write_text(report_markdown(report))
    latest_json, latest_md = write_report(report, checkpoint_dir, LATEST_STEM)
    return {"report": report, "json": hist / f"{name}.json", "md": md, "latest_json": latest_json,
            "latest_md": latest_md}


def precision_record(precision: PrecisionConfig) -> dict:
    """The rollout precision as a validation report records it (formats and the perturbation dial)."""
    from parity.precision.perturbation import perturbation_of

    sigma, mode, seed = perturbation_of(precision)
    rec = {"weights": str(precision.weights), "activations": str(precision.activations),
           "kv_cache": str(precision.kv_cache)}
    if sigma > 0:
        rec["perturbation"] = {"sigma": sigma, "mode": mode, "seed": seed}
    return rec


def validated_discrepancy(cfg: ParityConfig, precision: PrecisionConfig) -> tuple[float, str] | None:
    """(mean |p_train - p_inf|, report path) that the latest `validate` of this rollout precision measured, or
    None when no report exists for it (algorithm.correction.tolerance=auto then measures the first steps
    instead). Reports written for another precision (other formats, another perturbation) are not used."""
    from parity.precision.export import quantized_checkpoint_dir

    if str(precision.weights) == "bf16" and str(precision.activations) == "bf16":
        return None  # nothing to quantize: no validate stage ran
    want = precision_record(precision)
    for path, report in reversed(reports_of(quantized_checkpoint_dir(cfg, precision))):
        try:
            value = float(report["metrics"]["abs_prob_diff_mean"])
        except (KeyError, TypeError, ValueError):
            continue
        if report.get("precision") == want and math.isfinite(value):
            return value, str(path)
    return None
