"""The Countdown task: deterministic generator with disjoint splits, the teacher's traces, and the checker that
grades them (right, wrong and hostile expressions, through the grader's process pool and its timeouts)."""

from __future__ import annotations

import random
import statistics
from fractions import Fraction
from itertools import permutations
from types import SimpleNamespace

import pytest

from parity.data.countdown import (
    CountdownStream,
    countdown_demonstration,
    countdown_problems,
    decode_answer,
    encode_answer,
)
from parity.rewards.countdown import MAX_CHARS, check, evaluate
from parity.rewards.extract import last_boxed


def cfg(**kw):
    base = dict(min_numbers=3, max_numbers=4, max_number=9, ops=["+", "-", "*"], min_target=10, max_target=100,
                max_value=999, max_attempts=8, n_test=64, seed=1234)
    base.update(kw)
    return SimpleNamespace(**base)


def reachable(numbers: list[int], target: int, ops: str = "+-*") -> bool:
    """Brute force: can the numbers, each once, combine to the target (any order, any bracketing)?"""
    def values(nums: tuple[Fraction, ...]) -> set[Fraction]:
        if len(nums) == 1:
            return {nums[0]}
        out = set()
        for i, j in permutations(range(len(nums)), 2):
            rest = tuple(n for k, n in enumerate(nums) if k not in (i, j))
            a, b = nums[i], nums[j]
            for v in ([a + b] if "+" in ops else []) + ([a - b] if "-" in ops else []) + ([a * b] if "*" in ops else []):
                out |= values(rest + (v,))
        return out
    return Fraction(target) in values(tuple(Fraction(n) for n in numbers))


def test_generator_is_deterministic_and_splits_are_disjoint() -> None:
    c = cfg()
    train, test = countdown_problems("train", 300, c), countdown_problems("test", 64, c)
    assert train == countdown_problems("train", 300, c) and test == countdown_problems("test", 64, c)
    key = lambda p: (tuple(sorted(decode_answer(p.answer)[0])), decode_answer(p.answer)[1])  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in test}
    # the stream never yields a test problem, and resumes where it was
    s = CountdownStream(c, seed=3)
    first = s.take(50)
    assert not {key(p) for p in first} & {key(p) for p in test}
    state = s.state_dict()
    nxt = s.take(5)
    s2 = CountdownStream(c, seed=3)
    s2.load_state_dict(state)
    assert s2.take(5) == nxt
    # levels: 3 and 4 numbers, targets in range, every problem solvable
    sizes = {len(decode_answer(p.answer)[0]) for p in train}
    assert sizes == {3, 4}
    for p in train[:60] + test[:30]:
        nums, target = decode_answer(p.answer)
        assert 10 <= target <= 100 and all(1 <= n <= 9 for n in nums)
        assert reachable(nums, target), p
        assert p.problem == f"Use {' '.join(map(str, nums))} to make {target}."
    assert encode_answer([3, 5, 7], 22) == "countdown:3,5,7=22" and decode_answer("countdown:3,5,7=22") == ([3, 5, 7], 22)
    with pytest.raises(ValueError, match="malformed"):
        decode_answer("countdown:3,5,x")


def test_teacher_traces_vary_in_length_and_are_graded_by_their_own_checker() -> None:
    c = cfg(min_numbers=3, max_numbers=3)
    problems = countdown_problems("train", 200, c)
    rng = random.Random(0)
    traces = [countdown_demonstration(p, c, rng) for p in problems]
    for p, t in zip(problems, traces):
        nums, target = decode_answer(p.answer)
        ok, status = check(last_boxed(t.text), nums, target)
        assert ok == t.solved, (p, t.text)  # a solved trace boxes a correct expression, a give-up a wrong one
        assert t.attempts == t.text.count("\n") and 1 <= t.attempts <= c.max_attempts
        for line in t.text.splitlines()[:-1]:  # each step's arithmetic is right
            *steps, verdict = line.split(" ")
            assert verdict in ("yes", "no")
            for st in steps:
                lhs, rhs = st.split("=")
                assert evaluate(lhs)[0] == int(rhs)
    solved = [len(t.text) for t in traces if t.solved]
    missed = [len(t.text) for t in traces if not t.solved]
    assert 0.2 < len(solved) / len(traces) < 0.9
    assert statistics.fmean(missed) > statistics.fmean(solved)  # the long traces are the give-ups
    # the same prompt sampled twice by the teacher gives traces of different lengths
    again = [countdown_demonstration(problems[0], c, random.Random(s)).attempts for s in range(20)]
    assert len(set(again)) > 2


