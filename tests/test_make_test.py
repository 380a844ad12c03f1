"""`make test`'s two passes: the second (bfloat16) runs even when the first fails, and the target fails when
either pass failed. Real make and real pytest on small test files written here (TESTS and DTYPE_TESTS name them)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO

PASSES = "def test_ok():\n    pass\n"
FAILS = "def test_broken():\n    assert False, 'broken on purpose'\n"
# the second pass computes in bfloat16 whatever the CPU: both the pinned quick settings and model.dtype=auto
BF16 = ("import os\n\ndef test_bf16_pass():\n"
        "    assert os.environ['PARITY_TEST_DTYPE'] == os.environ['PARITY_AUTO_DTYPE'] == 'bfloat16'\n")


def _make_test(tmp_path, first: str, second: str) -> subprocess.CompletedProcess[str]:
    files = []
    for name, body in (("test_first.py", first), ("test_second.py", second)):
        (tmp_path / name).write_text(body)
        files.append(str(tmp_path / name))
    args = ["make", "-s", "-o", ".venv/.stamp", "test", f"TESTS={files[0]}", f"DTYPE_TESTS={files[1]}"]
    dry = subprocess.run([*args[:1], "-n", *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert files[0] in dry.stdout and " tests " not in dry.stdout, "make test must take its files from TESTS"
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("first", "second", "ok", "counts"), [
    (FAILS, BF16, False, ("1 failed", "1 passed")),
    (PASSES, FAILS, False, ("1 passed", "1 failed")),
    (PASSES, BF16, True, ("1 passed", "1 passed")),
])
def test_both_passes_run_and_either_failure_fails_the_target(tmp_path, first, second, ok, counts) -> None:
    out = _make_test(tmp_path, first, second)
    assert (out.returncode == 0) == ok, out.stdout + out.stderr
    summaries = [ln for ln in out.stdout.splitlines() if ln.lstrip("= ").startswith(("1 passed", "1 failed"))]
    assert [s.lstrip("= ").split(" in ")[0] for s in summaries] == list(counts), out.stdout
    first_rc, second_rc = (0 if c == "1 passed" else 1 for c in counts)
    assert f"first pass ({tmp_path / 'test_first.py'}) exit {first_rc}; second pass" in out.stdout
    assert out.stdout.rstrip().endswith(f"exit {second_rc}")
