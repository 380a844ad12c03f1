"""Parity: RL post-training with low-precision rollouts and training/inference mismatch correction."""

import os

__version__ = "0.1.0"

# On some CPUs (Intel's AVX512 Xeons) MKL picks a matrix product's kernel by its row count, so a row's result would
# depend on how many rows shared the call: a rollout split over Ray workers or CPU lanes would differ from one call
# in the last bit. Strict conditional numerical reproducibility keeps each row's result its own, on the CPU's fastest
# code path (cost measured in docs/PERFORMANCE.md). MKL reads it at its first call, so it is set before any.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
