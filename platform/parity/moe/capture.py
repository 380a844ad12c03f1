"""Recording, during a rollout, which experts every MoE layer used for every token of a forward.

Engine protocol (one recorder per model, reused across rollouts):

    rec = RoutingRecorder(model)
    rec.start()
    out = model(prompt_ids [B, P], ...)            # prefill
    r = rec.pop()                                   # [B, P, n_layers, top_k]; keep r[:, -1] (left padding)
    while ...:
        out = model(last_token [B, 1], past_key_values=...)
        r = rec.pop()                               # [B, 1, n_layers, top_k]; keep r[:, 0]
    rec.stop()

The kept positions are exactly those whose logits sampled a response token, which is the alignment the
codec and the trainer expect (parity.moe.codec): `RoutingBatch.from_steps(kept, lengths, rec.num_experts)`.
The engine, not the recorder, decides which positions and rows it keeps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parity.moe.codec import routing_torch_dtype
from parity.moe.routers import RouterRef, find_moe_routers


class RoutingRecorder:
    """Forward hooks on the routers (`mlp.gate`) of an HF Qwen3-MoE model.

    Records the router's returned `router_indices` [tokens, top_k], which the sparse block passes
    unchanged to its experts: exactly the experts the forward used (if routing replay is active, the
    replayed ids, since replay's hook always runs before this one). Recording happens only between
    start() and stop(); the hooks stay until close() (or the end of a `with` block).
    """

    def __init__(self, model: nn.Module) -> None:
        self._refs: list[RouterRef] = find_moe_routers(model)
        self.n_layers = len(self._refs)
        self.top_k = int(self._refs[0].router.top_k)
        self.num_experts = int(self._refs[0].router.num_experts)
        self._dtype = routing_torch_dtype(self.num_experts)
        self._active = False
        self._ids: list[torch.Tensor | None] = [None] * self.n_layers
        self._lead: list[tuple[int, ...] | None] = [None] * self.n_layers
        self._handles = []
        for ref in self._refs:
            self._handles.append(ref.block.register_forward_pre_hook(self._block_hook(ref)))
            self._handles.append(ref.router.register_forward_hook(self._router_hook(ref)))

    # A deepcopy of the model copies these hooks too; `module is ref...` keeps a copy from recording here.
    def _block_hook(self, ref: RouterRef):
        i = ref.moe_index

        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._active and module is ref.block:
                # the router sees tokens flattened; the block's input keeps the forward's [batch, seq] shape
                self._lead[i] = tuple(args[0].shape[:-1])
        return hook

    def _router_hook(self, ref: RouterRef):
        i = ref.moe_index

        def hook(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
            if not self._active or module is not ref.router:
                return
            if self._ids[i] is not None:
                raise RuntimeError(f"RoutingRecorder: MoE layer {i} ran a second forward before pop(); "
                                   "call pop() after every forward between start() and stop()")
            self._ids[i] = output[2].detach().to(self._dtype)
        return hook

    def start(self) -> None:
        self._clear()
        self._active = True

    def pop(self) -> torch.Tensor:
        """Routing of the forward since the last pop: [*lead, n_layers, top_k] where lead is the forward's
        token shape ([batch, seq] for an HF forward on input_ids [batch, seq]). Compact dtype (uint8 up to
        256 experts, else int16), on the model's device; values are the ids the experts received."""
        if not self._active:
            raise RuntimeError("RoutingRecorder.pop() outside start()/stop()")
        missing = [i for i, t in enumerate(self._ids) if t is None]
        if missing:
            what = "no forward ran" if len(missing) == self.n_layers else f"MoE layers {missing} did not run"
            raise RuntimeError(f"RoutingRecorder.pop(): {what} since the last pop")
        lead = self._lead[0]
        if lead is None or any(x != lead for x in self._lead):
            raise RuntimeError(f"RoutingRecorder.pop(): MoE layers saw different token shapes {self._lead}")
        ids = torch.stack([t for t in self._ids if t is not None], dim=1)  # [tokens, n_layers, top_k]
        self._clear()
        return ids.reshape(*lead, self.n_layers, self.top_k)

    def stop(self) -> None:
        self._active = False
        self._clear()

    def close(self) -> None:
        self.stop()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _clear(self) -> None:
        self._ids = [None] * self.n_layers
        self._lead = [None] * self.n_layers

    def __enter__(self) -> RoutingRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
