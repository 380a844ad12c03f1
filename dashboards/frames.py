"""Pure table transforms behind the Runs page and the labels every page shares: one row per pipeline or plain
training run (its stages folded under it), values inherited from the stage that measured them, and legend
labels from the config keys that differ between chosen runs. No I/O here, so every number the dashboard
shows can be checked by hand in tests (per-step curves: dashboards/curves.py, benchmarks: dashboards/bench.py)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from dashboards.data import RunRecord, mlflow_run_url
from parity import precision_names
from parity.tracking import naming

MISSING = "—"
# Keys that differ between seeds (or names/paths) of one configuration and so do not define it.
_NOT_CONFIG = re.compile(r"(^|\.)(seed|shuffle_seed|run_name|experiment_name|resume)$|(^|\.)(outputs_dir|out_dir|"
                         r"path|model_path|datasets_dir|export_dir|tracking_uri|registry_url)$|^tracking\.|^hydra")
# Keys never worth a legend entry: names, places, bookkeeping (a different model.path is a different model: kept).
_NOT_LABEL = re.compile(r"(^|\.)(run_name|resume|outputs_dir|out_dir|export_dir|datasets_dir|"
                        r"quantization_config_file)$|^tracking\.|^hydra|^eval\.(model_path|run_name|registered_model)$|"
                        r"^distributed\.(address|init_timeout_s)$")
_PRECISION_KEYS = re.compile(r"^rollout\.precision\.(weights|activations|kv_cache|kv_hadamard|perturbation\.sigma)$|"
                             r"^actor_rollout_ref\.rollout\.(quantization|engine_kwargs\.vllm\.kv_cache_dtype)$")
_UNSET = ("", "None", "null", "none")
SEED_KEY = "trainer.seed"
# the mismatch dial's Delta seed: unset, it follows trainer.seed (the loaded config records the value it took)
DIAL_SEED_KEY = "rollout.precision.perturbation.seed"


def param(params: dict[str, str], key: str, default: str = "") -> str:
    v = params.get(key)
    return default if v is None or v in _UNSET else str(v)


def precision_label(params: dict[str, str]) -> str:
    """The full spec ('bf16', 'wint8-aint8-kvint4_per_token_head-nohadamard', '...-sigma0.01'), the label the
    pipeline gives its artifacts: parity.precision_names reads the params (the seed block's `quantization` and
    vLLM kv_cache_dtype through the loader's own tables) and spells it (precision_spec)."""
    return precision_names.spec_of_params(params)


def precision_short(params: dict[str, str]) -> str:
    """The run names' spelling: 'bf16', 'int8', 'int8+int4kv', 'int8+int4kv-nohadamard', 'bf16+σ0.01'
    (parity.tracking.naming.precision_short of the params' formats)."""
    f = precision_names.formats_of_params(params)
    return naming.precision_short(f["weights"], f["activations"], f["kv_cache"], f["sigma"], f["kv_hadamard"])


def short_of_label(label: str) -> str:
    """'wint8-aint8-kvbf16' (a precision spec as the registry stores it) -> 'int8' (naming.precision_of_spec)."""
    return naming.precision_of_spec(label or "bf16")


def facts_dict(facts: Any) -> dict[str, Any]:
    """A registry artifact's facts (what the model was trained as), whether the driver gave JSON text or a dict."""
    if isinstance(facts, str):
        try:
            facts = json.loads(facts)
        except ValueError:
            return {}
    return facts if isinstance(facts, dict) else {}


def model_label(facts: Any, version: Any = None, fallback: str = "") -> str:
    """What a registered or evaluated model was trained as (naming.label_of its facts, ' v3' for a registered
    version), or `fallback` for an artifact recorded before artifacts kept their facts."""
    f = facts_dict(facts)
    if not f:
        return fallback
    v = "" if version is None or (isinstance(version, float) and pd.isna(version)) or str(version) in ("", "None") \
        else f" v{version}"
    return naming.label_of(f) + v


def config_key(params: dict[str, str]) -> str:
    """Short hash of the parameters that define a configuration (seeds, names and paths left out), so runs
    that differ only in their seed share a key."""
    kept = sorted((k, v) for k, v in params.items() if not _NOT_CONFIG.search(k))
    return hashlib.sha1(json.dumps(kept).encode()).hexdigest()[:8]


_BENCH_PROBLEMS = re.compile(r"^eval/(?P<name>[^/]+)/problems$")


def bench_problems(metrics: dict[str, float]) -> dict[str, int]:
    """{benchmark: problems} of the evaluation whose metrics a run holds (`eval/<benchmark>/problems`, the evaluate
    stage's), by name: the set its benchmark average is over."""
    found = {m["name"]: {"problems": v} for k, v in metrics.items()
             if (m := _BENCH_PROBLEMS.match(k)) and m["name"] != "macro"}
    return naming.benchmark_problems(found)


def bench_average(metrics: dict[str, float]) -> float | None:
    """The benchmark macro average a run carries: a pipeline's headline, else an evaluate stage's own."""
    for k in (naming.BENCHMARK_AVG_METRIC, naming.STAGE_BENCHMARK_AVG_METRIC):
        if k in metrics:
            return float(metrics[k])
    return None


# ---------------------------------------------------------------- runs

RUN_COLUMNS = ["run", "mlflow", "status", "experiment", "precision", "correction", "seed", "final_reward",
               "heldout_accuracy", "mismatch", "benchmark_avg", "bench_set", "bench_set_full", "collapsed", "steps",
               "duration", "failure", "started",
               "kind", "stage", "model", "sweep", "config", "run_name", "run_id", "parent_id", "train_run_id",
               "collapse_step", "duration_s", "params"]
MISMATCH_KEY = "mismatch/abs_prob_diff_mean"  # mean |p_train - p_inf| of a step (the pipeline's final_mismatch)
TOP_KINDS = ("pipeline", "train", "run")


def _stage_of(r: RunRecord) -> str:
    return r.tags.get(naming.STAGE_TAG, "")


def _kind(r: RunRecord, has_parent: bool, n_children: int) -> str:
    tagged = r.tags.get(naming.KIND_TAG)
    if tagged:
        return tagged
    if has_parent:
        return "stage"
    if n_children or r.tags.get(naming.FLOW_TAG):
        return "pipeline"
    if r.tags.get(naming.COMMAND_TAG) == "train" or "reward/mean" in r.metrics:
        return "train"
    return "run"


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _collapse(own: RunRecord, train: RunRecord | None) -> tuple[str, float | None]:
    flag = _first(own.metrics.get("collapsed"), train.metrics.get("collapsed") if train else None,
                  train.metrics.get("train/collapsed") if train else None)
    step = _first(own.metrics.get("collapse_step"), train.metrics.get("collapse_step") if train else None)
    if flag is None:
        return "", None
    return ("yes" + (f" (step {int(step)})" if step is not None else "")) if flag >= 0.5 else "no", step


def _steps(train: RunRecord | None) -> int | None:
    """Steps a training run got through: the step of its per-step metrics' latest values."""
    if train is None:
        return None
    steps = [s for k, s in train.metric_steps.items() if k.startswith(("reward/", "mismatch/", "train/", "perf/"))]
    return max(steps) if steps else None


def _failure(r: RunRecord, children: Sequence[RunRecord]) -> str:
    """Why a run failed: its own `parity.failure` tag, else its first failed stage's (`<stage>: <reason>`)."""
    own = r.tags.get(naming.FAILURE_TAG)
    if not own:
        failed = next((k for k in children if k.status == "FAILED" and k.tags.get(naming.FAILURE_TAG)), None)
        own = f"{_stage_of(failed) or failed.run_name}: {failed.tags[naming.FAILURE_TAG]}" if failed else ""
    if not own and r.status == "FAILED":
        return "failed (no reason recorded)"
    first = own.strip().splitlines()[0] if own.strip() else ""
    return first[:160] + ("…" if len(first) > 160 else "")


def _duration_s(r: RunRecord, now_ms: int) -> float | None:
    if not r.start_time:
        return None
    end = r.end_time if r.end_time else (now_ms if r.status == "RUNNING" else None)
    return None if end is None else max(0.0, (end - r.start_time) / 1000.0)


def duration_text(seconds: float | None) -> str:
    """'45 s', '3 min 12 s', '2 h 05 min'; '' when unknown."""
    if seconds is None or (isinstance(seconds, float) and pd.isna(seconds)):
        return ""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def runs_frame(records: Sequence[RunRecord], mlflow_ui: str, now_ms: int | None = None) -> pd.DataFrame:
    """One row a run, pipelines and plain training runs first (newest first), each followed by its stages.
    A stage inherits the config of its pipeline (runs of older stores logged params on the pipeline only);
    a pipeline shows what its stages measured when it does not carry the number itself (older stores): the
    final reward and held-out accuracy of its train stage, the benchmark average of its evaluate stage."""
    import time

    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    by_id = {r.run_id: r for r in records}
    kids: dict[str, list[RunRecord]] = {}
    for r in records:
        if r.parent_id in by_id:
            kids.setdefault(r.parent_id, []).append(r)

    def row(r: RunRecord) -> dict[str, Any]:
        parent = by_id.get(r.parent_id or "")
        params = {**(parent.params if parent else {}), **r.params}
        tags = {**(parent.tags if parent else {}), **r.tags}
        children = sorted(kids.get(r.run_id, []), key=lambda k: k.start_time or 0)
        kind, stage = _kind(r, parent is not None, len(children)), _stage_of(r)
        train = r if kind == "train" or stage == "train" else next((k for k in children if _stage_of(k) == "train"),
                                                                    None)
        bench = _first(bench_average(r.metrics), *(bench_average(k.metrics) for k in reversed(children)))
        # the set that average is over: the run's own evaluation, else its (last) evaluate stage's
        problems = next((p for p in (bench_problems(r.metrics),
                                     *(bench_problems(k.metrics) for k in reversed(children))) if p), {})
        collapsed, collapse_step = _collapse(r, train)
        final = _first(r.metrics.get("final_reward"), train.metrics.get("reward/mean") if train else None)
        acc = _first(r.metrics.get("heldout_accuracy"), train.metrics.get("eval/accuracy") if train else None)
        mismatch = _first(r.metrics.get("final_mismatch"), train.metrics.get(MISMATCH_KEY) if train else None)
        duration = _duration_s(r, now_ms)
        return {
            "run": f"↳ {stage or r.run_name}" if kind == "stage" else r.run_name,
            "mlflow": mlflow_run_url(mlflow_ui, r.experiment_id, r.run_id), "status": r.status,
            # what the run trained (a regression check: the candidate it checked), by its tags, else its params
            "experiment": tags.get(naming.FACT_TAGS["experiment"]) or param(params, "experiment_name", r.experiment),
            "precision": tags.get(naming.FACT_TAGS["precision"]) or (precision_short(params) if params else ""),
            "correction": tags.get(naming.FACT_TAGS["correction"]) or (param(params, "algorithm.correction.name", "none")
                                                            if params else ""),
            "seed": tags.get(naming.FACT_TAGS["seed"]) or param(params, SEED_KEY, ""),
            "final_reward": final if kind != "stage" or train is r else None,
            "heldout_accuracy": acc if kind != "stage" or train is r else None,
            "mismatch": mismatch if kind != "stage" or train is r else None,
            "steps": _steps(train) if kind != "stage" or train is r else None,
            "duration": duration_text(duration), "duration_s": duration,
            "failure": _failure(r, children),
            "benchmark_avg": bench if kind != "stage" else bench_average(r.metrics),
            "bench_set": naming.benchmark_set_short(problems),
            "bench_set_full": naming.benchmark_set(problems) if problems else "",
            "collapsed": collapsed, "collapse_step": collapse_step,
            "started": pd.to_datetime(r.start_time, unit="ms") if r.start_time else pd.NaT,
            "kind": kind, "stage": stage, "model": param(params, "model.name", param(params, "model.path")),
            "sweep": tags.get(naming.SWEEP_TAG, ""), "config": config_key(params), "run_name": r.run_name,
            "run_id": r.run_id, "parent_id": r.parent_id or "", "train_run_id": train.run_id if train else "",
            "params": params,
        }

    rows: list[dict[str, Any]] = []
    for r in records:
        if r.parent_id in by_id:
            continue  # placed under its pipeline
        rows.append(row(r))
        rows += [row(k) for k in sorted(kids.get(r.run_id, []), key=lambda k: k.start_time or 0)]
    df = pd.DataFrame(rows, columns=RUN_COLUMNS)
    # two runs are never shown under one name (stores written before names were made unique): the short id tells
    top = df["kind"] != "stage"
    dup = top & df["run"].map(df[top]["run"].value_counts()).fillna(0).gt(1)
    df.loc[dup, "run"] = df.loc[dup, "run"] + " (" + df.loc[dup, "run_id"].str[:6] + ")"
    # nor two benchmark sets under one short name ('7 benchmarks (112)' of other benchmarks): a number tells
    sets = df.loc[df["bench_set_full"] != "", ["bench_set", "bench_set_full"]].drop_duplicates()
    renamed = {full: f"{short} #{i + 1}" for short, group in sets.groupby("bench_set", sort=False)
               for i, full in enumerate(group["bench_set_full"]) if i}
    if renamed:
        df.loc[df["bench_set_full"].isin(list(renamed)), "bench_set"] = df["bench_set_full"].map(renamed)
    return df


def bench_sets(df: pd.DataFrame) -> dict[str, str]:
    """The benchmark sets of the rows that show a benchmark average: {short name as in `bench_set`: full name}."""
    rows = df[df["benchmark_avg"].notna() & (df["bench_set_full"] != "")]
    return dict(zip(rows["bench_set"], rows["bench_set_full"], strict=True))


def top_level(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["kind"] != "stage"]


def filter_runs(df: pd.DataFrame, choices: dict[str, Iterable[str]], text: str = "") -> pd.DataFrame:
    """Rows whose column values are among the chosen ones (an empty choice keeps all) and whose run name
    contains `text` (case-insensitive)."""
    mask = pd.Series(True, index=df.index)
    for col, allowed in choices.items():
        allowed = list(allowed)
        if allowed:
            mask &= df[col].astype(str).isin(allowed)
    if text:
        mask &= df["run_name"].str.contains(text, case=False, regex=False)
    return df[mask]


def with_stages(df: pd.DataFrame, shown_top: pd.DataFrame) -> pd.DataFrame:
    """The chosen top-level rows, each followed by its stage rows (the frame's order)."""
    keep = set(shown_top["run_id"])
    return df[df["run_id"].isin(keep) | df["parent_id"].isin(keep)]


def as_text(df: pd.DataFrame, numbers: dict[str, str]) -> pd.DataFrame:
    """Numbers written out with their format ('{:.3f}') and every missing cell as '—': what the table shows is
    these strings, whatever the front end does with a None in a number column."""
    out = missing_as_dash(df, [c for c in df.columns if c not in numbers])
    for c, fmt in numbers.items():
        out[c] = [MISSING if v is None or (isinstance(v, float) and pd.isna(v)) else fmt.format(v) for v in out[c]]
    return out


def missing_as_dash(df: pd.DataFrame, text_columns: Sequence[str]) -> pd.DataFrame:
    """Empty text cells shown as '—' (numbers are left to the table's formatter, which shows them the same)."""
    out = df.copy()
    for c in text_columns:
        if c in out.columns:
            out[c] = out[c].map(lambda v: MISSING if v is None or (isinstance(v, float) and pd.isna(v))
                                or str(v) in ("", "None", "nan", "NaT") else v)
    return out


# ---------------------------------------------------------------- legend labels

def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """The last component of each key, or more of it where two keys would read the same."""
    out = {}
    for k in keys:
        parts = k.split(".")
        n = 1
        while n < len(parts) and sum(1 for o in keys if o.split(".")[-n:] == parts[-n:]) > 1:
            n += 1
        out[k] = ".".join(parts[-n:])
    return out


def differing_keys(params_by_run: dict[str, dict[str, str]]) -> list[str]:
    """The config keys whose values differ between the runs (precision keys folded into 'precision')."""
    if len(params_by_run) < 2:
        return []
    keys = sorted({k for p in params_by_run.values() for k in p if not _NOT_LABEL.search(k)})
    if all(param(p, DIAL_SEED_KEY) in ("", param(p, SEED_KEY, "0")) for p in params_by_run.values()):
        keys = [k for k in keys if k != DIAL_SEED_KEY]  # it is the run's seed: told apart as `seed`, or grouped
    out = [k for k in keys if not _PRECISION_KEYS.search(k)
           and len({str(p.get(k, MISSING)) for p in params_by_run.values()}) > 1]
    if len({precision_short(p) for p in params_by_run.values()}) > 1:
        out.append("precision")
    return out


# the parts of the run's own label (naming.label), in its order, and the seed last
_ORDER = {"experiment_name": 0, "model.name": 1, "model.path": 1, "precision": 2, "algorithm.correction.name": 3,
          SEED_KEY: 9}
MAX_LABEL_KEYS = 2  # other keys a legend label names, past those the label needs to tell the runs apart ('+3 more')
LABEL_VALUE_CHARS = 14  # a longer value is cut ('[arithmetic, ai…'): the hover and the table have it whole
# a label past this many characters drops the keys it names only as extras, the last first: at the legend's 11 px
# font (about 6.5 px a character) it stays within curves.LEGEND_LABEL_PX
MAX_LABEL_CHARS = 60
# a key's name in a label where its last component would not say what it is
_ABBREV = {"trainer.total_steps": "steps", "model.warm_start.steps": "warm start", "trainer.prompts_per_step": "prompts",
           "rollout.n": "n", "rollout.max_new_tokens": "new tokens", "algorithm.policy_loss": "loss",
           "algorithm.adv_estimator": "adv", "algorithm.loss_agg_mode": "agg", "rollout.topk_logprobs": "top-k lp",
           "trainer.eval_every": "eval every", "eval.suite": "eval", "model.warm_start.lr": "warm-start lr"}


def _rank(key: str) -> int:
    """How much a key says about a training curve: the label's parts, what tells runs apart (naming's identity
    keys), the rest of training, and last what only the evaluation after training reads."""
    if key in _ORDER:
        return 0
    if key in naming.IDENTITY_KEYS or key.startswith("algorithm.correction."):
        return 1
    if key.startswith(("eval.", "tracking.", "distributed.")):
        return 3
    return 2


def _value(p: dict[str, str], k: str) -> str:
    return precision_short(p) if k == "precision" else str(p.get(k, MISSING))


def _cut(v: str) -> str:
    return v if len(v) <= LABEL_VALUE_CHARS else v[:LABEL_VALUE_CHARS - 1] + "…"


def label_keys(params_by_run: dict[str, dict[str, str]], group_seeds: bool = False) -> tuple[list[str], list[str]]:
    """(the keys a legend label names, the differing keys it leaves to the hover and the table). Named: the parts of
    the run's own label that differ (precision, correction, seed, ...), then the other keys needed to tell every
    two configurations apart (the one that splits the most first), then up to MAX_LABEL_KEYS more of what most
    shapes a curve (`_rank`). With grouped seeds the seed is neither."""
    keys = [k for k in differing_keys(params_by_run) if not (group_seeds and k == SEED_KEY)]
    chosen = [k for k in keys if k in _ORDER]
    rest = sorted((k for k in keys if k not in _ORDER), key=lambda k: (_rank(k), k))
    configs = {tuple(_value(p, k) for k in keys) for p in params_by_run.values()}

    def groups(ks: list[str]) -> int:
        return len({tuple(_value(p, k) for k in ks) for p in params_by_run.values()})

    while groups(chosen) < len(configs):  # some configurations still read alike: the key that splits the most
        best = max(rest, key=lambda k: (groups([*chosen, k]), -_rank(k)))
        chosen.append(best)
        rest.remove(best)
    extra = [k for k in rest if _rank(k) <= 2][:MAX_LABEL_KEYS - sum(1 for k in chosen if k not in _ORDER)]
    while extra and max(len(t) for t in _texts(params_by_run, [*chosen, *extra], len(rest) - len(extra))) \
            > MAX_LABEL_CHARS:
        extra.pop()
    left = [k for k in rest if k not in extra]
    return sorted([*chosen, *extra], key=lambda k: (_ORDER.get(k, 5), _rank(k), k)), left


def _texts(params_by_run: dict[str, dict[str, str]], keys: list[str], n_left: int) -> list[str]:
    """The labels `keys` spell (config_labels' parts, in its order), '+N more' for `n_left` keys left out."""
    keys = sorted(keys, key=lambda k: (_ORDER.get(k, 5), _rank(k), k))
    short = _short_keys([k for k in keys if k not in _ORDER])

    def part(k: str, p: dict[str, str]) -> str:
        if k == "precision":
            return precision_short(p)
        v = str(p.get(k, MISSING))
        if k == SEED_KEY:
            return f"seed {v}"
        if k in _ORDER:
            return v
        return f"{_ABBREV.get(k, short[k])}={_cut(v)}"

    more = f" +{n_left} more" if n_left else ""
    return [" / ".join(part(k, p) for k in keys) + more for p in params_by_run.values()]


def config_labels(params_by_run: dict[str, dict[str, str]], titles: dict[str, str],
                  group_seeds: bool = False) -> dict[str, str]:
    """Legend label of each run, short and distinct: the config keys label_keys picks, 'tis' vs 'none', 'int8'
    vs 'bf16', 'lr=1e-05', 'steps=40', 'seed 1' (left out when seeds are grouped), with '+3 more' where more keys
    differ than it names (config_details has them all); the run's title when nothing differs. Runs whose labels
    would collide (repeats of one configuration) get their short id appended unless grouped, where sharing a
    label is what puts them in one group."""
    keys, left = label_keys(params_by_run, group_seeds)
    labels = dict(zip(params_by_run, _texts(params_by_run, keys, len(left)), strict=True))
    if not keys:
        more = f" +{len(left)} more" if left else ""
        labels = {rid: titles.get(rid, rid[:8]) + more for rid in params_by_run}
    if not group_seeds:
        counts = pd.Series(list(labels.values())).value_counts()
        labels = {rid: f"{lab} ({rid[:6]})" if counts[lab] > 1 else lab for rid, lab in labels.items()}
    return labels


def config_details(params_by_run: dict[str, dict[str, str]], group_seeds: bool = False) -> dict[str, str]:
    """Every config key that differs between the runs, whole, for the hover of a legend label: 'precision=int8,
    algorithm.correction.name=tis, trainer.total_steps=40, eval.suite=[arithmetic, aime24]' (the seed left out
    when seeds are grouped)."""
    keys = [k for k in differing_keys(params_by_run) if not (group_seeds and k == SEED_KEY)]
    keys = sorted(keys, key=lambda k: (_ORDER.get(k, 5), _rank(k), k))
    return {rid: ", ".join(f"{k}={_value(p, k)}" for k in keys) for rid, p in params_by_run.items()}


def differences_table(params_by_run: dict[str, dict[str, str]], labels: dict[str, str],
                      names: dict[str, str]) -> pd.DataFrame:
    """One row per run (its legend label and run name), one column per config key that differs, whole values:
    the full list behind the short labels."""
    keys = sorted(differing_keys(params_by_run), key=lambda k: (_ORDER.get(k, 5), _rank(k), k))
    rows = [{"label": labels[rid], "run": names.get(rid, rid), **{k: _value(p, k) for k in keys}}
            for rid, p in params_by_run.items()]
    return pd.DataFrame(rows, columns=["label", "run", *keys])


# ---------------------------------------------------------------- regression checks and precision reports

def flag_checks(checks: pd.DataFrame) -> pd.DataFrame:
    """Regression checks with a `flagged` column (the check failed: a real drop beyond the margin), newest
    first, deltas and intervals in points of percent, and both sides labelled like every page: `candidate`
    and `champion` (what each model was trained as and its registered version; the artifact's precision for
    checks recorded before artifacts kept their facts) and the `precision` each was evaluated in; `created_at` as
    a time to the second (the registry keeps microseconds) and `checked`, the same as text."""
    d = checks.copy()
    d["flagged"] = ~d["passed"].astype(bool)
    d["created_at"] = pd.to_datetime(d["created_at"], format="mixed").dt.floor("s")
    d["checked"] = d["created_at"].dt.strftime(TIME_FORMAT).fillna(MISSING)
    for side, prefix in (("candidate", "candidate"), ("champion", "baseline")):
        facts = d.get(f"{prefix}_facts", pd.Series([None] * len(d), index=d.index))
        version = d.get(f"{prefix}_version", pd.Series([None] * len(d), index=d.index))
        ids = d[f"{prefix}_result_id"]
        d[side] = [model_label(f, v, f"result {i}") for f, v, i in zip(facts, version, ids, strict=True)]
    cand_eval = d.get("candidate_eval_precision", pd.Series([None] * len(d), index=d.index))
    d["precision"] = [short_of_label(e if isinstance(e, str) and e else p)
                      for e, p in zip(cand_eval, d["precision"], strict=True)]
    for c in ("delta", "ci_low", "ci_high", "margin"):
        d[c] = 100.0 * d[c].astype(float)
    return d.iloc[::-1].reset_index(drop=True)


TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # a time as every page writes it: to the second
# the time axis of a chart: d3 time formats (vega-lite's), a minute at least between ticks (else checks a second
# apart get millisecond ticks such as '.389')
AXIS_TIME_FORMAT = "%m-%d %H:%M"
MIN_TIME_SPAN = pd.Timedelta(hours=1)


def time_window(times: pd.Series) -> tuple[dict[str, int], dict[str, int]]:
    """The domain of a time axis over `times` (naive, as the chart reads them: local time), as vega-lite DateTime
    objects: the span of the times, widened symmetrically to at least MIN_TIME_SPAN, so the ticks fall on
    minutes or hours whether the times are one check or a year of them, and the points are not on the edges."""
    t = pd.to_datetime(times).dropna()
    if t.empty:
        t = pd.Series([pd.Timestamp("2000-01-01")])
    lo, hi = t.min(), t.max()
    pad = max((MIN_TIME_SPAN - (hi - lo)) / 2, (hi - lo) * 0.05)
    lo, hi = (lo - pad).floor("min"), (hi + pad).ceil("min")

    def dt(x: pd.Timestamp) -> dict[str, int]:
        return {"year": x.year, "month": x.month, "date": x.day, "hours": x.hour, "minutes": x.minute}

    return dt(lo), dt(hi)


def _scalars(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_scalars(v, f"{prefix}{k}."))
        elif isinstance(v, bool | int | float | str) or v is None:
            out[f"{prefix}{k}"] = v
    return out


def report_rows(folder: str, report: dict, file: str = "") -> list[dict[str, Any]]:
    """One row of a validation report of `python -m parity validate` (parity.precision.validate): when, which
    checkpoint folder, the precision it validated (labelled like every page: naming.precision_short), the
    verdict and the failed checks, every metric, and each threshold as `threshold.<name>`."""
    prec = report.get("precision") if isinstance(report.get("precision"), dict) else {}
    quant = report.get("quant") if isinstance(report.get("quant"), dict) else {}
    fmt = {k: str(prec.get(k) or quant.get(k) or "bf16") for k in ("weights", "activations", "kv_cache")}
    sigma = (prec.get("perturbation") or {}).get("sigma") if isinstance(prec.get("perturbation"), dict) else None
    hadamard = prec.get("kv_hadamard", quant.get("kv_hadamard", True))
    spec = str(report.get("precision_spec") or "")
    created = str(report.get("created_at") or "")
    row: dict[str, Any] = {
        "validated": pd.to_datetime(created, utc=True).strftime(TIME_FORMAT) if created else "",
        "checkpoint": folder,
        # the spec the report is named by says it all (-nohadamard, -sigma); older reports: their formats
        "precision": short_of_label(spec) if spec else naming.precision_short(fmt["weights"], fmt["activations"],
                                                                               fmt["kv_cache"], sigma, hadamard),
        "spec": spec,
        "engine": str(quant.get("engine") or ""),
        "verdict": "passed" if report.get("passed") else "FAILED",
        "passed": bool(report.get("passed")),
        "failures": "; ".join(map(str, report.get("failures") or [])),
    }
    row.update(_scalars(report["metrics"]) if isinstance(report.get("metrics"), dict) else {})
    if isinstance(report.get("thresholds"), dict):
        row.update(_scalars(report["thresholds"], "threshold."))
    row["file"] = file
    row["created_at"] = created  # to the microsecond: two validations within one second still sort right
    return [row]


def validation_history(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Report rows newest first, with `latest` marking the newest validation of each checkpoint and precision
    (the verdict that stands); a report from before they were kept has no time and counts as the oldest."""
    d = pd.DataFrame(list(rows))
    if d.empty:
        return d
    d = d.sort_values(["created_at", "file"], ascending=False, kind="stable").reset_index(drop=True)
    d = d.drop(columns="created_at")
    key = d["checkpoint"].astype(str) + "|" + d["precision"].astype(str) + "|" + d["spec"].astype(str)
    d.insert(3, "latest", ~key.duplicated(keep="first"))
    return d
