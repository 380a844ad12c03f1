"""Range and consistency checks that the schema's types cannot express. Each error names the key."""

from __future__ import annotations

from omegaconf import DictConfig

from parity.config.distributed import check_distributed
from parity.errors import ConfigError, ParityError


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key `{key}`: {msg}")


def validate_config(cfg: DictConfig) -> None:
    t, r, a = cfg.trainer, cfg.rollout, cfg.algorithm
    _check(t.lr > 0, "trainer.lr", f"must be > 0, got {t.lr}")
    _check(t.eval_temperature >= 0, "trainer.eval_temperature", f"must be >= 0 (0 = greedy), got {t.eval_temperature}")
    _check(t.eval_samples >= 1, "trainer.eval_samples", f"must be >= 1, got {t.eval_samples}")
    _check(t.eval_rows >= 1, "trainer.eval_rows", f"must be >= 1, got {t.eval_rows}")
    _check(t.total_steps >= 0, "trainer.total_steps", f"must be >= 0, got {t.total_steps}")
    _check(t.prompts_per_step >= 1, "trainer.prompts_per_step", f"must be >= 1, got {t.prompts_per_step}")
    _check(t.micro_batch_size >= 1, "trainer.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}")
    _check(t.mini_batches >= 1, "trainer.mini_batches", f"must be >= 1, got {t.mini_batches}")
    _check(t.cpu_lanes >= 1, "trainer.cpu_lanes", f"must be >= 1 (1 = off), got {t.cpu_lanes}")
    _check(t.pad_to_multiple >= 0, "trainer.pad_to_multiple", f"must be >= 0 (0 = off), got {t.pad_to_multiple}")
    _check(t.grad_clip > 0, "trainer.grad_clip", f"must be > 0, got {t.grad_clip}")
    _check(t.max_bad_steps >= 1, "trainer.max_bad_steps", f"must be >= 1, got {t.max_bad_steps}")
    _check(t.compile_mode in ("default", "reduce-overhead"), "trainer.compile_mode",
           f"must be default or reduce-overhead, got {t.compile_mode!r}")
    _check(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "trainer.betas",
           f"must be two values in [0, 1), got {list(t.betas)}")
    _check(t.device in ("auto", "cpu", "cuda") or str(t.device).startswith("cuda:"), "trainer.device",
           f"must be auto, cpu or cuda[:N], got {t.device!r}")
    _check(r.name in ("torch", "vllm"), "rollout.name", f"unknown engine {r.name!r}; known: torch, vllm")
    _check(not (r.name == "vllm" and r.precision.weights in ("int4", "int3")), "rollout.precision.weights",
           f"{r.precision.weights} weights are simulated by the torch engine only (rollout.name=torch); vLLM has no "
           "such checkpoint here")
    _check(not (r.name == "vllm" and r.precision.activations == "int4"), "rollout.precision.activations",
           "int4 activations are simulated by the torch engine only (rollout.name=torch); vLLM has no such "
           "checkpoint here")
    _check(r.temperature > 0, "rollout.temperature", f"must be > 0, got {r.temperature}")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _check(r.n >= 1, "rollout.n", f"must be >= 1, got {r.n}")
    _check(r.cpu_lanes >= 1, "rollout.cpu_lanes", f"must be >= 1 (1 = off), got {r.cpu_lanes}")
    _check(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    _check(r.topk_logprobs >= 0, "rollout.topk_logprobs", f"must be >= 0, got {r.topk_logprobs}")
    vocab = cfg.model.tiny.vocab_size
    if cfg.model.source == "tiny" and vocab > 0:
        _check(r.topk_logprobs <= vocab, "rollout.topk_logprobs", f"{r.topk_logprobs} exceeds the vocabulary ({vocab})")
    _check_registered(a)
    _check(cfg.model.source in ("tiny", "hf"), "model.source", f"must be tiny or hf, got {cfg.model.source!r}")
    _check(cfg.model.arch in ("qwen3", "qwen3_moe"), "model.arch", f"must be qwen3 or qwen3_moe, got {cfg.model.arch!r}")
    ws = cfg.model.warm_start
    _check(ws.teacher_error in ("none", "last_digit", "drop_sign"), "model.warm_start.teacher_error",
           f"unknown slip {ws.teacher_error!r}; known: none, last_digit, drop_sign")
    _check(0.0 <= ws.teacher_error_rate <= 1.0, "model.warm_start.teacher_error_rate",
           f"must be in [0, 1], got {ws.teacher_error_rate}")
    _check(cfg.model.dtype in ("auto", "bfloat16", "float32"), "model.dtype",
           f"must be auto, bfloat16 or float32, got {cfg.model.dtype!r}")
    from parity.core.device import forced_auto_dtype  # torch: importing parity.config must not import it

    forced_auto_dtype()
    if a.routing_replay:
        _check(cfg.model.arch == "qwen3_moe" or cfg.model.source == "hf", "algorithm.routing_replay",
               "routing replay needs an MoE model (model.arch=qwen3_moe)")
        _check(bool(r.capture_routing), "rollout.capture_routing", "must be true when algorithm.routing_replay is on")
    d = cfg.distributed
    if d.enabled:
        try:
            check_distributed(d)
        except ParityError as e:
            raise ConfigError(str(e)) from e
    workers = int(d.get("trainer_workers", 1))
    if workers != 1:
        _check(bool(d.enabled), "distributed.trainer_workers",
               f"{workers} trainer workers need the Ray loop: set distributed.enabled=true")
        _check(not a.routing_replay and not r.capture_routing, "distributed.trainer_workers",
               "MoE routing replay (algorithm.routing_replay, rollout.capture_routing) runs only with one trainer "
               "worker; set distributed.trainer_workers=1")
    from parity.algorithms.corrections import (
        build_corrections,  # the registry checks names, values, conflicts
    )

    try:
        build_corrections(a.correction, policy_loss=a.policy_loss, topk_logprobs=r.topk_logprobs)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _check_registered(a: DictConfig) -> None:
    """Names that select a registered component: the registry is the list of what exists."""
    from parity.algorithms import ADV_ESTIMATORS, AGGREGATIONS, POLICY_LOSSES

    for registry, value in ((ADV_ESTIMATORS, a.adv_estimator), (POLICY_LOSSES, a.policy_loss),
                            (AGGREGATIONS, a.loss_agg_mode)):
        _check(value in registry, registry.config_key,
               f"unknown {registry.kind} {value!r}; known: {', '.join(registry.names())}")
