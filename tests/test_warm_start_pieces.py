"""Carrying a warm start between jobs (scripts/warm_start_pieces.py): export rounds to bfloat16 and splits the
folder into pieces, pack compresses them, import restores the same float32 weights from either kind."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("warm_start_pieces", ROOT / "scripts" / "warm_start_pieces.py")
pieces_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pieces_mod)


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models" / "tiny-abc"
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(300, 700, generator=g), "ids": torch.arange(10)}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "config.json").write_text("{}")
    (d / "prepare.json").write_text(json.dumps({"model_dir": str(d), "weights_sha256": "before"}))
    return d


def test_export_pack_import_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces_mod, "PIECE", 100_000)  # several pieces from a small model
    d = _model_dir(tmp_path)
    original = load_file(str(d / "model.safetensors"))
    pieces_mod.export(d, tmp_path / "plain")
    rounded = load_file(str(d / "model.safetensors"))
    assert torch.equal(rounded["w"], original["w"].to(torch.bfloat16).float())  # rounded in place, still float32
    assert torch.equal(rounded["ids"], original["ids"])
    sha = json.loads((d / "prepare.json").read_text())["weights_sha256"]
    assert len(list((tmp_path / "plain").glob("warm.tar.part*"))) > 1
    pieces_mod.pack(tmp_path / "plain", tmp_path / "packed")
    plain_bytes = sum(p.stat().st_size for p in (tmp_path / "plain").iterdir())
    packed_bytes = sum(p.stat().st_size for p in (tmp_path / "packed").glob("warm.tar.xz.part*"))
    assert 0 < packed_bytes < plain_bytes
    for kind in ("plain", "packed"):
        pieces_mod.restore(tmp_path / kind, tmp_path / f"restored_{kind}")
        got = tmp_path / f"restored_{kind}" / "tiny-abc"
        assert json.loads((got / "prepare.json").read_text())["weights_sha256"] == sha
        w = load_file(str(got / "model.safetensors"))
        assert torch.equal(w["w"], rounded["w"]) and w["w"].dtype == torch.float32
        assert not (got / "model.bf16.safetensors").exists()


def test_import_names_a_folder_without_pieces(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="warm.tar.part"):
        pieces_mod.restore(tmp_path / "empty", tmp_path / "models")


def test_exact_pieces_restore_the_unrounded_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces_mod, "PIECE", 100_000)
    d = _model_dir(tmp_path)
    info = json.loads((d / "prepare.json").read_text())
    info["weights_sha256"] = pieces_mod._sha256(d / "model.safetensors")
    (d / "prepare.json").write_text(json.dumps(info))
    original = load_file(str(d / "model.safetensors"))
    pieces_mod.exact(d, tmp_path / "exact")
    assert len(list((tmp_path / "exact").glob("warm.tar.part*"))) > 1
    assert torch.equal(load_file(str(d / "model.safetensors"))["w"], original["w"])  # the source left as it was
    pieces_mod.restore(tmp_path / "exact", tmp_path / "restored")
    w = load_file(str(tmp_path / "restored" / "tiny-abc" / "model.safetensors"))
    assert torch.equal(w["w"], original["w"]) and w["w"].dtype == torch.float32  # not rounded to bfloat16


def test_exact_refuses_weights_that_differ_from_prepare_json(tmp_path):
    d = _model_dir(tmp_path)  # prepare.json says "before"
    with pytest.raises(ValueError, match="differs from prepare.json"):
        pieces_mod.exact(d, tmp_path / "exact")
