"""The policy trainer sharded over data-parallel processes with PyTorch FSDP2 (`fully_shard`), one code path for
CPU (gloo) and GPU (nccl). The caller forms the torch.distributed process group first (parity.distributed does,
one Ray actor per rank); `ShardedTrainer(model, cfg, device)` then shards the model in place.

What each rank holds and does, per RL step:
  - 1/W of every parameter, gradient and AdamW moment (dim-0 shards, DTensors); sharding units are each decoder
    layer and a root module (`PolicyRoot`) around the causal LM, whose forward runs the model body *and* the
    head function (log-probs, loss), so the root's parameters (embeddings, final norm, lm_head) are gathered
    exactly while they are used.
  - the whole batch: advantages and the loss denominators come from all rows, as in the single-process Trainer;
    each mini-batch's rows are split contiguously over the ranks (near-equal), so each rank's loss is its share
    of the single-process loss. The reduce-scatter *sums* the gradients (divide factor 1), so the summed gradient
    is the single-process gradient for every algorithm.loss_agg_mode.
  - the same number of micro-batch passes on every rank (FSDP's all-gathers and reduce-scatters must pair up):
    a rank with fewer rows runs zero-loss passes on one row.
  - the global gradient norm (over all shards) clips, AdamW steps the local shards.
  - step metrics (sums, maxes) and the corrections' step sums are added over ranks before they are used, so the
    metrics and e.g. dual's lambda equal the single-process ones to float rounding.

Weights and checkpoints leave in the single-process layout: `sync_weights` and `full_state` gather full
tensors (collectives: every rank must call them, in the same order); `load_state_dict` takes that layout and
keeps each rank's shard, so a checkpoint resumes with any number of ranks, or none.

Not supported sharded (a config error names distributed.trainer_workers): MoE routing replay, which runs extra
forwards outside the root module."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from parity.algorithms.mismatch import StepMetrics
from parity.core.device import compute_dtype
from parity.errors import ParityError
from parity.training.trainer import Trainer, position_ids
from parity.types import RolloutBatch

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig


class PolicyRoot(nn.Module):
    """The FSDP root: the causal LM's body, then `head(hidden, lm_head weight)`, in one forward."""

    def __init__(self, lm: nn.Module, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.lm = lm
        self.compute_dtype = compute_dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                head: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        # the same operations as Trainer.response_hidden / head_weight
        ctx = (contextlib.nullcontext() if self.compute_dtype == torch.float32
               else torch.autocast(input_ids.device.type, dtype=self.compute_dtype))
        with ctx:
            out = self.lm.model(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids(attention_mask))
        hidden = out.last_hidden_state[:, prompt_len - 1:-1]
        w = self.lm.lm_head.weight
        return head(hidden, w if w.dtype == self.compute_dtype else w.to(self.compute_dtype))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ParityError(f"sharded trainer: {type(model).__name__} has no model.layers to shard (config key "
                          "`distributed.trainer_workers`)")
    return list(layers)


def rank_rows(rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of `rows` (the first len % world ranks take one more)."""
    base, extra = divmod(len(rows), world)
    start = rank * base + min(rank, extra)
    return rows[start:start + base + (1 if rank < extra else 0)]


def _full(t: Any) -> Any:
    """The whole tensor of a DTensor shard (an all-gather: collective); anything else as it is."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


class ShardedTrainer(Trainer):
    def __init__(self, model: nn.Module, cfg: ParityConfig, device: torch.device,
                 measured_discrepancy: float | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not dist.is_initialized():
            raise ParityError("the sharded trainer needs a torch.distributed process group (parity.distributed "
                              "forms one when distributed.trainer_workers > 1)")
        if cfg.algorithm.routing_replay or cfg.rollout.capture_routing:
            raise ParityError("config key `distributed.trainer_workers`: MoE routing replay is not supported by the "
                              "sharded trainer; use distributed.trainer_workers=1")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model = model.to(device)
        mesh = init_device_mesh(device.type, (self.world,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        self.root = PolicyRoot(model, compute_dtype(cfg.model.dtype, device))
        fully_shard(self.root, mesh=mesh)
        for m in self.root.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum, not mean: each rank's loss already has the global scale
                m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no AVG / PREMUL_SUM)
                m.set_reduce_scatter_unused_params(True)  # an MoE expert no row of this rank used still pairs up
        super().__init__(model, cfg, device, measured_discrepancy=measured_discrepancy)  # AdamW over the shards
        self._batch: RolloutBatch | None = None

    # ---- the policy runs inside the FSDP root's forward ----

    def policy_forward(self, mb: RolloutBatch, head: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        return self.root(mb.input_ids.to(self.device), mb.attention_mask.to(self.device), mb.prompts.shape[1], head)

    def _passes(self, mini: torch.Tensor) -> int:
        """Micro-batch passes every rank makes on `mini`: rank 0's count (it holds the most rows)."""
        return math.ceil(math.ceil(len(mini) / self.world) / self.tcfg.micro_batch_size)

    def _idle_pass(self, grad: bool) -> None:
        """A pass that contributes nothing (loss 0 on one row) but runs the collectives of a real one; its
        gradient touches every parameter, like a real micro-batch."""
        assert self._batch is not None
        mb = self._batch.select(torch.arange(1)).to(self.device)

        def zero(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (h.float().sum() + w.float().sum()) * 0.0
        if grad:
            self.policy_forward(mb, zero).backward()
        else:
            with torch.no_grad():
                self.policy_forward(mb, zero)

    def _micro_batches(self, idx: torch.Tensor) -> Iterator[torch.Tensor]:
        mine = rank_rows(idx, self.rank, self.world)
        real = list(mine.split(self.tcfg.micro_batch_size)) if len(mine) else []
        yield from real
        for _ in range(self._passes(idx) - len(real)):  # runs after the caller's last real pass
            self._idle_pass(grad=True)

    def _old_logprobs(self, batch: RolloutBatch, order: torch.Tensor) -> torch.Tensor:
        old = torch.zeros(batch.responses.shape, dtype=torch.float32, device=self.device)
        for mini in order.chunk(self.tcfg.mini_batches):
            mine = rank_rows(mini, self.rank, self.world)
            real = list(mine.split(self.tcfg.micro_batch_size)) if len(mine) else []
            for rows in real:
                old[rows.to(self.device)] = self.logprobs(batch.select(rows))
            for _ in range(self._passes(mini) - len(real)):
                self._idle_pass(grad=False)
        self.root.reshard()  # no-grad forwards leave the root gathered; training expects the sharded parameters
        return old

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        batch = self._shaped(batch)  # here already, so the ranks' bookkeeping sees the widths the step does
        self._batch = batch
        try:
            return super().step(batch)
        finally:
            self._batch = None

    # ---- reductions over ranks ----

    def _reduce_and_clip(self, total: float) -> tuple[float, torch.Tensor]:
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        t = torch.tensor([total], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = _full(get_total_norm([p.grad for p in params], 2.0))  # norm over every rank's shards
        clip_grads_with_norm_(params, self.tcfg.grad_clip, norm)
        return float(t.item()), norm

    def _reduce_step_state(self, metrics: StepMetrics) -> None:
        metrics.all_reduce(device=self.device)
        sums = self.corrections.step_sums()
        if sums:
            keys = sorted(sums)
            t = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            self.corrections.set_step_sums(dict(zip(keys, t.cpu().tolist(), strict=True)))

    # ---- weights and state in the single-process layout ----

    def sync_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, one at a time (collective: every rank must drain the iterator)."""
        for name, p in self.model.named_parameters():
            yield name, _full(p.detach()).to(self.compute_dtype)

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with full tensors on the CPU (collective); tied parameters stay one tensor."""
        out: dict[str, torch.Tensor] = {}
        seen: dict[int, torch.Tensor] = {}
        for key, v in self.model.state_dict(keep_vars=True).items():
            if id(v) not in seen:
                seen[id(v)] = _full(v.detach()).cpu()
            out[key] = seen[id(v)]
        return out

    def state_dict(self) -> dict:
        """As Trainer.state_dict, with the optimizer's moments gathered (collective)."""
        state = super().state_dict()
        opt = state["optimizer"]
        opt["state"] = {i: {k: _full(v).cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                        for i, s in sorted(opt["state"].items())}
        return state

    def load_state_dict(self, state: dict) -> None:
        """From the single-process layout: every rank keeps its own shard of each moment (no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        opt = dict(state["optimizer"])
        shards = {}
        for i, s in opt["state"].items():
            p = params[int(i)]
            own = {}
            for k, v in s.items():
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape):
                    v = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                own[k] = v
            shards[i] = own
        opt["state"] = shards
        super().load_state_dict({**state, "optimizer": opt})


class GatheredModel:
    """What CheckpointManager.save needs of a model (save_pretrained), writing gathered full weights."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.model, self.state = model, state

    def save_pretrained(self, path: str, **kw: Any) -> None:
        self.model.save_pretrained(path, state_dict=self.state, **kw)


__all__ = ["ShardedTrainer", "PolicyRoot", "GatheredModel", "rank_rows"]
