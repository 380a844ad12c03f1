"""A decode call's state (`DecodeState`: every buffer its captured steps read and write) and its long tail.

A sampled call decodes until its longest response ends, while most rows ended long before and only write pad tokens.
With an engine's `compact_tail` (rollout.compact_tail), `next_tail` moves the unfinished rows to a state of half as
many rows a run (then a quarter, ...) once at most half of every run's rows are unfinished: its cache, per-row
buffers and step counter gathered from the call's state, its own graphs, the same compiled functions and weights;
`scatter_rows` puts its results back into the call's buffers at the end. Each row's arithmetic is the same except
where a product's result depends on how many rows it multiplies (a float GEMM may pick another kernel; integer
products do not). A cohort's tail state keeps the same number of rows for every run (the batched products take run
i's rows with run i's weights), as many as the run with the most unfinished rows needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DecodeState:
    """Every tensor a decode step reads or writes; fixed addresses so a graph can replay over them."""

    key: tuple
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    cos: torch.Tensor
    sin: torch.Tensor
    t: torch.Tensor  # [1] long: the step being sampled
    start: torch.Tensor  # [1] long: P, the cache slot of response token 0
    plen: torch.Tensor  # [B] long: real prompt lengths (rope position of response token 0)
    key_ok: torch.Tensor  # [B, S] bool: real prompt tokens and response slots
    uniforms: torch.Tensor  # [B, R] float64
    logits: torch.Tensor  # [B, V] float32: the logits the next sample draws from
    tok: torch.Tensor  # [B] long
    done: torch.Tensor  # [B] bool
    responses: torch.Tensor
    rmask: torch.Tensor
    logps: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_lp: torch.Tensor | None
    graphs: dict = field(default_factory=dict)  # attended cache length L -> captured decode step
    pool: Any = None  # one memory pool shared by the graphs (they never replay concurrently)
    extras: dict = field(default_factory=dict)


ROW_FIELDS = ("plen", "key_ok", "uniforms", "logits", "tok", "done", "responses", "rmask", "logps", "topk_ids",
               "topk_lp")
RESULT_FIELDS = ("done", "responses", "rmask", "logps", "topk_ids", "topk_lp")


def cache_tensors(st: DecodeState) -> list[torch.Tensor]:
    """Every row-first tensor of the state's KV cache (plain K/V pairs, or a packed cache's codes and scales); FP8
    codes as their bytes (a row gather copies bits, and not every index kernel takes float8)."""
    out = []
    for c in st.caches:
        parts = (c.k, c.v, c.k_scale, c.v_scale) if hasattr(c, "k_scale") else c
        out.extend(t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
                   for t in parts if t is not None)
    return out


def gather_rows(dst: DecodeState, src: DecodeState, rows: torch.Tensor) -> None:
    """dst's cache, per-row buffers and step counters := src's rows `rows`, in place (dst's graphs read them)."""
    for a, b in zip(cache_tensors(dst), cache_tensors(src), strict=True):
        torch.index_select(b, 0, rows, out=a)
    for f in ROW_FIELDS:
        a, b = getattr(dst, f), getattr(src, f)
        if a is not None:
            torch.index_select(b, 0, rows, out=a)
    if "forced" in dst.extras:
        torch.index_select(src.extras["forced"], 0, rows, out=dst.extras["forced"])
    dst.t.copy_(src.t)
    dst.start.copy_(src.start)


def scatter_rows(dst: DecodeState, src: DecodeState, rows: torch.Tensor, live: torch.Tensor) -> None:
    """dst's results (tokens, masks, log-probs, done flags) of the rows src decoded on (`rows[live]`) := src's."""
    sel = live.nonzero().squeeze(1)
    for f in RESULT_FIELDS:
        a, b = getattr(dst, f), getattr(src, f)
        if a is not None:
            a.index_copy_(0, rows.index_select(0, sel), b.index_select(0, sel))


def next_tail(dec: Any, st: DecodeState, runs: int, use_graphs: bool, min_rows: int
              ) -> tuple[DecodeState, DecodeState, torch.Tensor, torch.Tensor] | None:
    """When at most half of every run's rows are still decoding: a state of half as many rows a run (or a quarter,
    ...; at least `min_rows`) holding them, each run's unfinished rows first in their order, then finished rows of
    the same run filling it (they decode pad tokens nobody reads). (st, tail state, the rows of st it holds, which of
    them were unfinished); None when no smaller state fits. A kept tail state of that size (with its captured graphs)
    is reused. `dec`: the CudaDecoder."""
    B = st.done.shape[0]
    per = B // runs
    live = (~st.done).view(runs, per)
    most = int(live.sum(1).max())
    b = per
    while b % 2 == 0 and b // 2 >= max(most, min_rows):
        b //= 2
    if b == per:
        return None
    # each run's unfinished rows first, in their order (a stable sort on the done flag), then finished ones
    order = torch.sort(st.done.view(runs, per).to(torch.int32), dim=1, stable=True).indices[:, :b]
    rows = (order + torch.arange(runs, device=order.device)[:, None] * per).reshape(-1)
    kept = live.gather(1, order).reshape(-1)
    tails = st.extras.setdefault("tails", {})
    child = tails.get(b * runs)
    if child is None:
        child = tails[b * runs] = _tail_state(dec, st, b * runs, use_graphs)
    gather_rows(child, st, rows)
    return st, child, rows, kept


def _tail_state(dec: Any, st: DecodeState, rows: int, use_graphs: bool) -> DecodeState:
    """A state of `rows` rows with st's shapes otherwise, sharing its compiled functions and weights."""
    _, S, R, K = st.key[:4]
    child = dec.new_state((rows, *st.key[1:], "tail"), rows, S, R, K, st.key[6])
    for k in ("fns", "fused", "prepared", "layers"):
        child.extras[k] = st.extras[k]
    child.extras["fused_sampler"] = st.extras.get("fused_sampler", False)  # its graphs draw as the parent's do
    if "int8_pinned" in st.extras and use_graphs:
        from parity.precision import int8_triton
        from parity.rollout.decode_weights import _int8_triton_shapes
        child.extras["int8_pinned"] = int8_triton.tune_decode(rows // getattr(dec.engine, "runs", 1),
                                                              _int8_triton_shapes(st.extras["layers"]),
                                                              dec.engine.device)
    if "forced" in st.extras:
        child.extras["forced"] = torch.empty_like(st.extras["forced"][:rows])
    return child


__all__ = ["DecodeState", "next_tail", "gather_rows", "scatter_rows"]
