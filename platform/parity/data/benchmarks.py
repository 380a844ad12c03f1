"""Evaluation benchmarks: AIME24, AIME25, AMC23, MATH-500, Minerva, OlympiadBench and the held-out
arithmetic suite, each as a list of Problem(id, problem, answer) with the file's quirks resolved.

The reference answer of each file (see the datasets README):
    aime24, aime25, math500   `answer` (str)
    amc23                     `answer`, a JSON float of an integer (27.0) -> "27"
    minerva_math              no answer field: the last \\boxed{} of `solution` (brace-matched)
    olympiadbench             `final_answer[0].strip("$")`, problem text in `question`

Local JSONL files under the configured datasets folder are the default (tests and CI use them);
`source="hub"` reads public Hugging Face datasets instead, for users with network access.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity.data.arithmetic import Problem
from parity.data.prompts import read_jsonl
from parity.errors import DataError
from parity.rewards.extract import last_boxed

ARITHMETIC = "arithmetic"
COUNTDOWN = "countdown"
SYNTHETIC = (ARITHMETIC, COUNTDOWN)  # the generated tasks' held-out test splits (parity.data.tasks)
_REPO_ROOT = Path(__file__).resolve().parents[3]


def _str_field(rec: dict, key: str, where: str) -> str:
    if key not in rec:
        raise DataError(f"{where}: missing field `{key}`")
    v = rec[key]
    if not isinstance(v, str) or not v.strip():
        raise DataError(f"{where}: field `{key}` must be a non-empty string, got {type(v).__name__} {v!r:.60}")
    return v


def plain_answer(rec: dict, where: str, key: str = "answer") -> str:
    return _str_field(rec, key, where).strip()


def amc_answer(rec: dict, where: str, key: str = "answer") -> str:
    """AMC23 stores integers as JSON floats (27.0); string matching and the prompt want "27"."""
    if key not in rec:
        raise DataError(f"{where}: missing field `{key}`")
    v = rec[key]
    if isinstance(v, bool):
        raise DataError(f"{where}: field `{key}` is a boolean ({v})")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            raise DataError(f"{where}: field `{key}` is not a finite number ({v})")
        return str(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, str) and v.strip():
        s = v.strip()
        try:
            f = float(s)
        except ValueError:
            return s
        return str(int(f)) if f.is_integer() and "." in s else s
    raise DataError(f"{where}: field `{key}` must be a number, got {type(v).__name__} {v!r:.60}")


def minerva_answer(rec: dict, where: str, key: str = "solution") -> str:
    """The reference is the last \\boxed{} of the worked solution (Minerva has no answer field)."""
    boxed = last_boxed(_str_field(rec, key, where))
    if boxed is None or not boxed.strip():
        raise DataError(f"{where}: field `{key}` has no closed, non-empty \\boxed{{...}} to take the answer from")
    return boxed.strip()


def olympiad_answer(rec: dict, where: str, key: str = "final_answer") -> str:
    """final_answer is a list of one LaTeX string, 266 of them wrapped in $...$ (Qwen: strip("$"))."""
    if key not in rec:
        raise DataError(f"{where}: missing field `{key}`")
    v = rec[key]
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v or not isinstance(v[0], str) or not v[0].strip("$ \n"):
        raise DataError(f"{where}: field `{key}` must be a non-empty list of strings, got {v!r:.60}")
    return strip_math_delimiters(v[0])


def strip_math_delimiters(s: str) -> str:
    """`$x$` -> `x`, and a sentence's final period after it too: id 1970 is `$(-\\infty, 0) \\cup\\{1\\}$.`,
    where Qwen's strip("$") leaves `...\\}$.` and math-verify then reads the gold as 0."""
    prev = None
    while prev != s:
        prev = s
        s = s.strip().strip("$").rstrip(".")
    return s


@dataclass(frozen=True)
class BenchmarkSpec:
    name: str
    file: str  # relative to the datasets folder
    problem_field: str
    answer: Callable[..., str]  # (record, where, key) -> reference answer string
    answer_field: str
    id_field: str | None
    hub_id: str  # public Hugging Face dataset for source="hub" (fields may differ: overridable)
    hub_split: str
    hub_problem_field: str
    hub_answer_field: str
    hub_answer: Callable[..., str] = plain_answer


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "aime24": BenchmarkSpec("aime24", "aime24/test.jsonl", "problem", plain_answer, "answer", "id",
                            "HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    "aime25": BenchmarkSpec("aime25", "aime25/test.jsonl", "problem", plain_answer, "answer", "id",
                            "yentinglin/aime_2025", "train", "problem", "answer"),
    "amc23": BenchmarkSpec("amc23", "amc23/test.jsonl", "problem", amc_answer, "answer", "id",
                           "math-ai/amc23", "test", "question", "answer", amc_answer),
    "math500": BenchmarkSpec("math500", "math500/test.jsonl", "problem", plain_answer, "answer", "unique_id",
                             "HuggingFaceH4/MATH-500", "test", "problem", "answer"),
    "minerva_math": BenchmarkSpec("minerva_math", "minerva_math/test.jsonl", "problem", minerva_answer, "solution",
                                  "idx", "math-ai/minervamath", "test", "question", "answer"),
    "olympiadbench": BenchmarkSpec("olympiadbench", "olympiadbench/test.jsonl", "question", olympiad_answer,
                                   "final_answer", "id", "math-ai/olympiadbench", "test", "question", "answer"),
}


