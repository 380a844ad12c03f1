"""The policy trainer: one RL update from a graded RolloutBatch.

fp32 master weights, BF16 compute (autocast) when model.dtype=bfloat16. Per RL step: advantages from the
batch's rewards; for each mini-batch the loss denominators are fixed once (so the gradient does not depend on
the micro-batch split), micro-batches accumulate gradients, then clip and AdamW. A non-finite loss or gradient
skips the optimizer step, is counted, and `max_bad_steps` in a row stop the run.

One class per way the policy's forward and backward run, over the one `Trainer.step`: `Trainer` on one device,
`LaneTrainer` on CPU lanes (parity.cpu_lanes), `parity.training.sharded.ShardedTrainer` over FSDP ranks;
`build_trainer` picks the first two from the config and the device."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from parity.algorithms.advantages import compute_advantages
from parity.algorithms.aggregation import loss_denominators
from parity.algorithms.corrections import build_corrections
from parity.algorithms.corrections.base import token_rows
from parity.algorithms.drift import drift_metrics
from parity.algorithms.logprobs import chunked_token_logprobs
from parity.algorithms.mismatch import StepMetrics
from parity.algorithms.objective import Objective
from parity.core.device import compute_dtype
from parity.core.fast_compile import compile_decoder_layers_
from parity.cpu_lanes import check_lanes, in_lane, run_in_lanes, split_rows
from parity.errors import ParityError
from parity.moe.replay import replayed_routing, rollout_replay_inputs, routing_disagreement_metrics
from parity.precision.config import resolve_precision
from parity.precision.perturbation import DriftProbe
from parity.training.shared_prefix import shared_prefix_hidden
from parity.types import RolloutBatch

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

log = logging.getLogger(__name__)

class NonFiniteError(ParityError):
    pass


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def attention_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """The [b, 1, L, L] boolean mask a causal LM's attention takes (True: attend): a real position attends to the
    real positions up to itself, as the 2D mask says, and a padding position attends to itself as well, so that no
    query attends to nothing. A left-padding position's row is otherwise empty, and an attention kernel may then
    give NaN there (0/0 in its softmax or in the softmax's backward), which reaches every gradient even though no
    real position reads it. Real positions' outputs are those of the 2D mask: no real query sees a padding key."""
    keep = attention_mask.bool()
    L = keep.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=keep.device).tril()
    mask = causal[None] & keep[:, None, :]
    mask |= torch.eye(L, dtype=torch.bool, device=keep.device)[None] & ~keep[:, :, None]
    return mask[:, None]


def check_token_ids(batch: RolloutBatch, vocab: int) -> bool:
    """Raise ValueError naming the field and row when a response token (under the mask) or a top-K id lies
    outside [0, vocab) (negative top-K ids are padding); True when checked here, False when the batch is not on
    the host (then the log-prob head checks on the device, at the cost of a sync)."""
    if batch.responses.is_cuda:
        return False
    for name, ids, where in (("responses", batch.responses, batch.response_mask.bool()),
                             ("topk_ids", batch.topk_ids, None)):
        if ids is None:
            continue
        bad = ids >= vocab
        if where is not None:  # response tokens: negative ids are bad too, padding positions are not checked
            bad = (bad | (ids < 0)) & where
        if bool(bad.any()):
            row = int(bad.reshape(bad.shape[0], -1).any(-1).nonzero()[0, 0])
            raise ValueError(f"RolloutBatch.{name}: row {row} holds token ids outside [0, {vocab}) (the lm_head's "
                             f"vocabulary), e.g. {int(ids[row][bad[row]][0])}")
    return True


