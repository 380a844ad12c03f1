"""Deterministic synthetic arithmetic: problems of several operations and digit lengths, graded by
math-verify like every benchmark. Train and test are disjoint by construction: a problem belongs to
the test split iff a hash of its text falls in the test bucket, and the train sampler skips those."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parity.config.schema import ArithmeticConfig

TEST_BUCKETS = 10  # 1 in 10 problem texts is reserved for the test split


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


def _is_test(text: str) -> bool:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) % TEST_BUCKETS == 0


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_problem(rng: random.Random, level: int, ops: list[str]) -> tuple[str, int]:
    """Level L: operands of up to L digits; multiplication keeps one factor to a single digit below
    level 3 so that difficulty grows smoothly."""
    op = rng.choice(ops)
    if op == "*":
        a, b = _operand(rng, rng.randint(1, level)), _operand(rng, 1 if level < 3 else 2)
        return f"{a}*{b}", a * b
    a, b = _operand(rng, rng.randint(1, level)), _operand(rng, rng.randint(1, level))
    if op == "+":
        return f"{a}+{b}", a + b
    if op == "-":
        return f"{a}-{b}", a - b
    raise ValueError(f"config key `data.arithmetic.ops`: unknown operation {op!r}; known: + - *")


def _levels(cfg: ArithmeticConfig) -> list[int]:
    lo, hi = int(cfg.min_level), int(cfg.max_level)
    if not 1 <= lo <= hi <= 6:
        raise ValueError(f"config keys `data.arithmetic.min_level/max_level`: need 1 <= min <= max <= 6, got {lo}, {hi}")
    return list(range(lo, hi + 1))


def arithmetic_problems(split: str, n: int, cfg: ArithmeticConfig, seed_offset: int = 0) -> list[Problem]:
    """`n` distinct problems of `split` ('train' or 'test'), deterministic in (cfg.seed, seed_offset)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    levels, ops = _levels(cfg), list(cfg.ops)
    rng = random.Random(f"{cfg.seed}:{split}:{seed_offset}")
    seen: set[str] = set()
    out: list[Problem] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n + 10_000:
            raise ValueError(f"could not draw {n} distinct {split} arithmetic problems from levels {levels}")
        text, value = make_problem(rng, rng.choice(levels), ops)
        if text in seen or _is_test(text) != (split == "test"):
            continue
        seen.add(text)
        out.append(Problem(id=f"arith-{split}-{len(out)}", problem=text, answer=str(value)))
    return out


class ArithmeticStream:
    """Endless deterministic stream of train problems; its position is part of the checkpoint."""

    def __init__(self, cfg: ArithmeticConfig, seed: int = 0) -> None:
        self.cfg, self.seed, self.position = cfg, seed, 0
        self._levels, self._ops = _levels(cfg), list(cfg.ops)

    def take(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            rng = random.Random(f"{self.cfg.seed}:stream:{self.seed}:{self.position}")
            self.position += 1
            text, value = make_problem(rng, rng.choice(self._levels), self._ops)
            if not _is_test(text):
                out.append(Problem(id=f"arith-train-{self.position - 1}", problem=text, answer=str(value)))
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


TEACHER_ERRORS = ("none", "last_digit", "drop_sign")


def teacher_answer(answer: str, kind: str, rate: float, rng: random.Random) -> str:
    """The warm-start target: the right answer, or with probability `rate` the teacher's systematic slip."""
    if kind == "none" or rate <= 0.0 or rng.random() >= rate:
        return answer
    if kind == "last_digit":
        return answer[:-1] + str((int(answer[-1]) + 1) % 10)
    if kind == "drop_sign":
        return answer.lstrip("-")
    raise ValueError(f"config key `model.warm_start.teacher_error`: unknown slip {kind!r}; known: {TEACHER_ERRORS}")
