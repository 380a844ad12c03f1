"""The reference experiments compose and validate; their quick variants and the MoE default run end to end."""

from __future__ import annotations

import pytest

from parity.commands.train import train
from parity.config import load_config
from parity.training.loop import MetricsLog

SEEDS = ["seed_qwen35_9b_int8_sc", "seed_dcgrpo_qwen3_8b", "seed_dcgrpo_qwen3_8b_fp8"]


@pytest.mark.parametrize("name", SEEDS)
def test_seed_presets_compose_and_validate(name):
    cfg = load_config([f"experiment={name}"])
    assert cfg.model.source == "hf" and cfg.rollout.name == "vllm"
    if name.startswith("seed_qwen35"):
        from parity.precision.config import resolve_precision
        p = resolve_precision(cfg)
        assert (p.weights, p.activations, p.kv_cache) == ("int8", "int8", "int4_per_token_head")
        assert cfg.algorithm.correction.name == "score_centering" and cfg.rollout.topk_logprobs == 128
        assert (cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.trainer.total_steps) == (32, 4, 200)
    else:
        d = cfg.algorithm.correction.dual
        assert cfg.algorithm.correction.name == "dual" and (d["c"], d["lambda0"], d["eta"]) == (0.0037, 0.1, 1.0)
        assert (cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.rollout.max_new_tokens) == (64, 8, 8192)
        assert list(cfg.trainer.betas) == [0.9, 0.95] and cfg.algorithm.clip_ratio_low == 0.24


@pytest.mark.parametrize("name,metric", [
    ("seed_qwen35_9b_int8_sc_quick", "correction/sc_term_abs"),
    ("seed_dcgrpo_qwen3_8b_quick", "correction/lambda"),
    ("arith_tiny_moe", "r3/routing_disagreement_replayed"),
])
def test_quick_variants_run_end_to_end(quick_cfg, name, metric):
    from pathlib import Path

    extra = ["trainer.total_steps=2"] if name == "arith_tiny_moe" else []
    cfg = quick_cfg(f"experiment={name}", f"trainer.run_name={name}", *extra)
    if name.startswith("seed"):  # the preset's own sizes, not the test's quick ones
        assert cfg.trainer.prompts_per_step in (2, 32, 64)
    summary = train(cfg)
    rows = MetricsLog(Path(summary["run_dir"]) / "metrics.jsonl").read()
    last = rows[-1]
    assert last["step"] == cfg.trainer.total_steps
    assert metric in last, sorted(last)
    if name == "arith_tiny_moe":  # replay forces exactly the rollout's experts
        assert last["r3/routing_disagreement_replayed"] == 0.0
    if name.startswith("seed_qwen35"):
        assert summary["engine"]["weights"] == "int8" and summary["engine"]["kv_cache"] == "int4_per_token_head"


@pytest.mark.parametrize("name", ["countdown_tiny", "countdown_gpu"])
def test_countdown_presets_run_end_to_end(quick_cfg, name):
    """The mismatch substrate's presets, shrunk to seconds (the 27 M GPU preset too, on the CPU), with the dial on."""
    from pathlib import Path

    cfg = quick_cfg(f"experiment={name}", f"trainer.run_name={name}", "model.tokenizer_corpus_size=300",
                    "model.warm_start.steps=4", "model.warm_start.batch_size=4", "model.warm_start.eval_problems=2",
                    "trainer.eval_problems=2", "rollout.max_new_tokens=24", "rollout.n=2", "trainer.total_steps=1",
                    "trainer.checkpoint_every=0", "rollout.precision.perturbation.sigma=0.05")
    assert cfg.data.name == "countdown" and cfg.model.tokenizer == "bpe"
    summary = train(cfg)
    last = MetricsLog(Path(summary["run_dir"]) / "metrics.jsonl").read()[-1]
    assert last["step"] == 1 and summary["collapse_step"] is None
    for key in ("drift/adv_token_mean", "drift/delta_cosine", "response/entropy", "train/collapsed",
                "mismatch/abs_prob_diff_mean"):
        assert key in last, key
    assert summary["engine"]["perturbation"]["sigma"] == 0.05
