"""A KV-cache budget for the CUDA decode path (`engine.kv_budget_bytes`): how many batch rows fit in it, and a
call with more rows run as chunks that fit.

A row's cache is 2 (K, V) x layers x KV heads x slots x the bytes of one token-head: 2 head_dim for bf16, the
codec's bytes_per_token_head for a packed low-precision cache (68 against 256 for int4 at head_dim 128), so the
same budget holds 3.8x the rows with an int4 cache and decode batches grow accordingly. A chunked call gives
the rows an unchunked call would: every chunk is laid out with the whole call's prompt length, each row's draws
depend on (seed, prompt id, sample) only, and group ids keep the whole call's numbering.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch

from parity.core.sampling import SamplingSpec
from parity.types import RolloutBatch


def row_bytes(engine: Any, slots: int, dtype: torch.dtype, packed_on: bool = True) -> float:
    """KV-cache bytes of one batch row over `slots` cache slots, as the decode path would allocate it."""
    from parity.precision.kv_packed import cache_bytes_per_row
    from parity.rollout.decode_attention import use_packed
    layers = len(engine.model.model.layers)
    if packed_on and use_packed(engine, dtype):
        return cache_bytes_per_row(engine.kv_codec, layers, engine.n_kv, slots)
    return 2.0 * layers * engine.n_kv * slots * engine.head_dim * torch.empty((), dtype=dtype).element_size()


def rows_that_fit(engine: Any, slots: int, dtype: torch.dtype, packed_on: bool = True) -> int:
    """The most batch rows whose cache of `slots` slots fits in engine.kv_budget_bytes (at least one, else an
    error naming the budget)."""
    budget = float(engine.kv_budget_bytes)
    per = row_bytes(engine, slots, dtype, packed_on)
    fit = int(budget // per)
    if fit < 1:
        raise ValueError(f"engine.kv_budget_bytes={budget:.0f}: one batch row's KV cache of {slots} slots needs "
                         f"{per:.0f} bytes")
    return fit


def generate_in_chunks(engine: Any, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                       prompt_ids: list[int] | None, rows: int, prompt_len: int,
                       generate: Callable[..., RolloutBatch]) -> RolloutBatch:
    """generate(engine, prompts, spec, prompt_ids) over chunks of at most `rows` rows (whole prompts: their n
    samples stay together), prompts padded to `prompt_len`; the chunks' batches concatenated in order."""
    per = rows // spec.n
    if per < 1:
        raise ValueError(f"engine.kv_budget_bytes holds {rows} rows, fewer than one prompt's n={spec.n} samples")
    ids = list(range(len(prompt_token_ids))) if prompt_ids is None else list(prompt_ids)
    padded = replace(spec, pad_prompts_to=max(spec.pad_prompts_to, prompt_len))
    # each chunk's tensors copied at once: on CPU the decode path's batch tensors are its state buffers, which the
    # next chunk (same shapes, same state) overwrites
    parts = [_own(generate(engine, prompt_token_ids[i:i + per], padded, ids[i:i + per]))
             for i in range(0, len(prompt_token_ids), per)]
    out = concat_batches(parts, group_offsets=list(range(0, len(prompt_token_ids), per)))
    out.meta["kv_budget_chunks"] = len(parts)
    return out


def _own(b: RolloutBatch) -> RolloutBatch:
    return replace(b, **{f.name: getattr(b, f.name).clone() for f in fields(b)
                         if isinstance(getattr(b, f.name), torch.Tensor)})


def concat_batches(parts: list[RolloutBatch], group_offsets: list[int]) -> RolloutBatch:
    """Row-wise concatenation of batches of one layout (same prompt and response lengths); the group ids of
    part i are shifted by group_offsets[i] (they number prompts within a call)."""
    first = parts[0]
    out: dict = {}
    for f in fields(RolloutBatch):
        vals = [getattr(p, f.name) for p in parts]
        if f.name == "group_ids":
            out[f.name] = torch.cat([v + off for v, off in zip(vals, group_offsets)])
        elif isinstance(vals[0], torch.Tensor):
            out[f.name] = torch.cat(vals)
        elif isinstance(vals[0], list):
            out[f.name] = [x for v in vals for x in v]
        elif f.name == "meta":
            out[f.name] = dict(vals[0])
        else:
            out[f.name] = vals[0]
    return replace(first, **out)
