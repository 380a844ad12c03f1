"""Decoding a batch's compact routing into the dense training tensor [B, R, n_layers, top_k].

`decode_streaming` is the production path: one response at a time, straight into a preallocated tensor,
each temporary freed after its copy, so host memory peaks at the final tensor plus one response.
`decode_naive` decodes every response first and then copies (the obvious implementation); it is kept as
the reference that the streaming path must equal bit for bit (tests, tests/bench/bench_moe_r3_decode.py).

Both: row b holds response b's first min(n_b, R) tokens, positions from there to R hold `pad_value`
(responses longer than R are cut, empty responses are all padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.moe.codec import RoutingBatch, decode_routing


@dataclass
class DecodeStats:
    """Accounting of decode temporaries (bytes of decoded-but-not-yet-copied tensors held at once)."""

    peak_temp_bytes: int = 0
    responses: int = 0


def _check_pad(pad_value: int, dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    if not info.min <= pad_value <= info.max:
        raise ValueError(f"pad_value {pad_value} does not fit the routing tensor dtype {dtype}")


def _check_out(routing: RoutingBatch, out: torch.Tensor) -> None:
    want = (len(routing), routing.n_layers, routing.top_k)
    if out.ndim != 4 or (out.shape[0], out.shape[2], out.shape[3]) != want:
        raise ValueError(f"routing decode: out has shape {tuple(out.shape)}, expected "
                         f"[B={want[0]}, R, n_layers={want[1]}, top_k={want[2]}]")
    if out.dtype.is_floating_point or out.dtype == torch.bool:
        raise TypeError(f"routing decode: out must have an integer dtype, got {out.dtype}")


def decode_streaming(routing: RoutingBatch, out: torch.Tensor, pad_value: int = -1,
                     stats: DecodeStats | None = None) -> torch.Tensor:
    """Fill the preallocated `out` [B, R, n_layers, top_k] (any integer dtype, any device; a view such as
    a slice of a longer sequence tensor is fine) one response at a time; returns `out`."""
    _check_out(routing, out)
    _check_pad(pad_value, out.dtype)
    r = out.shape[1]
    for b, arr in enumerate(routing.responses):
        m = min(int(arr.shape[0]), r)
        if m:
            # decode only what is kept: a truncated response never costs more than one row of `out`
            tmp = decode_routing(arr, limit=m, dtype=out.dtype)
            if stats is not None:
                stats.peak_temp_bytes = max(stats.peak_temp_bytes, tmp.nbytes)
            out[b, :m].copy_(tmp)
            del tmp
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
