"""Held-out accuracy of the current policy on the configured task's test problems, graded like the rewards,
through the rollout engine and, for a quantized or perturbed rollout, also through the same weights on a plain
engine.

Greedy by default (`trainer.eval_temperature=0`). A task whose responses are searches (Countdown) is better
measured sampled: greedy decoding of a search trace repeats its likeliest attempt until the length limit, so
`trainer.eval_temperature=1` with `trainer.eval_samples=k` reports the mean over k samples a problem."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.core.sampling import Engine, SamplingSpec
from parity.data.arithmetic import Problem
from parity.data.prompts import render_prompt
from parity.data.tasks import heldout_problems
from parity.rollout import compute_dtype, engine_lanes, is_perturbed, resolve_device, rollout_precision
from parity.rollout.torch_engine import TorchEngine

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig, PrecisionConfig


def heldout_accuracy(engine: Engine, tok: Any, problems: list[Problem], template: str, grader: Any,
                     max_new_tokens: int, batch_size: int = 128, temperature: float = 0.0, samples: int = 1,
                     seed: int = 0) -> float:
    """Mean score over `problems` x `samples` responses (greedy when temperature is 0; then one sample)."""
    samples, per_call = call_size(temperature, samples, batch_size)
    correct = 0.0
    for s in range(0, len(problems), per_call):
        chunk = problems[s:s + per_call]
        ids = [tok(render_prompt(template, p.problem))["input_ids"] for p in chunk]
        spec = SamplingSpec(temperature=temperature, max_new_tokens=max_new_tokens, n=samples, seed=seed)
        batch = engine.generate(ids, spec, prompt_ids=list(range(s, s + len(chunk))))
        texts = tok.batch_decode(batch.responses, skip_special_tokens=True)
        scores = grader.grade(texts, [chunk[int(g)].answer for g in batch.group_ids], batch.truncated.tolist())
        correct += float(scores.sum())
    return correct / max(1, len(problems) * samples)


def call_size(temperature: float, samples: int, batch_size: int) -> tuple[int, int]:
    """(samples a problem, problems an engine call) of a held-out evaluation: one sample when greedy."""
    samples = 1 if temperature == 0.0 else max(1, int(samples))
    return samples, max(1, batch_size // samples)


def eval_settings(cfg: ParityConfig) -> dict:
    """heldout_accuracy's keywords from trainer.eval_temperature / eval_samples / eval_rows."""
    return {"temperature": float(cfg.trainer.eval_temperature), "samples": int(cfg.trainer.eval_samples),
            "seed": int(cfg.trainer.seed) + 7, "batch_size": int(cfg.trainer.eval_rows)}


def changes_numerics(precision: PrecisionConfig) -> bool:
    """Whether a rollout precision changes any number the engine computes (weights, activations or KV cache,
    or a perturbation of the weights)."""
    return (any(str(getattr(precision, k, "bf16")) != "bf16" for k in ("weights", "activations", "kv_cache"))
            or is_perturbed(precision))


