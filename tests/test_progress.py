"""The progress lines of the long loops (parity.core.progress), on a clock the test moves: their format with the
rate and the ETA, and the throttle (a line a tenth of the work, or after `every_s` seconds without one, and one
at the end). That the warm start's, the RL steps' and the evaluation's lines reach the terminal watching a flow
run is checked on the real server (tests/test_prefect_artifacts.py)."""

from __future__ import annotations

import logging

import pytest

from parity.core.progress import LOGGER, Progress, duration


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def lines():
    """What the logger `parity.progress` writes at INFO."""
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    lg, h = logging.getLogger(LOGGER), Keep()
    before = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    yield got
    lg.removeHandler(h)
    lg.setLevel(before)


def test_duration():
    assert [duration(s) for s in (0, 12.4, 59.6, 245, 3599, 3725)] == ["0s", "12s", "1m00s", "4m05s", "59m59s",
                                                                        "1h02m"]


def test_a_line_a_tenth_with_rate_and_eta(lines):
    clock = Clock()
    bar = Progress("warm start", 700, clock=clock)
    for step in range(700):
        clock.t += 0.25  # a tenth (70 steps) in 17.5 s, under every_s = 30 s: a line a tenth
        bar.update(1, loss=f"{1.0 - step / 1000:.3f}")
    assert len(lines) == 10
    assert lines[0] == "warm start: 70/700 steps (10%), ETA 2m38s, 4.00 steps/s, 18s elapsed, loss 0.931"
    assert lines[4] == "warm start: 350/700 steps (50%), ETA 1m28s, 4.00 steps/s, 1m28s elapsed, loss 0.651"
    assert lines[-1] == "warm start: 700/700 steps (100%), done, 4.00 steps/s, 2m55s elapsed, loss 0.301"


def test_slow_tenths_get_a_line_every_every_s(lines):
    """A tenth of 35 s: a line every 30 s instead, and none for a tenth done within 15 s after one (no two lines
    5 s apart); a rate under one a second is written as seconds a step."""
    clock = Clock()
    bar = Progress("train", 700, clock=clock)
    written = []
    for _ in range(700):
        clock.t += 0.5
        if bar.update(1) is not None:
            written.append(bar.done)
    assert lines[0] == "train: 60/700 steps (9%), ETA 5m20s, 2.00 steps/s, 30s elapsed"
    gaps = [(b - a) * 0.5 for a, b in zip([0, *written], written[:-1])]  # seconds between lines, the last aside
    assert written[-1] == 700 and all(15 <= g <= 30 for g in gaps), written
    assert written[:5] == [60, 120, 180, 210, 270]  # 210: a tenth 15 s after the time line at 180

    lines.clear()
    slow = Progress("evaluate", 40, "problem", clock=clock)
    for _ in range(10):
        clock.t += 8.0
        slow.update(4)
    assert lines[0] == "evaluate: 4/40 problems (10%), ETA 1m12s, 2.0 s/problem, 8s elapsed"
    assert len(lines) == 10


def test_a_resumed_loop_rates_only_its_own_steps(lines):
    clock = Clock()
    bar = Progress("train", 100, initial=50, clock=clock)
    for _ in range(50):
        clock.t += 1.0
        bar.update(1, reward="0.500")
    # 10 steps in 10 s since this process started: 1 step/s, 40 left
    assert lines[0] == "train: 60/100 steps (60%), ETA 40s, 1.00 steps/s, 10s elapsed, reward 0.500"
    assert lines[-1] == "train: 100/100 steps (100%), done, 1.00 steps/s, 50s elapsed, reward 0.500"
    assert len(lines) == 5
