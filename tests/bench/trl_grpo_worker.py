"""TRL's GRPOTrainer on a parity-prepared model: the peer of tests/bench/bench_vs_trl.py.

Runs in TRL's own virtual environment (bench_vs_trl.py builds it under outputs/; it holds torch, transformers,
trl, accelerate, datasets and math-verify, not parity), so this file imports nothing of parity. The settings are
parity's default experiment: 16 prompts x 8 responses a step (`per_device_train_batch_size=128`,
`num_generations=8`), temperature 1, top-p 1, no top-k, constant lr 5e-5, AdamW betas (0.9, 0.999), no weight decay,
gradient clip 1.0, clip ratio 0.2, token-mean loss over the step's tokens (`loss_type=dapo`), group-std advantages,
no KL term (`beta=0`), one optimizer step a generation. Reward: 1 when math-verify accepts the last \\boxed{} of
a finished response as the answer, 0 otherwise and for a response cut at the token limit, as parity grades.

Writes one JSON file: per step the wall-clock end time and the seconds spent generating, grading and in the rest of
TRL's rollout preparation; the train phase is the step minus those."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSONL of {prompt, answer}, in step order")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()

    t_import = time.time()
    import torch
    from datasets import Dataset
    from math_verify import parse, verify
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(ln) for ln in Path(a.prompts).read_text().splitlines() if ln.strip()]
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(a.model)
    eos = tok.eos_token_id

    def accuracy(completions: list[str], answer: list[str], completion_ids: list[list[int]], **_: object
                 ) -> list[float]:
        out = []
        for text, ans, ids in zip(completions, answer, completion_ids, strict=True):
            if eos not in ids:  # cut at the token limit: 0, as parity scores a truncated response
                out.append(0.0)
                continue
            try:
                ok = verify(parse(f"\\boxed{{{ans}}}"), parse(text))
            except Exception:  # noqa: BLE001 - an unparsable response scores 0
                ok = False
            out.append(1.0 if ok else 0.0)
        return out

    phases: dict[str, list[float]] = {"generate": [], "reward": [], "prepare": []}

    class Timed(GRPOTrainer):
        def _generate(self, *args, **kw):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return super()._generate(*args, **kw)
            finally:
                phases["generate"].append(time.perf_counter() - t0)

        def _calculate_rewards(self, *args, **kw):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return super()._calculate_rewards(*args, **kw)
            finally:
                phases["reward"].append(time.perf_counter() - t0)

        def _generate_and_score_completions(self, *args, **kw):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*args, **kw)
            finally:
                phases["prepare"].append(time.perf_counter() - t0)

    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            ends.append(time.time())  # step 0's "end": the first interval is step 1

        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            ends.append(time.time())

    bf16 = a.dtype == "bfloat16"
    cfg = GRPOConfig(
        output_dir=a.workdir, max_steps=a.steps, per_device_train_batch_size=128, gradient_accumulation_steps=1,
        num_generations=8, max_completion_length=a.tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=5e-5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, epsilon=0.2, beta=0.0, loss_type="dapo",
        scale_rewards="group", num_iterations=1, shuffle_dataset=False, bf16=bf16, fp16=False, use_cpu=True,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=0, log_completions=False, model_init_kwargs={"dtype": torch.float32},
    )
    trainer = Timed(model=a.model, reward_funcs=accuracy, args=cfg, train_dataset=data, processing_class=tok,
                    callbacks=[StepClock()])
    t_ready = time.time()
    trainer.train()
    n = min(len(ends) - 1, len(phases["prepare"]))
    steps = []
    for i in range(n):
        dt = ends[i + 1] - ends[i]
        prep = phases["prepare"][i]
        steps.append({"step": i + 1, "end": ends[i + 1], "step_s": dt, "rollout_s": phases["generate"][i],
                      "grade_s": phases["reward"][i], "prepare_other_s": prep - phases["generate"][i]
                      - phases["reward"][i], "train_s": dt - prep})
    Path(a.out).write_text(json.dumps({
        "peer": "trl", "versions": {"trl": __import__("trl").__version__,
                                    "transformers": __import__("transformers").__version__,
                                    "torch": torch.__version__},
        "dtype": a.dtype, "threads": torch.get_num_threads(), "startup_s": round(t_ready - t_import, 2),
        "steps": steps}))


if __name__ == "__main__":
    main()
