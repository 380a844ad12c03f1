"""Routing replay (R3): the training forward of an HF MoE model uses the experts the rollout used.

For a marked token the router's selection is replaced by the recorded ids; its gate weights are still
computed from the live router logits, w = softmax(logits)[forced ids] (renormalised over the k ids when
the router has norm_topk_prob), so the loss is differentiable in the router weights. Unmarked tokens
(prompt, padding) keep the live routing, bit for bit. Trainer usage, per micro-batch:

    replay = enable_routing_replay(model)                   # once; hooks stay until replay.remove()
    ids, mask = rollout_replay_inputs(batch.routed_experts, batch.response_mask, batch.prompts.shape[1])
    with replayed_routing(model, ids, mask):                # covers backward: gradient checkpointing
        logits = model(input_ids=batch.input_ids, ...).logits   # recomputes the forward inside backward
        loss.backward()

The replay tensors must describe exactly the tokens of each forward ([B, T] flattened as the model
flattens them); any disagreement in token count, layer count or top-k raises instead of misaligning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parity.moe.capture import RoutingRecorder
from parity.moe.codec import RoutingBatch, routing_torch_dtype
from parity.moe.decode import decode_streaming
from parity.moe.routers import RouterRef, find_moe_routers, router_device

_ATTR = "_parity_routing_replay"
_SLOT = "_parity_replay_slot"
DISAGREEMENT = "r3/routing_disagreement"
DISAGREEMENT_REPLAYED = "r3/routing_disagreement_replayed"


@dataclass
class _ReplayState:
    ids: torch.Tensor  # [N, n_layers, top_k], compact dtype, router device
    mask: torch.Tensor  # [N] bool, True = replay this token
    shape: tuple[int, int]  # the [B, T] the ids were given for (error messages)


class RoutingReplay:
    """Replay hooks on every MoE router of a model (create with `enable_routing_replay`)."""

    def __init__(self, model: nn.Module) -> None:
        self._refs: list[RouterRef] = find_moe_routers(model)
        self._model = model
        self.n_layers = len(self._refs)
        self.top_k = int(self._refs[0].router.top_k)
        self.num_experts = int(self._refs[0].router.num_experts)
        self._state: _ReplayState | None = None
        for ref in self._refs:
            # the hook finds its replay through the router, not a closure, so a deepcopy of the model
            # (e.g. a reference policy) carries a working, independent replay of its own
            object.__setattr__(ref.router, _SLOT, (self, ref.moe_index, ref.name))
        # prepend: replay rewrites the router output before any other hook (e.g. a RoutingRecorder) sees it
        self._handles = [ref.router.register_forward_hook(_replay_hook, prepend=True) for ref in self._refs]

    @property
    def active(self) -> bool:
        return self._state is not None

    def set(self, ids: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """ids [B, T, n_layers, top_k] (any integer dtype/device) and mask [B, T] bool (None = all tokens);
        ids=None turns replay off (live routing)."""
        if ids is None:
            self._state = None
            return
        if ids.ndim != 4:
            raise ValueError(f"replay routing: expected ids [B, T, n_layers, top_k], got shape {tuple(ids.shape)}")
        b, t, n_layers, top_k = (int(x) for x in ids.shape)
        if n_layers != self.n_layers:
            raise ValueError(f"replay routing has {n_layers} MoE layers, the model has {self.n_layers} "
                             f"({self._refs[0].name} ... {self._refs[-1].name})")
        if top_k != self.top_k:
            raise ValueError(f"replay routing has top_k={top_k}, the model's routers use top_k={self.top_k}")
        if mask is None:
            mask = torch.ones(b, t, dtype=torch.bool)
        if tuple(mask.shape) != (b, t):
            raise ValueError(f"replay mask has shape {tuple(mask.shape)}, ids cover [B={b}, T={t}]")
        if mask.dtype != torch.bool:
            raise TypeError(f"replay mask must be bool, got {mask.dtype}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"replay routing ids must be integers, got {ids.dtype}")
        _check_ids(ids, mask, self.num_experts)
        device = router_device(self._refs)
        mask = mask.to(device)
        # unmarked positions may hold padding (e.g. -1): zero them so the hook's gather stays in range
        ids = torch.where(mask[:, :, None, None], ids.to(device), 0)
        compact = ids.to(dtype=routing_torch_dtype(self.num_experts))
        self._state = _ReplayState(compact.reshape(b * t, n_layers, top_k), mask.reshape(b * t), (b, t))

    def remove(self) -> None:
        self._state = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ref in self._refs:
            ref.router.__dict__.pop(_SLOT, None)
        if getattr(self._model, _ATTR, None) is self:
            delattr(self._model, _ATTR)

    def __enter__(self) -> RoutingReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _replay_hook(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]):
    replay, layer, name = module.__dict__[_SLOT]
    st = replay._state
    if st is None:
        return None
    logits, live_weights, live_idx = output
    n = int(logits.shape[0])
    if n != st.ids.shape[0]:
        raise ValueError(f"replay routing covers {st.shape[0]}x{st.shape[1]} = {st.ids.shape[0]} tokens, "
                         f"but router {name} sees {n} tokens in this forward")
    forced = st.ids[:, layer].to(torch.long)
    # the router's own rule (softmax in at least fp32, gather, renormalise) at the forced ids
    weights = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    weights = weights.gather(-1, forced)
    if module.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    keep = st.mask[:, None]
    # unmarked tokens keep the router's own output untouched (bit for bit)
    return (logits, torch.where(keep, weights.to(live_weights.dtype), live_weights),
            torch.where(keep, forced, live_idx))


def _check_ids(ids: torch.Tensor, mask: torch.Tensor, num_experts: int) -> None:
    marked = ids[mask.to(ids.device)]  # [M, n_layers, top_k]
    if marked.numel() == 0:
        return
    lo, hi = int(marked.min()), int(marked.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"replay routing: expert id out of range [0, {num_experts}) on a marked token "
                         f"(min {lo}, max {hi}); padding positions must be unmarked in the mask")
    srt = marked.sort(dim=-1).values
    if bool((srt[..., 1:] == srt[..., :-1]).any()):
        raise ValueError("replay routing: a marked token lists the same expert twice in one layer")


def enable_routing_replay(model: nn.Module) -> RoutingReplay:
    """Install replay hooks on `model` (idempotent); replay stays inactive until set_replay_routing.
    Usable as a context manager, which removes the hooks on exit."""
    existing = getattr(model, _ATTR, None)
    if isinstance(existing, RoutingReplay):
        return existing
    replay = RoutingReplay(model)
    object.__setattr__(model, _ATTR, replay)
    return replay


def set_replay_routing(model: nn.Module, ids: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
    """Routing for the next forwards of `model`: ids [B, T, n_layers, top_k], mask [B, T] (see RoutingReplay.set)."""
    replay = getattr(model, _ATTR, None)
    if not isinstance(replay, RoutingReplay):
        raise RuntimeError("set_replay_routing: call enable_routing_replay(model) first")
    replay.set(ids, mask)


@contextmanager
def replayed_routing(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None) -> Iterator[None]:
    """Replay `ids` for the forwards (and backward recomputations) inside the block, then restore."""
    replay = enable_routing_replay(model)
    saved = replay._state
    replay.set(ids, mask)
    try:
        yield
    finally:
        replay._state = saved


def check_routing_matches_model(routing: RoutingBatch, model: nn.Module) -> None:
    """Clear error when a batch's routing was recorded on a model of another MoE shape."""
    refs = find_moe_routers(model)
    have = (len(refs), int(refs[0].router.top_k), int(refs[0].router.num_experts))
    got = (routing.n_layers, routing.top_k, routing.num_experts)
    for name, g, h in zip(("n_layers (MoE layers)", "top_k", "num_experts"), got, have):
        if g != h:
            raise ValueError(f"routed_experts has {name}={g}, the training model has {h}")


