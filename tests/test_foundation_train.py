"""End to end on the quick settings: train writes metrics/checkpoints, resume continues exactly, bad inputs are clear."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from parity.commands.train import train
from parity.errors import ParityError
from parity.training.loop import MetricsLog


def _weights(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_train_then_resume_matches_uninterrupted(quick_cfg, prepared_model):
    full = train(quick_cfg("trainer.run_name=full", "trainer.total_steps=3"))
    rows = MetricsLog(__import__("pathlib").Path(full["run_dir"]) / "metrics.jsonl").read()
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for key in ("reward/mean", "mismatch/abs_prob_diff_mean", "mismatch/k3_kl", "perf/step_s", "train/loss"):
        assert key in rows[1], key
    # same run in two parts: 2 steps, then resume to 3
    train(quick_cfg("trainer.run_name=parts", "trainer.total_steps=2"))
    resumed = train(quick_cfg("trainer.run_name=parts", "trainer.total_steps=3", "trainer.resume=true"))
    assert resumed["start_step"] == 2
    rows2 = MetricsLog(__import__("pathlib").Path(resumed["run_dir"]) / "metrics.jsonl").read()
    assert [r["step"] for r in rows2] == [0, 1, 2, 3]
    assert rows2[3]["reward/mean"] == rows[3]["reward/mean"]
    a = _weights(__import__("pathlib").Path(full["latest_checkpoint"]))
    b = _weights(__import__("pathlib").Path(resumed["latest_checkpoint"]))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_existing_run_without_resume_is_refused(quick_cfg, prepared_model):
    train(quick_cfg("trainer.run_name=once", "trainer.total_steps=1"))
    with pytest.raises(ParityError, match="trainer.resume"):
        train(quick_cfg("trainer.run_name=once", "trainer.total_steps=1"))


def test_run_name_cannot_escape_outputs(quick_cfg):
    with pytest.raises(ParityError, match="trainer.run_name"):
        train(quick_cfg("trainer.run_name=../../etc"))


def test_missing_model_path_is_one_clear_error(outputs_dir):
    out = subprocess.run([sys.executable, "-m", "parity", "train", f"outputs_dir={outputs_dir}",
                          "model.path=/nonexistent/model"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "model.path" in out.stderr and "/nonexistent/model" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_train_prints_summary_json(outputs_dir, prepared_model):
    from tests.conftest import QUICK
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "parity", "train", f"outputs_dir={outputs_dir}", *QUICK,
                          "trainer.run_name=cli", "trainer.total_steps=1"], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["command"] == "train" and summary["steps"] == 1 and summary["latest_checkpoint"]
    # where the process's time went before its step: seconds since the process started, in the order they happen,
    # the imports (the interpreter, torch, transformers) more than nothing, all of it within the process's life
    marks = summary["startup_s"]
    # (the first rollout is sampled before the warm start's evaluation: rollout0)
    assert list(marks) == ["imports", "model", "sides", "rollout0", "eval0", "first_step"], marks
    assert 0 < marks["imports"] <= marks["model"] <= marks["sides"] <= marks["rollout0"] <= marks["eval0"] \
        <= marks["first_step"] < wall
    # the step-0 evaluation's seconds, metric by metric: inside the stretch between the first rollout and eval0
    assert list(summary["step0_eval_s"]) == ["eval/accuracy"]
    # (each of the three numbers is rounded to 0.01 s, so the difference of two marks and the seconds may be
    # 0.015 s apart from their unrounded values' order, plus float's representation of the decimals)
    assert 0 <= summary["step0_eval_s"]["eval/accuracy"] <= marks["eval0"] - marks["rollout0"] + 0.015 + 1e-9


def test_quantized_rollout_also_evaluates_the_unquantized_weights(quick_cfg, prepared_model):
    """With an INT8 rollout, every evaluation also measures the trainer's weights on an unquantized engine:
    at step 0 that is exactly the prepared model's greedy accuracy on an unquantized engine, at the end the
    summary carries both; a BF16 rollout (nothing quantized) records no second accuracy."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from parity.data.arithmetic import arithmetic_problems
    from parity.rewards.grader import GraderPool
    from parity.rollout.torch_engine import TorchEngine
    from parity.training.heldout import heldout_accuracy
    over = ("trainer.eval_every=2", "trainer.eval_problems=16", "trainer.checkpoint_every=2")
    s = train(quick_cfg("trainer.run_name=int8_eval", "+precision=w8a8_int8", *over))
    rows = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all("eval/accuracy_unquantized" in r for r in evals)
    cfg = quick_cfg()
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    problems = arithmetic_problems("test", 16, cfg.data.arithmetic)
    with GraderPool(workers=1) as grader:
        def acc(model_dir) -> float:
            return heldout_accuracy(TorchEngine(model_dir, dtype=torch.float32), tok, problems,
                                    cfg.data.prompt_template, grader, cfg.rollout.max_new_tokens)
        first, last = acc(prepared_model), acc(s["latest_checkpoint"])  # the final step's weights, unquantized
    assert s["initial_accuracy_unquantized"] == evals[0]["eval/accuracy_unquantized"] == first
    assert s["final_accuracy_unquantized"] == evals[1]["eval/accuracy_unquantized"] == last
    b = train(quick_cfg("trainer.run_name=bf16_eval", *over))
    assert "initial_accuracy_unquantized" not in b and "final_accuracy_unquantized" not in b