def benchmark_names() -> list[str]:
    return [*BENCHMARKS, *SYNTHETIC]


def resolve_datasets_dir(path: str | os.PathLike | None = None) -> Path:
    """The local datasets folder: `path` (data.datasets_dir), else $PARITY_DATASETS, else
    ../shared/datasets; a relative path is taken from the working directory, falling back to the repo."""
    raw = str(path) if path else os.environ.get("PARITY_DATASETS") or "../shared/datasets"
    p = Path(raw).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    return (_REPO_ROOT / p).resolve()


def _unique_ids(problems: list[Problem], where: str) -> None:
    seen: set[str] = set()
    for p in problems:
        if p.id in seen:
            raise DataError(f"{where}: duplicate problem id {p.id!r}")
        seen.add(p.id)


def problems_from_records(name: str, records: list[tuple[int, dict]], where: str,
                          problem_field: str, answer: Callable[..., str], answer_field: str,
                          id_field: str | None) -> list[Problem]:
    out = []
    for row, rec in records:
        at = f"{where}: row {row}"
        problem = _str_field(rec, problem_field, at)
        gold = answer(rec, at, answer_field)
        rid = rec.get(id_field) if id_field else None
        pid = f"{name}/{rid}" if rid is not None and str(rid).strip() else f"{name}/row{row}"
        out.append(Problem(id=pid, problem=problem, answer=gold))
    _unique_ids(out, where)
    return out


def load_local(name: str, datasets_dir: str | os.PathLike | None = None) -> list[Problem]:
    spec = _spec(name)
    root = resolve_datasets_dir(datasets_dir)
    path = root / spec.file
    if not path.is_file():
        raise FileNotFoundError(f"benchmark {name!r}: file not found: {path} (set data.datasets_dir or "
                                f"PARITY_DATASETS to the folder holding {spec.file})")
    return problems_from_records(name, read_jsonl(path), str(path), spec.problem_field, spec.answer,
                                 spec.answer_field, spec.id_field)


def load_hub(name: str, hub_id: str | None = None, split: str | None = None, config: str | None = None,
             problem_field: str | None = None, answer_field: str | None = None) -> list[Problem]:
    """A public Hugging Face dataset (needs network and the `datasets` package)."""
    spec = _spec(name)
    try:
        import datasets  # lazy: optional, not part of the numerical core's environment
    except ImportError as e:
        raise DataError(f"benchmark {name!r}: source=hub needs the `datasets` package (pip install datasets); "
                        "or use the local files (eval.source=local, data.datasets_dir)") from e
    hub_id = hub_id or spec.hub_id
    split = split or spec.hub_split
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:
        raise DataError(f"benchmark {name!r}: cannot load hub dataset {hub_id!r} split {split!r}: {e}") from e
    records = [(i, dict(r)) for i, r in enumerate(ds, start=1)]
    if not records:
        raise DataError(f"hub:{hub_id}: dataset is empty")
    return problems_from_records(name, records, f"hub:{hub_id}[{split}]", problem_field or spec.hub_problem_field,
                                 spec.hub_answer, answer_field or spec.hub_answer_field, None)


def _spec(name: str) -> BenchmarkSpec:
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; known: {', '.join(benchmark_names())}")
    return BENCHMARKS[name]


def load_benchmark(name: str, datasets_dir: str | os.PathLike | None = None, source: str = "local",
                   limit: int | None = None, arithmetic_cfg: Any = None, arithmetic_n: int | None = None,
                   hub: dict | None = None, countdown_cfg: Any = None) -> list[Problem]:
    """Problems of one benchmark, in file order, the first `limit` of them when set. The synthetic tasks'
    benchmarks (arithmetic, countdown) are their generators' test splits, `data.<name>.n_test` problems."""
    if limit is not None and limit < 1:
        raise DataError(f"benchmark {name!r}: limit must be >= 1, got {limit}")
    if name in SYNTHETIC:
        from parity.data.tasks import SyntheticTask

        gen_cfg = arithmetic_cfg if name == ARITHMETIC else countdown_cfg
        if gen_cfg is None:
            raise DataError(f"benchmark {name!r} needs its generator's config (data.{name})")
        n = (arithmetic_n if name == ARITHMETIC else None) or int(gen_cfg.n_test)
        n = min(n, limit) if limit else n
        return SyntheticTask(name, gen_cfg).test_problems(n)
    if source == "local":
        problems = load_local(name, datasets_dir)
    elif source == "hub":
        problems = load_hub(name, **(hub or {}))
    else:
        raise DataError(f"config key `eval.source`: must be local or hub, got {source!r}")
    return problems[:limit] if limit else problems