def rollout_replay_inputs(routing: RoutingBatch, response_mask: torch.Tensor, prompt_len: int,
                          device: torch.device | str | None = None,
                          model: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Place a batch's per-response routing on the training sequence cat(prompts, responses) [B, P + R].

    Response token j's routing goes to position P - 1 + j (the position whose logits give its log-prob,
    parity.moe.codec); returns ids [B, P + R, n_layers, top_k] (compact dtype, 0 where unmarked) and the
    mask [B, P + R]. Each response's routing length must equal its number of sampled tokens; with
    `model`, the routing's layer count, top-k and expert count must equal the model's."""
    if model is not None:
        check_routing_matches_model(routing, model)
    if response_mask.ndim != 2:
        raise ValueError(f"response_mask must be [B, R], got shape {tuple(response_mask.shape)}")
    b, r = (int(x) for x in response_mask.shape)
    if len(routing) != b:
        raise ValueError(f"routed_experts holds {len(routing)} responses, the batch has {b} rows")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1 (the last prompt position routes response token 0), got {prompt_len}")
    resp = response_mask.to(torch.bool).cpu()
    lengths = resp.sum(-1).tolist()
    for row, (n_routing, n_tokens) in enumerate(zip(routing.lengths(), lengths)):
        if n_routing != n_tokens:
            raise ValueError(f"routed_experts row {row}: routing for {n_routing} tokens, the response has "
                             f"{n_tokens} sampled tokens")
        if not bool(resp[row, :n_tokens].all()):
            raise ValueError(f"response_mask row {row} is not right-padded (a gap before its last token)")
    dtype = routing_torch_dtype(routing.num_experts)
    ids = torch.zeros((b, prompt_len + r, routing.n_layers, routing.top_k), dtype=dtype, device=device)
    decode_streaming(routing, ids[:, prompt_len - 1:prompt_len - 1 + r], pad_value=0)
    mask = torch.zeros((b, prompt_len + r), dtype=torch.bool, device=device)
    mask[:, prompt_len - 1:prompt_len - 1 + r] = resp.to(mask.device)
    return ids, mask


def routing_disagreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Fraction of (token, layer) decisions whose expert sets differ (order inside top-k ignored).
    a, b [..., n_layers, top_k]; mask [...] selects tokens (None = all). 0.0 when nothing is selected."""
    if a.shape != b.shape:
        raise ValueError(f"routing_disagreement: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    differs = (a.long().sort(-1).values != b.to(a.device).long().sort(-1).values).any(-1)  # [..., n_layers]
    if mask is not None:
        if tuple(mask.shape) != tuple(differs.shape[:-1]):
            raise ValueError(f"routing_disagreement: mask shape {tuple(mask.shape)} != tokens {tuple(differs.shape[:-1])}")
        differs = differs[mask.to(differs.device, torch.bool)]
    total = differs.numel()
    return float(differs.sum().item()) / total if total else 0.0


@torch.no_grad()
def routing_disagreement_metrics(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                                 **forward_kwargs: Any) -> dict[str, float]:
    """Telemetry: disagreement of a plain training forward with the rollout (r3/routing_disagreement) and
    of the replayed forward (r3/routing_disagreement_replayed, 0 when replay works), on the marked tokens.
    Runs two no-grad forwards `model(**forward_kwargs)` (e.g. input_ids=..., attention_mask=...)."""
    replay = enable_routing_replay(model)
    saved = replay._state
    try:
        with RoutingRecorder(model) as rec:
            rec.start()
            replay.set(None)
            model(**forward_kwargs)
            live = rec.pop()
            replay.set(ids, mask)
            model(**forward_kwargs)
            used = rec.pop()
    finally:
        replay._state = saved
    if live.shape != ids.shape:
        raise ValueError(f"routing_disagreement_metrics: the forward routed tokens {tuple(live.shape)}, "
                         f"replay ids have shape {tuple(ids.shape)}")
    return {DISAGREEMENT: routing_disagreement(live, ids, mask),
            DISAGREEMENT_REPLAYED: routing_disagreement(used, ids, mask)}
