"""Math-verify reward: right/wrong answers, truncation, and a pool that neither hangs nor dies on
pathological responses, hung workers or crashed workers."""

import os
import signal
import threading
import time

import pytest
import torch

from parity.commands.grade import main as grade_main
from parity.rewards.grader import GraderPool, grade_answer, status_counts

TIMEOUT = 2.0
GRACE = 0.5
# Wall-clock allowance on top of the per-item budget: a replacement fork and a loaded 2-core machine.
SLACK = 3.0
ROOMY = 60.0

RIGHT = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{0.5}", "\\frac12"),
    ("\\boxed{42}", "42"),
    ("\\boxed{27}", "27"),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("first \\boxed{3}, no wait, \\boxed{4}", "4"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
]
WRONG = [
    ("\\boxed{3}", "4"),
    ("\\boxed{4} hmm, \\boxed{3}", "4"),  # only the last box counts
    ("the answer is 4", "4"),  # no box
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("\\boxed{(1, 2)}", "(2, 1)"),
]


@pytest.fixture(scope="module")
def pool():
    """Short per-item budget, for the pathological cases."""
    with GraderPool(workers=2, timeout_s=TIMEOUT, kill_grace_s=GRACE) as p:
        yield p


@pytest.fixture(scope="module")
def roomy_pool():
    """A generous budget for correctness checks: a right answer must not time out on a loaded machine."""
    with GraderPool(workers=2, timeout_s=ROOMY) as p:
        yield p


def test_grade_answer_right_and_wrong():
    for resp, ans in RIGHT:
        assert grade_answer(resp, ans, timeout_s=ROOMY)[0] == 1.0, (resp, ans)
    for resp, ans in WRONG:
        assert grade_answer(resp, ans, timeout_s=ROOMY)[0] == 0.0, (resp, ans)
    assert grade_answer("\\boxed{7}", "7", timeout_s=ROOMY) == (1.0, "7")
    assert grade_answer("nothing", "7") == (0.0, None)


def test_pool_matches_single_process(roomy_pool):
    pairs = RIGHT + WRONG
    scores = roomy_pool.grade([r for r, _ in pairs], [a for _, a in pairs])
    assert scores.dtype == torch.float32
    assert scores.tolist() == [1.0] * len(RIGHT) + [0.0] * len(WRONG)


def test_truncated_scores_zero(roomy_pool):
    res = roomy_pool.grade_detailed(["\\boxed{5}", "\\boxed{5}"], ["5", "5"], truncated=torch.tensor([True, False]))
    assert [r.score for r in res] == [0.0, 1.0]
    assert res[0].status == "truncated" and res[0].extracted == "5"


def test_statuses(roomy_pool):
    res = roomy_pool.grade_detailed(["\\boxed{5}", "\\boxed{6}", "no box", "\\boxed{5}"], ["5", "5", "5", ""])
    assert [r.status for r in res] == ["correct", "wrong", "no_answer", "bad_gold"]
    assert status_counts(res) == {"correct": 1, "wrong": 1, "no_answer": 1, "bad_gold": 1}


def test_length_mismatch_is_a_clear_error(pool):
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        pool.grade(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="truncated"):
        pool.grade(["a"], ["1"], truncated=[True, False])


PATHOLOGICAL = {
    "power_tower": "\\boxed{9^{9^{9^{9^{9}}}}}",
    "big_power": "\\boxed{9^{387420489}}",
    "nested_braces": "\\boxed{" + "{" * 1500 + "5" + "}" * 1500 + "}",
    "megabyte_of_braces": "\\boxed{" + "{" * 500_000 + "}" * 500_000 + "}",
    "unclosed_megabyte": "\\boxed{" + "{" * 1_000_000,
    "nested_fracs": "\\boxed{" + "\\frac{1}{" * 600 + "2" + "}" * 600 + "}",
    "nested_sqrt": "\\boxed{" + "\\sqrt{" * 1000 + "2" + "}" * 1000 + "}",
}


