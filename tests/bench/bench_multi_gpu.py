"""Multi-GPU benchmark: the trainer on 1 GPU (rollout on the other) vs sharded over 2 GPUs (FSDP2),
Qwen3-0.6B shape (tests/bench/bench_gpu.py SHAPE), random weights, one run, two processes (rank r on GPU r).

    PYTHONUNBUFFERED=1 python3 tests/bench/bench_multi_gpu.py --out $OUT/bench_multi_gpu.json   # 2-GPU host
    python tests/bench/bench_multi_gpu.py --device cpu --tiny                                     # CPU smoke test

(in an image without the project venv: PYTHONPATH=platform:<omegaconf/hydra/antlr4 site dir>, as for bench_gpu.py.)
Phases, each timed with CUDA synchronisation (median of --steps after --warmup):
  one_gpu_trainer   rank 0: the single-process Trainer; rank 1: the torch rollout engine. Per RL step: rollout
                    on GPU 1 (batch to rank 0) -> trainer step on GPU 0 -> weights GPU 0 -> GPU 1 by broadcast
                    (parity.distributed.weight_broadcast, NCCL). Reports rollout, train and sync seconds.
  two_gpu_trainer   both ranks: ShardedTrainer (FSDP2) on the same global batch, half the rows each; then the
                    gathered weights (rank 0) as the rollout would receive them. No rollout GPU is left over, so
                    this phase times the trainer step (and the gather) only.
Trainer tokens/s = rows x (prompt + response) / train step seconds, as in bench_gpu.py.

The 2-GPU figures have not been measured yet (no 2-GPU host has run it); `--device cpu --tiny` runs the
same phases over gloo on 2 CPU processes with a tiny model (seconds), so the script is known to run."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# NVLink multicast off (it can take a shared host's GPUs out of service); children inherit this environment
for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SHAPE  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
            rope_theta=10_000.0, eos_token_id=1, pad_token_id=0, bos_token_id=0)


def sizes(tiny: bool) -> dict:
    """prompts x samples per prompt = rows; prompt and response tokens (bench_gpu.py's trainer batch: 8 x 1024)."""
    return dict(prompts=2, n=2, P=8, R=8, micro=2) if tiny else dict(prompts=2, n=4, P=128, R=896, micro=8)


def build_model_dir(tiny: bool) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    d = tempfile.mkdtemp(prefix="bench_multi_gpu_")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**(TINY if tiny else SHAPE))).to(torch.bfloat16).save_pretrained(d)
    return d


