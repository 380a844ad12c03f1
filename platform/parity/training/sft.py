"""Supervised warm start of the tiny model on its task: prompt -> the task teacher's response <eos>
(arithmetic: `\\boxed{answer}`, with the teacher's slip; countdown: a search trace ending in `\\boxed{expr}`)."""

from __future__ import annotations

import math
import random
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


def warm_start(model: torch.nn.Module, tok: Any, task: SyntheticTask, template: str, ws: Any, dtype: torch.dtype,
               device: torch.device) -> list[float]:
    model.train().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=ws.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, ws.warmup_steps))
                                              * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, ws.steps)))))
    stream = task.stream(seed=10_000 + ws.seed)
    teacher_rng = random.Random(f"teacher:{ws.seed}")
    losses = []
    bar = tqdm(range(ws.steps), desc="warm start", unit="step", mininterval=2.0)
    for _ in bar:
        problems = stream.take(ws.batch_size)
        targets = [task.demonstration(p, teacher_rng) for p in problems]
        ids, am, lm = _encode_batch(tok, problems, template, targets)
        ids, am, lm = ids.to(device), am.to(device), lm.to(device)
        pos = (am.long().cumsum(-1) - 1).clamp_min(0)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits[lm[:, 1:]], ids[:, 1:][lm[:, 1:]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