@pytest.mark.parametrize("expr, numbers, target, ok, status", [
    ("3*5+7", [3, 5, 7], 22, True, "correct"),
    ("7 + 3 \\times 5", [7, 5, 3], 22, True, "correct"),
    ("(9-1)*(4-3)", [1, 3, 4, 9], 8, True, "correct"),
    ("8/(3-(8/3))", [3, 3, 8, 8], 24, True, "correct"),  # exact fractions, no float rounding
    ("3*5+7=22", [3, 5, 7], 22, True, "correct"),
    ("3*5+7", [3, 5, 7], 23, False, "wrong"),
    ("3*5+7+7", [3, 5, 7], 29, False, "wrong"),  # 7 used twice
    ("3*5", [3, 5, 7], 15, False, "wrong"),  # 7 unused
    ("3*57", [3, 5, 7], 171, False, "wrong"),  # digits glued into another number
    ("3/0+5+7", [0, 3, 5, 7], 12, False, "unparsable"),
    ("2^10", [2, 10], 1024, False, "unparsable"),  # no power operator at all
    ("9**9**9", [9, 9, 9], 1, False, "unparsable"),
    ("-3+5+7", [3, 5, 7], 9, False, "unparsable"),  # no unary minus
    ("__import__('os')", [1], 1, False, "unparsable"),
    ("1234567+1", [1234567, 1], 1234568, False, "unparsable"),  # literals of at most 6 digits
    ("(" * 17 + "1" + ")" * 17, [1], 1, False, "unparsable"),  # nesting bound
    ("1+" * 200 + "1", [1] * 201, 201, False, "too_long"),
])
def test_checker_right_wrong_and_hostile(expr: str, numbers: list[int], target: int, ok: bool, status: str) -> None:
    assert check(expr, numbers, target) == (ok, status)


def test_hostile_responses_are_graded_within_the_timeout_by_the_pool() -> None:
    from parity.rewards.grader import GraderPool

    answer = "countdown:3,5,7=22"
    hostile = ["\\boxed{" + "(" * 100_000 + "1" + ")" * 100_000 + "}",  # deep nesting
               "\\boxed{9^9^9^9^9}", "\\boxed{9**9**9**9}",  # huge exponents
               "x" * 1_000_000 + " \\boxed{3*5+7}",  # 1 MB of text before a right answer
               "\\boxed{" + "1+" * 500_000 + "1}",  # 1 MB inside the box
               "{" * 1_000_000]  # 1 MB of braces, no box
    with GraderPool(workers=1, timeout_s=2.0) as pool:
        res = pool.grade_detailed(hostile, [answer] * len(hostile))
    assert [r.score for r in res] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert [r.status for r in res] == ["too_long", "unparsable", "unparsable", "correct", "too_long", "no_answer"]
    # every item finished inside its 2 s budget (a timeout or a killed worker would be counted here)
    assert pool.stats.timeouts == 0 and pool.stats.restarts == 0 and pool.stats.crashes == 0
    assert len("\\boxed{" + "1+" * 200 + "1}") > MAX_CHARS


def test_teacher_budget_drawn_between_min_and_max_attempts() -> None:
    """data.countdown.min_attempts: the teacher's attempt budget is drawn per demonstration from [min, max], so it
    gives up after as few as `min` misses (a model imitating it gives up early at a rate RL can lower); unset, the
    budget is max_attempts and the traces are those the fixed teacher always wrote."""
    from parity.data.countdown import rules
    from parity.errors import DataError

    problems = CountdownStream(cfg(max_attempts=16), seed=3).take(300)
    def traces(c):  # one teacher generator over all problems, as the warm start draws them
        rng = random.Random(7)
        return [countdown_demonstration(p, c, rng) for p in problems]

    fixed, unset = traces(cfg(max_attempts=16)), traces(cfg(max_attempts=16, min_attempts=None))
    assert [t.text for t in fixed] == [t.text for t in unset]
    drawn = traces(cfg(max_attempts=16, min_attempts=1))
    given_up = [t.attempts for t in drawn if not t.solved]
    assert min(given_up) < 4 and max(t.attempts for t in drawn) <= 16
    assert all(t.attempts == 16 for t in fixed if not t.solved)  # the fixed teacher gives up at max_attempts only
    # early give-ups lower the teacher's own accuracy: the headroom a learner can win back by searching longer
    assert statistics.fmean(t.solved for t in drawn) < statistics.fmean(t.solved for t in fixed) - 0.1
    with pytest.raises(DataError, match="data.countdown.min_attempts"):
        rules(cfg(max_attempts=8, min_attempts=9))


def test_warm_start_batches_are_a_function_of_seed_and_index() -> None:
    """Batch k of the warm start is made from (seed, k) alone: made in a pool of processes (out of order) or in
    this process, the same tensors."""
    import multiprocessing

    import torch

    from parity.data.tasks import SyntheticTask
    from parity.models.tokenizer import build_char_tokenizer
    from parity.training import sft

    tok, task = build_char_tokenizer(), SyntheticTask("countdown", cfg(max_attempts=4, min_attempts=1))
    args = (tok, task, "{problem}\n", 3, 8)
    here = [sft.warm_start_batch(k, *args) for k in (0, 1, 2, 5)]
    with multiprocessing.get_context("spawn").Pool(2, initializer=sft._init_worker, initargs=args) as pool:
        there = pool.map(sft._make_batch, [5, 2, 1, 0])[::-1]
    for a, b in zip(here, there, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(here[0][0][:, :5], here[1][0][:, :5]) or here[0][0].shape != here[1][0].shape
    assert torch.equal(sft.warm_start_batch(1, *args)[0], here[1][0])
