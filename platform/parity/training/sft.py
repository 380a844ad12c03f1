"""Supervised warm start of the tiny model on its task: prompt -> the task teacher's response <eos>
(arithmetic: `\\boxed{answer}`, with the teacher's slip; countdown: a search trace ending in `\\boxed{expr}`)."""

from __future__ import annotations

import math
import os
import queue
import random
import threading
from typing import Any

import torch

from parity.core.progress import Progress
from parity.data.arithmetic import TEACHER_ERRORS, teacher_answer  # noqa: F401  (re-exported)
from parity.data.prompts import render_prompt
from parity.data.tasks import SyntheticTask


def _encode_batch(tok: Any, problems: list, template: str, targets: list[str]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt+target rows, attention mask and loss mask (target tokens and EOS only)."""
    seqs, tgt = [], []
    for p, text in zip(problems, targets, strict=True):
        prompt = tok(render_prompt(template, p.problem))["input_ids"]
        target = tok(text)["input_ids"] + [tok.eos_token_id]
        seqs.append(prompt + target)
        tgt.append(len(target))
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tok.pad_token_id, dtype=torch.long)
    am = torch.zeros_like(ids, dtype=torch.bool)
    lm = torch.zeros_like(ids, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(seqs, tgt)):
        ids[i, T - len(s):] = torch.tensor(s)
        am[i, T - len(s):] = True
        lm[i, T - n:] = True
    return ids, am, lm


def warm_start_batch(k: int, tok: Any, task: SyntheticTask, template: str, seed: int, batch_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch `k` of the warm start, a function of (seed, k) alone: its problems from the task's stream at position
    k x 2 x batch_size (a test-split problem is skipped, so a batch reads up to twice its size of positions), the
    teacher's draws from their own generator. So the batches can be made in any order, by any number of
    processes, and the warm start is the same. Returns ids, attention mask and the loss rows (next-token positions
    of target tokens) as flat indices, found here on the host: the same rows in the same order as indexing by the
    mask, without the device sync that costs."""
    stream = task.stream(seed=10_000 + seed)
    stream.load_state_dict({"position": 2 * batch_size * k})
    problems = stream.take(batch_size)
    rng = random.Random(f"teacher:{seed}:{k}")
    ids, am, lm = _encode_batch(tok, problems, template, [task.demonstration(p, rng) for p in problems])
    return ids, am, lm[:, 1:].reshape(-1).nonzero().squeeze(1)


_WORKER: dict = {}


def _init_worker(tok: Any, task: SyntheticTask, template: str, seed: int, batch_size: int) -> None:
    torch.set_num_threads(1)
    _WORKER.update(args=(tok, task, template, seed, batch_size))


def _make_batch(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return warm_start_batch(k, *_WORKER["args"])


def batch_workers() -> int:
    """Processes that make the warm start's batches: none on a machine of 2 cores or fewer (the training steps
    need them; a thread makes the batches), else up to 8, leaving two cores to the training loop."""
    cpus = os.cpu_count() or 1
    return 0 if cpus <= 2 else min(8, cpus - 2)


def _batches(tok: Any, task: SyntheticTask, template: str, ws: Any, stop: threading.Event,
             out: queue.Queue) -> None:
    """The warm start's batches in order, put on `out` ahead of the training steps: made in this thread, or by a
    pool of processes (batch_workers) when the machine has cores to spare, so the teacher's Python neither holds
    the training loop's interpreter nor limits the steps' rate."""
    def put(item: Any) -> bool:  # False once the training loop has stopped
        while not stop.is_set():
            try:
                out.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    args = (tok, task, template, int(ws.seed), int(ws.batch_size))
    workers = batch_workers()
    try:
        if workers == 0:
            for k in range(ws.steps):
                if not put(warm_start_batch(k, *args)):
                    return
            return
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # the parent may hold CUDA and threads: no fork
        with ctx.Pool(workers, initializer=_init_worker, initargs=args) as pool:
            ahead = 4 * workers  # batches in flight: enough to keep every worker busy, bounded in memory
            pending = [pool.apply_async(_make_batch, (k,)) for k in range(min(ahead, ws.steps))]
            for k in range(ws.steps):
                batch = pending[k].get()
                pending[k] = None  # type: ignore[call-overload]
                if k + ahead < ws.steps:
                    pending.append(pool.apply_async(_make_batch, (k + ahead,)))
                if not put(batch):
                    pool.terminate()
                    return
    except BaseException as e:  # handed to the training loop, which raises it
        put(e)


def warm_start(model: torch.nn.Module, tok: Any, task: SyntheticTask, template: str, ws: Any, dtype: torch.dtype,
               device: torch.device) -> list[float]:
    """Supervised steps on the teacher's demonstrations; on CUDA with deterministic kernels where torch has them
    (cuBLAS's fixed workspace is asked for before its first use in the process), so that a recipe rebuilt by
    another job on the same kind of machine gives the same weights (prepare.json records their hash)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _warm_start(model, tok, task, template, ws, dtype, device)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _warm_start(model: torch.nn.Module, tok: Any, task: SyntheticTask, template: str, ws: Any, dtype: torch.dtype,
                device: torch.device) -> list[float]:
    model.train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=ws.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, ws.warmup_steps))
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, ws.steps)))))
    stop, ready = threading.Event(), queue.Queue(maxsize=8)
    producer = threading.Thread(target=_batches, args=(tok, task, template, ws, stop, ready), daemon=True,
                                name="warm-start-batches")
    producer.start()
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # losses still on the device: read every few steps, not after each one
    bar = Progress("warm start", int(ws.steps))
    try:
        for step in range(ws.steps):
            batch = ready.get()
            if isinstance(batch, BaseException):
                raise batch
            ids, am, rows = (t.to(device, non_blocking=True) for t in batch)
            pos = (am.long().cumsum(-1) - 1).clamp_min(0)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).index_select(0, rows),
                                                     ids[:, 1:].reshape(-1).index_select(0, rows))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            pending.append(loss.detach())
            if len(pending) == 25 or step == ws.steps - 1:
                losses.extend(torch.stack(pending).tolist())
                pending.clear()
            bar.update(1, **({"loss": f"{losses[-1]:.3f}"} if losses else {}))
    finally:
        stop.set()
        producer.join(timeout=5)
    model.eval()
    return losses
