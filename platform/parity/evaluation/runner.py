"""Evaluate an engine on a suite of benchmarks: k samples a problem with each benchmark's sampling,
graded by the math-verify pool, every sample stored as JSONL, metrics with bootstrap intervals.

Prompts that do not fit the model (prompt + max_new_tokens > its context) are left-truncated, keeping
the end where the question and the \\boxed{} instruction are, and counted per benchmark: a small model
gets a clipped prompt rather than a crash, and the report says how often that happened.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parity.config.schema import DataConfig, EvalConfig
from parity.core.progress import Progress
from parity.core.sampling import Engine, SamplingSpec
from parity.data.arithmetic import Problem
from parity.data.benchmarks import BENCHMARKS, SYNTHETIC, load_benchmark
from parity.errors import ParityError
from parity.evaluation.metrics import benchmark_metrics, format_table, macro_average, pass_curve
from parity.rewards.grader import GraderPool

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "{problem} Answer in \\boxed{{}}.\n"
_SAMPLING_KEYS = ("temperature", "top_p", "max_new_tokens", "k", "prompt_template", "limit")
_HUB_KEYS = ("hub_id", "hub_split", "hub_config", "problem_field", "answer_field")


@dataclass(frozen=True)
class BenchmarkSettings:
    name: str
    temperature: float
    top_p: float
    max_new_tokens: int
    k: int
    prompt_template: str
    limit: int | None
    hub: dict = field(default_factory=dict)


def benchmark_settings(eval_cfg: EvalConfig, name: str, default_template: str) -> BenchmarkSettings:
    """Global eval sampling keys with `eval.benchmarks.<name>` on top; every value range-checked,
    every error naming its key."""
    over = dict(eval_cfg.benchmarks or {}).get(name) or {}
    unknown = sorted(set(over) - set(_SAMPLING_KEYS) - set(_HUB_KEYS))
    if unknown:
        raise ParityError(f"config key `eval.benchmarks.{name}.{unknown[0]}`: unknown; known: "
                          f"{', '.join(_SAMPLING_KEYS + _HUB_KEYS)}")

    def pick(key: str) -> tuple[Any, str]:
        if key in over and over[key] is not None:
            return over[key], f"eval.benchmarks.{name}.{key}"
        return getattr(eval_cfg, key), f"eval.{key}"

    (temp, kt), (top_p, kp) = pick("temperature"), pick("top_p")
    (mnt, km), (k, kk), (limit, kl) = pick("max_new_tokens"), pick("k"), pick("limit")
    template, kt2 = pick("prompt_template")
    template = default_template if template is None else template
    _require(float(temp) >= 0, kt, f"must be >= 0, got {temp}")
    _require(0 < float(top_p) <= 1, kp, f"must be in (0, 1], got {top_p}")
    _require(int(mnt) >= 1, km, f"must be >= 1, got {mnt}")
    _require(int(k) >= 1, kk, f"must be >= 1, got {k}")
    _require(limit is None or int(limit) >= 1, kl, f"must be >= 1 or null, got {limit}")
    _require("{problem}" in str(template), kt2, "must contain {problem}")
    hub = {"hub_id": over.get("hub_id"), "split": over.get("hub_split"), "config": over.get("hub_config"),
           "problem_field": over.get("problem_field"), "answer_field": over.get("answer_field")}
    return BenchmarkSettings(name, float(temp), float(top_p), int(mnt), int(k), str(template),
                             None if limit is None else int(limit), {k_: v for k_, v in hub.items() if v})


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ParityError(f"config key `{key}`: {msg}")


def engine_context_length(engine: Engine, tokenizer: Any, configured: int | None) -> int | None:
    """Tokens the engine can hold (prompt + response): the configured value, else the model's limit."""
    if configured:
        return int(configured)
    for attr in ("max_model_len", "max_position_embeddings"):
        if getattr(engine, attr, None):
            return int(getattr(engine, attr))
    model_cfg = getattr(getattr(engine, "model", None), "config", None)
    if getattr(model_cfg, "max_position_embeddings", None):
        return int(model_cfg.max_position_embeddings)
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if n and n < 10**7 else None


