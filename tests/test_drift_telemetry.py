"""Drift telemetry against hand computations, the collapse alarm on synthetic reward series, the raw-reward
estimator, and tolerance=auto reading a validate report."""

from __future__ import annotations

import json
import math

import pytest
import torch

from parity.algorithms.advantages import compute_advantages
from parity.algorithms.drift import (
    advantage_length_stats,
    drift_metrics,
    length_stats,
    repeated_ngram_frac,
    sampled_entropy,
)
from parity.training.collapse import CollapseAlarm
from parity.types import RolloutBatch


def _batch(lengths: list[int], rewards: list[float], groups: list[int], logq: float = -0.5) -> RolloutBatch:
    R = max(lengths)
    mask = torch.tensor([[t < L for t in range(R)] for L in lengths])
    responses = torch.tensor([[(t % 3) + 1 for t in range(R)] for _ in lengths]) * mask
    return RolloutBatch(prompts=torch.ones(len(lengths), 1, dtype=torch.long),
                        prompt_mask=torch.ones(len(lengths), 1, dtype=torch.bool), responses=responses,
                        response_mask=mask, rollout_logprobs=torch.where(mask, logq, 0.0),
                        rewards=torch.tensor(rewards), truncated=torch.zeros(len(lengths), dtype=torch.bool),
                        group_ids=torch.tensor(groups), prompt_ids=torch.tensor(groups))


def test_token_weighted_advantage_and_covariance_by_hand() -> None:
    a, L = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.tensor([2, 6, 4, 4])
    out = advantage_length_stats(a, L)
    assert out["drift/adv_token_mean"] == pytest.approx((2 - 6 + 2 - 2) / 16)
    # means: A 0, L 4 -> cov = mean([1*-2, -1*2, 0.5*0, -0.5*0]) = -1
    assert out["drift/adv_length_cov"] == pytest.approx(-1.0)
    # one length in every group: the group-centred advantages weigh the tokens to exactly zero
    assert advantage_length_stats(torch.tensor([1.0, -1.0, 2.0, -2.0]), torch.tensor([3, 3, 5, 5]))[
        "drift/adv_token_mean"] == 0.0


def test_length_spread_entropy_and_repeats_by_hand() -> None:
    b = _batch([2, 6, 4, 4], [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1])
    out = length_stats(b.response_lengths(), b.group_ids, b.rewards)
    assert out["response/length_std"] == pytest.approx(math.sqrt((4 + 4 + 0 + 0) / 4))
    assert out["response/length_cv_within_group"] == pytest.approx((2 / 4 + 0 / 4) / 2)
    assert out["response/length_correct_mean"] == pytest.approx(3.0)
    assert out["response/length_incorrect_mean"] == pytest.approx(5.0)
    assert sampled_entropy(b.rollout_logprobs, b.response_mask) == pytest.approx(0.5)
    # tokens 1 2 3 1 2 3: 4-grams (1231) (2312) (3123) -> no repeat; 1 2 3 1 2 3 1 2 3 -> (1231)(2312)(3123)(1231)..
    toks = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3], [5, 5, 5, 5, 5, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[True] * 9, [True] * 5 + [False] * 4, [True] * 3 + [False] * 6])
    # row 0: 6 grams, the last 3 repeat the first 3 -> 0.5; row 1: (5555) twice -> 1/2; row 2: too short (left out)
    assert repeated_ngram_frac(toks, mask) == pytest.approx((0.5 + 0.5) / 2)
    full = drift_metrics(compute_advantages("grpo", b.rewards, b.group_ids), b)
    assert {"drift/adv_token_mean", "drift/adv_length_cov", "response/entropy", "response/repeat_4gram_frac",
            "response/length_cv_within_group"} <= set(full)


def test_raw_reward_advantages_are_the_rewards() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = compute_advantages("raw", r, torch.tensor([0, 0, 1, 1]))
    assert a.dtype == torch.float32 and torch.equal(a, r)


def test_collapse_alarm_on_synthetic_series() -> None:
    alarm = CollapseAlarm(fraction=0.5, patience=3)
    series = [0.2, 0.6, 0.8, 0.5, 0.39, 0.3, 0.41, 0.3, 0.2, 0.1, 0.9]
    flags = [alarm.update(i + 1, r) for i, r in enumerate(series)]
    # peak 0.8 at step 3; below 0.4 at steps 5, 6 (then 0.41 resets), 8, 9, 10 -> fires at step 10, stays on
    assert flags == [0.0] * 9 + [1.0, 1.0]
    assert alarm.fired_at == 10
    # never rewarded: nothing to collapse from; a steady run never fires
    zero = CollapseAlarm(0.5, 2)
    assert [zero.update(i, 0.0) for i in range(5)] == [0.0] * 5
    # the state is a function of the logged rewards: replay gives the same alarm
    again = CollapseAlarm(0.5, 3)
    again.replay([{"step": 0, "eval/accuracy": 0.3}] + [{"step": i + 1, "reward/mean": r} for i, r in enumerate(series[:9])])
    assert again.fired_at is None and again.update(10, 0.1) == 1.0 and again.fired_at == 10
    with pytest.raises(ValueError, match="trainer.collapse.patience"):
        CollapseAlarm(0.5, 0)


def test_tolerance_auto_reads_the_validate_report_of_the_same_precision(quick_cfg, tmp_path) -> None:
    from parity.config.schema import TinyModelConfig
    from parity.models.tiny import build_tiny_model
    from parity.precision.export import quantized_checkpoint_dir
    from parity.precision.validate import precision_record
    from parity.rollout import rollout_precision
    from parity.training.tolerance import tolerance_setting
    from parity.training.trainer import build_trainer

    overrides = ["+precision=w8a8_int8_kv_int4", "algorithm.correction.name=dual",
                 "algorithm.correction.tolerance=auto", "algorithm.correction.tolerance_multiple=2.0",
                 f"rollout.precision.export_dir={tmp_path}", "trainer.device=cpu"]
    cfg = quick_cfg(*overrides)
    model = build_tiny_model("qwen3", TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    # no report yet: measured over the first steps
    setting = tolerance_setting(cfg)
    t = build_trainer(model, cfg, torch.device("cpu"), measured_discrepancy=setting.measured)
    assert t.corrections.tolerance is None and setting.value is None and setting.source == "first 3 steps"
    report = quantized_checkpoint_dir(cfg, rollout_precision(cfg)) / "validation.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"metrics": {"abs_prob_diff_mean": 0.004}, "passed": True,
                                  "precision": precision_record(rollout_precision(cfg))}))
    setting = tolerance_setting(cfg)
    t = build_trainer(model, cfg, torch.device("cpu"), measured_discrepancy=setting.measured)
    assert t.corrections.tolerance == pytest.approx(0.008) and t.corrections.corrections[0].c == pytest.approx(0.008)
    assert setting.source == str(report) and setting.value == pytest.approx(0.008)
    # a report of another precision (no KV quantization) is not this rollout's
    report.write_text(json.dumps({"metrics": {"abs_prob_diff_mean": 0.004}, "passed": True,
                                  "precision": {"weights": "int8", "activations": "int8", "kv_cache": "bf16"}}))
    assert tolerance_setting(cfg).measured is None
    assert build_trainer(model, cfg, torch.device("cpu"), measured_discrepancy=None).corrections.tolerance is None
