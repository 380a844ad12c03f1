"""Bad inputs: malformed datasets through the train command, responses that attack the grader, bad
configs; each gives one clear error or a zero score. docs/RELIABILITY.md maps every case to its test."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.commands.train import train

# ---------------------------------------------------------------- bad inputs: datasets, grader attacks, configs


def _jsonl(rows: list[bytes]) -> bytes:
    return b"\n".join(rows) + b"\n"


@pytest.mark.parametrize(("content", "match"), [
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"problem": "2+2", "answer": ']), r"row 2 is not valid JSON"),
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"question": "2+2", "answer": "4"}']),
     r"row 2 has no string field `problem`"),
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"problem": "2+2"}']), r"row 2 has no answer in field `answer`"),
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"problem": "\xff\xfe2", "answer": "4"}']),
     r"row 2 is not valid UTF-8"),
    (_jsonl([b'["1+1", "2"]']), r"row 1 is not a JSON object"),
    (b"\n  \n", r"dataset is empty"),
], ids=["malformed", "missing_problem", "missing_answer", "non_utf8", "not_an_object", "empty"])
def test_bad_training_dataset_is_one_clear_error_naming_file_and_row(quick_cfg, prepared_model, tmp_path, content,
                                                                     match):
    from parity.errors import DataError

    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as e:
        train(quick_cfg("trainer.run_name=bad-data", "data.name=jsonl", f"data.path={path}"))
    assert str(e.value).startswith(f"{path}: ")
    run = Path(quick_cfg().outputs_dir) / "runs" / "bad-data"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()  # failed before step 0


ATTACKS = {  # boxed answers a policy can emit: each must score 0 within the per-item budget, none may hang
    "deep_parentheses": "\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}",
    "deep_left_right": "\\boxed{" + "\\left(" * 290 + "1" + "\\right)" * 290 + "}",
    "deep_abs": "\\boxed{" + "|" * 2000 + "5" + "|" * 2000 + "}",
    "exponent_tower": "\\boxed{" + "2^{" * 800 + "2" + "}" * 800 + "}",
    "huge_factorial": "\\boxed{(10^{10})!}",
    "huge_float_exponent": "\\boxed{1e999999999}",
    "million_digits": "\\boxed{" + "9" * 1_000_000 + "}",
    "megabyte_of_braces": "\\boxed{" + "{" * 500_000 + "}" * 500_000 + "}",
    "hundred_thousand_boxes": "\\boxed{1}" * 100_000,
    "big_matrix": "\\boxed{\\begin{pmatrix}" + "\\\\".join(["&".join(["x"] * 60)] * 60) + "\\end{pmatrix}}",
}


def test_grader_attacks_score_zero_within_the_timeout_and_run_no_code(tmp_path):
    import os
    import time

    from parity.rewards.grader import GraderPool

    timeout, grace = 2.0, 0.5
    marker = tmp_path / "pwned"
    code = {  # model output that is Python: graded as math, never run
        "import_os": f"\\boxed{{__import__('os').system('touch {marker}')}}",
        "exec": f"\\boxed{{exec(\"open('{marker}', 'w')\")}}",
        "eval_open": f"\\boxed{{eval(\"open('{marker}', 'w')\")}}",
        "sympy_lambda": f"\\boxed{{Lambda(x, __import__('os').system('touch {marker}'))(1)}}",
        "dunder_walk": "\\boxed{().__class__.__bases__[0].__subclasses__()}",
        "plain_text": f"__import__('os').system('touch {marker}') so \\boxed{{4}}",
    }
    items = {**ATTACKS, **code}
    with GraderPool(workers=2, timeout_s=timeout, kill_grace_s=grace) as pool:
        pool.wait_ready()
        t0 = time.monotonic()
        res = pool.grade_detailed(list(items.values()) + ["\\boxed{5}"], ["5"] * (len(items) + 1))
        elapsed = time.monotonic() - t0
    status = {n: r.status for n, r in zip(items, res)}
    assert [r.score for r in res] == [0.0] * len(items) + [1.0], status  # the control item still grades right
    assert status["exponent_tower"] == status["huge_factorial"] == "timeout", status
    assert status["million_digits"] == status["megabyte_of_braces"] == "too_long", status
    slow = sum(r.status == "timeout" for r in res)
    assert elapsed < (slow / 2 + 2) * (timeout + grace) + 5.0, (elapsed, status)  # 2 workers, bounded items
    assert not marker.exists() and not os.path.exists("pwned")


@pytest.mark.parametrize(("overrides", "key"), [
    (["trainer.lr=fast"], "trainer.lr"),  # wrong types
    (["trainer.total_steps=1.5"], "trainer.total_steps"),
    (["rollout.n=[4]"], "rollout.n"),
    (["trainer.resume=perhaps"], "trainer.resume"),
    (["trainer.lr=-1e-4"], "trainer.lr"),  # out of range
    (["trainer.lr=0"], "trainer.lr"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["trainer.max_bad_steps=0"], "trainer.max_bad_steps"),
    (["trainer.compile_mode=max-autotune"], "trainer.compile_mode"),
    (["model.tiny.vocab_size=99", "rollout.topk_logprobs=128"], "rollout.topk_logprobs"),  # top-K above vocab
    (["rollout.topk_logprobs=-1"], "rollout.topk_logprobs"),
    (["algorithm.correction.name=score_centering", "algorithm.policy_loss=ppo_clip", "rollout.topk_logprobs=8"],
     "algorithm.policy_loss"),  # conflicting options
    (["algorithm.correction.name=score_centering", "algorithm.policy_loss=reinforce", "rollout.topk_logprobs=0"],
     "rollout.topk_logprobs"),
    (["algorithm.correction.name=tis+icepop"], "algorithm.correction.name"),
    (["algorithm.routing_replay=true"], "algorithm.routing_replay"),
    (["algorithm.correction.name=nope"], "algorithm.correction.name"),
    (["trainer.nope=1"], "nope"),  # unknown key
])
def test_bad_config_is_one_clear_error_naming_the_key(overrides, key):
    from hydra.errors import ConfigCompositionException

    from parity.config import ConfigError, load_config

    with pytest.raises((ConfigCompositionException, ConfigError)) as e:
        load_config(overrides)
    msg = f"{e.value} {e.value.__cause__ or ''}"
    assert key in msg, msg
