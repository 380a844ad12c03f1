"""One trainer step on a fixed batch under two trees: the fixed-input check of the study-throughput bench's trainer
side (its rollout side: tests/test_cohort_cuda.py). The same warm start, the same saved rollout batch and the same
arm's config go through `Trainer.step` once under the earlier tree and once under this one (with this tree's
phase's extra settings, e.g. a compiled, graph-replayed trainer); their logged numbers and the weights' updates are
compared within bounds that follow from the arithmetic.

    python3 tests/bench/fixed_trainer_step.py batch --model-dir MODEL --rows 128 --group 8 --max-new 512 \\
        --topk 64 --out batch.pt                                   # this tree: sampled by the warm start itself
    PYTHONPATH=TREE/platform python3 tests/bench/fixed_trainer_step.py step --model-dir MODEL --batch batch.pt \\
        --overrides '["experiment=...", ...]' --out old.pt          # once a tree
    PYTHONPATH=OLD/platform python3 tests/bench/fixed_trainer_step.py step ... \\
        --overrides '[..., "model.dtype=float32"]' --out ref.pt        # the reference: the old tree in float32
    python3 tests/bench/fixed_trainer_step.py compare old.pt new.pt --ref ref.pt

The `step` subcommand imports whichever `parity` is first on the path and uses only what both trees have
(`load_config`, `build_trainer`, `RolloutBatch`, `resolve_device`, `Trainer.logprobs`, the trainer's optimizer).
Bounds (`compare`): the trainer's forward runs under bf16 autocast, so one computation of it differs from another
(another kernel, another reduction order, a compiled graph) by the rounding of bf16 products. A logged number that
is a mean or norm over the batch: a relative 2^-7 (two units in the last place of bf16's 8-bit significand). The
trainer's per-token log-probs and the step's gradient: the new tree no further from the float32 reference than
twice the old tree is (the old tree's own bf16 rounding is the yardstick); so is the whole update. With that
reference the logged numbers are reported, not judged (one bf16 computation of a scalar is one draw of its
rounding), and the new tree's settings run once more in float32, held to the reference within 2^-10 (float32_check).
Without a reference: a mismatch metric (a mean over tokens of
a function of the trainer's log-prob minus the rollout's): within twice its largest slope times the measured mean
change of the per-token log-probs. The update: Adam's first update of an element is about lr x sign(g), so an
element whose gradient is within rounding of 0 may change sign under any rounding, and a 0.5% of such elements
make the whole update differ by 14% in L2 (measured between eager and compiled bf16 trainers on one H200); the
elements of the same sign must agree within 2^-7 (another lr, decay or optimizer shows there), and the gradient
mass of the elements that changed sign is reported."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REL = 2.0 ** -7  # two bf16 units in the last place, relative
F32_REL = 2.0 ** -10  # the float32 check's bound: far above float32's rounding (2^-24), far below a changed formula
# Logged numbers that no bound on the log-probs' rounding bounds: score centering's coefficients hold alpha ~
# rho = (1 - Q_H) / (1 - P_H), and where the head holds all but some 1e-5 of the trainer's mass, 1 - P_H is a difference
# of numbers equal to float32's rounding of the log-probs, so the coefficients' L1 moves by percents while the
# centring term's gradient (sum_H c_v grad log p_v: a multiple of p added to c moves it only by that multiple
# times the tail's mass) moves by the log-probs' own rounding. The gradient holds the term, so it is judged
# there; these two are reported (tests/test_fixed_trainer_step.py measures both in float64).
TAIL_CONDITIONED = ("correction/sc_coef_l1", "correction/sc_term_abs")


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
    """Trainer.step once, under the `parity` first on the path: its logged numbers, the gradient its first optimizer
    step was given, the update of every parameter (float32, on the host) and, before the step, the trainer's own
    log-probs of the batch's response tokens (float64, response tokens in row order)."""
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
    mask = batch.response_mask.bool()
    token_lp = torch.cat([trainer.logprobs(batch.select(i).to(trainer.device)).double().cpu()[mask[i]]
                          for i in torch.arange(batch.batch_size).split(cfg.trainer.micro_batch_size)])
    named = list(trainer.model.named_parameters())
    grads: dict[str, torch.Tensor] = {}

    def keep_grad(*_: object) -> None:
        if not grads:  # the first optimizer step of the trainer step
            grads.update({n: (p.grad.detach().float().cpu().clone() if p.grad is not None else torch.zeros(p.shape))
                          for n, p in named})
    hook = trainer.optimizer.register_step_pre_hook(keep_grad)
    metrics = trainer.step(batch)
    hook.remove()
    update = {n: p.detach().float().cpu() - before[n] for n, p in trainer.model.named_parameters()}
    import parity
    return {"metrics": {k: float(v) for k, v in metrics.items() if not k.startswith("perf/")},
            "update": update, "grad": grads, "token_logprobs": token_lp,
            "rollout_logprobs": batch.rollout_logprobs.double()[mask],
            "tree": str(Path(parity.__file__).resolve().parents[1]), "overrides": overrides}