def test_pathological_responses_score_zero_within_the_timeout(pool):
    names = list(PATHOLOGICAL)
    before = pool.stats.timeouts
    t = time.monotonic()
    res = pool.grade_detailed([PATHOLOGICAL[n] for n in names] + ["\\boxed{5}"], ["5"] * (len(names) + 1))
    elapsed = time.monotonic() - t
    assert [r.score for r in res] == [0.0] * len(names) + [1.0]
    by_name = {n: r.status for n, r in zip(names, res)}
    assert by_name["power_tower"] == "timeout"
    assert pool.stats.timeouts - before == sum(r.status == "timeout" for r in res)
    # 2 workers, each item bounded by TIMEOUT + GRACE: the batch cannot take longer than this.
    n_slow = sum(r.status == "timeout" for r in res)
    assert elapsed < (n_slow / 2 + 1) * (TIMEOUT + GRACE) + SLACK, (elapsed, by_name)


def test_single_pathological_item_times_out_in_time(pool):
    t = time.monotonic()
    res = pool.grade_detailed([PATHOLOGICAL["power_tower"]], ["5"])
    assert res[0].score == 0.0 and res[0].status == "timeout"
    assert time.monotonic() - t < TIMEOUT + GRACE + SLACK


def test_hung_worker_is_killed_and_replaced(pool):
    pool.wait_ready()
    pids = pool.worker_pids()
    restarts = pool.stats.restarts
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # a worker stuck where no signal handler runs
    t = time.monotonic()
    res = pool.grade_detailed(["\\boxed{5}", "\\boxed{6}", "\\boxed{7}"], ["5", "6", "8"])
    elapsed = time.monotonic() - t
    assert [r.status for r in res[:2]] == ["timeout", "timeout"]  # the stopped workers' items
    assert res[2].status == "wrong"  # graded by a replacement
    assert pool.stats.restarts - restarts == 2
    assert set(pool.worker_pids()).isdisjoint(pids)
    assert elapsed < TIMEOUT + GRACE + SLACK
    assert pool.grade(["\\boxed{1}"], ["1"]).tolist() == [1.0]


def test_pool_survives_crashed_workers(pool):
    pool.wait_ready()
    pids = pool.worker_pids()
    crashes = pool.stats.crashes
    killer = threading.Timer(0.5, lambda: [os.kill(p, signal.SIGKILL) for p in pids])
    killer.start()
    res = pool.grade_detailed([PATHOLOGICAL["power_tower"]] * 2 + ["\\boxed{2}"], ["5", "5", "2"])
    killer.join()
    assert [r.status for r in res] == ["crash", "crash", "correct"]
    assert pool.stats.crashes - crashes == 2
    # A worker that died while idle: its next item is retried on a replacement, not lost.
    for pid in pool.worker_pids():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert pool.grade(["\\boxed{3}", "\\boxed{4}"], ["3", "5"]).tolist() == [1.0, 0.0]


def test_grade_command():
    assert grade_main(["--response", "so \\boxed{\\frac{1}{2}}", "--answer", "0.5", "--timeout", "60"]) == {
        "score": 1, "extracted": "\\frac{1}{2}", "status": "correct"}
    out = grade_main(["--response", "\\boxed{3}", "--answer", "4", "--timeout", "60"])
    assert out["score"] == 0 and out["extracted"] == "3"
    out = grade_main(["--response", PATHOLOGICAL["power_tower"], "--answer", "5", "--timeout", "1"])
    assert out["score"] == 0 and out["status"] == "timeout"


def test_broken_environment_fails_loudly_not_as_zero_rewards(tmp_path, monkeypatch):
    """Workers that cannot import math-verify must stop grading with an error, not score everything 0."""
    fake = tmp_path / "math_verify"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit the parent's sys.path
    with GraderPool(workers=1, timeout_s=TIMEOUT, start_method="spawn") as p:
        with pytest.raises(RuntimeError, match="cannot import math-verify.*broken on purpose"):
            p.grade(["\\boxed{1}"], ["1"])
