"""trainer.share_step0_eval: runs that start from the same weights compute the warm start's plain-engine held-out
accuracy once (the first to take the lock in ${outputs_dir}/eval0/), the others read it; what it depends on (the
weights, the problems, the sampling seed, the engine) is in the key, so a run that would compute another number
computes its own."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from parity.commands.train import train
from parity.training.loop import MetricsLog

OVER = ("+precision=w8a8_int8", "trainer.share_step0_eval=true", "trainer.eval_every=1", "trainer.total_steps=1",
        "trainer.checkpoint_every=0")


def _step0(summary: dict) -> float:
    rows = MetricsLog(Path(summary["run_dir"]) / "metrics.jsonl").read()
    return rows[0]["eval/accuracy_unquantized"]


def test_runs_of_one_warm_start_share_its_evaluation(quick_cfg, prepared_model, outputs_dir):
    from transformers import AutoTokenizer

    from parity.data.arithmetic import arithmetic_problems
    from parity.rewards.grader import GraderPool
    from parity.rollout import compute_dtype
    from parity.rollout.torch_engine import TorchEngine
    from parity.training.heldout import eval_settings, heldout_accuracy
    a = train(quick_cfg("trainer.run_name=share_a", *OVER))
    # another arm (a correction) from the same warm start: the same step-0 computation, read
    b = train(quick_cfg("trainer.run_name=share_b", *OVER, "algorithm.correction.name=tis"))
    assert a["step0_eval_shared"]["reused"] is False and a["step0_eval_shared"]["computed_by"] == "share_a"
    assert b["step0_eval_shared"] == {**a["step0_eval_shared"], "reused": True}
    record = json.loads(Path(a["step0_eval_shared"]["file"]).read_text())
    assert Path(record_file := a["step0_eval_shared"]["file"]).parent == outputs_dir / "eval0", record_file
    assert _step0(a) == _step0(b) == record["accuracy"] and record["run"] == "share_a"
    # the number read is the warm start's own accuracy on a plain engine (greedy, the quick settings)
    cfg = quick_cfg()
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    with GraderPool(workers=1) as grader:
        engine = TorchEngine(str(prepared_model), dtype=compute_dtype(cfg.model.dtype, torch.device("cpu")))
        own = heldout_accuracy(engine, tok, arithmetic_problems("test", 16, cfg.data.arithmetic),
                               cfg.data.prompt_template, grader, cfg.rollout.max_new_tokens, **eval_settings(cfg))
    assert record["accuracy"] == own
    # fewer held-out problems: another number, computed by the run itself
    c = train(quick_cfg("trainer.run_name=share_c", *OVER, "trainer.eval_problems=8"))
    assert c["step0_eval_shared"]["reused"] is False and c["step0_eval_shared"]["file"] != record_file
    # a record that is not this code's (cut short by hand) is computed again, not trusted
    Path(record_file).write_text("{\"accuracy\": ")
    d = train(quick_cfg("trainer.run_name=share_d", *OVER))
    assert d["step0_eval_shared"]["reused"] is False and _step0(d) == record["accuracy"]
    assert json.loads(Path(record_file).read_text())["run"] == "share_d"


def test_two_evaluations_at_once_compute_it_once(quick_cfg, prepared_model, tmp_path):
    """Two held-out evaluators of one warm start at the same moment (as 16 study runs reach step 0 together):
    the file lock lets one compute; the other waits and reads its number."""
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
        assert evaluators[0].shared_file == evaluators[1].shared_file is not None

        def run(i: int) -> None:
            out = evaluators[i].evaluate(None, StartWeights(), 0)  # eval_through_rollout off below: no rollout
            results[i] = (out["eval/accuracy_unquantized"], evaluators[i].step0_shared)

        for h in evaluators:
            h.through_rollout, h.deployed_every = False, 0
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for h in evaluators:
            h.close()
    assert results[0][0] == results[1][0]
    assert sorted(r[1]["reused"] for r in results.values()) == [False, True]
