"""The in-process runner: one rollout engine and one Trainer in this process (parity.training.runner's sides)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from parity.core.device import resolve_device
from parity.core.sampling import SamplingSpec
from parity.rollout import build_engine
from parity.rollout.perturbed import PerturbedEngine
from parity.training.checkpoint import CheckpointManager, read_state, set_rng_state, training_state
from parity.training.runner import RolloutResult, Sides
from parity.training.trainer import build_trainer
from parity.types import RolloutBatch

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig


def sync_engine(engine: Any, named: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
    """Load trainer weights `version` steps in into an engine; a perturbed engine's draw follows that step count
    (also in a restarted worker, which starts again from the run's starting weights)."""
    if isinstance(engine, PerturbedEngine):
        return engine.update_weights(named, syncs=version)
    return engine.update_weights(named)


@dataclass
class _Submission:
    prompt_token_ids: list[list[int]]
    spec: SamplingSpec
    result: RolloutResult | None = None
    receive: Any = None  # begun on a server (a cohort member's call sent): its answer, when read


class LocalRollout:
    """The engine in this process. A submission is sampled when it is collected, or before the engine takes new
    weights or answers another call if that comes first, or when `begin` starts it: always with the weights loaded
    at submission. An engine whose calls go to a server (`send_generate`: a cohort member) sends a begun submission
    at once and reads the answer later, so this process works while the server samples."""

    def __init__(self, engine: Any, version: int) -> None:
        self.engine, self.version = engine, version
        self.waiting: list[_Submission] = []

    def submit(self, prompt_token_ids: list[list[int]], spec: SamplingSpec) -> _Submission:
        s = _Submission(prompt_token_ids, spec)
        self.waiting.append(s)
        return s

    def begin(self, handle: _Submission) -> None:
        if handle.result is not None or handle.receive is not None:
            return
        send = getattr(self.engine, "send_generate", None)
        if send is None:
            self._sample(handle)
        else:
            ids = handle.prompt_token_ids
            handle.receive = send(ids, handle.spec, prompt_ids=list(range(len(ids))))

    def _sample(self, s: _Submission) -> None:
        if s.result is None:
            ids = s.prompt_token_ids
            batch = s.receive() if s.receive is not None else \
                self.engine.generate(ids, s.spec, prompt_ids=list(range(len(ids))))
            s.result, s.receive = RolloutResult(batch, self.version), None

    def _finish_begun(self) -> None:
        """Read every begun submission's answer (a server answers one call of a member at a time)."""
        for s in self.waiting:
            if s.receive is not None:
                self._sample(s)

    def collect(self, handle: _Submission) -> RolloutResult:
        self._sample(handle)
        self.waiting.remove(handle)
        assert handle.result is not None
        return handle.result

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int, wait: bool) -> float:
        for s in self.waiting:  # submitted before these weights: sampled with the ones they were submitted under
            self._sample(s)
        seconds = sync_engine(self.engine, weights, version)
        self.version = version
        return seconds

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        self._finish_begun()
        return self.engine.generate(prompt_token_ids, spec, prompt_ids=prompt_ids)

    def step_metrics(self) -> dict[str, float]:
        return {}


class LocalLearner:
    """A Trainer on the run's starting weights; on resume, the checkpoint's trainer state and RNG restored."""

    def __init__(self, cfg: ParityConfig, base_dir: str, resume_from: Any, tok: Any, device: torch.device,
                 measured_discrepancy: float | None = None) -> None:
        model = AutoModelForCausalLM.from_pretrained(str(resume_from or base_dir), dtype=torch.float32)
        self.trainer = build_trainer(model, cfg, device, reference_dir=str(base_dir),
                               measured_discrepancy=measured_discrepancy)
        self.tok = tok
        if resume_from is not None:
            state = read_state(resume_from)
            self.trainer.load_state_dict(state["trainer"])
            set_rng_state(state["rng"])

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.trainer.step(batch)
        metrics["perf/train_s"] = time.perf_counter() - t0
        return metrics

    def publish(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.trainer.sync_weights()

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.trainer.sync_weights()

    def save(self, ckpts: CheckpointManager, step: int, data_state: dict) -> None:
        ckpts.save(step, self.trainer.model, self.tok, training_state(step, self.trainer, data_state))


@contextlib.contextmanager
def local_runner(cfg: ParityConfig, base_dir: str, run: Any, measured_discrepancy: float | None = None) -> Iterator[Sides]:
    device = resolve_device(cfg.trainer.device)
    learner = LocalLearner(cfg, base_dir, run.resume_from, AutoTokenizer.from_pretrained(base_dir), device,
                           measured_discrepancy)
    # the engine starts from the trainer's weights (re-quantized where its precision says so)
    engine = build_engine(cfg, run.resume_from or base_dir, reference_dir=base_dir, syncs=run.start_step)
    try:
        yield Sides(LocalRollout(engine, run.start_step), learner, {"engine": engine.describe()})
    finally:
        engine.close()


__all__ = ["local_runner", "LocalRollout", "LocalLearner", "sync_engine"]
