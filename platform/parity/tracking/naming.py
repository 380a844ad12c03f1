"""What a run is called and what tells it apart, for MLflow and the dashboard alike.

A pipeline run is named after what it ran, `arith_tiny / int8+int4kv / tis / seed 0` (experiment,
rollout precision, correction, seed), each stage run `<that> / train`, a plain `python -m parity train`
run `<that> / train` too. The same facts go into tags (`parity.precision`, `parity.correction`,
`parity.seed`) so the MLflow UI can filter on them, and a short set of identifying params goes on every
stage run. Pure functions of the config (no MLflow import): the dashboard reads runs back with them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from parity.precision_names import parse_spec

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig, PrecisionConfig

# The tags and metric names the writers (parity.tracking.train_run, tasks/recording.py, tasks/records.py) give runs
# and the dashboard reads back.
SWEEP_TAG = "parity.sweep"
KIND_TAG = "parity.kind"  # pipeline | stage | train (a plain training run)
STAGE_TAG = "parity.stage"  # a stage run's stage (prepare, quantize, validate, train, evaluate, register, compare)
FLOW_TAG = "parity.flow"  # a pipeline run's flow
COMMAND_TAG = "parity.command"  # the command of a plain run (train)
FAILURE_TAG = "parity.failure"  # why a run failed
PIPELINE_ID_TAG = "parity.pipeline_id"  # the registry's pipeline row
# a pipeline's (and a tracked train run's) benchmark macro average (headline_metrics); an evaluate stage's is its
# eval/macro/avg@k metric, which MLflow stores as avg_at_k (parity.tracking.mlflow_log.metric_key)
BENCHMARK_AVG_METRIC = "benchmark_macro_avg"
STAGE_BENCHMARK_AVG_METRIC = "eval/macro/avg_at_k"

# What kind of experiment this is, in MLflow's own tag: its UI before 3.17 (and other MLflow front ends) open an
# experiment of this kind on its runs table. MLflow 3.17's UI no longer reads it: a switch of its own (GenAI |
# Model training, `workflowType` in the address, else the browser's last choice, GenAI at first) decides, so the
# links Parity prints carry workflowType=machine_learning (experiment_url, run_url).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT = "custom_model_development"
# A saved view of the runs table (MLflow's "Views" menu; `viewStateShareKey` in the address opens it): the
# columns that say what each run ran and how it did, newest first. MLflow keeps saved views as experiment tags
# `mlflow.sharedViewState.<key>` holding {name, createdAt, updatedAt, state}, state being the table's settings.
TRAINING_VIEW = "parity-training-runs"
TRAINING_VIEW_TAG = f"mlflow.sharedViewState.{TRAINING_VIEW}"
TRAINING_VIEW_COLUMNS = (("tags", "parity.precision"), ("tags", "parity.correction"), ("metrics", "final_reward"),
                         ("metrics", "heldout_accuracy"), ("metrics", "final_mismatch"),
                         ("metrics", BENCHMARK_AVG_METRIC), ("tags", "parity.benchmarks"), ("metrics", "collapsed"),
                         ("tags", "parity.seed"))

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


def _number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def precision_short(weights: str, activations: str, kv_cache: str, perturbation_sigma: Any = None,
                    kv_hadamard: Any = True) -> str:
    """'bf16', 'int8' (W8A8), 'int8+int4kv', 'bf16+fp8kv', 'wint8-abf16' (weight-only), '-nohadamard' after an
    int4 KV cache without its rotation, '+σ0.01' when the rollout's mismatch dial perturbs it."""
    base = weights if weights == activations else f"w{weights}-a{activations}"
    if kv_cache not in ("bf16", "", "None"):
        base += f"+{_KV_SHORT.get(kv_cache, kv_cache)}kv"
        if kv_cache == "int4_per_token_head" and str(kv_hadamard).strip().lower() in ("false", "0", "no", "off"):
            base += "-nohadamard"
    sigma = _number(perturbation_sigma)
    if sigma:
        base += f"+σ{sigma:g}"
    return base


def precision_of_spec(spec: Any) -> str:
    """precision_short of a full spec as the registry stores it ('wint8-aint8-kvint4_per_token_head' ->
    'int8+int4kv'); a string that is not a spec is returned as it is."""
    p = parse_spec(str(spec or "bf16"))
    if "unknown" in p:
        return str(spec)
    return precision_short(p["weights"], p["activations"], p["kv_cache"], p["sigma"], p["kv_hadamard"])


def precision_of(cfg: ParityConfig) -> str:
    from parity.precision.config import resolve_precision

    p = resolve_precision(cfg)
    return precision_short(p.weights, p.activations, p.kv_cache, p.perturbation.sigma, p.kv_hadamard)


