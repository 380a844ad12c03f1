"""PARITY_FUSED_SAMPLER: which decode calls draw through the two-launch sampler (parity.rollout.sampler_kernel),
a bad value named, and the temperature factor torch uses. The kernels themselves: tests/test_sampler_kernel_interpret.py
(Triton's interpreter) and on the device tests/bench/gpu_sampler.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity.core.sampling import SamplingSpec
from parity.rollout import sampler_kernel as sk

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


def test_on_by_default_where_triton_is_and_a_bad_value_named(monkeypatch):
    """auto (the default): on wherever Triton is installed, off elsewhere; off: never, even on CUDA."""
    monkeypatch.delenv(sk.ENV, raising=False)
    assert sk.fused_sampler() == (sk.triton is not None)
    assert sk.fused_applies(SamplingSpec(), False, CUDA) == (sk.triton is not None)
    monkeypatch.setattr(sk, "triton", None)
    assert not sk.fused_sampler()  # a CPU install: auto asks for nothing
    monkeypatch.setenv(sk.ENV, "off")
    assert not sk.fused_applies(SamplingSpec(), False, CUDA)
    monkeypatch.setenv(sk.ENV, "yes")
    with pytest.raises(ValueError, match="PARITY_FUSED_SAMPLER='yes'"):
        sk.fused_sampler()


def test_which_calls_take_it(monkeypatch):
    """On: sampling at top_p = 1 on CUDA without top-K or forced tokens; greedy, nucleus, top-K log-probs,
    forced replays and CPU keep their draws (and never ask for Triton)."""
    monkeypatch.setenv(sk.ENV, "on")
    cpu = torch.device("cpu")
    for spec, forced, dev in [(SamplingSpec(temperature=0.0), False, CUDA), (SamplingSpec(top_p=0.9), False, CUDA),
                              (SamplingSpec(topk_logprobs=5), False, CUDA), (SamplingSpec(), True, CUDA),
                              (SamplingSpec(), False, cpu)]:
        assert not sk.fused_applies(spec, forced, dev)
    if sk.triton is None:  # this install: asked for where it applies, the missing Triton is named
        with pytest.raises(RuntimeError, match="PARITY_FUSED_SAMPLER=on needs Triton"):
            sk.fused_applies(SamplingSpec(temperature=0.7), False, CUDA)
    else:
        assert sk.fused_applies(SamplingSpec(temperature=0.7), False, CUDA)


@pytest.mark.parametrize("t", [1.0, 0.7, 0.6, 1.3])
def test_inverse_temperature_is_the_float32_reciprocal(t):
    """torch on CUDA computes logits / T as logits * (float32(1) / float32(T)); the kernel multiplies by the same."""
    assert sk.inverse_temperature(t) == float(np.float32(1.0) / np.float32(t))
