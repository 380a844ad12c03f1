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


# Set to 1: parity processes that use CUDA wait for the device with the host thread asleep (cuda_blocking_sync).
BLOCKING_SYNC_ENV = "PARITY_CUDA_BLOCKING_SYNC"
_CU_CTX_SCHED_BLOCKING_SYNC = 0x4


def cuda_blocking_sync() -> bool:
    """Make every visible CUDA device's primary context wait for the device with the calling thread blocked on an
    interrupt, not spinning (the driver's CU_CTX_SCHED_BLOCKING_SYNC). CUDA's default spins when there are no
    more contexts than cores: with a study's 16 runs on one GPU, each run's host spins a core through every
    synchronisation, which starves the others' kernel launches of CPU. The arithmetic is unchanged: only how the
    host waits. Call before the process's first CUDA use (torch's primary context then takes the flag). True when
    the flag was set; False without a CUDA driver (nothing to do)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        cu = ctypes.CDLL(name)
    except OSError:
        return False
    if cu.cuInit(0) != 0:
        return False
    count = ctypes.c_int(0)
    if cu.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    for i in range(count.value):
        dev = ctypes.c_int(0)
        if cu.cuDeviceGet(ctypes.byref(dev), i) != 0:
            return False
        rc = cu.cuDevicePrimaryCtxSetFlags(dev, _CU_CTX_SCHED_BLOCKING_SYNC)
        if rc != 0:
            raise RuntimeError(f"cuDevicePrimaryCtxSetFlags(device {i}, BLOCKING_SYNC) failed with CUresult {rc}")
    return True


def blocking_sync_from_env() -> bool:
    """cuda_blocking_sync() when PARITY_CUDA_BLOCKING_SYNC=1 (set by the study for its runs); else nothing."""
    value = os.environ.get(BLOCKING_SYNC_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"environment variable {BLOCKING_SYNC_ENV}: 1 or 0 (or unset), got {value!r}")
    return value == "1" and cuda_blocking_sync()


__all__ = ["AUTO_DTYPE_ENV", "BLOCKING_SYNC_ENV", "blocking_sync_from_env", "compute_dtype", "cuda_blocking_sync",
           "forced_auto_dtype", "resolve_device"]
