"""The run folder, for every runner: <outputs>/runs/<run_name>/ with config.yaml (secrets masked), checkpoints/,
metrics.jsonl (one line a step, cut back to the checkpoint on resume) and summary.json.

A run whose folder already holds checkpoints is resumed (trainer.resume=true: from its latest valid checkpoint)
or refused; nothing already written is touched by a refusal."""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.core.secrets import masked_config_yaml
from parity.errors import ParityError
from parity.paths import plain_name
from parity.training.checkpoint import CheckpointManager, read_state

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

log = logging.getLogger(__name__)


def safe_run_name(name: str) -> str:
    """Run names become folder names under outputs/runs: no separators, no traversal."""
    return plain_name(name, "trainer.run_name")


def run_dir_of(cfg: ParityConfig) -> Path:
    return Path(cfg.outputs_dir) / "runs" / safe_run_name(str(cfg.trainer.run_name))


class MetricsLog:
    """metrics.jsonl with exactly one line per step: on resume, lines past the checkpoint are dropped."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def append(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]


# what a rollout batch's meta says about the path that computed it (engine, linear product, decode loop, KV cache
# layout and its attention kernel): recorded in summary.json, since two routes to one format can differ in numbers
PATH_KEYS = ("engine", "device", "dtype", "linear_path", "weights", "activations", "kv_cache", "decode_path",
             "kv_cache_layout", "kv_kernel")


class RolloutPaths:
    """The distinct rollout paths a run's batches took, in order of first use (one, unless a fallback such as a
    failed compilation changed it mid-run)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def see(self, batch: Any) -> None:
        meta = getattr(batch, "meta", None) or {}
        path = {k: meta[k] for k in PATH_KEYS if k in meta}
        path.setdefault("decode_path", "plain_loop" if meta.get("engine") == "torch" else meta.get("engine"))
        tuned = dict((path.get("kv_kernel") or {}).get("tuned") or {})
        for seen in self.seen:  # the kernel's autotuned launches grow as new shapes are tuned: one path still
            if _untuned(seen) == _untuned(path):
                if tuned:
                    seen["kv_kernel"]["tuned"] = {**seen["kv_kernel"].get("tuned", {}), **tuned}
                return
        self.seen.append(copy.deepcopy(path))


def _untuned(path: dict) -> dict:
    """A rollout path without the attention kernel's autotuned launch configurations."""
    if not isinstance(path.get("kv_kernel"), dict):
        return path
    return {**path, "kv_kernel": {k: v for k, v in path["kv_kernel"].items() if k != "tuned"}}


def code_version() -> str | None:
    """The commit the run's code is at: PARITY_COMMIT if set (a copy of the tree without .git), else git's HEAD
    (with "+dirty" when tracked files differ from it); None when neither is known."""
    import os
    import subprocess

    if os.environ.get("PARITY_COMMIT"):
        return os.environ["PARITY_COMMIT"]
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=10).returncode
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


class RunFolder:
    """Opened once a run: writes config.yaml, refuses or resumes, cuts the metrics log back to the resumed step.

    `resume_from` is the checkpoint folder to continue from (None: a fresh run), `start_step` its step and
    `data_state` the training stream's position saved with it."""

    def __init__(self, cfg: ParityConfig) -> None:
        self.t_start = time.time()
        self.dir = run_dir_of(cfg)
        self.ckpts = CheckpointManager(self.dir, keep=cfg.trainer.keep_checkpoints)
        if not cfg.trainer.resume and self.ckpts.list():  # refused before anything of the run is overwritten
            raise ParityError(f"run {self.dir} already has checkpoints; set trainer.resume=true to continue it or "
                              "choose another trainer.run_name")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(masked_config_yaml(cfg))  # no registry/MLflow passwords on disk
        self.resume_from: Path | None = self.ckpts.latest_valid() if cfg.trainer.resume else None
        self.start_step, self.data_state = 0, None
        if self.resume_from is not None:
            state = read_state(self.resume_from, mmap=True)
            self.start_step, self.data_state = int(state["step"]), state["data"]
            log.info("resuming %s from %s (step %d)", self.dir.name, self.resume_from, self.start_step)
        self.metrics = MetricsLog(self.dir / "metrics.jsonl")
        self.metrics.truncate_after(self.start_step)
        self.callbacks: list[Any] = []
        self.rollout_paths = RolloutPaths()

    def emit(self, step: int, metrics: dict[str, float], checkpoint: Any = None) -> None:
        """Step `step`'s row: the metrics log first, then `checkpoint()` if given, then every callback (e.g.
        MLflow). A checkpoint of step N is written only once the log holds rows up to N, so a run killed right
        after it resumes with none of its rows missing."""
        self.metrics.append(step, metrics)
        if checkpoint is not None:
            checkpoint()
        for cb in self.callbacks:
            cb.on_step(step, metrics)

    def finish(self, total_steps: int, summary: dict, outcome: dict) -> dict:
        """summary.json: what the runner described, what the metrics log and the checkpoints say, and `outcome`
        (what the loop found: collapse step, tolerance)."""
        rows = self.metrics.read()
        first = rows[0] if rows and rows[0]["step"] == 0 else {}

        def last(key: str) -> Any:
            return next((r[key] for r in reversed(rows) if key in r), None)

        out = {"run_dir": str(self.dir), "start_step": self.start_step, **summary,
               "initial_accuracy": first.get("eval/accuracy"), "steps": total_steps,
               "final_accuracy": last("eval/accuracy"), "final_reward": last("reward/mean"),
               "final_mismatch": last("mismatch/abs_prob_diff_mean"),
               "latest_checkpoint": str(self.ckpts.list()[-1]) if self.ckpts.list() else None,
               "seconds": round(time.time() - self.t_start, 1), "code_version": code_version(), **outcome}
        if self.rollout_paths.seen:
            out["rollout_path"] = self.rollout_paths.seen[0]
            if len(self.rollout_paths.seen) > 1:
                out["rollout_paths"] = self.rollout_paths.seen
        if "eval/accuracy_unquantized" in first:
            out["initial_accuracy_unquantized"] = first["eval/accuracy_unquantized"]
        if last("eval/accuracy_unquantized") is not None:
            out["final_accuracy_unquantized"] = last("eval/accuracy_unquantized")
        for key in ("eval/final_accuracy", "eval/final_accuracy_unquantized"):
            if last(key) is not None:
                out[key.split("/", 1)[1].replace("final_accuracy", "large_final_accuracy")] = last(key)
        (self.dir / "summary.json").write_text(json.dumps(out, indent=1, default=str))
        return out


__all__ = ["RunFolder", "MetricsLog", "run_dir_of", "safe_run_name"]
