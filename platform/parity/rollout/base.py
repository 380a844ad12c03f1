"""The Engine interface every rollout engine implements, and the SamplingSpec it takes (defined in
parity.core.sampling, which the validation sampler shares)."""

from parity.core.sampling import Engine, SamplingSpec

__all__ = ["Engine", "SamplingSpec"]
