"""Arithmetic task and dataset loading."""

from __future__ import annotations

import pytest

from parity.config import load_config
from parity.data.arithmetic import ArithmeticStream, arithmetic_problems
from parity.data.prompts import load_jsonl_problems
from parity.errors import DataError


def test_arithmetic_is_deterministic_and_splits_are_disjoint():
    cfg = load_config(['data.arithmetic.ops=["+","-","*"]', "data.arithmetic.max_level=3"]).data.arithmetic
    test = arithmetic_problems("test", 200, cfg)
    assert test == arithmetic_problems("test", 200, cfg)
    train = ArithmeticStream(cfg).take(3000)
    assert not {p.problem for p in test} & {p.problem for p in train}
    for p in test[:50] + train[:50]:
        assert int(p.answer) == eval(p.problem, {"__builtins__": {}})  # noqa: S307 -- our own generated text
    ops = {op for p in train for op in "+-*" if op in p.problem[1:]}
    assert ops == {"+", "-", "*"}


def test_default_task_is_two_digit_addition_and_subtraction():
    cfg = load_config([]).data.arithmetic
    train = ArithmeticStream(cfg).take(500)
    assert {op for p in train for op in "+-*" if op in p.problem[1:]} == {"+", "-"}
    assert max(len(t.lstrip("-")) for p in train for t in p.problem[1:].replace("-", "+").split("+")) == 2


def test_teacher_slip_is_systematic_and_rate_controlled():
    import random

    from parity.training.sft import teacher_answer

    rng = random.Random(0)
    outs = [teacher_answer("-129", "last_digit", 0.6, rng) for _ in range(2000)]
    assert set(outs) == {"-129", "-120"}
    assert abs(outs.count("-120") / len(outs) - 0.6) < 0.04
    assert teacher_answer("57", "drop_sign", 1.0, rng) == "57" and teacher_answer("-57", "drop_sign", 1.0, rng) == "57"
    assert teacher_answer("57", "last_digit", 0.0, rng) == "57"
    with pytest.raises(ValueError, match="model.warm_start.teacher_error"):
        teacher_answer("5", "typo", 1.0, rng)


def test_stream_resumes_at_its_position():
    cfg = load_config([]).data.arithmetic
    a = ArithmeticStream(cfg)
    a.take(10)
    b = ArithmeticStream(cfg)
    b.load_state_dict(a.state_dict())
    assert a.take(5) == b.take(5)


def test_row_without_answer_names_file_and_row(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    with pytest.raises(DataError, match=r"d.jsonl: row 2 has no answer"):
        load_jsonl_problems(f, "problem", "answer", skip_missing_answers=False)


@pytest.mark.parametrize("content,match", [
    (b'{"problem": "1+1", "answer": "2"}\n{"problem": \n', "row 2 is not valid JSON"),
    (b'{"problem": "\xff\xfe", "answer": "2"}\n', "row 1 is not valid UTF-8"),
    (b"", "empty"),
])
def test_malformed_files_give_clear_errors(tmp_path, content, match):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_jsonl_problems(f, "problem", "answer", skip_missing_answers=False)


def test_math_train_drops_rows_without_answers():
    from pathlib import Path

    path = Path(load_config([]).data.datasets_dir) / "math_train" / "train.jsonl"
    problems, dropped = load_jsonl_problems(path, "problem", "answer", skip_missing_answers=True)
    assert dropped == 4 and len(problems) == 7474 - 4