# Mismatch metrics, means over the response tokens of f(x), x = trainer log-prob - rollout log-prob: the largest
# |f'(x)| over the batch's tokens bounds how far a change of the trainer's log-probs moves them (first order).
LIPSCHITZ = {"mismatch/k1_kl": lambda x: torch.ones_like(x),
             "mismatch/k3_kl": lambda x: (x.exp() - 1).abs(),
             "mismatch/chi2": lambda x: 2 * (x.exp() - 1).abs() * x.exp(),
             "mismatch/abs_prob_diff_mean": lambda x: torch.ones_like(x)}


def _l2(x: dict, y: dict | None, names: list[str]) -> float:
    return math.sqrt(sum(float((x[n] - (y[n] if y is not None else 0)).double().pow(2).sum()) for n in names))


def compare(a: dict, b: dict, rel: float = REL, ref: dict | None = None, b32: dict | None = None) -> dict:
    """b against a (`ref`, when given: a's tree in float32, the reference both bf16 computations round from).

    - logged numbers: relative difference within `rel` (an absolute 1e-6 for numbers below 1e-6: a mean of
      near-zero terms has no relative precision); the mismatch metrics of LIPSCHITZ, which are means over tokens of
      a function of the trainer's log-prob, within twice (their largest slope over the batch) x (the measured mean
      per-token change of the trainer's log-probs), the first-order consequence of that change;
    - the trainer's log-probs and the gradient: with `ref`, b no further from it than twice a (mean |.| per token,
      L2 of the whole gradient); without, within `rel` of a (mean per token relative to mean |log-prob|, L2);
    - the update: Adam's first update of an element is about lr x sign(g), so an element whose gradient is within
      its rounding of 0 may change sign under any rounding; the elements of the same sign must agree within `rel`
      (relative L2: catches another lr, decay or optimizer), the gradient mass of those that change sign is
      reported. update_rel_l2, the whole update's relative L2, is shown for reference. With `ref`: b's whole update
      no further from ref's than twice a's (or the same-sign rule);
    - with `ref`, the logged numbers are reported but not judged (one bf16 computation of a scalar is one draw of
      its rounding; no bound follows from one draw); `b32`, b's settings in float32, is held to `ref` within
      float32's bounds instead (float32_check): the same function, another order of arithmetic."""
    keys = sorted(set(a["metrics"]) & set(b["metrics"]))
    have_tokens = "token_logprobs" in a and "token_logprobs" in b
    if have_tokens:
        la, lb = a["token_logprobs"], b["token_logprobs"]
        eps = float((la - lb).abs().mean()) if la.numel() else 0.0
        x = la - a["rollout_logprobs"]
    rows, ok = [], True
    for k in keys:
        va, vb = a["metrics"][k], b["metrics"][k]
        if not (math.isfinite(va) and math.isfinite(vb)):
            good = (math.isnan(va) and math.isnan(vb)) or va == vb
            rows.append({"key": k, "a": va, "b": vb, "within": good})
            ok &= good
            continue
        scale = max(abs(va), abs(vb))
        d = abs(va - vb)
        if have_tokens and k in LIPSCHITZ and x.numel():
            bound = 2 * float(LIPSCHITZ[k](x).max()) * eps
            good = d <= max(bound, rel * scale)
            rows.append({"key": k, "a": va, "b": vb, "abs": d, "bound": bound, "within": good})
        else:
            good = d <= (rel * scale if scale >= 1e-6 else 1e-6)
            rows.append({"key": k, "a": va, "b": vb, "rel": d / scale if scale else 0.0, "within": good})
        ok &= good
    names = sorted(set(a["update"]) & set(b["update"]))
    missing = sorted(set(a["update"]) ^ set(b["update"]))
    den = _l2(a["update"], None, names)
    num = _l2(a["update"], b["update"], names)
    upd_rel = num / den if den else (0.0 if num == 0 else math.inf)
    out = {"update_rel_l2": upd_rel, "update_norm": den, "parameters": len(names), "missing_parameters": missing,
           "bound_rel": rel}
    same_num = same_den = 0.0
    flips, flip_mass, grad_mass = 0, 0.0, 0.0
    for n in names:
        ua, ub = a["update"][n].double(), b["update"][n].double()
        same = torch.sign(ua) == torch.sign(ub)
        same_num += float(((ua - ub) * same).pow(2).sum())
        same_den += float((ua * same).pow(2).sum())
        if "grad" in a and n in a["grad"]:
            g = a["grad"][n].double().abs()
            flips += int((~same).sum())
            flip_mass += float((g * ~same).sum())
            grad_mass += float(g.sum())
    same_rel = math.sqrt(same_num / same_den) if same_den else (0.0 if same_num == 0 else math.inf)
    upd_ok = same_rel <= rel and not missing
    if ref is not None and "update" in ref:
        # Adam's first update is lr x g / (|g| + eps): an element with |g| near eps moves with g's relative error
        # (2% in bf16), so the same-sign elements of two bf16 steps differ by more than 2^-7 (1.3% measured on an
        # H200); against the float32 step, b's whole update is no further from it than twice a's
        rnames = [n for n in names if n in ref["update"]]
        ua, ub = _l2(a["update"], ref["update"], rnames), _l2(b["update"], ref["update"], rnames)
        out.update(update_rel_l2_to_ref={"a": ua / den if den else 0.0, "b": ub / den if den else 0.0})
        upd_ok = (ub <= 2 * ua or same_rel <= rel) and not missing and len(rnames) == len(names)
    out.update(update_same_sign_rel_l2=same_rel, update_sign_changes=flips,
               update_sign_change_grad_mass=flip_mass / grad_mass if grad_mass else None, update_within=upd_ok)
    extra_ok = True
    if "grad" in a and "grad" in b:
        gnames = sorted(set(a["grad"]) & set(b["grad"]))
        gnorm = _l2(a["grad"], None, gnames)
        if ref is not None and "grad" in ref:
            da, db = _l2(a["grad"], ref["grad"], gnames), _l2(b["grad"], ref["grad"], gnames)
            g_ok = db <= 2 * da or db <= rel * gnorm
            out.update(grad_rel_l2_to_ref={"a": da / gnorm if gnorm else 0.0, "b": db / gnorm if gnorm else 0.0})
        else:
            g_rel = _l2(a["grad"], b["grad"], gnames) / gnorm if gnorm else 0.0
            g_ok = g_rel <= rel
            out.update(grad_rel_l2=g_rel)
        out["grad_within"] = g_ok
        extra_ok &= g_ok
    if have_tokens:
        scale = float(la.abs().mean()) if la.numel() else 0.0
        if ref is not None and "token_logprobs" in ref:
            ea, eb = (float((t - ref["token_logprobs"]).abs().mean()) for t in (la, lb))
            lp_ok = eb <= 2 * ea or eb <= rel * scale
            out.update(logprob_mean_abs_to_ref={"a": ea, "b": eb})
        else:
            lp_ok = eps <= rel * scale
        out.update(logprob_mean_abs_diff=eps, logprob_within=lp_ok)
        extra_ok &= lp_ok
    # with the float32 reference, the logged numbers are reported, not judged: each is one draw of bf16 rounding,
    # and from one draw no bound follows (two steps' rounding of the same number differ by up to 8% in a mean of
    # near-cancelling terms, 2026-12-04 H200); b32, b's settings in float32, is held to the reference instead
    judged = ref is None
    within = (ok or not judged) and upd_ok and extra_ok
    out.update(metrics=rows, metrics_within=ok, metrics_judged=judged,
               differ=[r["key"] for r in rows if not r["within"]])
    if ref is not None and b32 is not None:
        out["float32"] = float32_check(ref, b32)
        within = within and out["float32"]["within"]
    out["within"] = within
    return out