@contextlib.contextmanager
def first_alone(lock_path: Path) -> Iterator[dict]:
    """Processes about to compile the same graphs: the first to come goes alone (an exclusive lock), those that come
    while it works wait for it (a shared lock) and then go at once, each finding the first one's compiled graphs in
    Inductor's cache (a hit costs a fraction of a compile), instead of all compiling the same graphs side by side on
    the same cores. Yields {"first": bool, "waited_s": seconds before its turn}. A process that dies releases its
    lock (the kernel drops it with the file)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            turn = {"first": True}
        except BlockingIOError:  # one compiles now, or others already go after it
            fcntl.flock(f, fcntl.LOCK_SH)
            turn = {"first": False}
        turn["waited_s"] = round(time.perf_counter() - t0, 2)
        try:
            yield turn
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class HeldOut:
    """`eval/accuracy` through the rollout side; with trainer.eval_unquantized and a rollout precision that
    changes the numerics, also `eval/accuracy_unquantized`: the learner's weights on a torch engine in the compute
    dtype, in this process (what training did to the policy apart from what deploying it quantized costs); with
    trainer.eval_through_rollout=false then only the latter, except at the steps trainer.eval_deployed_every names
    and the last one (the deployed model). With trainer.final_eval_problems, the last step also measures both on
    that many problems (`eval/final_accuracy`, `eval/final_accuracy_unquantized`)."""

    def __init__(self, cfg: ParityConfig, tok: Any, grader: Any, start_dir: str, weights_sha256: str | None = None
                 ) -> None:
        self.tok, self.grader, self.template = tok, grader, cfg.data.prompt_template
        self.max_new_tokens = int(cfg.rollout.max_new_tokens)
        self.problems = heldout_problems(cfg, cfg.trainer.eval_problems)
        n_final = int(cfg.trainer.final_eval_problems)
        self.final_problems = heldout_problems(cfg, n_final) if n_final > 0 else []
        self.settings = eval_settings(cfg)
        self.through_rollout = bool(cfg.trainer.eval_through_rollout)
        self.deployed_every = int(cfg.trainer.eval_deployed_every)
        self.plain: Any = None
        # share_step0_eval: each step-0 evaluation's record shared by the runs that would compute the same number,
        # by metric; step0_shared, what this run's step-0 evaluation computed or read (the run's summary)
        self.shared: dict[str, Path] = {}
        self.step0_shared: dict[str, dict] = {}
        self.step0_seconds: dict[str, float] = {}  # each step-0 metric's seconds in this run (a shared one's wait too)
        self.run_name = str(cfg.trainer.run_name)
        share = bool(cfg.trainer.share_step0_eval)
        device = resolve_device(cfg.trainer.device)

        def shared_file(engine: dict) -> Path:
            key = step0_key(start_dir, weights_sha256, self.problems, self.template, self.max_new_tokens,
                            self.settings, {**engine, "grader": cfg.eval})
            return Path(cfg.outputs_dir) / "eval0" / f"{key}.json"

        if cfg.trainer.eval_unquantized and cfg.trainer.eval_every and changes_numerics(rollout_precision(cfg)):
            dtype, lanes = compute_dtype(cfg.model.dtype, device), engine_lanes(cfg)
            # the torch engines' decode settings, the plain one's too
            tail, cprefill = bool(cfg.rollout.compact_tail), bool(cfg.rollout.compile_prefill)
            self.plain = TorchEngine(start_dir, device=str(device), dtype=dtype, cpu_lanes=lanes, compact_tail=tail,
                                     compile_prefill=cprefill)
            if share:
                self.shared["eval/accuracy_unquantized"] = shared_file(
                    {"kind": "plain", "device": str(device), "dtype": str(dtype), "lanes": lanes,
                     **({"compact_tail": True} if tail else {}), **({} if cprefill else {"compile_prefill": False})})
        if share and not cfg.rollout.cohort:
            # the rollout side: everything that builds and feeds its engine (the format, a perturbation's seed, the
            # runner, the model's settings), all of the config but the learner's algorithm and the trainer's
            # schedule; runs of one format and seed differ only there. Not for a cohort's member: its server holds
            # each call until every member has one (parity.rollout.cohort_server), so the members' evaluations
            # already run as one call, and a member waiting here for another's number would hold that one's call
            self.shared["eval/accuracy"] = shared_file(
                {"kind": "rollout", "model": cfg.model, "data": cfg.data, "rollout": cfg.rollout,
                 "actor_rollout_ref": cfg.actor_rollout_ref, "distributed": cfg.distributed,
                 "precision": rollout_precision(cfg), "device": str(device), "seed": int(cfg.trainer.seed)})

    def accuracy(self, engine: Engine, problems: list[Problem] | None = None) -> float:
        return heldout_accuracy(engine, self.tok, self.problems if problems is None else problems, self.template,
                                self.grader, self.max_new_tokens, **self.settings)

    def deployed_due(self, step: int, final: bool) -> bool:
        """Whether the evaluation of `step` also measures the rollout engine when eval_through_rollout is off."""
        return self.plain is not None and self.deployed_every > 0 and (final or step % self.deployed_every == 0)

    def evaluate(self, rollout: Engine, learner: Any, step: int = 0, final: bool = False) -> dict[str, float]:
        out = {}
        share = step == 0 and not final  # the warm start's numbers (a final step 0 also measures the large set)

        def plain() -> float:
            self.plain.update_weights(learner.weights())
            return self.accuracy(self.plain)

        # the plain engine's number first: it is this process's own work, while a rollout the loop has begun may
        # still be sampling on a server, whose answer the rollout side's call below waits for
        t0 = time.perf_counter()
        if self.plain is not None:
            out["eval/accuracy_unquantized"] = self._shared_step0("eval/accuracy_unquantized", plain,
                                                                  lambda: self._warm(learner)) \
                if share and "eval/accuracy_unquantized" in self.shared else plain()
            if step == 0:
                self.step0_seconds["eval/accuracy_unquantized"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        if self.plain is None or self.through_rollout or self.deployed_due(step, final):
            out["eval/accuracy"] = self._shared_step0("eval/accuracy", lambda: self.accuracy(rollout)) \
                if share and "eval/accuracy" in self.shared else self.accuracy(rollout)
            if step == 0:
                self.step0_seconds["eval/accuracy"] = round(time.perf_counter() - t0, 2)
        if final and self.final_problems:
            out["eval/final_accuracy"] = self.accuracy(rollout, self.final_problems)
            if self.plain is not None:
                out["eval/final_accuracy_unquantized"] = self.accuracy(self.plain, self.final_problems)
        return out

    def _warm(self, learner: Any) -> dict:
        """The evaluation's first call on the plain engine, its score dropped: the engine compiles and
        captures its shapes now, while another run computes the shared step-0 number, instead of at the first
        evaluation this run computes itself (step trainer.eval_every), where it would hold up the run (and, for a
        cohort's member, every other member's next rollout). The runs that warm the same engine take turns
        (`first_alone`): one compiles, the others then find its graphs in Inductor's cache."""
        path = self.shared["eval/accuracy_unquantized"]
        with first_alone(path.with_suffix(".warm.lock")) as turn:
            self.plain.update_weights(learner.weights())
            _, per_call = call_size(self.settings["temperature"], self.settings["samples"],
                                    self.settings["batch_size"])
            self.accuracy(self.plain, self.problems[:per_call])
        return turn

    def _shared_step0(self, metric: str, compute: Callable[[], float],
                      while_waiting: Callable[[], dict | None] | None = None) -> float:
        """The warm start's `metric`, computed once for every run that shares its file: the first run to take the
        lock computes and writes it (atomically), the others wait for the lock and read it. A run that finds the
        lock taken first runs `while_waiting` (its seconds: the record's `warm_s`; what it returns: `warm_turn`)."""
        path = self.shared[metric]
        path.parent.mkdir(parents=True, exist_ok=True)
        warm: dict = {}  # while it waited: its seconds, and its turn at the compile (first_alone)
        with open(path.with_suffix(".lock"), "a") as lock:
            t_wait = time.perf_counter()
            if while_waiting is not None and not path.is_file():
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # another run is computing it
                    turn = while_waiting()
                    warm = {"warm_s": round(time.perf_counter() - t_wait, 2), **({"warm_turn": turn} if turn else {})}
                    fcntl.flock(lock, fcntl.LOCK_EX)
            else:
                fcntl.flock(lock, fcntl.LOCK_EX)
            waited = round(time.perf_counter() - t_wait, 2)  # while another run computed it (and this one warmed)
            try:
                rec = None
                if path.is_file():
                    try:
                        rec = json.loads(path.read_text())
                        float(rec["accuracy"])
                    except (ValueError, KeyError, TypeError) as e:  # not written by this code: computed again
                        print(f"held-out: {path} unreadable ({type(e).__name__}: {e}); evaluating the warm start "
                              "again", flush=True)
                        rec = None
                if rec is not None:
                    self.step0_shared[metric] = {"file": str(path), "computed_by": rec.get("run"), "reused": True,
                                                 "wait_s": waited, **warm}
                    print(f"held-out: step-0 {metric} of the warm start from {path.name} (computed by run "
                          f"{rec.get('run')})", flush=True)
                    return float(rec["accuracy"])
                t0 = time.perf_counter()
                acc = compute()
                rec = {"metric": metric, "accuracy": acc, "run": self.run_name,
                       "seconds": round(time.perf_counter() - t0, 2), "problems": len(self.problems), **self.settings}
                tmp = path.with_name(f".{path.name}.{os.getpid()}")
                tmp.write_text(json.dumps(rec, indent=1))
                os.replace(tmp, path)
                self.step0_shared[metric] = {"file": str(path), "computed_by": self.run_name, "reused": False,
                                             "wait_s": waited, **warm}
                return acc
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def close(self) -> None:
        if self.plain is not None:
            self.plain.close()


def step0_key(start_dir: str, weights_sha256: str | None, problems: list[Problem], template: str,
              max_new_tokens: int, settings: dict, engine: dict) -> str:
    """What a step-0 accuracy of the warm start depends on, hashed: the weights (their sha256 where the warm start
    recorded it, else each weight file's path, size and modification time), the problems and prompt, the sampling
    settings and seed, `engine` (what builds the engine and grades its answers), torch's version and the code's (a
    changed engine computes another number)."""
    import torch

    from parity.training.run_folder import code_version
    d = Path(start_dir).resolve()
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in d.glob("*.safetensors"))
    content = {"weights": weights_sha256 or [str(d), files], "template": template, "max_new_tokens": max_new_tokens,
               "problems": hashlib.sha256(json.dumps([[p.problem, str(p.answer)] for p in problems]).encode()
                                          ).hexdigest(),
               "settings": settings, "engine": {k: asdict(v) if is_dataclass(v) else v for k, v in engine.items()},
               "torch": torch.__version__, "code": code_version()}
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:24]
