"""Rollout engines behind one interface (parity.core.sampling.Engine)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.core.device import compute_dtype, resolve_device
from parity.core.sampling import Engine, SamplingSpec
from parity.cpu_lanes import check_lanes
from parity.errors import ConfigError
from parity.precision.config import resolve_precision
from parity.precision.perturbation import Perturbation, is_perturbed, load_reference, perturbation_of

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig, PrecisionConfig


def rollout_precision(cfg: ParityConfig) -> Any:
    """The rollout's precision: the seed block's `actor_rollout_ref.rollout` when it sets a quantization,
    else `rollout.precision` (parity.precision.config resolves both)."""
    return resolve_precision(cfg)


def engine_lanes(cfg: ParityConfig) -> int:
    """rollout.cpu_lanes, checked (parity.cpu_lanes)."""
    return check_lanes(cfg.rollout.cpu_lanes, "rollout.cpu_lanes")


def build_engine(cfg: ParityConfig, model_dir: str | Path, precision: PrecisionConfig | None = None, reference_dir: str | Path | None = None,
                 syncs: int = 0) -> Engine:
    """The configured rollout engine on the weights in `model_dir`. With `rollout.precision.perturbation.sigma`
    > 0 and `reference_dir` (theta_0: the run's starting model) given, the engine samples with theta + Delta
    (parity.rollout.perturbed; `syncs` = weight syncs done before, on resume)."""
    precision = rollout_precision(cfg) if precision is None else precision
    if str(cfg.rollout.cohort or ""):
        return _cohort_member(cfg, model_dir, reference_dir, precision)
    device = resolve_device(cfg.trainer.device)
    if cfg.rollout.name == "torch":
        from parity.rollout.torch_engine import TorchEngine
        engine: Engine = TorchEngine(model_dir, precision=precision, device=str(device),
                                     dtype=compute_dtype(cfg.model.dtype, device), capture_routing=bool(cfg.rollout.capture_routing),
                                     share_prefill=bool(cfg.rollout.shared_prefill),
                                     cpu_lanes=engine_lanes(cfg), compact_tail=bool(cfg.rollout.compact_tail),
                                     compile_prefill=bool(cfg.rollout.compile_prefill))
    elif cfg.rollout.name == "vllm":
        from parity.rollout.vllm_engine import VllmEngine  # lazy: vLLM is optional for the numerical core
        engine = VllmEngine(cfg, model_dir, precision=precision)
    else:
        raise ValueError(f"config key `rollout.name`: unknown engine {cfg.rollout.name!r}; known: torch, vllm")
    if reference_dir is not None and is_perturbed(precision):
        from parity.rollout.perturbed import PerturbedEngine

        theta0 = load_reference(reference_dir)
        start = theta0 if Path(reference_dir).resolve() == Path(model_dir).resolve() else load_reference(model_dir)
        return PerturbedEngine(engine, Perturbation(theta0, *perturbation_of(precision)), start, syncs)  # type: ignore[return-value]
    return engine


def _cohort_member(cfg: ParityConfig, model_dir: str | Path, reference_dir: str | Path | None,
                   precision: PrecisionConfig) -> Engine:
    """The run's side of a cohort (rollout.cohort=SOCKET#i): the server's engines start from the run's starting
    weights, so a run that resumes from other weights, or that draws its own perturbation, is not a member."""
    from parity.rollout.cohort_server import CohortClient, parse_member

    if cfg.rollout.name != "torch":
        raise ConfigError(f"rollout.cohort: the cohort decodes torch engines, not rollout.name={cfg.rollout.name!r}")
    if is_perturbed(precision):
        raise ConfigError("rollout.cohort: a perturbed rollout draws its own Delta per run; it cannot share a cohort")
    if reference_dir is not None and Path(reference_dir).resolve() != Path(model_dir).resolve():
        raise ConfigError("rollout.cohort: a resumed run starts from other weights than the cohort's; run it on its "
                          "own engine (rollout.cohort='')")
    try:
        address, member = parse_member(cfg.rollout.cohort)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return CohortClient(address, member)  # type: ignore[return-value]


def sampling_spec(cfg: ParityConfig, seed: int) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, n=r.n,
                        topk_logprobs=r.topk_logprobs, seed=seed)


__all__ = ["Engine", "SamplingSpec", "build_engine", "sampling_spec", "resolve_device", "compute_dtype", "is_perturbed",
           "rollout_precision", "engine_lanes"]
