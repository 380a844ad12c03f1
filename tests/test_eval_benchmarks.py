"""Benchmark loaders: row counts, each file's answer quirk, and one clear error per kind of bad input."""

import json
from pathlib import Path

import pytest

from parity.data.benchmarks import BENCHMARKS, load_benchmark, resolve_datasets_dir, strip_math_delimiters
from parity.errors import DataError

ROWS = {"aime24": 30, "aime25": 30, "amc23": 40, "math500": 500, "minerva_math": 272, "olympiadbench": 675}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_loads_with_nonempty_fields(name):
    problems = load_benchmark(name)
    assert len(problems) == ROWS[name]
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.problem.strip() and p.answer.strip() for p in problems)
    assert all(p.id.startswith(name + "/") for p in problems)


def test_answer_quirks():
    amc = load_benchmark("amc23")
    assert amc[0].answer == "27" and all("." not in p.answer for p in amc)  # 27.0 -> "27"
    assert {p.answer for p in amc} >= {"-1", "3159"}
    minerva = load_benchmark("minerva_math")
    assert minerva[5].answer == "np.arcsin(10/13)"  # the last box of the solution, verbatim
    assert minerva[86].answer == "I(0) e^{-\\frac{t}{R C}}"  # box ending with a newline, stripped
    ob = {p.id: p for p in load_benchmark("olympiadbench")}
    assert ob["olympiadbench/1970"].answer == "(-\\infty, 0) \\cup\\{1\\}"  # `$...$.` unwrapped
    assert not any(p.answer.startswith("$") or p.answer.endswith("$") for p in ob.values())
    assert ob["olympiadbench/1606"].problem.startswith("Xenia and Sergey")  # problem text from `question`
    aime25 = load_benchmark("aime25")
    assert aime25[0].id == "aime25/2025-I-1" and aime25[0].answer == "70"


def test_limit_and_arithmetic():
    assert [p.id for p in load_benchmark("math500", limit=3)] == [p.id for p in load_benchmark("math500")[:3]]
    from types import SimpleNamespace

    arith = SimpleNamespace(ops=["+", "-", "*"], min_level=1, max_level=3, n_test=50, seed=1234)
    probs = load_benchmark("arithmetic", arithmetic_cfg=arith)
    assert len(probs) == 50 and all(str(int(p.answer)) == p.answer for p in probs)
    assert len(load_benchmark("arithmetic", arithmetic_cfg=arith, limit=7)) == 7
    with pytest.raises(DataError, match="data.arithmetic"):
        load_benchmark("arithmetic")


def test_strip_math_delimiters():
    assert strip_math_delimiters("$x$") == "x"
    assert strip_math_delimiters(" $(0, 1]$. ") == "(0, 1]"
    assert strip_math_delimiters("221,$8") == "221,$8"  # inner $ kept (Qwen's strip does the same)


def _write(root: Path, name: str, lines: list[bytes]) -> Path:
    path = root / BENCHMARKS[name].file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _row(**kw) -> bytes:
    return json.dumps(kw).encode()


@pytest.mark.parametrize(("name", "lines", "match"), [
    ("aime24", [_row(id=1, problem="p", answer="1"), b"{not json"], r"test.jsonl: row 2 is not valid JSON"),
    ("aime24", [_row(id=1, problem="p", answer="1"), b'{"problem": "\xff\xfe", "answer": "1"}'],
     r"row 2 is not valid UTF-8"),
    ("aime24", [_row(id=1, problem="p")], r"row 1: missing field `answer`"),
    ("aime24", [_row(id=1, answer="3")], r"row 1: missing field `problem`"),
    ("aime24", [_row(id=1, problem="p", answer="")], r"row 1: field `answer` must be a non-empty string"),
    ("aime24", [b"   "], r"dataset is empty"),
    ("aime24", [_row(id=1, problem="p", answer="1"), _row(id=1, problem="q", answer="2")], r"duplicate problem id"),
    ("amc23", [_row(id=0, problem="p", answer=True)], r"row 1: field `answer` is a boolean"),
    ("amc23", [_row(id=0, problem="p", answer=[1])], r"row 1: field `answer` must be a number"),
    ("minerva_math", [_row(idx=0, problem="p", solution="so 4")], r"row 1: field `solution` has no closed"),
    ("minerva_math", [_row(idx=0, problem="p", solution="\\boxed{4")], r"row 1: field `solution` has no closed"),
    ("olympiadbench", [_row(id=0, question="q", final_answer=[])], r"row 1: field `final_answer` must be"),
    ("olympiadbench", [_row(id=0, question="q", final_answer=["$$"])], r"row 1: field `final_answer` must be"),
    ("olympiadbench", [_row(id=0, problem="q", final_answer=["1"])], r"row 1: missing field `question`"),
])
def test_bad_rows_name_file_and_row(tmp_path, name, lines, match):
    path = _write(tmp_path, name, lines)
    with pytest.raises(DataError, match=match) as e:
        load_benchmark(name, datasets_dir=tmp_path)
    assert str(path) in str(e.value)


def test_missing_file_unknown_benchmark_and_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"aime25/test.jsonl.*datasets_dir"):
        load_benchmark("aime25", datasets_dir=tmp_path)
    with pytest.raises(DataError, match=r"unknown benchmark 'aime26'; known: aime24"):
        load_benchmark("aime26")
    with pytest.raises(DataError, match="eval.source"):
        load_benchmark("aime24", source="s3")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match=r"source=hub needs the `datasets` package"):
            load_benchmark("aime24", source="hub")


def test_datasets_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("PARITY_DATASETS", str(tmp_path))
    assert resolve_datasets_dir(None) == tmp_path.resolve()
    assert resolve_datasets_dir(str(tmp_path / "x")) == (tmp_path / "x").resolve()
    monkeypatch.delenv("PARITY_DATASETS")
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)  # a relative default is found from the repo, not the working directory
    assert resolve_datasets_dir(None) == (repo / "../shared/datasets").resolve()
