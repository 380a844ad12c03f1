"""The training task behind `data.name`: where train prompts come from, the held-out test split, and the
warm-start teacher of the embedded model.

    arithmetic   synthetic +/- (and *) problems, answers `\\boxed{n}` (parity.data.arithmetic)
    countdown    reach a target from given numbers; worked solutions are search traces of varying length
                 (parity.data.countdown)
    math_train   the MATH training set from data.datasets_dir (no generator: no teacher, no test split of its
    jsonl        own; the arithmetic generator stands in for the embedded model's warm start and held-out set)

A synthetic task owns its generator's config section (`data.<name>`) and is deterministic in it."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.config import as_plain
from parity.data.arithmetic import ArithmeticStream, Problem, arithmetic_problems, teacher_answer
from parity.data.countdown import CountdownStream, Rules, countdown_demonstration, countdown_problems, rules
from parity.errors import DataError

if TYPE_CHECKING:
    from parity.config.schema import (
        ArithmeticConfig,
        CountdownConfig,
        DataConfig,
        ParityConfig,
        WarmStartConfig,
    )

SYNTHETIC = ("arithmetic", "countdown")
KNOWN = (*SYNTHETIC, "math_train", "jsonl")


@dataclass(frozen=True)
class SyntheticTask:
    """A generated task: its train stream, its disjoint test split and its warm-start teacher."""

    name: str
    cfg: ArithmeticConfig | CountdownConfig  # data.<name>
    teacher: WarmStartConfig | None = None  # model.warm_start (teacher_error / teacher_error_rate of arithmetic)

    @functools.cached_property
    def _rules(self) -> Rules:  # data.countdown as plain values (read for every demonstration)
        return rules(self.cfg)

    def stream(self, seed: int = 0) -> ArithmeticStream | CountdownStream:
        return (CountdownStream if self.name == "countdown" else ArithmeticStream)(self.cfg, seed=seed)

    def test_problems(self, n: int, seed_offset: int = 0) -> list[Problem]:
        fn = countdown_problems if self.name == "countdown" else arithmetic_problems
        return fn("test", n, self.cfg, seed_offset=seed_offset)

    def demonstration(self, p: Problem, rng: random.Random) -> str:
        """The teacher's response to `p` (without EOS): what the warm start imitates."""
        if self.name == "countdown":
            return countdown_demonstration(p, self._rules, rng).text
        kind = "none" if self.teacher is None else str(self.teacher.teacher_error)
        rate = 0.0 if self.teacher is None else float(self.teacher.teacher_error_rate)
        return f"\\boxed{{{teacher_answer(p.answer, kind, rate, rng)}}}"

    def config_payload(self) -> dict:
        """What of the task determines a warm-started model (part of the prepared model's cache key)."""
        return {"task": self.name, self.name: as_plain(self.cfg)}


def synthetic_task(data_cfg: DataConfig, warm_start: WarmStartConfig | None = None) -> SyntheticTask:
    """The task that generates the embedded model's warm start and held-out problems: data.name when it is a
    generator, else arithmetic (a dataset such as math_train brings no teacher and no test split)."""
    name = str(data_cfg.name)
    if name not in KNOWN:
        raise DataError(f"config key `data.name`: unknown dataset {name!r}; known: {', '.join(KNOWN)}")
    name = name if name in SYNTHETIC else "arithmetic"
    return SyntheticTask(name, getattr(data_cfg, name), warm_start)


def heldout_problems(cfg: ParityConfig, n: int) -> list[Problem]:
    """The held-out problems a run's `eval/accuracy` is measured on (the task's disjoint test split)."""
    return synthetic_task(cfg.data).test_problems(n)
