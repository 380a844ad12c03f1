"""`python -m parity grade --response TEXT --answer TEXT`: grade one response with math-verify.

Prints {"score": 0 or 1, "extracted": <content of the response's last \\boxed{}>, "status": ...}.
Runs in this process's main thread, under the same per-item timeout as the grading pool."""

from __future__ import annotations

import argparse

from parity.rewards.mathverify import grade_one

EXAMPLES = ["python -m parity grade --response 'so \\boxed{42}' --answer 42"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parity grade",
                                description="Grade a response's last \\boxed{} against a reference answer.")
    p.add_argument("--response", required=True, help="model response; its last \\boxed{...} is graded")
    p.add_argument("--answer", required=True, help="reference answer (LaTeX, without \\boxed)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds before the item scores 0")
    return p


def main(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")

    r = grade_one(args.response, args.answer, timeout_s=args.timeout)
    return {"score": int(r.score), "extracted": r.extracted, "status": r.status}
