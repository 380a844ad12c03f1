"""Training prompt sources: the arithmetic stream or a JSONL dataset (MATH train), as a resumable stream."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from parity.data.arithmetic import ArithmeticStream, Problem
from parity.data.countdown import CountdownStream
from parity.errors import DataError

if TYPE_CHECKING:
    from parity.config.schema import DataConfig


def render_prompt(template: str, problem: str) -> str:
    return template.format(problem=problem)


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(row number, record) pairs; a row that is not valid UTF-8 JSON object raises DataError naming file and row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    rows = []
    with path.open("rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: row {i} is not valid UTF-8 ({e.reason} at byte {e.start})") from e
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: row {i} is not valid JSON ({e.msg})") from e
            if not isinstance(rec, dict):
                raise DataError(f"{path}: row {i} is not a JSON object")
            rows.append((i, rec))
    if not rows:
        raise DataError(f"{path}: dataset is empty")
    return rows


def load_jsonl_problems(path: str | Path, problem_field: str, answer_field: str, skip_missing_answers: bool,
                        min_difficulty: float | None = None) -> tuple[list[Problem], int]:
    """Problems of a JSONL file and the number of rows dropped for a missing answer (only when allowed)."""
    out, dropped = [], 0
    for i, rec in read_jsonl(path):
        if problem_field not in rec or not isinstance(rec[problem_field], str):
            raise DataError(f"{path}: row {i} has no string field `{problem_field}`")
        ans = rec.get(answer_field)
        if ans is None or (isinstance(ans, str) and not ans.strip()):
            if skip_missing_answers:
                dropped += 1
                continue
            raise DataError(f"{path}: row {i} has no answer in field `{answer_field}`")
        if min_difficulty is not None and float(rec.get("difficulty", 0.0)) < min_difficulty:
            continue
        out.append(Problem(id=f"{Path(path).parent.name}-{i}", problem=rec[problem_field], answer=str(ans)))
    if not out:
        raise DataError(f"{path}: no usable rows")
    return out, dropped


class ListStream:
    """Epoch-shuffled stream over a fixed problem list; its position is part of the checkpoint."""

    def __init__(self, problems: list[Problem], seed: int = 0) -> None:
        self.problems, self.seed, self.position = problems, seed, 0

    def take(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            epoch, idx = divmod(self.position, len(self.problems))
            order = list(range(len(self.problems)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            out.append(self.problems[order[idx]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def build_train_stream(data_cfg: DataConfig, seed: int = 0) -> ArithmeticStream | CountdownStream | ListStream:
    if data_cfg.name in ("arithmetic", "countdown"):
        from parity.data.tasks import synthetic_task

        return synthetic_task(data_cfg).stream(seed=seed)
    if data_cfg.name == "math_train":
        path = Path(data_cfg.datasets_dir) / "math_train" / "train.jsonl"
    elif data_cfg.name == "jsonl":
        if not data_cfg.path:
            raise DataError("config key `data.path`: required when data.name=jsonl")
        path = Path(data_cfg.path)
    else:
        raise DataError(f"config key `data.name`: unknown dataset {data_cfg.name!r}; known: arithmetic, countdown, "
                        "math_train, jsonl")
    problems, _ = load_jsonl_problems(path, data_cfg.problem_field, data_cfg.answer_field,
                                      skip_missing_answers=data_cfg.name == "math_train",
                                      min_difficulty=data_cfg.min_difficulty)
    return ListStream(problems, seed=data_cfg.shuffle_seed + seed)
