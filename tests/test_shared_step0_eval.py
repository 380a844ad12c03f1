"""trainer.share_step0_eval: runs that start from the same weights compute the warm start's step-0 held-out
accuracies once (the first to take the lock in ${outputs_dir}/eval0/), the others read them: the plain engine's for
every run of the warm start, the rollout's for the runs of one format; what a number depends on (the weights, the
problems, the sampling seed, the engine) is in its key, so a run that would compute another number computes its
own."""

from __future__ import annotations

import fcntl
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from parity.commands.train import train
from parity.training.loop import MetricsLog

# the evaluations sampled (2 samples a problem at temperature 1), so that a run which reads a number instead of
# sampling it would step differently if the engines drew from a shared random state
OVER = ("+precision=w8a8_int8", "trainer.share_step0_eval=true", "trainer.eval_every=1", "trainer.total_steps=1",
        "trainer.checkpoint_every=0", "trainer.eval_temperature=1.0", "trainer.eval_samples=2")


def _rec(shared: dict) -> dict:
    """A step0_eval_shared entry without its timing (wait_s: how long the lock was held by another run)."""
    assert shared["wait_s"] >= 0
    return {k: v for k, v in shared.items() if k != "wait_s"}


def _step0(summary: dict) -> dict:
    return MetricsLog(Path(summary["run_dir"]) / "metrics.jsonl").read()[0]


def test_runs_of_one_warm_start_share_its_evaluation(quick_cfg, prepared_model, outputs_dir):
    from transformers import AutoTokenizer

    from parity.data.arithmetic import arithmetic_problems
    from parity.rewards.grader import GraderPool
    from parity.rollout import compute_dtype
    from parity.rollout.torch_engine import TorchEngine
    from parity.training.heldout import eval_settings, heldout_accuracy
    a = train(quick_cfg("trainer.run_name=share_a", *OVER))
    # another arm (a correction) of the same format from the same warm start: both step-0 computations, read
    b = train(quick_cfg("trainer.run_name=share_b", *OVER, "algorithm.correction.name=tis"))
    both = ("eval/accuracy", "eval/accuracy_unquantized")
    assert sorted(a["step0_eval_shared"]) == sorted(b["step0_eval_shared"]) == sorted(both)
    # each step-0 metric's seconds in the run (the summary's account of its start)
    assert sorted(a["step0_eval_s"]) == sorted(b["step0_eval_s"]) == sorted(both)
    assert all(x["step0_eval_s"][m] >= 0 for x in (a, b) for m in both)
    for m in both:
        assert a["step0_eval_shared"][m]["reused"] is False and a["step0_eval_shared"][m]["computed_by"] == "share_a"
        assert _rec(b["step0_eval_shared"][m]) == {**_rec(a["step0_eval_shared"][m]), "reused": True}
        record = json.loads(Path(a["step0_eval_shared"][m]["file"]).read_text())
        assert Path(a["step0_eval_shared"][m]["file"]).parent == outputs_dir / "eval0"
        assert _step0(a)[m] == _step0(b)[m] == record["accuracy"] and record["run"] == "share_a"
    # reading the numbers leaves the run's course as it was: the same arm, reading both, steps as the one computing
    a2 = train(quick_cfg("trainer.run_name=share_a2", *OVER))
    assert all(a2["step0_eval_shared"][m]["reused"] for m in both)
    row_a, row_a2 = (MetricsLog(Path(s["run_dir"]) / "metrics.jsonl").read()[1] for s in (a, a2))
    same = [k for k in row_a if not k.startswith("perf/") and k != "time"]
    assert [row_a[k] for k in same] == [row_a2.get(k) for k in same], [k for k in same if row_a[k] != row_a2.get(k)]
    plain_file = a["step0_eval_shared"]["eval/accuracy_unquantized"]["file"]
    assert plain_file != a["step0_eval_shared"]["eval/accuracy"]["file"]
    # the plain number read is the warm start's own accuracy on a plain engine (the same sampled settings)
    cfg = quick_cfg(*OVER)
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    with GraderPool(workers=1) as grader:
        engine = TorchEngine(str(prepared_model), dtype=compute_dtype(cfg.model.dtype, torch.device("cpu")))
        own = heldout_accuracy(engine, tok, arithmetic_problems("test", 16, cfg.data.arithmetic),
                               cfg.data.prompt_template, grader, cfg.rollout.max_new_tokens, **eval_settings(cfg))
    assert _step0(a)["eval/accuracy_unquantized"] == own
    # another rollout format from the same warm start: the plain number read, the rollout's computed
    e = train(quick_cfg("trainer.run_name=share_e", *OVER[1:], "+precision=w8a8_int8_kv_int4"))
    assert _rec(e["step0_eval_shared"]["eval/accuracy_unquantized"]) == {**_rec(a["step0_eval_shared"][both[1]]),
                                                                          "reused": True}
    assert e["step0_eval_shared"]["eval/accuracy"]["reused"] is False
    # fewer held-out problems: other numbers, computed by the run itself
    c = train(quick_cfg("trainer.run_name=share_c", *OVER, "trainer.eval_problems=8"))
    assert not any(c["step0_eval_shared"][m]["reused"] for m in both)
    assert c["step0_eval_shared"][both[1]]["file"] != plain_file
    # a record that is not this code's (cut short by hand) is computed again, not trusted
    value = _step0(a)[both[1]]
    Path(plain_file).write_text("{\"accuracy\": ")
    d = train(quick_cfg("trainer.run_name=share_d", *OVER))
    assert d["step0_eval_shared"][both[1]]["reused"] is False and _step0(d)[both[1]] == value
    assert d["step0_eval_shared"]["eval/accuracy"]["reused"] is True
    assert json.loads(Path(plain_file).read_text())["run"] == "share_d"


