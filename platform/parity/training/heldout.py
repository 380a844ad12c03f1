"""Held-out accuracy of the current policy on the arithmetic test split (greedy, graded by math-verify)."""

from __future__ import annotations

from typing import Any

from parity.data.arithmetic import Problem
from parity.data.prompts import render_prompt
from parity.rollout.base import Engine, SamplingSpec


def heldout_accuracy(engine: Engine, tok: Any, problems: list[Problem], template: str, grader: Any,
                     max_new_tokens: int, batch_size: int = 128) -> float:
    correct = 0.0
    for s in range(0, len(problems), batch_size):
        chunk = problems[s:s + batch_size]
        ids = [tok(render_prompt(template, p.problem))["input_ids"] for p in chunk]
        batch = engine.generate(ids, SamplingSpec(temperature=0.0, max_new_tokens=max_new_tokens, n=1))
        texts = tok.batch_decode(batch.responses, skip_special_tokens=True)
        scores = grader.grade(texts, [p.answer for p in chunk], batch.truncated.tolist())
        correct += float(scores.sum())
    return correct / max(1, len(problems))
