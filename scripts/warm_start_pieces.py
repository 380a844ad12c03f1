"""Carry a prepared (warm-started) model between jobs of a machine that keeps nothing, in pieces small enough to
travel (docs/study/grpo_study.md, "Reproducing").

    python scripts/warm_start_pieces.py export MODEL_DIR OUT_DIR   # round the weights to bfloat16 in place, then
                                                                   # write OUT_DIR/warm.tar.part00, part01, ...
    python scripts/warm_start_pieces.py exact MODEL_DIR OUT_DIR    # the folder as it is, float32 unrounded: for a
                                                                   # warm start that runs already started from (twice
                                                                   # the bytes: two calls' worth of carry)
    python scripts/warm_start_pieces.py pack PIECES_DIR OUT_DIR    # the same pieces xz-compressed (warm.tar.xz.part*):
                                                                   # about 70% of the bytes, to carry to a job beside the
                                                                   # repository (the device's tree limit); slow, so done
                                                                   # off the device
    python scripts/warm_start_pieces.py import PIECES_DIR MODELS_DIR

`export` rounds every float32 weight to the nearest bfloat16 value and saves the model so (still float32, and
prepare.json's weights_sha256 updated): every run of the study, in this job and in later ones, then starts from
exactly these weights, and the pieces carry them in bfloat16, half the bytes, without loss. `import` writes the
model folder back with the same float32 file (its hash is checked against prepare.json), from plain or packed
pieces, rounded or exact."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import sys
import tarfile
import tempfile
from pathlib import Path

PIECE = 15 * 2**20  # below the 16 MiB a returned file may have


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_pieces(blob: bytes, out: Path, stem: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(blob), PIECE):
        (out / f"{stem}.part{i // PIECE:02d}").write_bytes(blob[i:i + PIECE])
    return -(-len(blob) // PIECE)


def _tar(model_dir: Path, weights: tuple[str, bytes] | None = None) -> bytes:
    """The model folder as one tar under its own name; `weights` (member name, bytes), when given, stands in for
    model.safetensors."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(model_dir.iterdir()):
            if weights is not None and f.name == "model.safetensors":
                ti = tarfile.TarInfo(f"{model_dir.name}/{weights[0]}")
                ti.size = len(weights[1])
                tar.addfile(ti, io.BytesIO(weights[1]))
            else:
                tar.add(str(f), arcname=f"{model_dir.name}/{f.name}")
    return buf.getvalue()


def export(model_dir: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    rounded = {k: (v.to(torch.bfloat16).to(v.dtype) if v.dtype == torch.float32 else v) for k, v in tensors.items()}
    save_file(rounded, str(weights), metadata={"format": "pt"})
    info = json.loads((model_dir / "prepare.json").read_text())
    info.update(weights_sha256=_sha256(weights), weights_rounded_to="bfloat16")
    (model_dir / "prepare.json").write_text(json.dumps(info, indent=1))
    with tempfile.TemporaryDirectory() as tmp:  # its own file: several exports may run at once
        half = Path(tmp) / "bf16.safetensors"
        save_file({k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in rounded.items()}, str(half))
        blob = _tar(model_dir, ("model.bf16.safetensors", half.read_bytes()))
    n = _write_pieces(blob, out, "warm.tar")
    print(json.dumps({"model": model_dir.name, "bytes": len(blob), "pieces": n, "weights_sha256": info["weights_sha256"]}))


def exact(model_dir: Path, out: Path) -> None:
    """The model folder in pieces as it is: the float32 weights unrounded, prepare.json's hash theirs. For a warm
    start that runs have already started from without export's rounding, so later runs start from the same."""
    want = json.loads((model_dir / "prepare.json").read_text())["weights_sha256"]
    got = _sha256(model_dir / "model.safetensors")
    if got != want:
        raise ValueError(f"{model_dir}: weights hash {got} differs from prepare.json's {want}")
    blob = _tar(model_dir)
    n = _write_pieces(blob, out, "warm.tar")
    print(json.dumps({"model": model_dir.name, "bytes": len(blob), "pieces": n, "weights_sha256": got}))


def _blob(pieces: Path, pattern: str) -> bytes:
    parts = sorted(pieces.glob(pattern))
    if not parts:
        raise FileNotFoundError(f"{pieces}: no {pattern} files")
    return b"".join(p.read_bytes() for p in parts)


def pack(pieces: Path, out: Path) -> None:
    """Plain pieces (warm.tar.part*) to xz-compressed ones (warm.tar.xz.part*), same tar inside."""
    blob = lzma.compress(_blob(pieces, "warm.tar.part*"), preset=9 | lzma.PRESET_EXTREME)
    print(json.dumps({"bytes": len(blob), "pieces": _write_pieces(blob, out, "warm.tar.xz")}))


def restore(pieces: Path, models: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    packed = sorted(pieces.glob("warm.tar.xz.part*"))
    blob = lzma.decompress(_blob(pieces, "warm.tar.xz.part*")) if packed else _blob(pieces, "warm.tar.part*")
    models.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        if any(not n.startswith(top) or ".." in n for n in names):
            raise ValueError(f"unexpected member names in {pieces}: {names}")
        tar.extractall(models, filter="data")
    d = models / top
    half = d / "model.bf16.safetensors"
    if half.exists():  # export's pieces; exact's hold model.safetensors itself
        save_file({k: v.to(torch.float32) if v.dtype == torch.bfloat16 else v for k, v in load_file(str(half)).items()},
                  str(d / "model.safetensors"), metadata={"format": "pt"})
        half.unlink()
    want = json.loads((d / "prepare.json").read_text())["weights_sha256"]
    got = _sha256(d / "model.safetensors")
    if got != want:
        raise ValueError(f"{d}: restored weights hash {got} differs from prepare.json's {want}")
    print(json.dumps({"model": str(d), "weights_sha256": got}))


if __name__ == "__main__":
    verb, a, b = sys.argv[1:4]
    verbs = {"export": export, "exact": exact, "pack": pack, "import": restore}
    if verb not in verbs:
        sys.exit(f"warm_start_pieces.py: unknown verb {verb!r}; expected one of {', '.join(verbs)}")
    verbs[verb](Path(a), Path(b))
