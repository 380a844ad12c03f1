"""Held-out accuracy of the current policy on the task's test split, graded like the rewards.

Greedy by default (`trainer.eval_temperature=0`). A task whose responses are searches (Countdown) is better
measured sampled: greedy decoding of a search trace repeats its likeliest attempt until the length limit, so
`trainer.eval_temperature=1` with `trainer.eval_samples=k` reports the mean over k samples a problem."""

from __future__ import annotations

from typing import Any

from parity.data.arithmetic import Problem
from parity.data.prompts import render_prompt
from parity.rollout.base import Engine, SamplingSpec


def heldout_accuracy(engine: Engine, tok: Any, problems: list[Problem], template: str, grader: Any,
                     max_new_tokens: int, batch_size: int = 128, temperature: float = 0.0, samples: int = 1,
                     seed: int = 0) -> float:
    """Mean score over `problems` x `samples` responses (greedy when temperature is 0; then one sample)."""
    samples = 1 if temperature == 0.0 else max(1, int(samples))
    per_call = max(1, batch_size // samples)
    correct = 0.0
    for s in range(0, len(problems), per_call):
        chunk = problems[s:s + per_call]
        ids = [tok(render_prompt(template, p.problem))["input_ids"] for p in chunk]
        spec = SamplingSpec(temperature=temperature, max_new_tokens=max_new_tokens, n=samples, seed=seed)
        batch = engine.generate(ids, spec, prompt_ids=list(range(s, s + len(chunk))))
        texts = tok.batch_decode(batch.responses, skip_special_tokens=True)
        scores = grader.grade(texts, [chunk[int(g)].answer for g in batch.group_ids], batch.truncated.tolist())
        correct += float(scores.sum())
    return correct / max(1, len(problems) * samples)


def eval_settings(cfg: Any) -> dict:
    """heldout_accuracy's sampling keywords from trainer.eval_temperature / eval_samples."""
    return {"temperature": float(cfg.trainer.eval_temperature), "samples": int(cfg.trainer.eval_samples),
            "seed": int(cfg.trainer.seed) + 7}
