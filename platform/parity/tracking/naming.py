"""What a run is called and what tells it apart, for MLflow and the dashboard alike.

A pipeline run is named after what it ran, `arith_tiny / int8+int4kv / tis / seed 0` (experiment,
rollout precision, correction, seed), each stage run `<that> / train`, a plain `python -m parity train`
run `<that> / train` too. The same facts go into tags (`parity.precision`, `parity.correction`,
`parity.seed`) so the MLflow UI can filter on them, and a short set of identifying params goes on every
stage run. Pure functions of the config (no MLflow import): the dashboard reads runs back with them."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlencode

# MLflow 3's UI opens an experiment on its GenAI traces view unless the experiment says what it holds; the
# UI reads this tag and shows its runs table ("Machine learning") for this value.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT = "custom_model_development"
SWEEP_TAG = "parity.sweep"
KIND_TAG = "parity.kind"  # pipeline | stage | train (a plain training run)

# config keys that tell runs apart (prefixes; a correction's own settings are added for the corrections in use)
IDENTITY_KEYS = (
    "experiment_name", "model.name", "model.path", "model.source", "data.name", "data.path", "rollout.name",
    "rollout.n", "rollout.temperature", "rollout.max_new_tokens", "rollout.precision.weights",
    "rollout.precision.activations", "rollout.precision.kv_cache", "rollout.precision.perturbation.",
    "actor_rollout_ref.rollout.quantization", "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype",
    "algorithm.adv_estimator", "algorithm.policy_loss", "algorithm.loss_agg_mode", "algorithm.correction.name",
    "algorithm.correction.tolerance", "trainer.lr", "trainer.seed", "trainer.total_steps", "trainer.prompts_per_step",
    "trainer.run_name",
)
_KV_SHORT = {"int4_per_token_head": "int4", "int8": "int8", "int8_per_token_head": "int8", "fp8": "fp8",
             "fp8_per_token_head": "fp8-pth"}


def _get(node: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
        except Exception:  # a DictConfig key the schema does not know
            return default
    return default if node is None else node


def _number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def precision_short(weights: str, activations: str, kv_cache: str, perturbation_sigma: Any = None) -> str:
    """'bf16', 'int8' (W8A8), 'int8+int4kv', 'bf16+fp8kv', 'wint8-abf16' (weight-only), '+σ0.01' when the
    rollout's mismatch dial perturbs it."""
    base = weights if weights == activations else f"w{weights}-a{activations}"
    if kv_cache not in ("bf16", "", "None"):
        base += f"+{_KV_SHORT.get(kv_cache, kv_cache)}kv"
    sigma = _number(perturbation_sigma)
    if sigma:
        base += f"+σ{sigma:g}"
    return base


def precision_of(cfg: Any) -> str:
    from parity.precision.config import resolve_precision

    p = resolve_precision(cfg)
    return precision_short(p.weights, p.activations, p.kv_cache,
                           _get(cfg, "rollout.precision.perturbation.sigma"))


def run_title(cfg: Any) -> str:
    """`<experiment> / <precision> / <correction> / seed <n>`: what a pipeline or training run ran."""
    return " / ".join([str(_get(cfg, "experiment_name", "experiment")), precision_of(cfg),
                       str(_get(cfg, "algorithm.correction.name", "none")), f"seed {_get(cfg, 'trainer.seed', 0)}"])


def stage_title(title: str, stage: str) -> str:
    return f"{title} / {stage}"


def run_tags(cfg: Any) -> dict[str, str]:
    return {"parity.experiment": str(_get(cfg, "experiment_name", "")), "parity.precision": precision_of(cfg),
            "parity.correction": str(_get(cfg, "algorithm.correction.name", "none")),
            "parity.seed": str(_get(cfg, "trainer.seed", 0)), "parity.run_name": str(_get(cfg, "trainer.run_name", ""))}


def identity_params(flat: dict[str, Any]) -> dict[str, Any]:
    """The flattened config's keys that tell runs apart: experiment, model, data, precision (and the mismatch
    dial), the correction with the settings of each correction it composes, lr, seed, steps, batch shape."""
    names = str(flat.get("algorithm.correction.name") or "none").split("+")
    prefixes = IDENTITY_KEYS + tuple(f"algorithm.correction.{n}." for n in names if n and n != "none")
    return {k: v for k, v in flat.items() if any(k == p or (p.endswith(".") and k.startswith(p)) for p in prefixes)}


def headline_metrics(train: dict[str, Any], macro: dict[str, Any] | None = None) -> dict[str, float]:
    """The numbers a pipeline (or plain training) run is judged by: final reward, held-out accuracy (rollout
    engine, and unquantized weights where measured), the benchmark macro average, and the collapse flag
    with its step where the training reported one (`collapse_step`, None when the alarm never fired)."""
    out: dict[str, float] = {}
    for name, key in (("final_reward", "final_reward"), ("heldout_accuracy", "final_accuracy"),
                      ("heldout_accuracy_initial", "initial_accuracy"),
                      ("heldout_accuracy_unquantized", "final_accuracy_unquantized")):
        v = _number(train.get(key))
        if v is not None:
            out[name] = v
    avg = _number((macro or {}).get("avg@k"))
    if avg is not None:
        out["benchmark_macro_avg"] = avg
    if "collapse_step" in train:
        step = train["collapse_step"]
        out["collapsed"] = 0.0 if step is None else 1.0
        if step is not None:
            out["collapse_step"] = float(step)
    return out


def compare_url(dashboard_url: str, **query: str) -> str:
    """The dashboard's Compare page opened on a selection, e.g. compare_url(url, sweep="sweep-20261201-101500")."""
    q = urlencode({k: v for k, v in query.items() if v})
    return f"{dashboard_url.rstrip('/')}/compare" + (f"?{q}" if q else "")
