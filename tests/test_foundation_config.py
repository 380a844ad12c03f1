"""Config tree: presets compose, the schema rejects unknown keys and wrong types naming the key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from parity.config import ConfigError, load_config


def _compose_error(overrides: list[str]) -> str:
    with pytest.raises((ConfigCompositionException, ConfigError, Exception)) as ei:
        load_config(overrides)
    e = ei.value
    return f"{e} {e.__cause__ or ''}"


def test_default_is_arith_tiny():
    cfg = load_config([])
    assert cfg.experiment_name == "arith_tiny"
    assert cfg.model.arch == "qwen3" and cfg.rollout.name == "torch"


def test_unknown_key_names_the_key():
    msg = _compose_error(["trainer.lrr=0.1"])
    assert "lrr" in msg


def test_removed_dtype_key_is_refused_with_its_new_spelling(tmp_path):
    """`rollout.dtype` had no reader: on the command line or in a config file, the error names it and model.dtype."""
    for ov in (["rollout.dtype=bfloat16"], ["+rollout.dtype=bfloat16"]):
        with pytest.raises(ConfigError, match=r"`rollout\.dtype` was removed.*`model\.dtype`"):
            load_config(ov)
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\nrollout:\n  dtype: bfloat16\n")
    with pytest.raises(ConfigError, match=r"experiment/old.*`rollout\.dtype` was removed.*`model\.dtype`"):
        load_config(["experiment=old"], extra_config_dir=str(tmp_path))


def test_seed_block_dtype_loads_verbatim_and_model_dtype_decides():
    """The seed block's dtype is accepted (the block loads verbatim) and not read: model.dtype is the dtype."""
    cfg = load_config(["experiment=seed_qwen35_9b_int8_sc", "model.dtype=float32"])
    assert (cfg.actor_rollout_ref.rollout.dtype, cfg.model.dtype) == ("bfloat16", "float32")
    assert load_config([]).actor_rollout_ref.rollout.dtype is None


def test_wrong_type_names_the_key():
    msg = _compose_error(["trainer.total_steps=many"])
    assert "total_steps" in msg


def test_negative_lr_is_rejected():
    with pytest.raises(ConfigError, match="trainer.lr"):
        load_config(["trainer.lr=-1e-4"])


def test_topk_above_vocab_is_rejected():
    with pytest.raises(ConfigError, match="rollout.topk_logprobs"):
        load_config(["model.tiny.vocab_size=99", "rollout.topk_logprobs=128"])


def test_int4_weights_on_vllm_and_unknown_teacher_slip_are_rejected():
    with pytest.raises(ConfigError, match="rollout.precision.weights"):
        load_config(["rollout.name=vllm", "rollout.precision.weights=int4"])
    with pytest.raises(ConfigError, match="rollout.precision.weights.*int3 weights are simulated by the torch engine"):
        load_config(["rollout.name=vllm", "rollout.precision.weights=int3"])
    with pytest.raises(ConfigError, match="rollout.precision.activations.*int4 activations are simulated by the torch"):
        load_config(["rollout.name=vllm", "rollout.precision.weights=int8", "rollout.precision.activations=int4"])
    with pytest.raises(ConfigError, match="model.warm_start.teacher_error"):
        load_config(["model.warm_start.teacher_error=typo"])
    with pytest.raises(ConfigError, match="model.warm_start.teacher_error_rate"):
        load_config(["model.warm_start.teacher_error_rate=1.5"])


def test_plus_experiment_form_and_user_config_dir(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nexperiment_name: mine\ntrainer:\n  lr: 0.5\n")
    cfg = load_config(["+experiment=mine"], extra_config_dir=str(tmp_path))
    assert cfg.experiment_name == "mine" and cfg.trainer.lr == 0.5


def test_cli_prints_resolved_config_without_running(tmp_path):
    out = subprocess.run([sys.executable, "-m", "parity", "train", "trainer.total_steps=7", "--cfg", "job", "--resolve"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "total_steps: 7" in out.stdout


def test_cli_unknown_key_is_one_clear_error():
    out = subprocess.run([sys.executable, "-m", "parity", "train", "trainer.nope=1"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "nope" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_grade_prints_json_last_line():
    out = subprocess.run([sys.executable, "-m", "parity", "grade", "--response", "so \\boxed{42}", "--answer", "42"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["score"] == 1


def test_auto_dtype_follows_the_switch_and_a_pinned_dtype_stays(monkeypatch, tmp_path):
    """PARITY_AUTO_DTYPE decides what model.dtype=auto computes in on any CPU (an AVX2 machine can run what an
    AVX512-BF16 one runs); a pinned model.dtype ignores it; a bad value is one error naming the variable, raised
    before a run writes anything."""
    import os

    import torch

    from parity.rollout import compute_dtype

    cpu = torch.device("cpu")
    auto, pinned = load_config([]), load_config(["model.dtype=float32"])
    assert auto.model.dtype == "auto"
    for forced in ("bfloat16", "float32"):
        monkeypatch.setenv("PARITY_AUTO_DTYPE", forced)
        assert compute_dtype(auto.model.dtype, cpu) == getattr(torch, forced)
        assert compute_dtype(pinned.model.dtype, cpu) == torch.float32
    monkeypatch.setenv("PARITY_AUTO_DTYPE", "bf16")
    with pytest.raises(ConfigError, match="PARITY_AUTO_DTYPE.*'bf16'"):
        load_config([])
    with pytest.raises(ConfigError, match="PARITY_AUTO_DTYPE"):
        compute_dtype(auto.model.dtype, cpu)
    out = subprocess.run([sys.executable, "-m", "parity", "train", f"outputs_dir={tmp_path}"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PARITY_AUTO_DTYPE": "bf16"})
    assert out.returncode != 0 and "PARITY_AUTO_DTYPE" in out.stderr and "Traceback" not in out.stderr
    assert {p.name for p in tmp_path.iterdir()} <= {"hydra"}  # Hydra's own log only: no model, no run