def test_two_evaluations_at_once_compute_it_once(quick_cfg, prepared_model, tmp_path):
    """Two held-out evaluators of one warm start at the same moment (as 16 study runs reach step 0 together):
    the file lock lets one compute; the other waits and reads its number. One that finds the lock taken warms
    its plain engine first."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from parity.rewards.grader import GraderPool
    from parity.training.heldout import HeldOut
    cfg = quick_cfg(f"outputs_dir={tmp_path}", *OVER)
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    weights = load_file(str(prepared_model / "model.safetensors"))

    class StartWeights:  # the learner side at step 0: the warm start's own weights
        def weights(self) -> list:
            return list(weights.items())

    results: dict[int, tuple[float, dict]] = {}
    with GraderPool(workers=1) as grader:
        evaluators = [HeldOut(cfg, tok, grader, str(prepared_model)) for _ in range(2)]
        assert evaluators[0].shared == evaluators[1].shared and len(evaluators[0].shared) == 2

        def run(i: int) -> None:
            out = evaluators[i].evaluate(None, StartWeights(), 0)  # eval_through_rollout off below: no rollout
            results[i] = (out["eval/accuracy_unquantized"], evaluators[i].step0_shared["eval/accuracy_unquantized"])

        for h in evaluators:
            h.through_rollout, h.deployed_every = False, 0
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        lock_file = evaluators[0].shared["eval/accuracy_unquantized"].with_suffix(".lock")
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_file, "a") as held:  # another run holds the lock: both wait for it
            fcntl.flock(held, fcntl.LOCK_EX)
            for t in threads:
                t.start()
            time.sleep(1.0)
            assert not results, results
            fcntl.flock(held, fcntl.LOCK_UN)
        for t in threads:
            t.join()
        for h in evaluators:
            h.close()
    assert results[0][0] == results[1][0]
    assert sorted(r[1]["reused"] for r in results.values()) == [False, True]
    # both found the lock taken (held above), so each first ran one call of the evaluation's shape on its plain
    # engine (its compile and captures at step 0, not at its first own evaluation); the number is the same
    assert all(0 <= r[1]["warm_s"] <= r[1]["wait_s"] for r in results.values())
    # the two warmed the same plain engine in turns: one first and alone, the other after it (Inductor's cache)
    assert sorted(r[1]["warm_turn"]["first"] for r in results.values()) == [False, True]


def test_first_alone_lets_one_compile_then_the_others_together(tmp_path):
    """heldout.first_alone: the first process to come holds the turn alone; two that come meanwhile wait for it and
    then hold it at the same time (a barrier of two inside the turn would time out if they went one by one); one
    that comes after everyone left goes first again."""
    from parity.training.heldout import first_alone
    lock = tmp_path / "sub" / "x.warm.lock"
    inside, turns, order = threading.Barrier(2, timeout=20), {}, []
    first_in, release = threading.Event(), threading.Event()

    def first() -> None:
        with first_alone(lock) as turn:
            turns["a"] = turn
            order.append("a in")
            first_in.set()
            release.wait(20)
            order.append("a out")

    def later(name: str) -> None:
        with first_alone(lock) as turn:
            turns[name] = turn
            order.append(f"{name} in")
            inside.wait()  # both inside at once

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(20)
    others = [threading.Thread(target=later, args=(n,)) for n in ("b", "c")]
    for t in others:
        t.start()
    time.sleep(1.0)  # b and c have started and asked for their turn (the margin over the 0.4 s below: a busy host)
    assert order == ["a in"]  # b and c wait while a compiles
    release.set()
    for t in (a, *others):
        t.join(30)
    assert order[:2] == ["a in", "a out"] and sorted(order[2:]) == ["b in", "c in"]
    assert turns["a"]["first"] and not turns["b"]["first"] and not turns["c"]["first"]
    assert turns["b"]["waited_s"] >= 0.4 and turns["c"]["waited_s"] >= 0.4
    with first_alone(lock) as turn:  # nobody holds it: first again (its graphs come from the cache anyway)
        assert turn["first"] and turn["waited_s"] < 1.0


def test_a_cohort_member_shares_only_the_plain_evaluation(quick_cfg, prepared_model, tmp_path):
    """A cohort's server holds each generate call until every member has one: its members' rollout evaluations
    already run as one call, and a member waiting for another's rollout number would hold that one's call. So a
    member shares the plain engine's step-0 number (in its own process) and not the rollout's."""
    from transformers import AutoTokenizer

    from parity.rewards.grader import GraderPool
    from parity.training.heldout import HeldOut
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    with GraderPool(workers=1) as grader:
        member = HeldOut(quick_cfg(f"outputs_dir={tmp_path}", *OVER, f"rollout.cohort='{tmp_path / 'c.sock'}#0'"),
                         tok, grader, str(prepared_model))
        alone = HeldOut(quick_cfg(f"outputs_dir={tmp_path}", *OVER), tok, grader, str(prepared_model))
        assert list(member.shared) == ["eval/accuracy_unquantized"]
        assert member.shared["eval/accuracy_unquantized"] == alone.shared["eval/accuracy_unquantized"]
        assert sorted(alone.shared) == ["eval/accuracy", "eval/accuracy_unquantized"]
        member.close(), alone.close()


@pytest.mark.parametrize("setting,attr,value", [("compact_tail", "compact_tail", True),
                                                ("compile_prefill", "compile_prefill", False)])
def test_the_decode_settings_are_part_of_the_plain_numbers_key(quick_cfg, prepared_model, tmp_path, setting, attr,
                                                               value):
    """rollout.compact_tail and rollout.compile_prefill also set the plain engine's decode (a float product over
    fewer rows, or an eager prompt forward, may round otherwise, so the number may differ): runs with and without
    them do not read each other's step-0 numbers."""
    from transformers import AutoTokenizer

    from parity.rewards.grader import GraderPool
    from parity.training.heldout import HeldOut
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    with GraderPool(workers=1) as grader:
        on = HeldOut(quick_cfg(f"outputs_dir={tmp_path}", *OVER, f"rollout.{setting}={str(value).lower()}"), tok,
                     grader, str(prepared_model))
        off = HeldOut(quick_cfg(f"outputs_dir={tmp_path}", *OVER), tok, grader, str(prepared_model))
        assert getattr(on.plain, attr) == value and getattr(off.plain, attr) != value
        for m in ("eval/accuracy", "eval/accuracy_unquantized"):
            assert on.shared[m] != off.shared[m], m
        on.close(), off.close()
