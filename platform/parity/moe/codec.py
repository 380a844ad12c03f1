"""Compact transport of rollout routing (R3): one array per response, response tokens only, no padding.

Alignment (the contract between the capturing engine and the trainer): for a response of n sampled tokens
the encoded array is ids[n, n_layers, top_k], where ids[j] are the experts used at the forward position
whose logits sampled response token j. With left-padded prompts of length P and the training sequence
cat(prompt, response), that is sequence position P - 1 + j: the last prompt token for j = 0 (the prefill's
last position), response token j - 1 for j >= 1 (the decode step that fed it). These are exactly the
positions whose logits give the training log-probs of the response, and every sampled token has one.
`n_layers` counts MoE layers only (see parity.moe.routers).

Ids are stored as uint8 when num_experts <= 256, else int16; a batch's routing is a `RoutingBatch`, the
object held by `RolloutBatch.routed_experts`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_MAGIC = b"PRR1"
# magic, dtype code (1 = uint8, 2 = int16), n_layers, top_k, num_experts, number of responses
_HEADER = struct.Struct("<4sBIIII")
_DTYPE_CODES = {1: np.dtype(np.uint8), 2: np.dtype(np.int16)}
_INT16_MAX_EXPERTS = 32768  # ids 0..32767 fit int16
_TORCH_TO_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.uint8: np.uint8}


def routing_dtype(num_experts: int) -> np.dtype:
    """The compact id dtype: uint8 up to 256 experts, int16 up to 32768."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= _INT16_MAX_EXPERTS:
        return np.dtype(np.int16)
    raise ValueError(f"num_experts={num_experts} does not fit the int16 routing codec (max {_INT16_MAX_EXPERTS})")


def routing_torch_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if routing_dtype(num_experts) == np.uint8 else torch.int16


