"""The repository speaks of the project: no text file it tracks (docs, code, comments, file names) refers to
work sessions, machines lent for a while, or numbered issues. A figure cites its date, hardware and command.

The phrases are specific so that the word "session" in its technical senses (a pytest session, an HTTP or
database session, `sqlalchemy.orm.Session`, a Ray session) and "issue" as a plain English word stay allowed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()

# (what it is, pattern); matched case-insensitively against each line and each tracked path
PATTERNS = [
    ("a numbered work session", r"\bsessions?[ _-]?\d+\b"),  # session 6, session-5's, sessions 3-4, session6
    ("a session-numbered file name", r"(?<![a-z0-9])s\d+_run\d|_s\d+_"),  # 2026-11-30_s6_run7..., ..._s4_bench
    ("a work session", r"\b(?:this|that|the same|an? earlier|an? later|a previous|the previous|the next|"
                       r"each|every|one|a new|a fresh) (?:work )?session\b(?!-?(?:wide|scoped|scope|fixture))"),
    ("a lent machine", r"\blent\b|\bmachine[- ]lending\b|\blending (?:a |the )?machines?\b"),
    ("machines withheld", r"\bmachines? (?:was|were) withheld\b"),
    ("a numbered issue", r"\bissue ?#?\d+\b|\bissues #\d+|\bissue-\d+\b|\(#\d+\)"),  # issue 12, (issue 4, item 4), issue #7
    ("an issue's text", r"\bthe issue(?:'s| asks| says| text| wants)\b"),
]
COMPILED = [(what, re.compile(p, re.IGNORECASE)) for what, p in PATTERNS]
# the technical senses of "session" that the work-session pattern must not take
ALLOWED = re.compile(r"\b(?:test|pytest|http|requests|db|database|sqlalchemy|orm|ray|browser|apptest|streamlit|"
                     r"websocket|devtools|chromium|tls|ssh|login|user|mlflow)[ -]session\b", re.IGNORECASE)


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"git ls-files failed in {REPO}: {e}")
    return [p for p in out.stdout.decode().split("\0") if p and p != SELF]


def _findings(name: str, text: str) -> list[str]:
    found = []
    for what, rx in COMPILED:
        for m in rx.finditer(name):
            found.append(f"{name}: file name: {what}: {m.group(0)!r}")
    for lineno, line in enumerate(text.splitlines(), 1):
        scrubbed = ALLOWED.sub(" ", line)
        for what, rx in COMPILED:
            for m in rx.finditer(scrubbed):
                found.append(f"{name}:{lineno}: {what}: {m.group(0)!r} in {line.strip()[:120]!r}")
    return found


def test_patterns_catch_the_phrases_and_spare_the_technical_senses() -> None:
    caught = ["session 6's two runs", "in session-5", "sessions 3-4", "2026-11-30_s6_run7_bench_final.json",
              "..._s4_bench_gpu_full.json", "the lent machine's 16 CPU cores", "each on a freshly lent machine",
              "issue 12", "(issue 4, item 4)", "issue #7", "the issue-4 pilot", "Goals of issue 12",
              "alternated in the same session", "the issue's anchor", "the multi-GPU machines were withheld"]
    spared = ["a session-wide outputs folder", "built once per test session", "one AppTest session",
              "with Session(engine) as s", "sqlalchemy.orm.Session", "scope=\"session\"", "an HTTP session",
              "servers of earlier tests in the same pytest session", "the issue is the summation order",
              "s5 = x", "ts_5_run", "issues of the grader", "the host issues 56 graph launches"]
    for text in caught:
        assert _findings("x.md", text), f"not caught: {text!r}"
    for text in spared:
        assert not _findings("x.md", text), f"caught, but technical: {text!r}: {_findings('x.md', text)}"


def test_tracked_text_speaks_of_the_project_only() -> None:
    findings = []
    for name in _tracked_files():
        path = REPO / name
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):  # binary, or listed but absent from this checkout
            text = ""
        findings += _findings(name, text)
    assert not findings, "wording about sessions, lent machines or issue numbers:\n" + "\n".join(findings[:60])