def trainer_cfg(device: str, micro: int) -> object:
    from parity.config import load_config
    dtype = "float32" if device == "cpu" else "bfloat16"
    return load_config([f"trainer.micro_batch_size={micro}", f"model.dtype={dtype}", f"trainer.device={device}",
                        "algorithm.policy_loss=reinforce", "algorithm.correction.name=none", "rollout.topk_logprobs=0"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from parity.core.sampling import SamplingSpec
    from parity.distributed.weight_broadcast import WeightBroadcast, free_port
    from parity.rollout.torch_engine import TorchEngine
    from parity.training.sharded import ShardedTrainer
    from parity.training.trainer import build_trainer

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    s = sizes(args.tiny)
    cfg = trainer_cfg(args.device, s["micro"])
    dtype = torch.bfloat16 if cuda else torch.float32
    vocab = (TINY if args.tiny else SHAPE)["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, vocab, (s["prompts"], s["P"]), generator=g).tolist()
    spec = SamplingSpec(temperature=1.0, max_new_tokens=s["R"], n=s["n"], seed=0)
    result: dict = {"rank": rank, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}

    def load() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def graded(batch: object) -> object:
        batch.rewards = torch.rand(batch.batch_size, generator=torch.Generator().manual_seed(1))
        return batch

    # ---- phase 1: trainer on GPU 0, rollout on GPU 1, weights by broadcast ----
    wport = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(wport, src=0)
    wb = WeightBroadcast("127.0.0.1", wport[0], rank, 2, backend, timeout_s=600)
    trainer = engine = None
    if rank == 0:
        trainer = build_trainer(load(), cfg, device)
        meta = [(n, tuple(p.shape), str(trainer.compute_dtype).removeprefix("torch."))
                for n, p in trainer.model.named_parameters()]
    else:
        engine = TorchEngine(model_dir, device=str(device), dtype=dtype)
        meta = None
    box = [meta]
    dist.broadcast_object_list(box, src=0)
    meta = box[0]
    times: dict[str, list[float]] = {"rollout_s": [], "train_s": [], "sync_s": [], "rl_step_s": []}
    batch = None
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        box = [None]
        if rank == 1:
            box = [engine.generate(prompts, spec).to("cpu")]
            sync(device)
        t_roll = time.perf_counter()
        dist.broadcast_object_list(box, src=1)
        batch = graded(box[0])
        t1 = time.perf_counter()
        if rank == 0:
            trainer.step(batch)
            sync(device)
        t2 = time.perf_counter()
        if rank == 0:
            wb.send(trainer.sync_weights())
        else:
            engine.update_weights(wb.receive(meta, device))
        sync(device)
        dist.barrier()
        t3 = time.perf_counter()
        if i >= args.warmup:
            for k, v in (("rollout_s", t_roll - t0), ("train_s", t2 - t1), ("sync_s", t3 - t2), ("rl_step_s", t3 - t0)):
                times[k].append(v)
    rows, n_tok = batch.batch_size, batch.batch_size * (batch.prompts.shape[1] + batch.responses.shape[1])
    both: list = [None, None]
    dist.all_gather_object(both, times)
    times = {**both[0], "rollout_s": both[1]["rollout_s"]}  # the rollout ran on rank 1, the trainer on rank 0
    one = {k: median(v) for k, v in times.items()}
    one.update({"rows": rows, "tokens": n_tok, "response_tokens": int(batch.response_mask.sum())})
    if rank == 0:
        one["train_tokens_per_s"] = n_tok / one["train_s"]
        one["rollout_tokens_per_s"] = one["response_tokens"] / one["rollout_s"]
        result["one_gpu_trainer"] = one
    del trainer, engine
    wb.close()
    if cuda:
        torch.cuda.empty_cache()

    # ---- phase 2: the trainer sharded over both GPUs, same batch ----
    sharded = ShardedTrainer(load(), cfg, device)
    step_s, gather_s = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        sharded.step(batch)
        sync(device)
        dist.barrier()
        t1 = time.perf_counter()
        for _ in sharded.sync_weights():  # the full weights as rank 0 would publish them
            pass
        sync(device)
        dist.barrier()
        t2 = time.perf_counter()
        if i >= args.warmup:
            step_s.append(t1 - t0)
            gather_s.append(t2 - t1)
    two = {"train_s": median(step_s), "gather_s": median(gather_s), "rows": rows, "tokens": n_tok,
           "rows_per_rank": [len(x) for x in torch.arange(rows).tensor_split(2)]}
    two["train_tokens_per_s"] = n_tok / two["train_s"]
    if cuda:
        two["peak_GiB_rank"] = torch.cuda.max_memory_allocated(device) / 2**30
    if rank == 0:
        result["two_gpu_trainer"] = two
        result["train_speedup_2_over_1"] = one["train_s"] / two["train_s"]
        result["samples_s"] = {"one_gpu_trainer": times, "two_gpu_trainer": {"train_s": step_s, "gather_s": gather_s}}
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda on a host with 2 GPUs, else the CPU smoke test (cpu --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (the CPU smoke test)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "outputs" / "bench_multi_gpu.json"))
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
        if args.device == "cpu":
            args.tiny = True
            print("bench_multi_gpu: fewer than 2 GPUs here; running the CPU smoke test (--device cpu --tiny)")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"bench_multi_gpu: needs 2 GPUs, this host has {torch.cuda.device_count()} (--device cpu --tiny "
                 "runs the same phases on CPU)")
    from parity.distributed.weight_broadcast import free_port

    t0 = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model_dir = build_model_dir(args.tiny)
    try:
        mp.start_processes(rank_main, args=(2, free_port("127.0.0.1"), args, model_dir, args.out), nprocs=2,
                           start_method="spawn")
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    res = json.loads(Path(args.out).read_text())
    res.update({"torch": torch.__version__, "shape": "tiny" if args.tiny else "qwen3-0.6b", "total_s":
                time.perf_counter() - t0})
    Path(args.out).write_text(json.dumps(res, indent=1))
    one, two = res["one_gpu_trainer"], res["two_gpu_trainer"]
    print(f"{'':28}{'step s':>10}{'tokens/s':>12}")
    print(f"{'trainer on 1 ' + args.device:28}{one['train_s']:>10.3f}{one['train_tokens_per_s']:>12.0f}"
          f"   (rollout on the other: {one['rollout_s']:.3f} s, {one['rollout_tokens_per_s']:.0f} tok/s; "
          f"sync {one['sync_s']:.3f} s; RL step {one['rl_step_s']:.3f} s)")
    print(f"{'trainer sharded over 2':28}{two['train_s']:>10.3f}{two['train_tokens_per_s']:>12.0f}"
          f"   (gather of the full weights {two['gather_s']:.3f} s)")
    print(f"speed-up of the trainer step, 2 over 1: {res['train_speedup_2_over_1']:.2f}x")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