def label(experiment: Any, precision: PrecisionConfig, correction: Any, seed: Any) -> str:
    """THE label of what a run trained: `<experiment> / <precision> / <correction> / seed <n>`, e.g.
    `arith_tiny / int8+int4kv / score_centering / seed 0`. MLflow run names, the model versions' tags and every
    page of the dashboard (Runs, Compare, Benchmarks, Regression, Precision) label a trained model with it."""
    def text(v: Any, default: str) -> str:
        return default if v is None or str(v) in ("", "None", "nan") else str(v)

    return " / ".join([text(experiment, "experiment"), text(precision, "bf16"), text(correction, "none"),
                       f"seed {text(seed, '0')}"])


FACT_TAGS = {"experiment": "parity.experiment", "precision": "parity.precision", "correction": "parity.correction",
             "seed": "parity.seed", "run_name": "parity.run_name"}


def facts_of(cfg: ParityConfig) -> dict[str, str]:
    """What a config trains, as the label's parts (and the precision's full spec and the run folder's name): what
    the registry keeps with each model artifact and the MLflow runs and model versions carry as tags."""
    from parity.precision.config import resolve_precision, spec_of

    return {"experiment": str(cfg.experiment_name), "precision": precision_of(cfg),
            "precision_spec": spec_of(resolve_precision(cfg)), "correction": str(cfg.algorithm.correction.name),
            "seed": str(cfg.trainer.seed), "run_name": str(cfg.trainer.run_name)}


def label_of(facts: dict[str, Any]) -> str:
    """label() of a facts dict (facts_of, a registry artifact's facts, or run tags read back: facts_of_tags)."""
    return label(facts.get("experiment"), facts.get("precision"), facts.get("correction"), facts.get("seed"))


def facts_of_tags(tags: dict[str, str]) -> dict[str, str]:
    return {k: tags[t] for k, t in FACT_TAGS.items() if tags.get(t) not in (None, "")}


def run_title(cfg: ParityConfig) -> str:
    """What a pipeline or training run ran: label() of its config."""
    return label_of(facts_of(cfg))


def stage_title(title: str, stage: str) -> str:
    return f"{title} / {stage}"


def unique_run_name(client: Any, experiment_id: str, name: str) -> str:
    """`name`, or `name #2`, `#3` ... when runs of the experiment already carry it: two runs (say one FAILED
    after 5 steps, then a new one FINISHED) are never shown under one name."""
    quoted = f'"{name}%"' if "'" in name else f"'{name}%'"
    try:
        taken = {r.info.run_name for r in client.search_runs([experiment_id], f"attributes.run_name LIKE {quoted}",
                                                             max_results=5000)}
    except Exception:  # a store that cannot search by name: a time stamp keeps the name apart
        import time

        return f"{name} ({time.strftime('%m-%d %H:%M:%S')})"
    n = 1
    while (name if n == 1 else f"{name} #{n}") in taken:
        n += 1
    return name if n == 1 else f"{name} #{n}"


def run_tags(cfg: ParityConfig) -> dict[str, str]:
    return tags_of(facts_of(cfg))


def tags_of(facts: dict[str, Any]) -> dict[str, str]:
    """The MLflow tags of a run or model version that trained (or checks) the model with these facts."""
    tags = {t: str(facts.get(k, "")) for k, t in FACT_TAGS.items()}
    tags["parity.label"] = label_of(facts)
    if facts.get("precision_spec"):
        tags["parity.precision_spec"] = str(facts["precision_spec"])
    return tags


def identity_params(flat: dict[str, Any]) -> dict[str, Any]:
    """The flattened config's keys that tell runs apart: experiment, model, data, precision (and the mismatch
    dial), the correction with the settings of each correction it composes, lr, seed, steps, batch shape."""
    names = str(flat.get("algorithm.correction.name") or "none").split("+")
    prefixes = IDENTITY_KEYS + tuple(f"algorithm.correction.{n}." for n in names if n and n != "none")
    return {k: v for k, v in flat.items() if any(k == p or (p.endswith(".") and k.startswith(p)) for p in prefixes)}


BENCHMARKS_TAG = "parity.benchmarks"  # the set a run's benchmark average is over (benchmark_set), beside the number


def benchmark_problems(benchmarks: dict[str, Any]) -> dict[str, int]:
    """{benchmark: problems} of an evaluation's per-benchmark rows (evaluate's `benchmarks`), by name: one set is
    spelled one way however it was read back."""
    out = {}
    for name, row in (benchmarks or {}).items():
        n = _number(row.get("problems")) if isinstance(row, dict) else None
        out[str(name)] = int(n) if n is not None else 0
    return dict(sorted(out.items()))


