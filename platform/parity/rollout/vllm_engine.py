"""The vLLM rollout engine: the production sampler behind the same Engine interface as the torch engine.

vLLM runs in-process by default (VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine-core process to leak, start in
seconds instead of a minute on CPU). What it is asked for, and why:

- `logprobs_mode=processed_logprobs`: the returned log-probs are log_softmax(logits / T), the trainer's
  definition of pi_inf (vLLM's default is before temperature). With top_p < 1 vLLM renormalises them over the
  nucleus it sampled from (the torch engine reports the full-vocabulary value); `describe()` says so.
- one request per response row with its own seed derived from (spec.seed, prompt id, sample index), so a row
  is the same however prompts are sharded over workers (same rule as the torch engine; vLLM's stream differs).
- `max_logprobs >= 128`; each position's top-K come back sorted by rank, normalised over the full vocabulary.
- precision: a quantized rollout (W8A8 INT8 / FP8) loads a compressed-tensors checkpoint. When `model_dir`
  is a plain HF checkpoint it is exported once, with parity.precision.export, into a folder under outputs/
  that close() removes; a folder that already holds a compressed-tensors config is loaded as it is.
- weight sync: vllm_sync (vLLM's in-place reload for BF16/FP32; re-quantize and re-prepack each quantized
  linear layer for INT8/FP8, because vLLM's reload gives NaN there), then the prefix cache is reset, without
  which prompts cached under the old weights are reused.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parity.core.layout import BatchLayout, layout_batch
from parity.core.sampling import SamplingSpec
from parity.errors import ParityError
from parity.moe.codec import RoutingBatch
from parity.precision.export import export_compressed_tensors
from parity.rollout import compute_dtype, resolve_device
from parity.rollout.vllm_options import VllmOptions, resolve_vllm_options
from parity.types import RolloutBatch

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig, PrecisionConfig


def routing_capture_supported() -> tuple[bool, str]:
    """vLLM returns routed experts only through its GPU model runner (V2, needs CUDA and Triton)."""
    if not torch.cuda.is_available():
        return False, "vLLM returns routed experts only on CUDA GPUs (its Model Runner V2); this device is cpu"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "vLLM's routed-expert capture needs Triton, which is not installed"
    return True, ""


def _is_compressed_tensors(model_dir: Path) -> bool:
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        return False
    qc = json.loads(cfg_file.read_text()).get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors"


class VllmEngine:
    name = "vllm"

    def __init__(self, cfg: ParityConfig, model_dir: str | Path, precision: PrecisionConfig | None = None) -> None:
        r = cfg.rollout
        device = resolve_device(cfg.trainer.device)
        self.dtype = compute_dtype(cfg.model.dtype, device)
        dtype_name = "bfloat16" if self.dtype == torch.bfloat16 else "float32"
        self.opts: VllmOptions = resolve_vllm_options(cfg, precision, dtype_name, str(device))
        self.precision = precision
        self.model_dir = Path(model_dir)
        self.capture_routing = bool(r.capture_routing)
        if self.capture_routing:
            ok, why = routing_capture_supported()
            if not ok:
                raise ParityError(f"config key `rollout.capture_routing`=true with rollout.name=vllm: {why}; use "
                                  "rollout.name=torch, the routed-expert capture path on this device")
        self.in_process = bool(r.vllm_in_process)
        if self.in_process:  # must be set before vLLM builds its engine core
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.quantized_sync = str(r.vllm_quantized_sync)
        if self.quantized_sync not in ("requantize", "rebuild"):
            raise ParityError(f"config key `rollout.vllm_quantized_sync`: {self.quantized_sync!r}; "
                              "known: requantize, rebuild")
        hf = json.loads((self.model_dir / "config.json").read_text())
        self.pad_id, self.eos_id = int(hf.get("pad_token_id") or 0), int(hf["eos_token_id"])
        self.num_experts = hf.get("num_experts")
        self._workdir = Path(tempfile.mkdtemp(prefix="vllm_", dir=self._scratch(cfg)))
        self.checkpoint_dir = self._checkpoint_for(self.model_dir)
        self.llm_kwargs = self._llm_kwargs(cfg)
        self.init_s = 0.0
        self.llm: Any = None
        self._start(self.checkpoint_dir)
        self.sync_route = "reload" if not self.opts.quantized else self.quantized_sync

    # ---- start / stop ----

    @staticmethod
    def _scratch(cfg: ParityConfig) -> str:
        base = Path(str(cfg.outputs_dir)) / "tmp"
        base.mkdir(parents=True, exist_ok=True)
        return str(base)

    def _checkpoint_for(self, model_dir: Path) -> Path:
        if not self.opts.quantized or _is_compressed_tensors(model_dir):
            return model_dir
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        out = self._workdir / "checkpoint"
        export_compressed_tensors(model, out, self.opts.weights, self.opts.activations, source_dir=model_dir)
        return out

    def _llm_kwargs(self, cfg: ParityConfig) -> dict[str, Any]:
        r = cfg.rollout
        kw = {"tokenizer": str(self.model_dir), "seed": int(r.seed), "enforce_eager": bool(r.vllm_enforce_eager),
              "max_model_len": int(r.max_model_len), "gpu_memory_utilization": float(r.gpu_memory_utilization),
              "max_logprobs": max(128, int(r.topk_logprobs)), **self.opts.llm_kwargs()}
        if self.capture_routing:
            kw["enable_return_routed_experts"] = True
        return kw

    def _start(self, checkpoint: Path) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        try:
            self.llm = LLM(model=str(checkpoint), **self.llm_kwargs)
        except Exception as e:  # vLLM's own message names its argument; say which engine start failed
            raise ParityError(f"vLLM engine start failed for {checkpoint} with {self._describe_kwargs()}: {e}") from e
        self.init_s = time.perf_counter() - t0
        if self.opts.quantized:
            from parity.rollout.vllm_sync import tag_quantized_formats

            self.llm.collective_rpc(tag_quantized_formats, args=(self.opts.weights,))

    def _describe_kwargs(self) -> str:
        keys = ("dtype", "kv_cache_dtype", "attention_backend", "linear_backend", "logprobs_mode")
        return ", ".join(f"{k}={self.llm_kwargs[k]!r}" for k in keys if k in self.llm_kwargs)

    def _stop(self) -> None:
        if self.llm is None:
            return
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            self.llm = None
            gc.collect()
            # in-process vLLM keeps a one-rank process group; drop it so another engine can start here
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            destroy_distributed_environment()

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def describe(self) -> dict:
        p = self.precision
        return {"engine": self.name, "device": self.opts.device, "dtype": self.opts.dtype,
                "weights": self.opts.weights, "activations": self.opts.activations,
                "kv_cache": getattr(p, "kv_cache", "bf16"), "kv_cache_dtype": self.opts.kv_cache_dtype,
                "linear_path": "vllm_" + ("w8a8_" + self.opts.weights if self.opts.quantized else self.opts.dtype),
                "logprobs_mode": self.llm_kwargs.get("logprobs_mode"), "weight_sync": self.sync_route,
                "in_process": self.in_process, "init_s": round(self.init_s, 2)}

    # ---- generate ----

    def _params(self, spec: SamplingSpec, seed: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(n=1, temperature=spec.temperature, top_p=spec.top_p, max_tokens=spec.max_new_tokens,
                              logprobs=spec.topk_logprobs, seed=seed, stop_token_ids=[self.eos_id],
                              detokenize=False)

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        lay = layout_batch(prompt_token_ids, spec, prompt_ids, self.pad_id)
        P, R = lay.width, spec.max_new_tokens
        if P + R > int(self.llm_kwargs["max_model_len"]):
            raise ValueError(f"prompt ({P}) + max_new_tokens ({R}) exceeds rollout.max_model_len "
                             f"({self.llm_kwargs['max_model_len']})")
        requests = [{"prompt_token_ids": [int(t) for t in prompt_token_ids[i]]} for i, _ in lay.rows]
        params = [self._params(spec, s % (1 << 62)) for s in lay.row_seeds()]
        t0 = time.perf_counter()
        outs = self.llm.generate(requests, params, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        return self._to_batch(outs, prompt_token_ids, lay, gen_s, spec)

    def _to_batch(self, outs: list, prompts_in: list[list[int]], lay: BatchLayout, gen_s: float,
                  spec: SamplingSpec) -> RolloutBatch:
        B, R, K = lay.size, spec.max_new_tokens, spec.topk_logprobs
        responses = torch.full((B, R), self.pad_id, dtype=torch.long)
        rmask = torch.zeros((B, R), dtype=torch.bool)
        logps = torch.zeros((B, R), dtype=torch.float32)
        done = torch.zeros(B, dtype=torch.bool)
        topk_ids = torch.zeros((B, R, K), dtype=torch.int32) if K else None
        topk_lp = torch.zeros((B, R, K), dtype=torch.float32) if K else None
        routing = []
        for r, ((i, _), out) in enumerate(zip(lay.rows, outs, strict=True)):
            toks = prompts_in[i]
            c = out.outputs[0]
            ids = list(c.token_ids)[:R]
            n = len(ids)
            responses[r, :n], rmask[r, :n] = torch.tensor(ids, dtype=torch.long), True
            done[r] = bool(n and ids[-1] == self.eos_id)
            for t, (tok, lp) in enumerate(zip(ids, c.logprobs or [], strict=False)):
                logps[r, t] = lp[tok].logprob
                if K:
                    head = sorted((e.rank, tid, e.logprob) for tid, e in lp.items() if e.rank is not None and
                                  e.rank <= K)[:K]
                    topk_ids[r, t, :len(head)] = torch.tensor([h[1] for h in head], dtype=torch.int32)
                    topk_lp[r, t, :len(head)] = torch.tensor([h[2] for h in head], dtype=torch.float32)
            if c.logprobs is None or len(c.logprobs) < n:
                raise RuntimeError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for "
                                   f"{n} tokens of row {r}")
            if self.capture_routing:
                routing.append(self._response_routing(c, len(toks), n))
        batch = lay.rollout_batch(
            responses, rmask, logps, ~done, topk_ids, topk_lp,
            meta={**self.describe(), "generate_s": gen_s,
                  "logprobs_renormalised_over_top_p": spec.top_p < 1.0 and spec.temperature > 0})
        if self.capture_routing:
            batch.routed_experts = RoutingBatch.from_responses(routing, num_experts=int(self.num_experts))
        return batch

    @staticmethod
    def _response_routing(c: Any, prompt_len: int, n: int) -> torch.Tensor:
        """Token t of a response is routed by the forward at position prompt_len - 1 + t."""
        arr = getattr(c, "routed_experts", None)
        if arr is None:
            raise RuntimeError("vLLM returned no routed_experts although enable_return_routed_experts is set")
        ids = torch.as_tensor(arr)[prompt_len - 1:prompt_len - 1 + n]
        if ids.shape[0] != n:
            raise RuntimeError(f"vLLM routed_experts has {arr.shape[0]} positions, need {prompt_len - 1 + n}")
        return ids

    # ---- weight sync ----

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        if self.sync_route == "rebuild":
            self._rebuild(named_tensors)
            return time.perf_counter() - t0
        from parity.rollout.vllm_sync import pack_tensors, worker_update

        tensors = {k: v.detach().cpu() for k, v in named_tensors}
        payload: Any = tensors if self.in_process else pack_tensors(tensors.items())
        self.last_sync = self.llm.collective_rpc(worker_update, args=(payload, self.sync_route))
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def _rebuild(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the new weights as a quantized checkpoint and restart vLLM on it (the fallback route)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in params:
                    raise KeyError(f"weight sync: model has no parameter {name!r}")
                params[name].copy_(t.to(params[name].dtype))
        self._stop()
        out = self._workdir / "checkpoint"
        export_compressed_tensors(model, out, self.opts.weights, self.opts.activations, source_dir=self.model_dir)
        del model
        self.checkpoint_dir = out
        self._start(out)
