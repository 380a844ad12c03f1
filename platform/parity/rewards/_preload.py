"""Imported by the grader pool's forkserver: workers fork from a process with math-verify warm."""

import gc

from parity.rewards.mathverify import warm_up

warm_up()
# Forked workers share the preloaded modules' pages copy-on-write; keeping the collector off those
# objects stops each worker's first collections from writing to (and so copying) all of them.
gc.freeze()
