"""Secrets masking: which config keys are secrets, and the run folder's config.yaml holds no password."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from parity.config import with_values
from parity.tracking.secrets import MASK, is_secret_key, mask_params, masked_config_yaml

SECRET = "s3cr3t-pw-4711"


@pytest.mark.parametrize("key", ["tracking.password", "hf_token", "x.client_secret", "cloud.api_key", "a.apiKey",
                                 "b.private_key", "c.auth-token", "d.credentials", "e.aws_secret_access_key"])
def test_secret_keys(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["rollout.max_new_tokens", "eval.max_new_tokens", "vllm.max_num_batched_tokens",
                                 "model.tokenizer", "rollout.topk_logprobs", "data.max_prompt_tokens",
                                 "trainer.keep_checkpoints"])
def test_ordinary_keys_are_not_secrets(key: str) -> None:
    """They were masked in MLflow params before (any key containing 'token' was a secret)."""
    assert not is_secret_key(key)
    assert mask_params({key: 256})[key] == 256


def test_masked_config_yaml_hides_url_passwords_and_secret_values() -> None:
    cfg = OmegaConf.create({"tracking": {"registry_url": f"postgresql+psycopg://parity:{SECRET}@db:5432/reg",
                                         "tracking_uri": f"http://u:{SECRET}@mlflow:5000", "hf_token": SECRET},
                            "rollout": {"max_new_tokens": 64}, "hosts": [f"https://a:{SECRET}@h/x"],
                            "ref": "${rollout.max_new_tokens}"})
    text = masked_config_yaml(cfg)
    assert SECRET not in text
    back = OmegaConf.create(text)
    assert back.tracking.registry_url == f"postgresql+psycopg://parity:{MASK}@db:5432/reg"
    assert back.tracking.hf_token == MASK and back.hosts[0] == f"https://a:{MASK}@h/x"
    assert back.rollout.max_new_tokens == 64 and back.ref == 64  # resolved, not masked


def test_the_run_folder_config_holds_no_registry_password(quick_cfg) -> None:
    from parity.commands.train import train
    from parity.training.loop import run_dir_of

    cfg = quick_cfg("trainer.run_name=secrets-run", "trainer.total_steps=1", "trainer.checkpoint_every=0")
    cfg = with_values(cfg, {"tracking.registry_url": f"postgresql+psycopg://parity:{SECRET}@127.0.0.1:1/reg"})
    train(cfg)
    text = (run_dir_of(cfg) / "config.yaml").read_text()
    assert SECRET not in text and f"parity:{MASK}@127.0.0.1" in text
    assert OmegaConf.create(text).rollout.max_new_tokens == cfg.rollout.max_new_tokens