def _id_batch(responses, mask, topk_ids=None):
    from parity.types import RolloutBatch
    r = torch.tensor(responses)
    b, n = r.shape
    return RolloutBatch(prompts=torch.zeros(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.bool),
                        responses=r, response_mask=torch.tensor(mask), rollout_logprobs=torch.zeros(b, n),
                        rewards=torch.zeros(b), truncated=torch.zeros(b, dtype=torch.bool),
                        group_ids=torch.arange(b), prompt_ids=torch.arange(b),
                        topk_ids=None if topk_ids is None else torch.tensor(topk_ids),
                        topk_logprobs=None if topk_ids is None else torch.zeros(b, n, len(topk_ids[0][0])))


def test_trainer_checks_token_ids_on_the_host_and_names_the_row():
    """The trainer checks token ids against the vocabulary on the host (so the CUDA step has no device sync for
    it): ids under the response mask and top-K ids (negative ones are padding) must lie in [0, vocab)."""
    from parity.training.trainer import check_token_ids
    assert check_token_ids(_id_batch([[1, 2], [3, 99]], [[True, True], [True, False]]), vocab=10)  # 99 is padding
    with pytest.raises(ValueError, match=r"RolloutBatch\.responses: row 1 holds token ids outside \[0, 10\).*12"):
        check_token_ids(_id_batch([[1, 2], [12, 0]], [[True, True], [True, True]]), vocab=10)
    with pytest.raises(ValueError, match=r"RolloutBatch\.responses: row 0 .*-1"):
        check_token_ids(_id_batch([[-1, 2]], [[True, True]]), vocab=10)
    ok = _id_batch([[1, 2]], [[True, True]], topk_ids=[[[1, -1], [2, 3]]])
    assert check_token_ids(ok, vocab=10)
    with pytest.raises(ValueError, match=r"RolloutBatch\.topk_ids: row 0 .*10"):
        check_token_ids(_id_batch([[1, 2]], [[True, True]], topk_ids=[[[1, 10], [2, 3]]]), vocab=10)


def test_held_out_rows_a_call_change_the_calls_not_the_answers(quick_cfg, prepared_model):
    """trainer.eval_rows sets how many rows (problems x samples) one held-out engine call decodes. Every row's
    sampling follows its own seed (the problem's index and the sample), so 16 problems x 4 samples give the same
    answers in one call of 64 rows as in eight of 8; the engine sees the calls asked for. A value below 1 is
    refused naming the key."""
    from transformers import AutoTokenizer

    from parity.data.arithmetic import arithmetic_problems
    from parity.errors import ConfigError
    from parity.rewards.grader import GraderPool
    from parity.rollout.torch_engine import TorchEngine
    from parity.training.heldout import eval_settings, heldout_accuracy

    cfg = quick_cfg("trainer.eval_temperature=1.0", "trainer.eval_samples=4", "trainer.eval_rows=64")
    assert eval_settings(cfg)["batch_size"] == 64
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    problems = arithmetic_problems("test", 16, cfg.data.arithmetic)
    engine = TorchEngine(prepared_model, dtype=torch.float32)
    calls: list[int] = []
    answers: list[tuple[int, list[int]]] = []
    generate = engine.generate

    def counted(ids, spec, prompt_ids=None):
        calls.append(len(ids) * spec.n)
        b = generate(ids, spec, prompt_ids=prompt_ids)
        answers.extend((pid, r[m].tolist()) for pid, r, m in zip(b.prompt_ids.tolist(), b.responses, b.response_mask))
        return b

    engine.generate = counted  # type: ignore[method-assign]
    with GraderPool(workers=1) as grader:
        def acc(rows: int) -> float:
            return heldout_accuracy(engine, tok, problems, cfg.data.prompt_template, grader,
                                    cfg.rollout.max_new_tokens, **{**eval_settings(cfg), "batch_size": rows})
        one = acc(64)
        assert calls == [64]
        in_one = sorted(answers)
        calls.clear(), answers.clear()
        eight = acc(8)
        assert calls == [8] * 8
    assert one == eight
    assert sorted(answers) == in_one and len(in_one) == 64 and len({tuple(a) for _, a in in_one}) > 8
    with pytest.raises(ConfigError, match="trainer.eval_rows"):
        quick_cfg("trainer.eval_rows=0")
