"""A session's outputs folder holding what a quantized run leaves behind, made by the real commands: `quantize`
(W8A8 INT8 through the seed block, its config.json at the seed's path pattern
<outputs>/precision_validation/Qwen3.5-9B-W8A8-INT8/config.json, beside the tokenizer files, generation_config.json
and precision.json of the checkpoint), then `validate` twice with the INT4 KV cache: once passing, then once
failing (a threshold no model meets). The precision tests and the dashboard's pages read it."""

from __future__ import annotations

from pathlib import Path

import pytest

VALIDATION = ["rollout.precision.validation.num_prompts=4", "rollout.precision.validation.samples_per_prompt=1",
              "rollout.precision.validation.max_new_tokens=8", "rollout.precision.validation.min_top1_agreement=0.5",
              "rollout.precision.validation.max_mean_abs_prob_diff=0.5", "rollout.precision.validation.max_k3_kl=1.0",
              "rollout.precision.validation.max_ppl_ratio=2.0"]
FAILING = "rollout.precision.validation.max_mean_abs_prob_diff=1e-12"
CHECKPOINT = "Qwen3.5-9B-W8A8-INT8"


def seed_overrides(outputs: Path, model_dir: Path) -> list[str]:
    from tests.conftest import QUICK

    return [f"outputs_dir={outputs}", *QUICK, f"model.path={model_dir}", "actor_rollout_ref.rollout.quantization=int8",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=int4_per_token_head",
            "actor_rollout_ref.rollout.quantization_config_file="
            f"{outputs}/precision_validation/{CHECKPOINT}/config.json", *VALIDATION]


@pytest.fixture(scope="session")
def quantized_outputs(tmp_path_factory, prepared_model: Path) -> dict:
    from parity.commands import quantize, validate
    from parity.config import load_config
    from parity.precision.validate import PrecisionValidationError

    out = tmp_path_factory.mktemp("quantized-outputs")
    overrides = seed_overrides(out, prepared_model)
    q = quantize.run(load_config(overrides))
    passed = validate.run(load_config(overrides))
    with pytest.raises(PrecisionValidationError) as failed:
        validate.run(load_config([*overrides, FAILING]))
    return {"outputs_dir": str(out), "overrides": overrides, "quantize": q, "passed": passed,
            "failed_json": failed.value.report_json, "failed_md": failed.value.report_md,
            "checkpoint_dir": str(Path(q["checkpoint_dir"]))}
