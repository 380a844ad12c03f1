"""The device and the compute dtype a config asks for (trainer.device, model.dtype)."""

from __future__ import annotations

import os

import torch

from parity.errors import ConfigError

# What `model.dtype=auto` resolves to when set (bfloat16 | float32), whatever the CPU: an AVX2-only machine can run
# what an AVX512-BF16 one runs.
AUTO_DTYPE_ENV = "PARITY_AUTO_DTYPE"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cpu_has_native_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def forced_auto_dtype() -> str | None:
    """PARITY_AUTO_DTYPE, checked: the dtype `model.dtype=auto` resolves to, or None (unset: the device decides)."""
    value = os.environ.get(AUTO_DTYPE_ENV, "").strip()
    if value and value not in ("bfloat16", "float32"):
        raise ConfigError(f"environment variable {AUTO_DTYPE_ENV}: what model.dtype=auto resolves to must be bfloat16 "
                          f"or float32 (or unset), got {value!r}")
    return value or None


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype of trainer forwards and engine weights on `device` for `model.dtype`=`name` (auto picks bf16 where
    it is native, or what PARITY_AUTO_DTYPE says)."""
    if name == "auto":
        name = forced_auto_dtype() or ("bfloat16" if device.type == "cuda" or _cpu_has_native_bf16() else "float32")
    return torch.bfloat16 if name == "bfloat16" else torch.float32


__all__ = ["AUTO_DTYPE_ENV", "compute_dtype", "forced_auto_dtype", "resolve_device"]
