"""Write a quantized checkpoint in the compressed-tensors format that vLLM loads.

Layout (what vLLM's compressed-tensors loader and transformers' CompressedTensorsHfQuantizer read):
- `config.json`: the model's Hugging Face config plus `quantization_config`, built with the
  compressed_tensors package's own classes: one config group targeting `Linear` with
  weights {8-bit int | float, symmetric, per channel, static} and input_activations {8-bit, symmetric,
  per token, dynamic} (absent for weight-only FP8), format int-quantized / float-quantized, status
  compressed, `ignore` = lm_head and the MoE routers.
- safetensors shards: each quantized Linear as `<name>.weight` (int8 or float8_e4m3fn [out, in]) and
  `<name>.weight_scale` (float32 [out, 1]); MoE experts under the checkpoint names
  `experts.{e}.{gate,up,down}_proj.weight[_scale]`; every other tensor (embeddings, norms, lm_head,
  routers) unchanged in the model's dtype.
The weights are quantized tensor by tensor while the shards are written, so the host holds the model
plus at most one shard of codes.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from parity.precision.apply import QuantExperts, _quantizable
from parity.precision.formats import quantize_rowwise
from parity.precision.linear import QuantLinear

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig, PrecisionConfig

EXPORTABLE = {("int8", "int8"): "int-quantized", ("fp8", "fp8"): "float-quantized",
              ("fp8", "bf16"): "float-quantized"}
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")


def checkpoint_dir_name(model_name: str, weights: str, activations: str) -> str:
    """<model>-W8A8-INT8 (the seed's pattern), <model>-W8A8-FP8, <model>-W8A16-FP8; model = last path part."""
    base = str(model_name).rstrip("/").split("/")[-1]
    a_bits = {"bf16": "16", "int4": "4"}.get(activations, "8")
    return f"{base}-W8A{a_bits}-{weights.upper()}"


def quantized_checkpoint_dir(cfg: ParityConfig, precision: PrecisionConfig) -> Path:
    """Where `quantize` writes (and `validate` reads) the rollout's checkpoint: the folder of the seed block's
    quantization_config_file when set, else <rollout.precision.export_dir>/<model>-W8A8-INT8 (and siblings)."""
    from parity.precision.config import quantization_config_path

    seed_file = quantization_config_path(cfg)
    if seed_file:
        return Path(str(seed_file)).parent
    name = checkpoint_dir_name(str(cfg.model.name), precision.weights, precision.activations)
    return Path(str(cfg.rollout.precision.export_dir)) / name


def quantization_config_dict(weights: str, activations: str) -> dict:
    """The `quantization_config` entry, produced by compressed_tensors' pydantic classes."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
    )

    if (weights, activations) not in EXPORTABLE:
        raise ValueError(f"export: W={weights} A={activations} is not exportable; supported: "
                         f"{', '.join(f'W={w} A={a}' for w, a in EXPORTABLE)}")
    typ = "int" if weights == "int8" else "float"
    w_args = QuantizationArgs(num_bits=8, type=typ, symmetric=True, strategy="channel", dynamic=False)
    a_args = None if activations == "bf16" else QuantizationArgs(num_bits=8, type=typ, symmetric=True,
                                                                  strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=w_args, input_activations=a_args)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=EXPORTABLE[(weights, activations)],
                            quantization_status=QuantizationStatus.COMPRESSED, ignore=list(IGNORE))
    return json.loads(qc.model_dump_json(exclude_none=True))


def _codes(w: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_rowwise(w, weights)
    return q.contiguous(), s.contiguous()


def _linear_tensors(name: str, mod: nn.Module, weights: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(mod, QuantLinear):
        if mod.weights != weights:
            raise ValueError(f"export: {name} holds {mod.weights} codes, export asked for {weights}")
        q, s = mod.weight.detach(), mod.weight_scale.detach()
    else:
        q, s = _codes(mod.weight.detach(), weights)
    yield f"{name}.weight", q
    yield f"{name}.weight_scale", s
    if mod.bias is not None:
        yield f"{name}.bias", mod.bias.detach()


def _expert_tensors(name: str, mod: nn.Module, weights: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused [E, 2I, H] / [E, H, I] experts -> per-expert gate/up/down projections."""
    for e in range(mod.gate_up_proj.shape[0]):
        if isinstance(mod, QuantExperts):
            gu, gus = mod.gate_up_proj[e], mod.gate_up_proj_scale[e]
            dn, dns = mod.down_proj[e], mod.down_proj_scale[e]
        else:
            (gu, gus), (dn, dns) = _codes(mod.gate_up_proj[e].detach(), weights), _codes(mod.down_proj[e].detach(),
                                                                                         weights)
        i = gu.shape[0] // 2
        for proj, q, s in (("gate_proj", gu[:i], gus[:i]), ("up_proj", gu[i:], gus[i:]), ("down_proj", dn, dns)):
            yield f"{name}.{e}.{proj}.weight", q.contiguous()
            yield f"{name}.{e}.{proj}.weight_scale", s.contiguous()


def compressed_tensors(model: nn.Module, weights: str, activations: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of the whole model in the compressed-tensors layout, one at a time."""
    done: set[str] = set()
    for name, mod in model.named_modules():
        kind = "linear" if isinstance(mod, QuantLinear) else "experts" if isinstance(mod, QuantExperts) \
            else _quantizable(name, mod)
        if kind is None:
            continue
        done.add(name)
        yield from (_linear_tensors if kind == "linear" else _expert_tensors)(name, mod, weights)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        owner = name.rpartition(".")[0]
        if owner in done or (tied and name == "lm_head.weight"):
            continue
        yield name, t.detach()


def _copy_side_files(source_dir: str | Path | None, out: Path) -> None:
    if source_dir is None:
        return
    for fname in TOKENIZER_FILES:
        src = Path(source_dir) / fname
        if src.is_file():
            shutil.copy2(src, out / fname)


def export_compressed_tensors(model: nn.Module, out_dir: str | Path, weights: str = "int8",
                              activations: str = "int8", source_dir: str | Path | None = None,
                              max_shard_bytes: int = 2 << 30) -> Path:
    """Write the checkpoint of `model` (BF16/FP32, or already holding QuantLinear modules) to out_dir;
    tokenizer and generation files are copied from `source_dir` when given. Returns config.json's path."""
    qconfig = quantization_config_dict(weights, activations)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    files: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0

    def flush() -> None:
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[0], str(out / fname), metadata={"format": "pt"})
        files.append(fname)
        for k in shards[0]:
            weight_map[k] = fname
        shards[0], sizes[0] = {}, 0

    for name, t in compressed_tensors(model, weights, activations):
        nbytes = t.numel() * t.element_size()
        if shards[0] and sizes[0] + nbytes > max_shard_bytes:
            flush()
        shards[0][name] = t.contiguous().cpu()
        sizes[0] += nbytes
        total += nbytes
    flush()
    if len(files) == 1:
        (out / files[0]).rename(out / "model.safetensors")
    else:
        final = {}
        for i, f in enumerate(files):
            new = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            (out / f).rename(out / new)
            final[f] = new
        index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = model.config.to_dict() if hasattr(model, "config") else {}
    if hf and not hf.get("architectures"):  # vLLM picks its model class from this list
        hf["architectures"] = [type(model).__name__]
    hf["quantization_config"] = qconfig
    config_file = out / "config.json"
    config_file.write_text(json.dumps(hf, indent=2, default=str))
    _copy_side_files(source_dir, out)
    return config_file


_CKPT_EXPERT = re.compile(r"^(?P<mod>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<what>weight|weight_scale)$")


@torch.no_grad()
def load_compressed_checkpoint_(model: nn.Module, ckpt_dir: str | Path) -> int:
    """Load an exported checkpoint's codes and scales verbatim (no re-quantization) into `model`, which
    must already hold QuantLinear / QuantExperts of the same formats (quantize_model_). What the file
    says is what runs, so a corrupted checkpoint shows in validation. Returns the tensor count."""
    modules = dict(model.named_modules())
    plain = dict(model.named_parameters(remove_duplicate=False))
    n = 0
    for name, t in load_compressed_checkpoint_state(ckpt_dir).items():
        owner, _, attr = name.rpartition(".")
        mod, m = modules.get(owner), _CKPT_EXPERT.match(name)
        if isinstance(mod, QuantLinear) and attr in ("weight", "weight_scale", "bias"):
            dst = getattr(mod, attr)
        elif m and isinstance(modules.get(m["mod"]), QuantExperts):
            ex, e = modules[m["mod"]], int(m["e"])
            base = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj"
            dst = ex._buffers[base if m["what"] == "weight" else f"{base}_scale"][e]
            i = ex.intermediate_dim
            dst = dst if base == "down_proj" else dst[:i] if m["proj"] == "gate_proj" else dst[i:]
        elif name in plain:
            dst = plain[name]
        else:
            raise KeyError(f"checkpoint {ckpt_dir}: tensor {name!r} matches nothing in the model (was it quantized "
                           "with the same formats?)")
        codes = (isinstance(mod, QuantLinear) and attr == "weight") or bool(m and m["what"] == "weight")
        if dst is None or dst.shape != t.shape or (codes and dst.dtype != t.dtype):
            raise ValueError(f"checkpoint {ckpt_dir}: tensor {name!r} {tuple(t.shape)} {t.dtype} does not fit the "
                             f"model's {None if dst is None else (tuple(dst.shape), dst.dtype)}")
        dst.copy_(t)
        n += 1
    return n


def load_compressed_checkpoint_state(out_dir: str | Path) -> dict[str, Any]:
    """All tensors of an exported checkpoint (tests, inspection)."""
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(Path(out_dir).glob("model*.safetensors")):
        state.update(load_file(str(f)))
    return state