def benchmark_set(problems: dict[str, int]) -> str:
    """The set a benchmark average is over, named with its sizes: 'arithmetic (64 problems)',
    '7 benchmarks, 112 problems: aime24 8, aime25 8, ...'. Two averages compare only over the same set."""
    if not problems:
        return "no benchmarks"
    if len(problems) == 1:
        (name, n), = problems.items()
        return f"{name} ({n} problems)"
    parts = ", ".join(f"{k} {v}" for k, v in problems.items())
    return f"{len(problems)} benchmarks, {sum(problems.values())} problems: {parts}"


def benchmark_set_short(problems: dict[str, int]) -> str:
    """benchmark_set in a table cell: 'arithmetic (64)', 'arithmetic + aime24 (72)', '7 benchmarks (112)'."""
    if not problems:
        return ""
    total = sum(problems.values())
    names = " + ".join(problems) if len(problems) <= 2 else f"{len(problems)} benchmarks"
    return f"{names} ({total})"


def sampling_text(temperature: Any, samples: Any, max_new_tokens: Any) -> str:
    """'greedy, up to 16 new tokens' or 'sampled at T=1, 4 a problem, up to 64 new tokens'."""
    t, n = _number(temperature) or 0.0, int(_number(samples) or 1)
    how = "greedy" if t == 0.0 else f"sampled at T={t:g}" + (f", {n} a problem" if n > 1 else "")
    return f"{how}, up to {int(_number(max_new_tokens) or 0)} new tokens"


def heldout_text(heldout: dict[str, Any]) -> str:
    """What a run's held-out accuracy is measured on: 'the arithmetic task's test split, its first 256 problems,
    greedy, up to 16 new tokens, through the rollout engine during training'."""
    return (f"the {heldout.get('task', 'training')} task's test split, its first {heldout.get('problems')} problems, "
            f"{sampling_text(heldout.get('temperature'), heldout.get('samples'), heldout.get('max_new_tokens'))}, "
            "through the rollout engine during training")


def headline_metrics(train: dict[str, Any], macro: dict[str, Any] | None = None) -> dict[str, float]:
    """The numbers a pipeline (or plain training) run is judged by: final reward, the last step's mean
    |p_train - p_inf| (`final_mismatch`), held-out accuracy (rollout engine, and unquantized weights where measured), the benchmark macro average, and the collapse flag
    with its step where the training reported one (`collapse_step`, None when the alarm never fired)."""
    out: dict[str, float] = {}
    for name, key in (("final_reward", "final_reward"), ("final_mismatch", "final_mismatch"),
                      ("heldout_accuracy", "final_accuracy"),
                      ("heldout_accuracy_initial", "initial_accuracy"),
                      ("heldout_accuracy_unquantized", "final_accuracy_unquantized")):
        v = _number(train.get(key))
        if v is not None:
            out[name] = v
    avg = _number((macro or {}).get("avg@k"))
    if avg is not None:
        out[BENCHMARK_AVG_METRIC] = avg
    if "collapse_step" in train:
        step = train["collapse_step"]
        out["collapsed"] = 0.0 if step is None else 1.0
        if step is not None:
            out["collapse_step"] = float(step)
    return out


def training_view(now_ms: int) -> str:
    """The value of TRAINING_VIEW_TAG: the runs table with TRAINING_VIEW_COLUMNS in this order, newest first,
    active runs."""
    import json

    columns = [f"{kind}.`{key}`" for kind, key in TRAINING_VIEW_COLUMNS]
    state = {"selectedColumns": columns, "columnOrder": columns, "columnWidths": dict.fromkeys(columns, 140),
             "orderByKey": "attributes.start_time", "orderByAsc": False, "searchFilter": "", "startTime": "ALL",
             "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs"}
    return json.dumps({"name": "Training runs (parity)", "createdAt": now_ms, "updatedAt": now_ms,
                       "state": json.dumps(state)})


ML_WORKFLOW = "workflowType=machine_learning"


def experiment_url(mlflow_ui: str, experiment_id: str) -> str:
    """The experiment in MLflow's UI, opened on its runs table in the training-runs view."""
    return (f"{mlflow_ui.rstrip('/')}/#/experiments/{experiment_id}/runs?{ML_WORKFLOW}"
            f"&viewStateShareKey={TRAINING_VIEW}")


def run_url(mlflow_ui: str, experiment_id: str, run_id: str) -> str:
    """One run's page in MLflow's UI, its sidebar on model training (not GenAI)."""
    return f"{mlflow_ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{ML_WORKFLOW}"


def compare_url(dashboard_url: str, **query: str) -> str:
    """The dashboard's Compare page opened on a selection, e.g. compare_url(url, sweep="sweep-20261201-101500")."""
    q = urlencode({k: v for k, v in query.items() if v})
    return f"{dashboard_url.rstrip('/')}/compare" + (f"?{q}" if q else "")
