"""Imported by the grader pool's forkserver: workers fork from a process with math-verify warm."""

from parity.rewards.mathverify import warm_up

warm_up()