def _to_numpy(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        return ids.detach().cpu().numpy()
    return np.asarray(ids)


def encode_routing(ids: torch.Tensor | np.ndarray, num_experts: int, what: str = "routing") -> np.ndarray:
    """ids[n, n_layers, top_k] (any integer dtype, any device) -> C-contiguous compact array.
    Every id must lie in [0, num_experts): an out-of-range id is an error, never a wrapped value."""
    arr = _to_numpy(ids)
    if arr.ndim != 3:
        raise ValueError(f"{what}: expected ids of shape [tokens, n_layers, top_k], got {tuple(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what}: expert ids must be integers, got {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{what}: expert id out of range [0, {num_experts}): min {lo}, max {hi}")
    return np.ascontiguousarray(arr, dtype=routing_dtype(num_experts))


def decode_routing(arr: np.ndarray, limit: int | None = None, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """One response's compact ids -> a new tensor [min(n, limit), n_layers, top_k] of `dtype`.
    Only the first `limit` tokens are converted, so a truncated response costs only what is kept."""
    if dtype not in _TORCH_TO_NUMPY:
        raise TypeError(f"routing decode dtype must be one of {list(_TORCH_TO_NUMPY)}, got {dtype}")
    part = arr if limit is None else arr[:limit]
    # astype always copies: the result is writable and owns its memory (safe for torch.from_numpy)
    return torch.from_numpy(part.astype(_TORCH_TO_NUMPY[dtype], copy=True))


@dataclass
class RoutingBatch:
    """Routing of a batch of responses: `responses[i]` is response i's compact ids [n_i, n_layers, top_k]."""

    responses: list[np.ndarray]
    n_layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        want = routing_dtype(self.num_experts)
        for i, arr in enumerate(self.responses):
            if not isinstance(arr, np.ndarray) or arr.dtype != want:
                got = getattr(arr, "dtype", type(arr).__name__)
                raise TypeError(f"RoutingBatch response {i}: expected a numpy {want} array "
                                f"(num_experts={self.num_experts}), got {got}; build it with encode_routing")
            if arr.ndim != 3 or arr.shape[1:] != (self.n_layers, self.top_k):
                raise ValueError(f"RoutingBatch response {i}: shape {tuple(arr.shape)} does not match "
                                 f"[tokens, n_layers={self.n_layers}, top_k={self.top_k}]")

    def __len__(self) -> int:
        return len(self.responses)

    def lengths(self) -> list[int]:
        return [int(a.shape[0]) for a in self.responses]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.responses)

    def select(self, indices: Sequence[int]) -> RoutingBatch:
        """Responses `indices` (shares the arrays); called by RolloutBatch.select."""
        n = len(self.responses)
        picked = []
        for i in indices:
            if not -n <= int(i) < n:
                raise IndexError(f"RoutingBatch.select: index {i} out of range for {n} responses")
            picked.append(self.responses[int(i)])
        return RoutingBatch(picked, self.n_layers, self.top_k, self.num_experts)

    @classmethod
    def from_responses(cls, ids: Sequence[torch.Tensor | np.ndarray], num_experts: int) -> RoutingBatch:
        """From per-response ids [n_i, n_layers, top_k]; n_layers and top_k are read from the arrays."""
        if not ids:
            raise ValueError("RoutingBatch.from_responses needs at least one response to learn n_layers/top_k; "
                             "use RoutingBatch([], n_layers, top_k, num_experts) for an empty batch")
        arrays = [encode_routing(x, num_experts, what=f"response {i}") for i, x in enumerate(ids)]
        return cls(arrays, int(arrays[0].shape[1]), int(arrays[0].shape[2]), num_experts)

    @classmethod
    def from_steps(cls, steps: Sequence[torch.Tensor], lengths: Sequence[int], num_experts: int) -> RoutingBatch:
        """From a decode loop's per-position routing: steps[t] is [B, n_layers, top_k], the experts used at
        the forward position that sampled response token t of every row (the prefill's last position for
        t = 0); row b keeps its first lengths[b] positions (its sampled tokens, EOS included)."""
        if any(n < 0 or n > len(steps) for n in lengths):
            raise ValueError(f"RoutingBatch.from_steps: lengths {list(lengths)} must lie in [0, {len(steps)}] "
                             f"(one routing step per sampled token)")
        if not steps:
            raise ValueError("RoutingBatch.from_steps: no steps (at least one forward must have run)")
        stacked = torch.stack([s.detach().cpu() for s in steps], dim=1)  # [B, T, n_layers, top_k]
        if stacked.shape[0] != len(lengths):
            raise ValueError(f"RoutingBatch.from_steps: steps have {stacked.shape[0]} rows, lengths has {len(lengths)}")
        return cls.from_responses([stacked[b, :n] for b, n in enumerate(lengths)], num_experts)

    @classmethod
    def concat(cls, batches: Sequence[RoutingBatch]) -> RoutingBatch:
        if not batches:
            raise ValueError("RoutingBatch.concat needs at least one batch")
        meta = {(b.n_layers, b.top_k, b.num_experts) for b in batches}
        if len(meta) != 1:
            raise ValueError(f"RoutingBatch.concat: batches disagree on (n_layers, top_k, num_experts): {sorted(meta)}")
        first = batches[0]
        return cls([a for b in batches for a in b.responses], first.n_layers, first.top_k, first.num_experts)

    def to_bytes(self) -> bytes:
        code = 1 if routing_dtype(self.num_experts) == np.uint8 else 2
        header = _HEADER.pack(_MAGIC, code, self.n_layers, self.top_k, self.num_experts, len(self.responses))
        lengths = np.asarray(self.lengths(), dtype="<u8").tobytes()
        body = [np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes() for a in self.responses]
        return b"".join([header, lengths, *body])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RoutingBatch:
        """Inverse of to_bytes. The arrays are read-only views of `data` (no copy); ids are range-checked."""
        buf = memoryview(data)
        if len(buf) < _HEADER.size:
            raise ValueError(f"routing bytes: {len(buf)} bytes is shorter than the {_HEADER.size}-byte header")
        magic, code, n_layers, top_k, num_experts, count = _HEADER.unpack_from(buf, 0)
        if magic != _MAGIC:
            raise ValueError(f"routing bytes: bad magic {magic!r}, expected {_MAGIC!r}")
        if code not in _DTYPE_CODES or _DTYPE_CODES[code] != routing_dtype(num_experts):
            raise ValueError(f"routing bytes: dtype code {code} does not match num_experts={num_experts}")
        dtype = _DTYPE_CODES[code].newbyteorder("<")
        pos = _HEADER.size
        if len(buf) < pos + 8 * count:
            raise ValueError(f"routing bytes: truncated length table ({count} responses)")
        lengths = np.frombuffer(buf, dtype="<u8", count=count, offset=pos)
        pos += 8 * count
        per_token = n_layers * top_k * dtype.itemsize
        expected = pos + int(lengths.sum()) * per_token
        if len(buf) != expected:
            raise ValueError(f"routing bytes: {len(buf)} bytes, the header and lengths describe {expected}")
        arrays = []
        for i, n in enumerate(lengths.tolist()):
            arr = np.frombuffer(buf, dtype=dtype, count=n * n_layers * top_k, offset=pos)
            arr = arr.reshape(n, n_layers, top_k).astype(dtype.newbyteorder("="), copy=False)
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_experts):
                raise ValueError(f"routing bytes: response {i} has an expert id outside [0, {num_experts})")
            arrays.append(arr)
            pos += n * per_token
        return cls(arrays, n_layers, top_k, num_experts)
