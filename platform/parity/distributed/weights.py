"""Trainer weights as one object in Ray's object store: ray.put once, every rollout worker reads it.

Tensors travel as numpy arrays so workers on the same node read them zero-copy from shared memory; numpy has
no bfloat16, so a bf16 tensor travels as its raw 16 bits (int16 view) and is viewed back, bit-exact."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

# torch dtype -> (numpy carrier dtype, torch view dtype of the carrier)
_CARRIERS = {torch.bfloat16: torch.int16, torch.float16: torch.float16, torch.float32: torch.float32}


def pack_weights(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (torch dtype name, numpy array)}; bf16 as int16 bits."""
    out = {}
    for name, t in named:
        if t.dtype not in _CARRIERS:
            raise TypeError(f"weight sync: {name!r} has dtype {t.dtype}; expected bfloat16, float16 or float32")
        carrier = t.detach().cpu().contiguous().view(_CARRIERS[t.dtype])
        out[name] = (str(t.dtype).removeprefix("torch."), carrier.numpy())
    return out


def unpack_weights(packed: dict[str, tuple[str, np.ndarray]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, in the order packed; tensors share the arrays' memory (read-only in the
    object store: the engine copies them into its own parameters)."""
    for name, (dtype_name, arr) in packed.items():
        dtype = getattr(torch, dtype_name)
        if dtype not in _CARRIERS:
            raise TypeError(f"weight sync: {name!r} arrived with unknown dtype {dtype_name!r}")
        with _readonly_ok():
            carrier = torch.from_numpy(arr)
        yield name, carrier.view(dtype)


class _readonly_ok:
    """torch warns on non-writable numpy arrays (object store buffers are read-only); nothing writes to them."""

    def __enter__(self) -> None:
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("ignore", message=".*non-writable.*")

    def __exit__(self, *exc: object) -> None:
        self._w.__exit__(*exc)
