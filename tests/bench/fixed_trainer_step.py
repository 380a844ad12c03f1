"""One trainer step on a fixed batch under two trees: the fixed-input check of the study-throughput bench's trainer
side (its rollout side: tests/test_cohort_cuda.py). The same warm start, the same saved rollout batch and the same
arm's config go through `Trainer.step` once under the earlier tree and once under this one (with this tree's
phase's extra settings, e.g. a compiled, graph-replayed trainer); their logged numbers and the weights' updates are
compared within bounds that follow from the arithmetic.

    python3 tests/bench/fixed_trainer_step.py batch --model-dir MODEL --rows 128 --group 8 --max-new 512 \\
        --topk 64 --out batch.pt                                   # this tree: sampled by the warm start itself
    PYTHONPATH=TREE/platform python3 tests/bench/fixed_trainer_step.py step --model-dir MODEL --batch batch.pt \\
        --overrides '["experiment=...", ...]' --out old.pt          # once a tree
    python3 tests/bench/fixed_trainer_step.py compare old.pt new.pt

The `step` subcommand imports whichever `parity` is first on the path and uses only what both trees have
(`load_config`, `build_trainer`, `RolloutBatch`, `resolve_device`). Bounds (`compare`): the trainer's forward runs
under bf16 autocast, so one run of it differs from another computation of the same function (another kernel,
another reduction order, a compiled graph) by the rounding of bf16 products: a relative 2^-7 (two units in the last
place of bf16's 8-bit significand) on a logged number that is a mean or norm over the batch, and on the norm of the
weights' update; an update element of Adam's first step is about lr x sign(g), so the update is compared by its
norm, not element by element (an element whose gradient is near 0 may change sign under any rounding)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REL = 2.0 ** -7  # two bf16 units in the last place, relative


def make_batch(model_dir: str, rows: int, group: int, prompt_len: int, max_new: int, topk: int, temperature: float,
               seed: int, device: str) -> dict:
    """A rollout batch the warm start sampled itself (ancestral sampling at `temperature`, EOS ends a response),
    random prompts of prompt_len // 2 to prompt_len tokens (left-padded), rewards 0/1 drawn from `seed`, the
    rollout's log-probs its own forward's plus N(0, 0.02) (a low-precision engine's size of gap), and its top-K."""
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    c = model.config
    pad, eos, vocab = int(c.pad_token_id or 0), int(c.eos_token_id or 1), int(c.vocab_size)
    lens = torch.randint(prompt_len // 2, prompt_len + 1, (rows // group,), generator=g).repeat_interleave(group)
    prompts = torch.full((rows, prompt_len), pad, dtype=torch.long)
    pmask = torch.zeros(rows, prompt_len, dtype=torch.bool)
    body = torch.randint(2, vocab, (rows // group, prompt_len), generator=g).repeat_interleave(group, 0)
    for i in range(rows):
        n = int(lens[i])
        prompts[i, prompt_len - n:] = body[i, :n]
        pmask[i, prompt_len - n:] = True
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=prompts.to(device), attention_mask=pmask.long().to(device), do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                             pad_token_id=pad, eos_token_id=eos)
    resp = out[:, prompt_len:].cpu()
    R = resp.shape[1]
    is_eos = resp == eos
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((rows,), R))
    rmask = torch.arange(R)[None, :] <= first[:, None]
    resp = torch.where(rmask, resp, torch.full_like(resp, pad))
    truncated = ~is_eos.any(1)
    with torch.no_grad():
        ids = torch.cat([prompts, resp], 1).to(device)
        am = torch.cat([pmask, rmask], 1).long().to(device)
        pos = (am.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, prompt_len - 1:-1].float()
        lp = torch.log_softmax(logits / temperature, -1).cpu()
    tok_lp = lp.gather(-1, resp[..., None])[..., 0]
    noisy = (tok_lp + 0.02 * torch.randn(tok_lp.shape, generator=g)).clamp(max=0.0)
    top_lp, top_ids = lp.topk(topk, -1) if topk else (None, None)
    rewards = (torch.rand(rows, generator=g) < 0.4).float()
    return {"prompts": prompts, "prompt_mask": pmask, "responses": resp, "response_mask": rmask,
            "rollout_logprobs": torch.where(rmask, noisy, torch.zeros_like(noisy)), "rewards": rewards,
            "truncated": truncated, "group_ids": torch.arange(rows) // group, "prompt_ids": torch.arange(rows) // group,
            "topk_ids": None if top_ids is None else torch.where(rmask[..., None], top_ids, -1).to(torch.int32),
            "topk_logprobs": None if top_lp is None else torch.where(rmask[..., None], top_lp, 0.0),
            "meta": {"seed": seed, "model_dir": model_dir, "temperature": temperature}}


def run_step(model_dir: str, batch_file: str, overrides: list[str], seed: int) -> dict:
    """Trainer.step once, under the `parity` first on the path: its logged numbers and the update of every
    parameter (float32, on the host)."""
    from transformers import AutoModelForCausalLM

    from parity.config import load_config
    from parity.core.device import resolve_device
    from parity.training.trainer import build_trainer
    from parity.types import RolloutBatch
    cfg = load_config(overrides)
    fields = {k: v for k, v in torch.load(batch_file, weights_only=False).items() if k != "meta"}
    if not cfg.rollout.topk_logprobs:
        fields["topk_ids"] = fields["topk_logprobs"] = None  # an arm without top-K log-probs never sees them
    batch = RolloutBatch(**fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    trainer = build_trainer(model, cfg, resolve_device(cfg.trainer.device), reference_dir=model_dir)
    metrics = trainer.step(batch)
    update = {n: p.detach().float().cpu() - before[n] for n, p in trainer.model.named_parameters()}
    import parity
    return {"metrics": {k: float(v) for k, v in metrics.items() if not k.startswith("perf/")},
            "update": update, "tree": str(Path(parity.__file__).resolve().parents[1]), "overrides": overrides}


def compare(a: dict, b: dict, rel: float = REL) -> dict:
    """b against a: each logged number both have (relative difference, bound `rel` on numbers of magnitude at
    least 1e-6, an absolute 1e-6 below: a mean of near-zero terms has no relative precision), the relative L2
    difference of the whole update, and `within` when all of them hold."""
    keys = sorted(set(a["metrics"]) & set(b["metrics"]))
    rows, ok = [], True
    for k in keys:
        x, y = a["metrics"][k], b["metrics"][k]
        if not (math.isfinite(x) and math.isfinite(y)):
            good = (math.isnan(x) and math.isnan(y)) or x == y
            rows.append({"key": k, "a": x, "b": y, "within": good})
            ok &= good
            continue
        scale = max(abs(x), abs(y))
        d = abs(x - y)
        good = d <= (rel * scale if scale >= 1e-6 else 1e-6)
        rows.append({"key": k, "a": x, "b": y, "rel": d / scale if scale else 0.0, "within": good})
        ok &= good
    names = sorted(set(a["update"]) & set(b["update"]))
    missing = sorted(set(a["update"]) ^ set(b["update"]))
    num = sum(float((a["update"][n] - b["update"][n]).double().pow(2).sum()) for n in names)
    den = sum(float(a["update"][n].double().pow(2).sum()) for n in names)
    upd_rel = math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)
    upd_ok = upd_rel <= rel and not missing
    return {"metrics": rows, "metrics_within": ok, "update_rel_l2": upd_rel, "update_norm": math.sqrt(den),
            "parameters": len(names), "missing_parameters": missing, "update_within": upd_ok,
            "bound_rel": rel, "within": ok and upd_ok,
            "differ": [r["key"] for r in rows if not r["within"]]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("batch", help="sample and save the fixed batch (this tree)")
    b.add_argument("--model-dir", required=True)
    b.add_argument("--rows", type=int, default=128)
    b.add_argument("--group", type=int, default=8)
    b.add_argument("--prompt-len", type=int, default=32)
    b.add_argument("--max-new", type=int, default=512)
    b.add_argument("--topk", type=int, default=64)
    b.add_argument("--temperature", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--out", required=True)
    s = sub.add_parser("step", help="one trainer step under the parity first on the path")
    s.add_argument("--model-dir", required=True)
    s.add_argument("--batch", required=True)
    s.add_argument("--overrides", required=True, help="a JSON list of Hydra overrides (the arm's run config)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)
    c = sub.add_parser("compare", help="two steps' outputs, the second against the first")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "batch":
        if a.rows % a.group:
            ap.error(f"--rows {a.rows} is not a multiple of --group {a.group}")
        saved = make_batch(a.model_dir, a.rows, a.group, a.prompt_len, a.max_new, a.topk, a.temperature, a.seed,
                           a.device)
        torch.save(saved, a.out)
        print(json.dumps({"batch": a.out, "rows": a.rows, "response_tokens": int(saved["response_mask"].sum()),
                          "truncated": int(saved["truncated"].sum())}), flush=True)
    elif a.cmd == "step":
        res = run_step(a.model_dir, a.batch, json.loads(a.overrides), a.seed)
        torch.save(res, a.out)
        print(json.dumps({"tree": res["tree"], "metrics": len(res["metrics"]),
                          "loss": res["metrics"].get("train/loss")}), flush=True)
    else:
        res = compare(torch.load(a.a, weights_only=False), torch.load(a.b, weights_only=False))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        print(json.dumps({k: res[k] for k in ("within", "update_rel_l2", "differ")}), flush=True)
        sys.exit(0 if res["within"] else 1)


if __name__ == "__main__":
    main()
