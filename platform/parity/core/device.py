"""The device and the compute dtype a config asks for (trainer.device, model.dtype)."""

from __future__ import annotations

from typing import Any

import torch


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


def compute_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    """The dtype of trainer forwards and engine weights (model.dtype; auto picks bf16 where it is native)."""
    name = cfg.model.dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" or _cpu_has_native_bf16() else "float32"
    return torch.bfloat16 if name == "bfloat16" else torch.float32


__all__ = ["resolve_device", "compute_dtype"]