def token_budget(context: int | None, max_new_tokens: int) -> tuple[int | None, int]:
    """(prompt tokens allowed, new tokens): a response budget that fills the whole context is halved,
    so prompts keep room (reported as clamped)."""
    if context is None:
        return None, max_new_tokens
    if max_new_tokens >= context:
        max_new_tokens = max(1, context // 2)
    return context - max_new_tokens, max_new_tokens


def left_truncate(ids: list[int], budget: int | None) -> tuple[list[int], bool]:
    if budget is None or len(ids) <= budget:
        return ids, False
    return ids[len(ids) - budget:], True


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return list(tokenizer(text)["input_ids"])


def decode_responses(tokenizer: Any, batch: Any) -> list[str]:
    rows = [batch.responses[i][batch.response_mask[i]].tolist() for i in range(batch.batch_size)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def _load(settings: BenchmarkSettings, eval_cfg: EvalConfig, data_cfg: DataConfig) -> list[Problem]:
    return load_benchmark(settings.name, datasets_dir=data_cfg.datasets_dir, source=str(eval_cfg.source),
                          limit=settings.limit, arithmetic_cfg=data_cfg.arithmetic, hub=settings.hub,
                          countdown_cfg=data_cfg.countdown)


def run_benchmark(engine: Engine, tokenizer: Any, grader: Any, settings: BenchmarkSettings, problems: list[Problem],
                  context: int | None, eval_cfg: EvalConfig, sink: Any, bar: Progress | None = None) -> dict:
    """Generate, grade and store one benchmark; returns its grid of grades and bookkeeping. `bar` counts its
    problems as each batch is graded."""
    budget, new_tokens = token_budget(context, settings.max_new_tokens)
    chat = bool(eval_cfg.chat_template)
    encoded = [left_truncate(encode_prompt(tokenizer, settings.prompt_template.format(problem=p.problem), chat),
                             budget) for p in problems]
    k = settings.k
    per_call = max(1, int(eval_cfg.batch_size) // k)
    seed = int(eval_cfg.seed) + zlib.crc32(settings.name.encode()) % (1 << 30)
    spec = SamplingSpec(temperature=settings.temperature, top_p=settings.top_p, max_new_tokens=new_tokens, n=k,
                        seed=seed)
    correct = np.zeros((len(problems), k), dtype=np.float64)
    answers: list[list[str | None]] = [[None] * k for _ in problems]
    statuses: Counter[str] = Counter()
    resp_trunc = 0
    for s in range(0, len(problems), per_call):
        idx = list(range(s, min(s + per_call, len(problems))))
        batch = engine.generate([encoded[i][0] for i in idx], spec, prompt_ids=idx)
        texts = decode_responses(tokenizer, batch)
        golds = [problems[int(pid)].answer for pid in batch.prompt_ids.tolist()]
        results = grader.grade_detailed(texts, golds, batch.truncated.tolist())
        lengths = batch.response_mask.sum(-1).tolist()
        seen: Counter[int] = Counter()
        for row, (pid, text, res) in enumerate(zip(batch.prompt_ids.tolist(), texts, results)):
            j = seen[pid]
            seen[pid] += 1
            correct[pid, j] = res.score
            answers[pid][j] = res.extracted
            statuses[res.status] += 1
            resp_trunc += int(bool(batch.truncated[row]))
            sink.write(json.dumps({
                "benchmark": settings.name, "problem_id": problems[pid].id, "sample": j,
                "reference": problems[pid].answer, "response": text, "extracted": res.extracted,
                "score": res.score, "status": res.status, "response_truncated": bool(batch.truncated[row]),
                "response_tokens": int(lengths[row]), "prompt_truncated": encoded[pid][1]}) + "\n")
        sink.flush()
        if bar is not None:
            bar.update(len(idx), benchmark=settings.name)
    return {"correct": correct, "answers": answers, "statuses": dict(statuses),
            "prompts_truncated": sum(t for _, t in encoded), "responses_truncated": resp_trunc,
            "max_new_tokens": new_tokens, "prompt_budget": budget}


def evaluate(engine: Engine, tokenizer: Any, suite: list[str], eval_cfg: EvalConfig, out_dir: str | Path, *,
             data_cfg: DataConfig | None = None, grader: Any = None, progress: bool = True, model_info: dict | None = None) -> dict:
    """Evaluate `engine` on `suite`; writes <out_dir>/samples.jsonl, metrics.json and table.md and
    returns {'benchmarks': {name: row}, 'macro': ..., 'table': markdown, ...}. `model_info` (which model
    was evaluated: its folder, how it was chosen, the registered name and version) is kept as 'model'."""
    suite = list(suite)
    if not suite:
        raise ParityError("config key `eval.suite`: empty; known benchmarks: " + ", ".join([*BENCHMARKS, *SYNTHETIC]))
    for name in suite:
        if name not in BENCHMARKS and name not in SYNTHETIC:
            raise ParityError(f"config key `eval.suite`: unknown benchmark {name!r}; known: "
                              + ", ".join([*BENCHMARKS, *SYNTHETIC]))
    data_cfg = DataConfig() if data_cfg is None else data_cfg
    for name in dict(eval_cfg.benchmarks or {}):
        if name not in BENCHMARKS and name not in SYNTHETIC:
            raise ParityError(f"config key `eval.benchmarks.{name}`: unknown benchmark")
    n_boot, level = int(eval_cfg.bootstrap), float(eval_cfg.ci_level)
    _require(n_boot >= 1, "eval.bootstrap", f"must be >= 1, got {n_boot}")
    _require(0 < level < 1, "eval.ci_level", f"must be in (0, 1), got {level}")
    default_template = str(eval_cfg.prompt_template or data_cfg.prompt_template or DEFAULT_TEMPLATE)
    settings = {name: benchmark_settings(eval_cfg, name, default_template) for name in suite}
    problems = {name: _load(settings[name], eval_cfg, data_cfg) for name in suite}  # bad data fails before sampling

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    own_grader = grader is None
    if own_grader:
        grader = GraderPool(workers=int(eval_cfg.grade_workers),
                            timeout_s=float(eval_cfg.grade_timeout_s))
    stats_before = dict(grader.stats.as_dict()) if hasattr(grader, "stats") else {}
    context = engine_context_length(engine, tokenizer, eval_cfg.max_model_len)
    t0 = time.time()
    rows: dict[str, dict] = {}
    estimates: dict[str, dict] = {}
    try:
        with (out / "samples.jsonl").open("w", encoding="utf-8") as sink:
            bar = Progress("evaluate", sum(len(problems[name]) for name in suite), "problem") if progress else None
            for name in suite:
                st = settings[name]
                t = time.time()
                res = run_benchmark(engine, tokenizer, grader, st, problems[name], context, eval_cfg, sink, bar)
                est = benchmark_metrics(res["correct"], res["answers"], n_boot, level, seed=int(eval_cfg.seed))
                estimates[name] = est
                rows[name] = {
                    "problems": len(problems[name]), "k": st.k,
                    "metrics": {m: e.as_dict() for m, e in est.items()},
                    "pass_curve": pass_curve(res["correct"]),
                    "sampling": {**{k_: v for k_, v in asdict(st).items() if k_ not in ("name", "hub", "limit")},
                                 "max_new_tokens_used": res["max_new_tokens"], "prompt_budget": res["prompt_budget"]},
                    "statuses": res["statuses"], "prompts_truncated": res["prompts_truncated"],
                    "responses_truncated": res["responses_truncated"], "seconds": round(time.time() - t, 2),
                }
                log.info("%s: avg@%d %.3f (%d problems, %d prompts truncated)", name, st.k,
                         est["avg@k"].value, len(problems[name]), res["prompts_truncated"])
    finally:
        if own_grader:
            grader.close()
    macro = {m: macro_average({n: estimates[n][m] for n in suite}, level).as_dict() for m in estimates[suite[0]]}
    grading = {k_: v - stats_before.get(k_, 0) for k_, v in grader.stats.as_dict().items()} \
        if hasattr(grader, "stats") else {}
    table = format_table(rows, macro if len(suite) > 1 else None)
    summary = {"out_dir": str(out), "samples_path": str(out / "samples.jsonl"), "suite": suite,
               "benchmarks": rows, "macro": macro, "grading": grading, "context_length": context,
               "model": model_info or {}, "engine": engine.describe() if hasattr(engine, "describe") else {},
               "seconds": round(time.time() - t0, 2), "table": table}
    (out / "metrics.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "table.md").write_text(table + "\n")
    return summary
