"""Where a padded trainer step's non-finite gradient comes from, on a CUDA machine.

On an H200 (2026-12-04) one trainer step of the gpu preset's bf16 arm on a fixed batch padded to multiples of 64
tokens (trainer.pad_to_multiple=64) gave a non-finite gradient, eager or compiled, where the same batch unpadded
gave a finite one and, on CPU, padded and unpadded give the same step. The trainer now passes a padded batch's
forward a 4D mask in which each padding position attends to itself (parity.training.trainer.attention_mask_4d: no
query attends to nothing). This bench runs that step (one process, one configuration after another, the batch
sampled by the model itself as tests/bench/fixed_trainer_step.py does) unpadded, padded, padded with the 2D mask
as before, and so with each of PyTorch's attention back-ends switched off in turn (cuDNN; cuDNN and flash; all but
the math kernel), with the trainer's shared-prefix path, and once with a hook on every module that names the first
whose output or input gradient is non-finite and where; it writes each one's loss, gradient norm and whether the
optimizer stepped.

    PYTHONPATH=platform:.gpucarry/site python3 tests/bench/gpu_trainer_padding.py --model-dir MODEL --out pad.json
(without --model-dir: the small random Qwen3 of the CUDA tests)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "tests" / "bench"))
sys.path.insert(0, str(ROOT))

from fixed_trainer_step import make_batch, run_step  # noqa: E402
from gpu_study_throughput import run_list  # noqa: E402

BACKENDS = {"all": {}, "no_cudnn": {"cudnn": False}, "no_cudnn_flash": {"cudnn": False, "flash": False},
            "math_only": {"cudnn": False, "flash": False, "mem_efficient": False}}


def set_backends(off: dict) -> None:
    b = torch.backends.cuda
    b.enable_cudnn_sdp(off.get("cudnn", True))
    b.enable_flash_sdp(off.get("flash", True))
    b.enable_mem_efficient_sdp(off.get("mem_efficient", True))


def first_nonfinite(fn) -> tuple[object, list[str]]:
    """fn() with global hooks on every module's forward and backward: the first few modules whose forward output,
    or whose gradient with respect to its input in the backward, is non-finite."""
    seen: list[str] = []

    def hook(mod: torch.nn.Module, _inp: object, out: object) -> None:
        t = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, tuple) and out
                                                       and isinstance(out[0], torch.Tensor) else None)
        if t is None or not t.is_floating_point() or len(seen) >= 8 or bool(torch.isfinite(t).all()):
            return
        bad = ~torch.isfinite(t)
        where = bad.reshape(t.shape[0], t.shape[1], -1).any(-1).nonzero()[:6].tolist() if t.dim() >= 2 else []
        seen.append(f"{type(mod).__name__} {tuple(t.shape)}: {int(bad.sum())} non-finite, (row, position) {where}")

    def back(mod: torch.nn.Module, grad_in: tuple, _grad_out: tuple) -> None:
        t = next((g for g in grad_in if isinstance(g, torch.Tensor)), None)
        if t is not None and len(seen) < 16 and not bool(torch.isfinite(t).all()):
            bad = ~torch.isfinite(t)
            where = bad.reshape(t.shape[0], t.shape[1], -1).any(-1).nonzero()[:6].tolist() if t.dim() >= 2 else []
            seen.append(f"backward {type(mod).__name__} {tuple(t.shape)}: {int(bad.sum())} non-finite input "
                        f"gradients, (row, position) {where}")

    mm = torch.nn.modules.module
    handles = [mm.register_module_forward_hook(hook), mm.register_module_full_backward_hook(back)]
    try:
        return fn(), seen
    finally:
        for h in handles:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--preset-arm", default="bf16 / none")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--multiple", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_trainer_padding: needs a CUDA device")
    work = Path(tempfile.mkdtemp(prefix="trainer_padding_"))
    model_dir = a.model_dir
    if model_dir is None:
        from tests.kv_packed_checks import write_small_qwen3
        model_dir = str(work / "model")
        write_small_qwen3(model_dir)
    batch = make_batch(model_dir, rows=a.rows, group=8, prompt_len=32, max_new=a.max_new, topk=8, temperature=1.0,
                       seed=0, device="cuda")
    torch.save(batch, work / "batch.pt")
    overrides = [*run_list("gpu", 0, 1, 0, model_dir, a.preset_arm)[0]["overrides"], "rollout.topk_logprobs=8"]
    pad = [f"trainer.pad_to_multiple={a.multiple}"]
    # (name, overrides, attention back-ends, padding queries attend to themselves: the trainer's 4D mask)
    cases = [("unpadded", [], "all", True), ("padded", pad, "all", True), ("padded_2d_mask", pad, "all", False),
             *((f"padded_2d_mask_{k}", pad, k, False) for k in BACKENDS if k != "all"),
             ("padded_shared_prefix", [*pad, "trainer.shared_prefix=on"], "all", True),
             ("unpadded_shared_prefix", ["trainer.shared_prefix=on"], "all", True)]
    record = {"date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "batch": {"rows": a.rows, "prompt_width": int(batch["prompts"].shape[1]),
                        "response_width": int(batch["responses"].shape[1]),
                        "left_pads": [int(x) for x in (~batch["prompt_mask"]).sum(1)[:: 8].tolist()]},
              "cases": {}}
    import parity.training.trainer as trainer_module
    mask_4d = trainer_module.attention_mask_4d

    def two_d_mask(am: torch.Tensor) -> torch.Tensor:  # the padded forward given the 2D mask, as before
        return am

    for name, extra, backends, sees_itself in cases:
        set_backends(BACKENDS[backends])
        trainer_module.attention_mask_4d = mask_4d if sees_itself else two_d_mask
        t0 = time.time()
        try:
            r = run_step(model_dir, str(work / "batch.pt"), [*overrides, *extra], seed=0)
            m = r["metrics"]
            row = {"loss": m.get("train/loss"), "grad_norm": m.get("train/grad_norm"),
                   "optimizer_steps": m.get("train/optimizer_steps"),
                   "finite": all(math.isfinite(float(m.get(k, float("nan")))) for k in ("train/loss", "train/grad_norm"))}
        except Exception as e:  # noqa: BLE001 -- a case that raises is this bench's finding, not its end
            row = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
        row.update(extra=extra, backends=BACKENDS[backends], padded_query_sees_itself=sees_itself,
                   seconds=round(time.time() - t0, 1))
        record["cases"][name] = row
        print(name, json.dumps(row), flush=True)
        Path(a.out).write_text(json.dumps(record, indent=1))
    set_backends({})
    trainer_module.attention_mask_4d = two_d_mask
    # the padded step once more with the 2D mask, every module's output watched: where the first non-finite value is
    try:
        _, seen = first_nonfinite(lambda: run_step(model_dir, str(work / "batch.pt"), [*overrides, *pad], seed=0))
    except Exception as e:  # noqa: BLE001 -- hooks on every module may not suit one of them: say so
        seen = [f"the watched step raised {type(e).__name__}: {str(e)[-400:]}"]
    record["first_nonfinite"] = seen
    Path(a.out).write_text(json.dumps(record, indent=1))
    print("first non-finite outputs and input gradients:", *seen or ["none"],
          sep="\n  ", flush=True)


if __name__ == "__main__":
    main()