def float32_check(ref: dict, b32: dict, rel: float = F32_REL) -> dict:
    """b's settings in float32 against the reference (a's tree in float32): the same function computed in another
    order. Float32's unit is 2^-24; a reordered forward and backward over a batch moves the log-probs and the
    gradient by some 1e-6 relative (a reordered sum of n terms by up to about n x 2^-24 of their magnitude), so
    2^-10 is far above rounding and far below another formula, lr or token set. Logged numbers: within `rel`
    relative, or 1e-6 absolute; a fraction of tokens (a key with "frac": clipped, masked, over a tolerance) also
    within 2 / (response tokens): a token whose value sits on the threshold may cross it under any rounding;
    TAIL_CONDITIONED numbers reported, not judged. The update: the same-sign elements within `rel` (Adam's eps: see
    compare)."""
    n_tok = int(ref["token_logprobs"].numel()) if "token_logprobs" in ref else 0
    rows, reported, ok = [], [], True
    for k in sorted(set(ref["metrics"]) & set(b32["metrics"])):
        va, vb = ref["metrics"][k], b32["metrics"][k]
        if not (math.isfinite(va) and math.isfinite(vb)):
            good = (math.isnan(va) and math.isnan(vb)) or va == vb
        else:
            flips = 2 / n_tok if n_tok and "frac" in k else 0.0  # a fraction of tokens past a clip or mask
            good = abs(va - vb) <= max(rel * max(abs(va), abs(vb)), 1e-6, flips)
            if k in TAIL_CONDITIONED:  # see TAIL_CONDITIONED: reported, judged through the gradient
                reported.append({"key": k, "ref": va, "b32": vb, "rel": abs(va - vb) / max(abs(va), abs(vb), 1e-30)})
                continue
        if not good:
            rows.append({"key": k, "ref": va, "b32": vb})
        ok &= good
    out = {"metrics_within": ok, "differ": rows, "reported": reported, "bound_rel": rel}
    gnames = sorted(set(ref.get("grad", {})) & set(b32.get("grad", {})))
    gnorm = _l2(ref["grad"], None, gnames) if gnames else 0.0
    out["grad_rel_l2"] = _l2(ref["grad"], b32["grad"], gnames) / gnorm if gnorm else 0.0
    if n_tok and "token_logprobs" in b32:
        lr, lb = ref["token_logprobs"], b32["token_logprobs"]
        out["logprob_rel_mean_abs"] = float((lr - lb).abs().mean()) / max(float(lr.abs().mean()), 1e-30) \
            if lr.shape == lb.shape else math.inf
    else:
        out["logprob_rel_mean_abs"] = 0.0
    num = den = 0.0
    names = sorted(set(ref["update"]) & set(b32["update"]))
    for n in names:
        ua, ub = ref["update"][n].double(), b32["update"][n].double()
        same = torch.sign(ua) == torch.sign(ub)
        num += float(((ua - ub) * same).pow(2).sum())
        den += float((ua * same).pow(2).sum())
    out["update_same_sign_rel_l2"] = math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)
    out["within"] = (ok and out["grad_rel_l2"] <= rel and out["logprob_rel_mean_abs"] <= rel
                     and out["update_same_sign_rel_l2"] <= rel and set(ref["update"]) == set(b32["update"]))
    return out


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
    c.add_argument("--ref", default=None, help="a's tree's step in float32 (model.dtype=float32): the reference")
    c.add_argument("--b32", default=None, help="with --ref: b's tree and settings in float32, held to the reference")
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
        res = compare(torch.load(a.a, weights_only=False), torch.load(a.b, weights_only=False),
                      ref=torch.load(a.ref, weights_only=False) if a.ref else None,
                      b32=torch.load(a.b32, weights_only=False) if a.b32 else None)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        print(json.dumps({k: res.get(k) for k in ("within", "update_same_sign_rel_l2", "grad_within", "logprob_within",
                                                   "differ")}), flush=True)
        sys.exit(0 if res["within"] else 1)


if __name__ == "__main__":
    main()
