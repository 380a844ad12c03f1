"""Decoding a batch's compact routing into the dense training tensor [B, R, n_layers, top_k].

`decode_streaming` is the production path: one response at a time, straight into a preallocated tensor.
The widening from the compact ids happens inside the copy kernel, reading a zero-copy view of the
response, so no decoded temporary exists at all (on CPU): host memory peaks at the final tensor. An
earlier version decoded each response into an int64 temporary and freed it after its copy; glibc kept
~6 MiB of those freed, variously sized blocks in its heap (bench_moe_r3_decode.py measured it), which
this version avoids. `decode_naive` decodes every response first and then copies (the obvious
implementation); it is kept as the reference that the streaming path must equal bit for bit.

Both: row b holds response b's first min(n_b, R) tokens, positions from there to R hold `pad_value`
(responses longer than R are cut, empty responses are all padding).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from parity.moe.codec import RoutingBatch, decode_routing


@dataclass
class DecodeStats:
    """Accounting of decode temporaries: the most bytes of decoded-but-not-yet-copied ids held at once
    (the naive decode holds every response; the streaming decode holds none)."""

    peak_temp_bytes: int = 0
    responses: int = 0


def _check_pad(pad_value: int, dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    if not info.min <= pad_value <= info.max:
        raise ValueError(f"pad_value {pad_value} does not fit the routing tensor dtype {dtype}")


def _check_dtype(dtype: torch.dtype, num_experts: int) -> None:
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"routing decode: the routing tensor must have an integer dtype, got {dtype}")
    if torch.iinfo(dtype).max < num_experts - 1:
        raise TypeError(f"routing decode: {dtype} cannot hold expert ids up to {num_experts - 1}")


def _check_out(routing: RoutingBatch, out: torch.Tensor) -> None:
    want = (len(routing), routing.n_layers, routing.top_k)
    if out.ndim != 4 or (out.shape[0], out.shape[2], out.shape[3]) != want:
        raise ValueError(f"routing decode: out has shape {tuple(out.shape)}, expected "
                         f"[B={want[0]}, R, n_layers={want[1]}, top_k={want[2]}]")
    _check_dtype(out.dtype, routing.num_experts)


def _compact_view(arr: np.ndarray) -> torch.Tensor:
    """Zero-copy tensor over compact ids. Arrays from RoutingBatch.from_bytes are read-only views of the
    wire buffer; torch warns about those, but this view is only ever read (as a copy_ source)."""
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def decode_streaming(routing: RoutingBatch, out: torch.Tensor, pad_value: int = -1,
                     stats: DecodeStats | None = None) -> torch.Tensor:
    """Fill the preallocated `out` [B, R, n_layers, top_k] (any integer dtype wide enough for the ids, any
    device; a view such as a slice of a longer sequence tensor is fine) one response at a time; returns
    `out`. Only the kept min(n, R) tokens of a response are read."""
    _check_out(routing, out)
    _check_pad(pad_value, out.dtype)
    r = out.shape[1]
    for b, arr in enumerate(routing.responses):
        m = min(int(arr.shape[0]), r)
        if m:
            # copy_ widens uint8/int16 -> out.dtype element by element: no decoded temporary on CPU
            out[b, :m].copy_(_compact_view(arr[:m]))
        if m < r:
            out[b, m:].fill_(pad_value)
        if stats is not None:
            stats.responses += 1
    return out


def decode_naive(routing: RoutingBatch, max_len: int, pad_value: int = -1, dtype: torch.dtype = torch.int64,
                 device: torch.device | str | None = None, stats: DecodeStats | None = None) -> torch.Tensor:
    """Reference: decode every response in full, then allocate the padded tensor and copy."""
    if max_len < 0:
        raise ValueError(f"routing decode: max_len must be >= 0, got {max_len}")
    _check_dtype(dtype, routing.num_experts)
    _check_pad(pad_value, dtype)
    decoded = [decode_routing(arr, dtype=dtype) for arr in routing.responses]
    if stats is not None:
        stats.peak_temp_bytes = max(stats.peak_temp_bytes, sum(t.nbytes for t in decoded))
        stats.responses += len(decoded)
    out = torch.full((len(routing), max_len, routing.n_layers, routing.top_k), pad_value, dtype=dtype,
                     device=device)
    for b, t in enumerate(decoded):
        m = min(int(t.shape[0]), max_len)
        out[b, :m] = t[:m]
    return out
