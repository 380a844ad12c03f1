"""The default mismatch tolerance c, read by the config schema (`algorithm.correction.tolerance`) and by the
correction stack (a tolerance left null); a module of its own so that neither imports the other."""

# DC-GRPO's tolerance for Qwen3-8B (arXiv 2606.08779)
DEFAULT_TOLERANCE = 0.0037
