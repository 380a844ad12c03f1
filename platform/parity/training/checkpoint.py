"""Checkpoints: atomic (written to a temporary folder, then renamed), checksummed, pruned to the last N.

Layout: <run_dir>/checkpoints/step_000020/{model.safetensors, config.json, tokenizer files, state.pt,
MANIFEST.json}. MANIFEST holds a sha256 of every file; resume verifies it and falls back to the previous
checkpoint, with a warning, when the latest one is corrupt."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parity.errors import ParityError

log = logging.getLogger(__name__)


class CheckpointWriteError(ParityError, OSError):
    """A checkpoint could not be written (a full disk, a file-size limit, an I/O error); earlier ones are intact."""


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = max(1, keep)

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def save(self, step: int, model: torch.nn.Module, tokenizer: Any, state: dict) -> Path:
        """Write everything to a hidden temporary folder, fsync, then rename into place: a crash or a full
        disk mid-write leaves the previous checkpoints untouched and loadable."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = self.root / f".tmp_step_{step:06d}_{os.getpid()}"
        for stale in self.root.glob(".tmp_step_*"):  # left by a writer that was killed mid-save
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir()
            model.save_pretrained(str(tmp), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            torch.save(state, tmp / "state.pt")
            manifest = {"step": step, "files": {p.name: file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}}
            (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
            for p in tmp.iterdir():
                with p.open("rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            kept = [p.name for p in self.list() if p != final]
            raise CheckpointWriteError(
                f"could not write checkpoint {final} ({type(e).__name__}: {e}); nothing of it was kept, and the "
                f"earlier checkpoints ({', '.join(kept) or 'none'}) are intact: free space under {self.root} and "
                "rerun with trainer.resume=true") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.list()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def list(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step_"))

    @staticmethod
    def verify(path: Path) -> str | None:
        """None when the checkpoint is intact, else the reason it is not."""
        mf = path / "MANIFEST.json"
        if not mf.is_file():
            return "MANIFEST.json missing"
        try:
            files = json.loads(mf.read_text())["files"]
        except (json.JSONDecodeError, KeyError) as e:
            return f"MANIFEST.json unreadable ({e})"
        for name, digest in files.items():
            p = path / name
            if not p.is_file():
                return f"{name} missing"
            if file_sha256(p) != digest:
                return f"{name} checksum mismatch"
        return None

    def latest_valid(self) -> Path | None:
        for path in reversed(self.list()):
            reason = self.verify(path)
            if reason is None:
                return path
            log.warning("checkpoint %s is corrupt (%s); falling back to the previous one", path, reason)
        return None

    @staticmethod
    def step_of(path: Path) -> int:
        return int(path.name.split("_")[1])


def rng_state() -> dict:
    """This process's Python, NumPy and torch RNG states, as a checkpoint's state.pt holds them."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def training_state(step: int, trainer: Any, data_state: dict) -> dict:
    """state.pt of a checkpoint, whichever runner writes it: the step, the trainer's state (optimizer,
    corrections, counters), the training stream's position and the trainer process's RNG."""
    return {"step": step, "trainer": trainer.state_dict(), "data": data_state, "rng": rng_state()}


def read_state(path: Path, mmap: bool = False) -> dict:
    """A checkpoint's state.pt. `mmap`: memory-mapped, for a reader that wants the step and the data position
    without pulling the optimizer's moments into memory."""
    return torch.load(Path(path) / "state.pt", weights_only=False, mmap=mmap)
