"""The RL loop, top to bottom, for every runner: rollout -> grade -> learner step -> weight sync -> (eval,
checkpoint, log).

A runner supplies the two sides (parity.training.runner): in this process (parity.training.local), or over Ray
actors (parity.distributed.driver.ray_runner); the command layer (parity.commands.train.runner_of) picks the one
distributed.enabled asks for. Everything else is here once: the run folder (parity.training.run_folder), the data
stream and prompt truncation, grading, held-out evaluation, the collapse alarm, the correction tolerance resolved
once for the run (parity.training.tolerance), the step's metrics. With distributed.off_policy_overlap the rollout
of step t+1 is submitted before the learner's step t, so it is sampled with weights one update old
(perf/staleness = 1)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from parity.core.device import blocking_sync_from_env
from parity.core.profile import StartupClock, StepProfiler
from parity.core.progress import Progress
from parity.data.prompts import build_train_stream, render_prompt
from parity.rewards.grader import GraderPool
from parity.rollout import sampling_spec
from parity.training.collapse import CollapseAlarm
from parity.training.heldout import HeldOut
from parity.training.run_folder import MetricsLog, RunFolder, run_dir_of, safe_run_name
from parity.training.runner import LearnerSide, RolloutSide
from parity.training.tolerance import ToleranceSetting, tolerance_setting
from parity.training.warm_start import prepare_model

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig


class Callback(Protocol):
    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...


def train(cfg: ParityConfig, callbacks: list[Callback] | None = None, *, runner: Callable) -> dict:
    """One RL run with the two sides `runner` builds; returns its summary. parity.commands.train.train passes the
    runner distributed.enabled asks for."""
    clock = StartupClock()  # summary.json's startup_s: the seconds since the process started at each point
    clock.mark("imports")  # the interpreter, the config and the imports
    blocking_sync_from_env()  # before the first CUDA use (PARITY_CUDA_BLOCKING_SYNC; the study sets it for its runs)
    seed = int(cfg.trainer.seed)
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    run = RunFolder(cfg)
    run.callbacks = list(callbacks or [])
    start = prepare_model(cfg)
    base = str(start["model_dir"])
    tolerance = tolerance_setting(cfg)
    tok = AutoTokenizer.from_pretrained(base)
    stream = build_train_stream(cfg.data, seed=seed)
    if run.data_state is not None:
        stream.load_state_dict(run.data_state)
    # long prompts (MATH with the tiny model's 256 positions) keep their end, where the question is
    max_prompt = AutoConfig.from_pretrained(base).max_position_embeddings - cfg.rollout.max_new_tokens
    clock.mark("model")  # the warm start found or built, the tokenizer and the data stream
    with runner(cfg, base, run, tolerance.measured) as sides, \
            GraderPool(workers=cfg.eval.grade_workers, timeout_s=cfg.eval.grade_timeout_s) as grader:
        clock.mark("sides")  # the trainer and the rollout engine (or its client) built, the graders started
        data = Data(tok, stream, cfg.data.prompt_template, max_prompt, grader)
        heldout = HeldOut(cfg, tok, grader, str(run.resume_from or base), start.get("weights_sha256"))
        try:
            alarm = rl_loop(cfg, data, sides.rollout, sides.learner, heldout, run, clock)
        finally:
            heldout.close()
        outcome = {"collapse_step": alarm.fired_at, "tolerance": tolerance_in_force(tolerance, run.metrics.read()),
                   "start_weights_sha256": start.get("weights_sha256"), "startup_s": clock.marks}
        if heldout.step0_shared:
            outcome["step0_eval_shared"] = heldout.step0_shared
        if heldout.step0_seconds:  # where the start's step-0 evaluation went, metric by metric
            outcome["step0_eval_s"] = heldout.step0_seconds
        if clock.detail:
            outcome["startup_detail"] = clock.detail
    return run.finish(int(cfg.trainer.total_steps), sides.summary, outcome)


def tolerance_in_force(setting: ToleranceSetting, rows: list[dict]) -> dict:
    """The summary's `tolerance`: the last value the steps logged (an auto tolerance measured over the first steps
    is known from then on), else the one the run started with; and where it came from."""
    logged = next((r["correction/tolerance"] for r in reversed(rows) if "correction/tolerance" in r), None)
    return {"value": setting.value if logged is None else logged, "source": setting.source}


def rl_loop(cfg: ParityConfig, data: Data, rollout: RolloutSide, learner: LearnerSide, heldout: HeldOut,
            run: RunFolder, clock: StartupClock) -> CollapseAlarm:
    """The RL steps from run.start_step; `clock` (train's) marks the step-0 evaluation and the first step."""
    tc, overlap = cfg.trainer, bool(cfg.distributed.off_policy_overlap)
    alarm = CollapseAlarm.from_config(cfg)
    alarm.replay(run.metrics.read())  # a resumed run's alarm state is that of its logged rewards
    paths = run.rollout_paths

    def launch(step: int) -> Launched:
        problems, ids, n_cut = data.prompts(tc.prompts_per_step)
        spec = sampling_spec(cfg, seed=int(tc.seed) * 1_000_003 + step)
        return Launched(rollout.submit(ids, spec), problems, n_cut, dict(data.stream.state_dict()),
                        time.perf_counter())

    pending = launch(run.start_step) if run.start_step < tc.total_steps else None
    if run.start_step == 0:
        # the first rollout is begun before the warm start's evaluation (both read the starting weights, neither
        # draws from a shared random state): an engine's first call compiles and captures its shapes, and that
        # then runs beside the evaluation (a cohort's server, a Ray worker) or while another run computes the
        # shared step-0 number this run waits for (trainer.share_step0_eval), not after it
        if pending is not None:
            rollout.begin(pending.handle)
            clock.mark("rollout0")  # the first rollout sampled (in this process) or sent (to a server or workers)
        t_eval = time.perf_counter()
        run.emit(0, heldout.evaluate(rollout, learner, 0, final=tc.total_steps == 0))
        clock.mark("eval0")  # the held-out evaluation of the warm start
        if pending is not None:  # step 1's perf/rollout_s: the rollout's time, not the evaluation's between
            pending.t_submit += time.perf_counter() - t_eval
    bar = Progress("train", int(tc.total_steps), initial=run.start_step)
    prof = StepProfiler()  # PARITY_PROFILE_STEPS: where listed steps' time goes (parity.core.profile)
    for step in range(run.start_step, tc.total_steps):
        t0 = time.perf_counter()
        with prof.phase(step + 1, "rollout"):
            result = rollout.collect(pending.handle)  # type: ignore[union-attr]  (launched before every step)
        t_roll = time.perf_counter()
        paths.see(result.batch)
        setup = (getattr(result.batch, "meta", None) or {}).get("decode_setup_s")
        if setup and step == run.start_step:  # the first rollout's set-up: new state, prefill compile, captures
            clock.detail["rollout0_setup_s"] = setup
        this, pending = pending, (launch(step + 1) if overlap and step + 1 < tc.total_steps else None)
        batch = data.grade(result.batch, this.problems)
        t_grade = time.perf_counter()
        with prof.phase(step + 1, "train"):
            metrics = learner.step(batch)
        with prof.phase(step + 1, "sync"):
            metrics["perf/sync_s"] = rollout.load(learner.publish(), step + 1, wait=not overlap)
        prof.write(step + 1, run.dir)
        metrics["data/prompt_truncated_frac"] = this.n_cut / max(1, len(this.problems))
        metrics["train/collapsed"] = alarm.update(step + 1, metrics["reward/mean"])
        n_tok = int(batch.response_mask.sum())
        roll_s = t_roll - this.t_submit  # from submission: with overlap most of it hid behind the previous step
        metrics.update({"perf/rollout_s": roll_s, "perf/rollout_wait_s": t_roll - t0,
                        "perf/grade_s": t_grade - t_roll, "perf/step_s": time.perf_counter() - t0,
                        "perf/staleness": float(step - result.min_version),
                        "perf/rollout_tokens_per_s": n_tok / max(1e-9, roll_s),
                        "perf/train_tokens_per_s": n_tok / max(1e-9, metrics["perf/train_s"]),
                        **rollout.step_metrics()})
        done = step + 1
        if tc.eval_every and (done % tc.eval_every == 0 or done == tc.total_steps):
            metrics.update(heldout.evaluate(rollout, learner, done, final=done == tc.total_steps))
        due = tc.checkpoint_every and (done % tc.checkpoint_every == 0 or done == tc.total_steps)
        run.emit(done, metrics, partial(learner.save, run.ckpts, done, this.data_state) if due else None)
        if pending is None and done < tc.total_steps:
            pending = launch(done)
        bar.update(1, reward=f"{metrics['reward/mean']:.3f}")
        clock.mark("first_step")  # the first step's rollout (compiles and graph captures of its shapes), train, sync
    return alarm


@dataclass
class Launched:
    """A submitted rollout and what the loop keeps beside it: the problems (to grade), prompts cut, the stream's
    position after taking them (what a checkpoint at the end of this step records; overlap takes the next step's
    prompts earlier), when it was submitted."""

    handle: Any
    problems: list
    n_cut: int
    data_state: dict
    t_submit: float


@dataclass
class Data:
    """The training prompts and their grading."""

    tok: Any
    stream: Any
    template: str
    max_prompt: int
    grader: Any

    def prompts(self, n: int) -> tuple[list, list[list[int]], int]:
        problems = self.stream.take(n)
        ids, n_cut = encode_prompts(self.tok, self.template, problems, self.max_prompt)
        return problems, ids, n_cut

    def grade(self, batch: Any, problems: list) -> Any:
        batch.texts = self.tok.batch_decode(batch.responses, skip_special_tokens=True)
        batch.answers = [problems[int(g)].answer for g in batch.group_ids]
        batch.rewards = self.grader.grade(batch.texts, batch.answers, batch.truncated.tolist())
        return batch


def encode_prompts(tok: Any, template: str, problems: list, max_prompt: int) -> tuple[list[list[int]], int]:
    """Token ids of each rendered prompt, left-truncated to `max_prompt`; and how many were cut."""
    out, cut = [], 0
    for p in problems:
        ids = tok(render_prompt(template, p.problem))["input_ids"]
        if len(ids) > max_prompt:
            ids, cut = ids[-max_prompt:], cut + 1
        out.append(ids)
    return out, cut


__all__ = ["train", "rl_loop", "Callback", "MetricsLog", "RunFolder", "run_dir_of", "safe_run_name", "encode_prompts"]
