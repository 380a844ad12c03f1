"""A short RL run (2 steps) of the real loop with vLLM as the rollout engine: it completes, syncs weights each
step and logs the mismatch telemetry between the trainer and vLLM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")


def test_two_step_rl_run_with_vllm_logs_mismatch(quick_cfg, prepared_model):
    from parity.commands.train import train

    cfg = quick_cfg("rollout.name=vllm", "trainer.run_name=vllm_quick")
    summary = train(cfg)
    assert summary["engine"]["engine"] == "vllm" and summary["engine"]["weight_sync"] == "reload"
    rows = [json.loads(ln) for ln in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        d = r["mismatch/abs_prob_diff_mean"]
        print(f"step {r['step']}: vLLM vs trainer mean |p diff| {d:.2e}, k3 {r['mismatch/k3_kl']:.2e}, "
              f"sync {r['perf/sync_s']:.3f} s, rollout {r['perf/rollout_tokens_per_s']:.0f} tok/s")
        assert math.isfinite(d) and d < 0.01  # the engine runs the trainer's (BF16-synced) weights
        assert r["perf/sync_s"] > 0 and r["mismatch/tokens"] > 0
    assert summary["latest_checkpoint"] is not None
