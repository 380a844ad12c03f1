"""last_boxed: brace matching, escapes, the last box wins, and linear time on hostile input."""

import time

import pytest

from parity.rewards.extract import last_boxed


@pytest.mark.parametrize(("text", "expected"), [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are literal, not grouping
    ("\\boxed{(-\\infty, 0) \\cup\\{1\\}}", "(-\\infty, 0) \\cup\\{1\\}"),
    ("\\fbox{7}", "7"),
    ("\\boxed{3} and \\fbox{4}", "4"),
    ("\\fbox{4} and \\boxed{3}", "3"),
    ("$\\boxed 5$", "5"),
    ("\\boxed {12}", "12"),
    ("\\boxed{\\boxed{9}}", "9"),
    ("\\boxed{a}\\boxedfoo{b}", "a"),  # a longer macro name is not a box
    ("\\boxed{x \\\\ y}", "x \\\\ y"),  # an escaped backslash does not escape the brace after it
    ("\\boxed{}", ""),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text", ["", "no box here", "\\boxed{unclosed", "\\boxed", "\\boxed{1} \\boxed{2"])
def test_last_boxed_none(text):
    assert last_boxed(text) is None


@pytest.mark.parametrize("text", [
    "{" * 1_000_000,
    "\\boxed{" + "{" * 1_000_000,  # never closes
    "\\boxed{" * 200_000,
    "\\boxed{" + "{" * 500_000 + "}" * 500_001,
    "\\boxedx" * 200_000,
])
def test_last_boxed_huge_input_is_fast(text):
    t = time.perf_counter()
    last_boxed(text)
    assert time.perf_counter() - t < 2.0
