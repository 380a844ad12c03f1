"""Countdown: reach a target from given numbers with + - * (and / where enabled), each number used once.

A reasoning task whose worked solutions vary in length between samples of one prompt: the teacher that
warm-starts the model writes a search trace, one attempt a line (each attempt combines two numbers at a time
until one is left, then says whether it hit the target), stops at the first hit and boxes its expression,
or gives up after `max_attempts` misses and boxes its closest attempt, which is wrong. So a response's length
is the number of attempts it needed, and the long responses are the give-ups: length and correctness
correlate, as they do in the long chains of thought the published mismatch collapses were seen on.

    prompt:    Use 3 5 7 to make 22.
    response:  7+5=12 12*3=36 no
               3*5=15 15+7=22 yes
               \\boxed{3*5+7}

Deterministic: a problem is a function of (data.countdown.seed, split, index); every problem has a solution
(its target is the value of a random combination of its numbers). Train and test are disjoint: a problem
(its numbers as a multiset and its target) belongs to the test split iff a hash of it falls in the test
bucket. The reference answer handed to the grader is `countdown:3,5,7=22` (parity.rewards.countdown
checks the boxed expression itself: no eval, bounded size)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.data.arithmetic import Problem
from parity.errors import DataError

if TYPE_CHECKING:
    from parity.config.schema import CountdownConfig
from parity.rewards.countdown import ANSWER_PREFIX, decode_answer, encode_answer  # noqa: F401  (the task's answers)

TEST_BUCKETS = 10
OPS = ("+", "-", "*", "/")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class Term:
    """A number on the board: its value, the expression that made it, and that expression's precedence
    (3 for a literal), so expressions are written with the fewest parentheses."""

    value: int
    expr: str
    prec: int = 3


def combine(a: Term, b: Term, op: str, max_value: int) -> Term | None:
    """a op b as a new board number, or None when the result leaves the task's rules: non-positive,
    fractional or above `max_value`."""
    if op == "+":
        v = a.value + b.value
    elif op == "-":
        v = a.value - b.value
    elif op == "*":
        v = a.value * b.value
    elif op == "/":
        if b.value <= 1 or a.value % b.value:
            return None
        v = a.value // b.value
    else:
        raise ValueError(f"unknown countdown operation {op!r}; known: {' '.join(OPS)}")
    if v <= 0 or v > max_value:
        return None
    p = _PREC[op]
    left = a.expr if a.prec >= p else f"({a.expr})"
    # a right operand of equal precedence needs parentheses under - and / (a-(b-c), a/(b/c))
    right = b.expr if b.prec > p or (b.prec == p and op in "+*") else f"({b.expr})"
    return Term(v, f"{left}{op}{right}", p)


def random_path(rng: random.Random, numbers: list[int], ops: list[str], max_value: int
                ) -> tuple[list[str], Term]:
    """One attempt: repeatedly combine two board numbers (a random ordered pair and a random operation that
    keeps the board within the rules) until one is left. Returns the written steps ("3*5=15") and the
    final term."""
    board = [Term(n, str(n)) for n in numbers]
    steps = []
    for _ in range(1000):
        if len(board) == 1:
            return steps, board[0]
        i, j = rng.sample(range(len(board)), 2)
        options = [(op, t) for op in rng.sample(ops, len(ops)) if (t := combine(board[i], board[j], op, max_value))]
        if not options:  # e.g. a - b with a < b: the other order
            i, j = j, i
            options = [(op, t) for op in ops if (t := combine(board[i], board[j], op, max_value))]
            if not options:  # both orders leave the rules (only possible under max_value): another pair
                continue
        op, t = options[0]
        steps.append(f"{board[i].value}{op}{board[j].value}={t.value}")
        board = [b for k, b in enumerate(board) if k not in (i, j)] + [t]
    raise DataError(f"countdown: no operation combines the numbers {numbers} within data.countdown.max_value={max_value}")


@dataclass(frozen=True)
class Trace:
    text: str  # the attempts and the boxed answer (no EOS)
    attempts: int
    solved: bool


def teacher_trace(rng: random.Random, numbers: list[int], target: int, ops: list[str], max_value: int,
                  max_attempts: int) -> Trace:
    """The warm-start teacher: random attempts (distinct step sequences) until one hits the target, or
    `max_attempts` misses, after which it boxes the attempt that came closest (a wrong answer)."""
    lines, seen = [], set()
    best: tuple[int, str] | None = None
    for _ in range(20 * max_attempts):
        if len(lines) >= max_attempts:
            break
        steps, final = random_path(rng, numbers, ops, max_value)
        key = " ".join(steps)
        if key in seen:
            continue
        seen.add(key)
        hit = final.value == target
        lines.append(f"{key} {'yes' if hit else 'no'}")
        if hit:
            return Trace("\n".join(lines) + f"\n\\boxed{{{final.expr}}}", len(lines), True)
        if best is None or abs(final.value - target) < best[0]:
            best = (abs(final.value - target), final.expr)
    assert best is not None
    return Trace("\n".join(lines) + f"\n\\boxed{{{best[1]}}}", len(lines), False)


def _is_test(numbers: list[int], target: int) -> bool:
    key = f"{sorted(numbers)}->{target}"
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % TEST_BUCKETS == 0


@dataclass(frozen=True)
class Rules:
    """data.countdown as plain values, checked once: the generator reads them thousands of times a batch, and a
    config object's attribute access costs more than the arithmetic."""
    seed: int
    min_numbers: int
    max_numbers: int
    ops: tuple[str, ...]
    min_target: int
    max_target: int
    max_number: int
    max_value: int
    max_attempts: int
    min_attempts: int  # = max_attempts unless the teacher's budget is drawn (data.countdown.min_attempts)


