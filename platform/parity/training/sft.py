"""Supervised warm start of the tiny model on its task: prompt -> the task teacher's response <eos>
(arithmetic: `\\boxed{answer}`, with the teacher's slip; countdown: a search trace ending in `\\boxed{expr}`)."""

from __future__ import annotations

import math
import queue
import random
import threading
from typing import Any

import torch
from tqdm import tqdm

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


def _batches(tok: Any, task: SyntheticTask, template: str, ws: Any, stop: threading.Event,
             out: queue.Queue) -> None:
    """The warm start's batches in order (the task's stream and the teacher's draws), encoded: run in a thread
    ahead of the training steps, so the teacher's Python overlaps the device's work."""
    def put(item: Any) -> bool:  # False once the training loop has stopped
        while not stop.is_set():
            try:
                out.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    try:
        stream = task.stream(seed=10_000 + ws.seed)
        teacher_rng = random.Random(f"teacher:{ws.seed}")
        for _ in range(ws.steps):
            problems = stream.take(ws.batch_size)
            targets = [task.demonstration(p, teacher_rng) for p in problems]
            ids, am, lm = _encode_batch(tok, problems, template, targets)
            # the loss rows (next-token positions of target tokens) as flat indices, found here on the host:
            # the same rows in the same order as indexing by the mask, without the device sync that costs
            if not put((ids, am, lm[:, 1:].reshape(-1).nonzero().squeeze(1))):
                return
    except BaseException as e:  # handed to the training loop, which raises it
        put(e)


def warm_start(model: torch.nn.Module, tok: Any, task: SyntheticTask, template: str, ws: Any, dtype: torch.dtype,
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
    bar = tqdm(range(ws.steps), desc="warm start", unit="step", mininterval=2.0)
    try:
        for step in bar:
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
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        stop.set()
        producer.join(timeout=5)
    model.eval()
    return losses
