"""Parity: RL post-training with low-precision rollouts and training/inference mismatch correction."""

__version__ = "0.1.0"
