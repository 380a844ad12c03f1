"""Grading one (response, reference) pair with math-verify, and the loop a grading worker runs.

This module is deliberately light (no torch): the grader pool's forkserver preloads it, so each
worker process is forked with math-verify, sympy and their caches already warm.

math-verify's own timeouts use signal.alarm with whole seconds and reset any outer alarm, so they
cannot be nested inside a per-item budget. We switch them off and arm one ITIMER_REAL per item
instead; its exception derives from BaseException so the `except Exception` clauses inside
math-verify and sympy cannot swallow it. Code stuck inside C (a huge integer power) does not see
the signal at all: the pool's hard deadline kills such a worker.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from parity.rewards.countdown import ANSWER_PREFIX as COUNTDOWN_PREFIX
from parity.rewards.countdown import check as check_countdown
from parity.rewards.countdown import decode_answer as decode_countdown
from parity.rewards.extract import last_boxed

# Statuses of a graded item. Only "correct" scores 1.0.
CORRECT = "correct"
WRONG = "wrong"
NO_ANSWER = "no_answer"  # the response has no (closed) \boxed{}
UNPARSABLE = "unparsable"  # the boxed content parses to nothing
BAD_GOLD = "bad_gold"  # the reference answer is empty or parses to nothing
TOO_LONG = "too_long"  # boxed content longer than max_answer_chars
TRUNCATED = "truncated"  # the response hit the length limit without EOS
TIMEOUT = "timeout"
CRASH = "crash"
ERROR = "error"  # math-verify raised (a bug on some input): scored 0, counted, the worker lives on


@dataclass(frozen=True)
class GradeResult:
    score: float  # 1.0 or 0.0
    extracted: str | None  # content of the response's last \boxed{}
    status: str  # one of the statuses above


class ItemTimeout(BaseException):
    """Raised by the per-item timer; a BaseException so library `except Exception` lets it through."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise ItemTimeout()


def _quiet_math_verify() -> None:
    # math-verify logs the full offending text on every timeout/failure (megabytes for a
    # pathological response) and warns once that its own timeouts are off: we report statuses instead.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)


def _mv():
    import math_verify

    return math_verify


def _parse_boxed(content: str) -> list:
    return _mv().parse("\\boxed{" + content + "}", parsing_timeout=None)  # type: ignore[arg-type]


@lru_cache(maxsize=8192)
def _parse_cached(content: str) -> tuple:
    # Cached: in RL a reference is graded G times per step and samples often agree on their answer;
    # parsed sympy objects are immutable, so sharing them is safe.
    return tuple(_parse_boxed(content))


def _grade_unprotected(response: str, answer: str, max_answer_chars: int) -> GradeResult:
    extracted = last_boxed(response)
    if extracted is None or not extracted.strip():
        return GradeResult(0.0, extracted, NO_ANSWER)
    if len(extracted) > max_answer_chars:
        return GradeResult(0.0, extracted, TOO_LONG)
    if answer is None or not str(answer).strip():
        return GradeResult(0.0, extracted, BAD_GOLD)
    if str(answer).startswith(COUNTDOWN_PREFIX):  # an expression to check, not a value to compare
        return _grade_countdown(extracted, str(answer))
    gold = _parse_cached(str(answer))
    if not gold:
        return GradeResult(0.0, extracted, BAD_GOLD)
    pred = list(_parse_cached(extracted))
    if not pred:
        return GradeResult(0.0, extracted, UNPARSABLE)
    ok = _mv().verify(list(gold), pred, timeout_seconds=None)  # type: ignore[arg-type]
    return GradeResult(1.0 if ok else 0.0, extracted, CORRECT if ok else WRONG)


def _grade_countdown(extracted: str, answer: str) -> GradeResult:
    try:
        numbers, target = decode_countdown(answer)
    except ValueError:
        return GradeResult(0.0, extracted, BAD_GOLD)
    ok, status = check_countdown(extracted, numbers, target)
    return GradeResult(1.0 if ok else 0.0, extracted, {"correct": CORRECT, "wrong": WRONG, "too_long": TOO_LONG}
                       .get(status, UNPARSABLE))


def grade_one(response: str, answer: str, timeout_s: float | None = 5.0,
              max_answer_chars: int = 4096) -> GradeResult:
    """Grade in this process. The timeout needs the main thread (signals); elsewhere it is ignored
    and the caller must bound the time itself (GraderPool does, with processes)."""
    _quiet_math_verify()
    _mv()  # the first import takes seconds: not part of the item's budget
    armed = bool(timeout_s) and threading.current_thread() is threading.main_thread()
    if armed:
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, float(timeout_s))  # type: ignore[arg-type]
    try:
        return _grade_unprotected(response, answer, max_answer_chars)
    except ItemTimeout:
        return GradeResult(0.0, last_boxed(response), TIMEOUT)
    except RecursionError:
        return GradeResult(0.0, last_boxed(response), UNPARSABLE)
    except Exception:
        return GradeResult(0.0, last_boxed(response), ERROR)
    finally:
        if armed:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, old)


def serve(conn: Any, timeout_s: float, max_answer_chars: int) -> None:
    """Worker loop: receive (job, response, answer), send (job, score, extracted, status).
    Exits on None or when the parent goes away (EOF)."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _quiet_math_verify()
    try:
        try:
            _mv()
        except Exception as e:  # a broken environment: no item could ever be graded, so say so once
            conn.send(("fatal", f"cannot import math-verify: {e!r}"))
            return
        # A fresh worker may still be importing; the pool starts an item's clock only after this.
        conn.send(("ready", os.getpid()))
    except (BrokenPipeError, OSError):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job, response, answer = msg
        r = grade_one(response, answer, timeout_s, max_answer_chars)
        try:
            conn.send((job, r.score, r.extracted, r.status))
        except (BrokenPipeError, OSError):
            return


def warm_up() -> None:
    """Import math-verify and fill its lazily built regexes/caches, so forked workers start warm."""
    _quiet_math_verify()
    gold = _parse_cached("\\frac{1}{2}")
    _mv().verify(list(gold), _parse_boxed("0.5"), timeout_seconds=None)  # type: ignore[arg-type]
