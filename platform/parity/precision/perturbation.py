"""A controlled mismatch dial: the rollout engine samples with theta + Delta while the trainer learns theta.

    Delta = sigma * eps * |theta_0|,   eps ~ N(0, 1) per weight,   theta_0 = the run's starting model

(the score-centering paper's fixed-bias mismatch). `fixed`: one Delta for the whole run (drawn from `seed`, by
default the run's trainer.seed, so the seeds of a study draw independent biases),
re-applied after every weight sync, so the sampler's bias points the same way step after step, like a
quantization error does. `redraw`: a new Delta at every sync (draw k at sync k), the control that breaks the
fixed-bias feedback loop. Every draw is a pure function of (seed, draw, parameter name, theta_0), so the
engine side (which perturbs) and the trainer side (which measures how far the policy drifted along Delta)
compute the same Delta independently, on any runner, across resumes.

The perturbation is applied to full-precision tensors before the engine's own format (a quantized engine
quantizes theta + Delta), through the engine's ordinary weight sync, so it works for every engine."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from parity.config.schema import PrecisionConfig

MODES = ("fixed", "redraw")


def perturbation_of(precision: PrecisionConfig | None) -> tuple[float, str, int]:
    """(sigma, mode, seed) of a precision's `perturbation` section (none: no perturbation); ValueError naming the
    key if invalid."""
    if precision is None:
        return 0.0, "fixed", 0
    p = precision.perturbation
    sigma, mode, seed = float(p.sigma), str(p.mode), p.seed
    if seed is None:  # null follows trainer.seed, which parity.precision.config.resolve_precision fills in
        if sigma > 0.0:
            raise ValueError("config key `rollout.precision.perturbation.seed` is null (= trainer.seed) here: pass "
                             "the precision resolved by parity.rollout.rollout_precision(cfg)")
        seed = 0
    seed = int(seed)
    if not sigma >= 0.0:
        raise ValueError(f"config key `rollout.precision.perturbation.sigma`: must be >= 0, got {sigma}")
    if mode not in MODES:
        raise ValueError(f"config key `rollout.precision.perturbation.mode`: must be one of {', '.join(MODES)}, "
                         f"got {mode!r}")
    return sigma, mode, seed


def is_perturbed(precision: PrecisionConfig) -> bool:
    return perturbation_of(precision)[0] > 0.0


def _seed(seed: int, draw: int, name: str) -> int:
    h = hashlib.blake2b(f"perturbation:{seed}:{draw}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def load_reference(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """theta_0: the named parameters (HF names, as a trainer's weight sync sends them) of the model in
    `model_dir`, float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Perturbation:
    """Delta draws for one run. `delta(name, draw)` is float32 on the CPU; `fixed` caches its one draw."""

    def __init__(self, reference: dict[str, torch.Tensor], sigma: float, mode: str = "fixed", seed: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"perturbation mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.sigma, self.mode, self.seed = float(sigma), mode, int(seed)
        self.scale = {n: (self.sigma * t.float().abs()) for n, t in reference.items()}
        self._cache: dict[tuple[str, str], torch.Tensor] = {}  # fixed: the one draw, per device it is used on

    @classmethod
    def from_precision(cls, precision: PrecisionConfig, model_dir: str | Path) -> Perturbation | None:
        """The run's perturbation, or None when sigma is 0 (then nothing is loaded or touched)."""
        sigma, mode, seed = perturbation_of(precision)
        return cls(load_reference(model_dir), sigma, mode, seed) if sigma > 0 else None

    def draw_index(self, syncs: int) -> int:
        """Which draw the engine holds after `syncs` weight syncs (0 = the starting weights)."""
        return 0 if self.mode == "fixed" else int(syncs)

    def delta(self, name: str, draw: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Delta of parameter `name` at draw `draw`, float32, on `device` (default the CPU). Drawn on the CPU so
        every device gets the same numbers; under `fixed` kept on each device it was asked for (a sync then adds
        it without a host-to-device copy)."""
        if name not in self.scale:
            raise KeyError(f"perturbation: the starting model has no parameter {name!r}")
        draw = self.draw_index(draw)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        key = (name, str(dev))
        if self.mode == "fixed" and key in self._cache:
            return self._cache[key]
        scale = self.scale[name]
        g = torch.Generator().manual_seed(_seed(self.seed, draw, name))
        d = (torch.randn(scale.shape, generator=g, dtype=torch.float32) * scale).to(dev)
        if self.mode == "fixed":
            self._cache[key] = d
        return d

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]], draw: int
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """theta + Delta, tensor by tensor, each in its own dtype and device (added in float32)."""
        for name, t in named_tensors:
            yield name, (t.float() + self.delta(name, draw, t.device)).to(t.dtype)

    def describe(self) -> dict:
        return {"sigma": self.sigma, "mode": self.mode, "seed": self.seed}


class DriftProbe:
    """How far the trained policy moved along the sampler's bias: cos(theta_t - theta_0, Delta) over all the
    policy's parameters (float64 sums). Positive and rising: the policy drifts toward the sampler's weights,
    the feedback loop score centering removes; about 0 under `redraw`."""

    def __init__(self, perturbation: Perturbation, reference: dict[str, torch.Tensor], device: torch.device) -> None:
        self.p = perturbation
        self.theta0 = {n: t.to(device) for n, t in reference.items()}

    @classmethod
    def from_precision(cls, precision: PrecisionConfig, model_dir: str | Path, device: torch.device) -> DriftProbe | None:
        sigma, mode, seed = perturbation_of(precision)
        if sigma <= 0:
            return None
        ref = load_reference(model_dir)
        return cls(Perturbation(ref, sigma, mode, seed), ref, device)

    @torch.no_grad()
    def cosine(self, named_parameters: Iterable[tuple[str, torch.Tensor]], draw: int) -> float:
        sums = None  # [dot, |Delta|^2, |step|^2] in float64 on the parameters' device: one sync at the end
        for name, p in named_parameters:
            if name not in self.theta0:
                continue
            step = (p.detach().double() - self.theta0[name].double()).reshape(-1)
            d = self.p.delta(name, draw, p.device).double().reshape(-1)
            part = torch.stack([step @ d, d @ d, step @ step])
            sums = part if sums is None else sums + part
        if sums is None:
            return 0.0
        dot, nd, ns = sums.cpu().tolist()
        den = (nd ** 0.5) * (ns ** 0.5)
        return dot / den if den > 0 else 0.0


__all__ = ["Perturbation", "DriftProbe", "perturbation_of", "is_perturbed", "load_reference", "MODES"]