class Trainer:
    """The policy on one device; its subclasses change where the forward and backward run, not the step."""

    lanes = 1  # CPU lanes the micro-batches run in (LaneTrainer)

    def __init__(self, model: torch.nn.Module, cfg: ParityConfig, device: torch.device,
                 reference_dir: str | None = None, measured_discrepancy: float | None = None) -> None:
        """`reference_dir`: the run's starting model (theta_0); with a rollout perturbation on, each step then
        reports drift/delta_cosine, how far the policy moved along the sampler's bias. `measured_discrepancy`: the
        validate stage's mean |p_train - p_inf| for algorithm.correction.tolerance=auto (parity.training.tolerance),
        None to measure it over the first steps."""
        self.model, self.cfg, self.device = model.to(device), cfg, device
        self.alg, self.tcfg = cfg.algorithm, cfg.trainer
        self.compute_dtype = compute_dtype(cfg.model.dtype, device)
        self.temperature = float(cfg.rollout.temperature)
        params = list(self.model.parameters())
        # CUDA: one fused AdamW kernel over all parameters instead of a dozen multi-tensor passes
        fused = device.type == "cuda" and all(p.is_floating_point() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=self.tcfg.lr, betas=tuple(self.tcfg.betas),
                                           weight_decay=self.tcfg.weight_decay, **({"fused": True} if fused else {}))
        self.corrections = build_corrections(self.alg.correction, measured_discrepancy=measured_discrepancy)
        self.objective = Objective(self.alg, self.corrections)  # policy loss and aggregation resolved once
        self.bad_steps = 0  # consecutive non-finite steps
        self.skipped_steps = 0
        self.shared_prefix = self._shared_prefix_mode()
        if self.tcfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        # compiled layers replayed as CUDA graphs (Inductor's cudagraph trees): only on CUDA
        self.graph_replay = bool(self.tcfg.compile_layers) and str(self.tcfg.compile_mode) == "reduce-overhead" \
            and device.type == "cuda"
        if self.tcfg.compile_layers:
            mode = str(self.tcfg.compile_mode)
            compile_decoder_layers_(self.model, mode=None if mode == "default" else mode)
        self.routing_replay = bool(cfg.algorithm.routing_replay)
        self.rl_steps = 0  # RL steps taken (= weight syncs the rollout engine has had when the next batch is sampled)
        self.drift_probe = None
        if reference_dir is not None:
            self.drift_probe = DriftProbe.from_precision(resolve_precision(cfg), reference_dir, device)

    def _shared_prefix_mode(self) -> bool:
        """trainer.shared_prefix: auto = on CPU; off wherever the decoder layers' own forward must run (gradient
        checkpointing and compiled layers live there)."""
        mode = str(self.tcfg.shared_prefix).strip().lower()
        if mode not in ("auto", "on", "off", "true", "false"):
            raise ParityError(f"config key `trainer.shared_prefix`: auto, on or off, got {mode!r}")
        if mode in ("off", "false") or self.tcfg.gradient_checkpointing or self.tcfg.compile_layers:
            return False
        return mode in ("on", "true") or self.device.type == "cpu"

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def response_hidden(self, mb: RolloutBatch) -> torch.Tensor:
        """Final-norm hidden states at the positions that predict each response token: [b, R, H] (each prompt computed
        once for its responses where trainer.shared_prefix is on, parity.training.shared_prefix)."""
        return self._hidden(mb)

    def _own_grads(self) -> None:
        """Under graph replay, a parameter whose .grad was None takes the backward graph's output tensor itself,
        which lives in the graphs' memory pool and is overwritten by the next micro-batch's replay (on the H200 the
        step then failed with "accessing tensor output of CUDAGraphs that has been overwritten"): copies made
        here are the step's own. A copy of the weights' size per micro-batch."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad = p.grad.clone()

    def _after_backward(self) -> None:
        """After each micro-batch's loss.backward(), inside its routing-replay block: where a mode's forward left
        gradient work of its own (LaneTrainer)."""

    def _hidden(self, mb: RolloutBatch) -> torch.Tensor:
        if self.shared_prefix and mb.routed_experts is None:
            with self._autocast():
                h = shared_prefix_hidden(self.model, mb.prompts, mb.prompt_mask, mb.responses, mb.response_mask)
            if h is not None:
                return h
        ids, am = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
        P = mb.prompts.shape[1]
        # padded to a multiple of tokens: every row has left padding, whose query rows would attend to nothing
        # (a boolean 4D mask is what HF's SDPA attention takes as is; its eager attention adds the mask as a bias)
        sdpa = getattr(self.model.config, "_attn_implementation", "sdpa") == "sdpa"
        mask = attention_mask_4d(am) if self.tcfg.pad_to_multiple and sdpa else am
        with self._autocast():
            # use_cache=False: training needs no KV cache (HF builds one by default: memory, and under
            # trainer.compile_layers a per-layer guard on it that recompiled every layer)
            out = self.model.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(am), use_cache=False)
        return out.last_hidden_state[:, P - 1:-1]

    def head_weight(self) -> torch.Tensor:
        """lm_head in the compute dtype (bf16 products use tensor cores; the cast is differentiable, so the
        fp32 master weight still receives the gradient)."""
        w = self.model.lm_head.weight
        return w if w.dtype == self.compute_dtype else w.to(self.compute_dtype)

    def policy_forward(self, mb: RolloutBatch, head: Callable[[torch.Tensor, torch.Tensor], Any]) -> Any:
        """`head(hidden, lm_head weight)` on a micro-batch: the one place the policy runs, so the sharded trainer
        (parity.training.sharded) can run it inside its root module's forward."""
        if self.graph_replay:
            # a new step of Inductor's cudagraph trees before each micro-batch: its forward's outputs (saved for its
            # backward) get their own generation instead of sharing one with the previous micro-batch's
            torch.compiler.cudagraph_mark_step_begin()
        return head(self.response_hidden(mb), self.head_weight())

    @torch.no_grad()
    def logprobs(self, mb: RolloutBatch) -> torch.Tensor:
        def head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            b, R, H = h.shape
            lp = chunked_token_logprobs(h.reshape(b * R, H), w, mb.responses.to(self.device).reshape(b * R, 1),
                                        self.temperature)
            return lp.reshape(b, R).float() * mb.response_mask.to(self.device)
        return self.policy_forward(mb, head)

    def _routing(self, mb: RolloutBatch, metrics: StepMetrics) -> contextlib.AbstractContextManager:
        """MoE routing replay (R3): force the rollout's experts on the positions that predict response tokens."""
        if mb.routed_experts is None:
            return contextlib.nullcontext()
        ids, mask = rollout_replay_inputs(mb.routed_experts, mb.response_mask, mb.prompts.shape[1],
                                          device=self.device, model=self.model)
        if not self._r3_metrics:  # telemetry on the step's first micro-batch: two extra no-grad forwards
            am = mb.attention_mask.to(self.device)
            with self._autocast():
                self._r3_metrics = routing_disagreement_metrics(
                    self.model, ids, mask, input_ids=mb.input_ids.to(self.device), attention_mask=am,
                    position_ids=position_ids(am))
        if not self.routing_replay:
            return contextlib.nullcontext()
        return replayed_routing(self.model, ids, mask)

    def _micro_batches(self, idx: torch.Tensor) -> Iterator[torch.Tensor]:
        yield from idx.split(self.tcfg.micro_batch_size)

    # Data-parallel hooks: identities here; parity.training.sharded overrides them.
    def _old_logprobs(self, batch: RolloutBatch, order: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.logprobs(batch.select(i)) for i in order.split(self.tcfg.micro_batch_size)])

    def _reduce_and_clip(self, total: float) -> tuple[float, torch.Tensor]:
        """Clip the gradients to trainer.grad_clip; return the mini-batch loss and the norm before clipping."""
        return total, torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)

    def _reduce_step_state(self, metrics: StepMetrics) -> None:
        """Before the step's metrics and the corrections' end_step are computed."""

    def _shaped(self, batch: RolloutBatch) -> RolloutBatch:
        """The step's batch padded to trainer.pad_to_multiple (a few batch shapes for a compiled trainer, whose CUDA
        graphs then replay); the batch itself when off or already of those widths."""
        if not self.tcfg.pad_to_multiple:
            return batch
        return batch.padded(self.tcfg.pad_to_multiple, int(getattr(self.model.config, "pad_token_id", 0) or 0))

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        self.model.train()
        batch = self._shaped(batch)
        adv = compute_advantages(self.alg.adv_estimator, batch.rewards.float(), batch.group_ids,
                                 norm_by_std=self.alg.norm_adv_by_std)
        metrics = StepMetrics()
        self._r3_metrics: dict[str, float] = {}
        B = batch.batch_size
        order = torch.arange(B)
        minis = order.chunk(self.tcfg.mini_batches)
        ids_checked = check_token_ids(batch, self.model.lm_head.weight.shape[0])
        need_old = self.tcfg.mini_batches > 1 or self.tcfg.ppo_epochs > 1
        old = None
        if need_old:  # log-probs of the policy that the whole step starts from (PPO's pi_old)
            old = self._old_logprobs(batch, order)
        grad_norms, losses, stepped, skipped = [], [], 0, 0
        for _ in range(self.tcfg.ppo_epochs):
            for mini in minis:
                denom = loss_denominators(batch.response_mask[mini])
                self.optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for micro in self._micro_batches(mini):
                    host_mb = batch.select(micro)
                    mb = host_mb.to(self.device)
                    # Everything the head needs from the host goes to the device before the forward is launched:
                    # a copy from host memory after it (or x[mask] on the device) would hold the host until the
                    # forward finished, and the GPU would then idle while the head and backward are launched.
                    rows = token_rows(host_mb.response_mask.bool()).to(self.device)
                    adv_mb = adv[micro].to(self.device)
                    old_mb = None if old is None else old[micro].to(self.device)
                    head = functools.partial(self.objective, batch=mb, advantages=adv_mb, old_logprobs=old_mb,
                                             temperature=self.temperature, denom=denom, metrics=metrics, rows=rows,
                                             ids_checked=ids_checked)
                    with self._routing(mb, metrics):
                        loss = self.policy_forward(mb, head)
                        loss.backward()  # inside the replay block: checkpointed recomputation replays too
                        self._after_backward()
                    if self.graph_replay:
                        self._own_grads()
                    total += float(loss.detach())
                total, gn = self._reduce_and_clip(total)
                if not (torch.isfinite(gn) and torch.isfinite(torch.tensor(total))):
                    self.optimizer.zero_grad(set_to_none=True)
                    self.skipped_steps += 1
                    self.bad_steps += 1
                    skipped += 1
                    if self.bad_steps >= self.tcfg.max_bad_steps:
                        raise NonFiniteError(f"{self.bad_steps} consecutive optimizer steps had a non-finite loss or "
                                             f"gradient (loss={total}, grad_norm={float(gn)}); stopping the run "
                                             f"(config key `trainer.max_bad_steps`={self.tcfg.max_bad_steps})")
                    log.warning("non-finite loss or gradient (loss=%s, grad_norm=%s): optimizer step skipped "
                                "(%d in a row, %d in this run; the run stops at trainer.max_bad_steps=%d in a row)",
                                total, float(gn), self.bad_steps, self.skipped_steps, self.tcfg.max_bad_steps)
                    continue
                self.bad_steps = 0
                self.optimizer.step()
                stepped += 1
                grad_norms.append(float(gn))
                losses.append(total)
        self._reduce_step_state(metrics)
        out = metrics.compute()
        out.update(drift_metrics(adv, batch))
        if self.drift_probe is not None:  # the batch was sampled after rl_steps syncs (redraw: that draw's Delta)
            out["drift/delta_cosine"] = self.drift_probe.cosine(self.model.named_parameters(), self.rl_steps)
        self.rl_steps += 1
        out.update(self._r3_metrics)
        out.update(self.corrections.end_step(out))
        r = batch.rewards.float()
        out.update({
            "train/loss": sum(losses) / max(1, len(losses)) if losses else float("nan"),
            "train/grad_norm": sum(grad_norms) / max(1, len(grad_norms)) if grad_norms else float("nan"),
            "train/skipped_steps": float(self.skipped_steps),
            "train/skipped_in_step": float(skipped),
            "train/bad_steps_in_a_row": float(self.bad_steps),
            "train/optimizer_steps": float(stepped),
            "reward/mean": float(r.mean()),
            "reward/std": float(r.std()) if B > 1 else 0.0,
            "response/length_mean": float(batch.response_lengths().float().mean()),
            "response/truncated_frac": float(batch.truncated.float().mean()),
            "adv/abs_mean": float(adv.abs().mean()),
        })
        return out

    def sync_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Trainer weights for the rollout engine, one tensor at a time (in the compute dtype), so the host never holds a
        second full copy during a sync."""
        for name, p in self.model.named_parameters():
            yield name, p.detach().to(self.compute_dtype)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "corrections": self.corrections.state_dict(),
                "bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps, "rl_steps": self.rl_steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.corrections.load_state_dict(state["corrections"])
        self.bad_steps, self.skipped_steps = state["bad_steps"], state["skipped_steps"]
        self.rl_steps = int(state["rl_steps"])


class LaneTrainer(Trainer):
    """The CPU trainer whose micro-batches run in `trainer.cpu_lanes` threads (parity.cpu_lanes): the rows split at
    prompt-group boundaries, each lane's forward and backward on its own, the gradients added in lane order."""

    def __init__(self, model: torch.nn.Module, cfg: ParityConfig, device: torch.device, lanes: int,
                 reference_dir: str | None = None, measured_discrepancy: float | None = None) -> None:
        super().__init__(model, cfg, device, reference_dir=reference_dir, measured_discrepancy=measured_discrepancy)
        self.lanes = lanes
        self._lane_graphs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # forwards whose backward is pending

    def response_hidden(self, mb: RolloutBatch) -> torch.Tensor:
        """The rows run in lanes: under autograd the result is a leaf per lane, and `_after_backward` (after the
        loss's backward) carries each lane's gradient through its own forward. A batch with routing replay, or one
        split into fewer than two groups, runs as one."""
        parts = split_rows(mb.group_ids, self.lanes) if mb.routed_experts is None else []
        if len(parts) < 2 or in_lane():
            return self._hidden(mb)
        grad = torch.is_grad_enabled()  # grad mode and autocast are per thread: the lanes take the caller's

        def lane(rows: slice) -> torch.Tensor:
            with torch.set_grad_enabled(grad):
                return self._hidden(mb.select(torch.arange(rows.start, rows.stop)))
        hs = run_in_lanes(lane, parts)
        if not grad:
            return torch.cat(hs)
        leaves = [h.detach().requires_grad_() for h in hs]
        self._lane_graphs.append(list(zip(hs, leaves)))
        return torch.cat(leaves)

    def _after_backward(self) -> None:
        """The parameters' gradients of the lanes' forwards (from their leaves' gradients, which the loss's backward
        filled), computed in the lanes and added to .grad in lane order (deterministic whatever lane ends first)."""
        graphs, self._lane_graphs = self._lane_graphs, []
        params = [p for p in self.model.parameters() if p.requires_grad]
        for pairs in graphs:
            def back(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
                h, leaf = pair
                if leaf.grad is None:
                    return (None,) * len(params)
                return torch.autograd.grad(h, params, leaf.grad, allow_unused=True)
            grads = run_in_lanes(back, pairs)
            for i, p in enumerate(params):
                total = None
                for g in grads:
                    if g[i] is not None:
                        total = g[i] if total is None else total + g[i]
                if total is not None:
                    p.grad = total if p.grad is None else p.grad.add_(total)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        self._lane_graphs = []  # (a step that raised may have left forwards behind)
        return super().step(batch)


def trainer_lanes(cfg: ParityConfig, device: torch.device) -> int:
    """trainer.cpu_lanes (checked) where the trainer's own forward runs on the CPU; 1 on other devices and where the
    decoder layers' own forward must run (gradient checkpointing, compiled layers)."""
    n = check_lanes(cfg.trainer.cpu_lanes, "trainer.cpu_lanes")
    if device.type != "cpu" or cfg.trainer.gradient_checkpointing or cfg.trainer.compile_layers:
        return 1
    return n


def build_trainer(model: torch.nn.Module, cfg: ParityConfig, device: torch.device, reference_dir: str | None = None,
                  measured_discrepancy: float | None = None) -> Trainer:
    """The single-process trainer for this config and device: LaneTrainer where CPU lanes apply, else Trainer."""
    lanes = trainer_lanes(cfg, device)
    if lanes > 1:
        return LaneTrainer(model, cfg, device, lanes, reference_dir=reference_dir,
                           measured_discrepancy=measured_discrepancy)
    return Trainer(model, cfg, device, reference_dir=reference_dir, measured_discrepancy=measured_discrepancy)