def rules(cfg: CountdownConfig) -> Rules:
    """`cfg` (data.countdown, a config or any object with its keys) checked and as plain values."""
    if isinstance(cfg, Rules):
        return cfg
    lo, hi = int(cfg.min_numbers), int(cfg.max_numbers)
    if not 2 <= lo <= hi <= 6:
        raise DataError(f"config keys `data.countdown.min_numbers/max_numbers`: need 2 <= min <= max <= 6, got {lo}, {hi}")
    ops = tuple(str(o) for o in cfg.ops)
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise DataError(f"config key `data.countdown.ops`: unknown operation(s) {bad or list(ops)}; known: {' '.join(OPS)}")
    if not 1 <= int(cfg.min_target) <= int(cfg.max_target):
        raise DataError("config keys `data.countdown.min_target/max_target`: need 1 <= min_target <= max_target, got "
                        f"{cfg.min_target}, {cfg.max_target}")
    if int(cfg.max_number) < 1:
        raise DataError(f"config key `data.countdown.max_number`: must be >= 1, got {cfg.max_number}")
    most = int(cfg.max_attempts)
    if most < 1:
        raise DataError(f"config key `data.countdown.max_attempts`: must be >= 1, got {most}")
    least = getattr(cfg, "min_attempts", None)
    least = most if least is None else int(least)
    if not 1 <= least <= most:
        raise DataError(f"config key `data.countdown.min_attempts`: need 1 <= min_attempts <= max_attempts={most}, "
                        f"got {least}")
    return Rules(seed=int(cfg.seed), min_numbers=lo, max_numbers=hi, ops=ops, min_target=int(cfg.min_target),
                 max_target=int(cfg.max_target), max_number=int(cfg.max_number), max_value=int(cfg.max_value),
                 max_attempts=most, min_attempts=least)


def draw_problem(rng: random.Random, cfg: CountdownConfig) -> tuple[list[int], int]:
    """Numbers of a random level and the value of a random combination of them as the target (so a solution
    exists), redrawn until the target lies in [min_target, max_target]."""
    r = rules(cfg)
    ops = list(r.ops)
    for _ in range(10_000):
        numbers = [rng.randint(1, r.max_number) for _ in range(rng.randint(r.min_numbers, r.max_numbers))]
        _, final = random_path(rng, numbers, ops, r.max_value)
        if r.min_target <= final.value <= r.max_target:
            return numbers, final.value
    raise DataError("data.countdown: no target in [min_target, max_target] after 10,000 draws; widen the range")


def problem_text(numbers: list[int], target: int) -> str:
    return f"Use {' '.join(str(n) for n in numbers)} to make {target}."


def _problem(split: str, index: int, numbers: list[int], target: int) -> Problem:
    return Problem(id=f"countdown-{split}-{index}", problem=problem_text(numbers, target),
                   answer=encode_answer(numbers, target))


def countdown_problems(split: str, n: int, cfg: CountdownConfig, seed_offset: int = 0) -> list[Problem]:
    """`n` distinct problems of `split` ('train' or 'test'), deterministic in (cfg.seed, seed_offset)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    cfg = rules(cfg)
    rng = random.Random(f"countdown:{cfg.seed}:{split}:{seed_offset}")
    out: list[Problem] = []
    seen: set[str] = set()
    for _ in range(200 * n + 10_000):
        if len(out) >= n:
            return out
        numbers, target = draw_problem(rng, cfg)
        key = f"{sorted(numbers)}->{target}"
        if key in seen or _is_test(numbers, target) != (split == "test"):
            continue
        seen.add(key)
        out.append(_problem(split, len(out), numbers, target))
    raise DataError(f"could not draw {n} distinct {split} countdown problems (found {len(out)}): ask for fewer "
                    "(model.warm_start.eval_problems, trainer.eval_problems, data.countdown.n_test) or widen "
                    "data.countdown's ranges (max_numbers, max_number, max_target)")


class CountdownStream:
    """Endless deterministic stream of train problems; its position is part of the checkpoint."""

    def __init__(self, cfg: CountdownConfig, seed: int = 0) -> None:
        self.cfg, self.seed, self.position = rules(cfg), seed, 0

    def take(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            rng = random.Random(f"countdown:{self.cfg.seed}:stream:{self.seed}:{self.position}")
            self.position += 1
            numbers, target = draw_problem(rng, self.cfg)
            if not _is_test(numbers, target):
                out.append(_problem("train", self.position - 1, numbers, target))
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def countdown_demonstration(p: Problem, cfg: CountdownConfig, rng: random.Random) -> Trace:
    """The teacher's trace for `p`; with data.countdown.min_attempts set, its attempt budget is first drawn
    uniformly from [min_attempts, max_attempts] (one draw of `rng`, only then: a fixed budget keeps the draws of
    the traces it always wrote)."""
    numbers, target = decode_answer(p.answer)
    r = rules(cfg)
    budget = r.max_attempts if r.min_attempts == r.max_attempts else rng.randint(r.min_attempts, r.max_attempts)
    return teacher_trace(rng, numbers, target, list(r.ops), r.max_value, budget)
