"""Checkpoints are atomic and checksummed; a corrupt latest one falls back to the previous."""

from __future__ import annotations

import logging

import pytest
import torch

from parity.training.checkpoint import CheckpointManager


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file
        save_file({"w": self.w.detach()}, f"{path}/model.safetensors")


def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog):
    m = CheckpointManager(tmp_path, keep=3)
    m.save(1, Tiny(), None, {"step": 1})
    m.save(2, Tiny(), None, {"step": 2})
    (m.path(2) / "state.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        assert m.latest_valid() == m.path(1)
    assert "checksum mismatch" in caplog.text


def test_failed_write_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep=3)
    m.save(1, Tiny(), None, {"step": 1})

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        m.save(2, Tiny(), None, {"step": 2})
    monkeypatch.undo()
    assert m.list() == [m.path(1)]
    assert m.latest_valid() == m.path(1)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_prunes_to_keep(tmp_path):
    m = CheckpointManager(tmp_path, keep=2)
    for s in range(1, 5):
        m.save(s, Tiny(), None, {"step": s})
    assert [CheckpointManager.step_of(p) for p in m.list()] == [3, 4]
