"""The collapse-and-rescue study's presets: which model and task, which mismatch sources, corrections and
objectives, how many seeds and steps, and how many runs at a time.

An arm is one (mismatch source, correction, objective) combination; a study runs every arm once per seed. Each
preset has two stages: `search`, the dose-response of uncorrected training over the mismatch sources (where does
it degrade?), and `arms`, every correction at the headline setting the search found. `--quick` shrinks any preset
to seconds (2 steps, 1 seed, tiny batches), the form `make test` runs."""

from __future__ import annotations

from dataclasses import dataclass, field

# mismatch sources: the rollout engine's difference from the trainer
SOURCES: dict[str, list[str]] = {
    "bf16": [],
    "int8+int4kv": ["+precision=w8a8_int8_kv_int4"],
    "w4a4+int4kv": ["rollout.precision.weights=int4", "rollout.precision.activations=int4",
                    "rollout.precision.kv_cache=int4_per_token_head"],
    # the DCMDP deployment format: W8A8 FP8 (E4M3), the KV cache in bf16
    "fp8": ["+precision=w8a8_fp8"],
    "fp8+int4kv_norot": ["rollout.precision.weights=fp8", "rollout.precision.activations=fp8",
                         "rollout.precision.kv_cache=int4_per_token_head", "rollout.precision.kv_hadamard=false"],
}


def sigma_source(sigma: float, mode: str = "fixed") -> tuple[str, list[str]]:
    name = f"sigma={sigma:g}" + ("" if mode == "fixed" else f" {mode}")
    return name, [f"rollout.precision.perturbation.sigma={sigma:g}", f"rollout.precision.perturbation.mode={mode}"]


TOPK = ["rollout.topk_logprobs={topk}", "algorithm.correction.score_centering.top_k=0"]  # K: the preset's
CORRECTIONS: dict[str, list[str]] = {
    "none": ["algorithm.correction.name=none"],
    "tis": ["algorithm.correction.name=tis"],
    "icepop": ["algorithm.correction.name=icepop"],
    "mis": ["algorithm.correction.name=mis"],
    "score_centering": ["algorithm.correction.name=score_centering", *TOPK],
    "score_centering+tis": ["algorithm.correction.name=score_centering+tis", *TOPK],
    "dual (c=0.0037)": ["algorithm.correction.name=dual", "algorithm.correction.dual.c=0.0037"],
    "dual (auto)": ["algorithm.correction.name=dual", "algorithm.correction.tolerance=auto"],
    # the published dual with the paper's settings, and the group-centred variant (c: a quantile of the first step's
    # gaps)
    "dual": ["algorithm.correction.name=dual", "algorithm.correction.dual.c=0.0037",
             "algorithm.correction.dual.lambda0=0.1", "algorithm.correction.dual.eta=1.0"],
    "dual_centered": ["algorithm.correction.name=dual_centered"],
    # MIS with its threshold set from the measured mismatch: about 3x the mean token k3 of W4A4 + INT4 KV on the GPU
    # model (0.0054-0.0067 over the first 10 steps, 3 seeds), so that it drops the tail of the responses, not half
    "mis (k3 < 0.02)": ["algorithm.correction.name=mis", "algorithm.correction.mis.threshold=0.02"],
}
OBJECTIVES: dict[str, list[str]] = {
    # the seeds' objective: group-normalised advantages (on-policy, one epoch: the PPO-clip gradient is REINFORCE's)
    "grpo": ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std=true", "algorithm.policy_loss=reinforce"],
    # REINFORCE on the raw 0/1 reward: no baseline, the largest sampler drift
    "reinforce_raw": ["algorithm.adv_estimator=raw", "algorithm.policy_loss=reinforce"],
}


@dataclass(frozen=True)
class Arm:
    source: str
    source_overrides: tuple[str, ...]
    correction: str = "none"
    objective: str = "grpo"
    extra: tuple[str, ...] = ()  # e.g. plain SGD, another lr
    tag: str = ""  # the name's tail for `extra` (default: the extra overrides' values)
    seeds: tuple[int, ...] | None = None  # the seeds this arm runs (None: every seed of the study)

    @property
    def name(self) -> str:
        tail = self.tag or " ".join(x.split("=")[-1] for x in self.extra)
        return f"{self.source} / {self.correction} / {self.objective}" + (f" {tail}" if tail else "")

    def overrides(self, topk: int = 64) -> list[str]:
        """Hydra overrides of the arm; `topk` = the K of score centering's head (the preset's)."""
        return [*self.source_overrides, *(o.format(topk=topk) for o in CORRECTIONS[self.correction]),
                *OBJECTIVES[self.objective], *self.extra]

    def labels(self) -> dict:
        return {"source": self.source, "correction": self.correction, "objective": self.objective,
                "extra": " ".join(self.extra)}


def arm(source: str | tuple[str, list[str]], correction: str = "none", objective: str = "grpo",
        extra: tuple[str, ...] = (), tag: str = "", seeds: tuple[int, ...] | None = None) -> Arm:
    name, overrides = (source, SOURCES[source]) if isinstance(source, str) else source
    return Arm(name, tuple(overrides), correction, objective, tuple(extra), tag, seeds)


@dataclass(frozen=True)
class Preset:
    name: str
    experiment: str
    base: tuple[str, ...]  # overrides of every run
    steps: int
    eval_every: int
    seeds: tuple[int, ...]
    concurrency: int
    threads_per_run: int
    search: tuple[Arm, ...]
    arms: tuple[Arm, ...]
    # the reference's calibration: the exact rollout under other learning settings (and mismatch probes), run
    # with the arms' steps and settings, so that an arm both stages share is one run
    calibrate: tuple[Arm, ...] = ()
    quick: tuple[str, ...] = ()
    note: str = ""
    topk: int = 64  # rollout.topk_logprobs of the score-centering arms
    arms_steps: int | None = None  # steps of the arms stage when it differs from the search's
    arms_eval_every: int | None = None  # likewise its trainer.eval_every
    arms_extra: tuple[str, ...] = ()  # overrides of the arms stage's runs only
    env: dict = field(default_factory=dict)
    # overrides every run of seed s gets beside trainer.seed=s, "{seed}" replaced by s: with
    # "model.warm_start.seed={seed}" each seed starts from a warm start of its own (seeds independent)
    seed_overrides: tuple[str, ...] = ()
    # under CUDA MPS, the share of the SMs each run's process may use at a time (parity.study.mps; None: all)
    mps_sm_share: int | None = None


QUICK = ("model.warm_start.steps=20", "model.warm_start.batch_size=16", "model.warm_start.eval_problems=8",
         "trainer.eval_problems=8", "trainer.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=24", "trainer.eval_every=1",
         "trainer.checkpoint_every=0", "eval.grade_workers=1", "model.tokenizer_corpus_size=500")

# the corrections of the raw-REINFORCE experiment (the published dual at c = 0.0037 and with tolerance=auto)
REINFORCE_CORRECTIONS = ("none", "tis", "icepop", "mis", "score_centering", "score_centering+tis", "dual (c=0.0037)",
                         "dual (auto)")
# the corrections of the GRPO headline: the published dual as the paper sets it, and the group-centred variant
GRPO_CORRECTIONS = ("none", "tis", "icepop", "mis (k3 < 0.02)", "score_centering", "score_centering+tis", "dual",
                    "dual_centered")
ALL_CORRECTIONS = GRPO_CORRECTIONS


def _full(source, objective: str = "grpo", corrections: tuple[str, ...] = GRPO_CORRECTIONS) -> tuple[Arm, ...]:
    return tuple(arm(source, c, objective) for c in corrections)


def _dose(sigmas: tuple[float, ...], redraw: float, objective: str = "grpo") -> tuple[Arm, ...]:
    return (*(arm(sigma_source(s), objective=objective) for s in sigmas),
            arm(sigma_source(redraw, "redraw"), objective=objective))


# ---- the headline: GRPO (the sources' objective) on a substrate where exact rollouts learn --------------------
# Countdown's teacher gives up after a budget drawn from [1, max_attempts] (data.countdown.min_attempts=1): the
# warm-started model gives up early at some rate, and GRPO with exact rollouts learns to search longer (held-out
# accuracy rises). The calibration stage tries the exact rollout under other settings; docs/study/collapse_study.md
# reports it.

LAPTOP = Preset(
    name="laptop", experiment="countdown_tiny",
    base=("trainer.checkpoint_every=0", "trainer.prompts_per_step=8", "rollout.max_new_tokens=96",
          "data.countdown.max_numbers=3", "data.countdown.min_attempts=1", "model.warm_start.steps=400",
          "model.warm_start.eval_problems=64", "trainer.eval_problems=64", "trainer.eval_through_rollout=false",
          "eval.grade_workers=1", "trainer.lr=2e-4"),
    # lr 2e-4: it gained 5-7 points by steps 12-24 in the calibration, where lr 1e-4 gained 2.8 points in 30 steps
    # and lr 4e-4 lost 7 (docs/study/grpo_study.md)
    steps=30, eval_every=6, seeds=(0, 1, 2), concurrency=2, threads_per_run=1,
    search=(arm("bf16"), arm("int8+int4kv"), arm("w4a4+int4kv"), *_dose((0.1, 0.2), 0.2)),
    calibrate=(arm("bf16", extra=("trainer.lr=1e-4",)), arm("bf16", extra=("trainer.lr=4e-4",))),
    arms=(arm("bf16"), arm("w4a4+int4kv"), arm("w4a4+int4kv", "score_centering"), arm("w4a4+int4kv", "dual"),
          arm("w4a4+int4kv", "dual_centered")),
    note="2 CPU cores: GRPO, exact rollouts against W4A4 + INT4 KV uncorrected and under score centering and the "
         "two duals",
)

# the sources' horizon on one H200: Agent Lightning's curves and the DCMDP runs are 200 updates; uncorrected GRPO fell
# at about step 45 there, so a run must go well past that for a format to be called harmless
CORE_SEEDS = (0, 1, 2, 3, 4)  # the three core arms (exact; W4A4 + INT4 KV none; W4A4 + INT4 KV score_centering)
ARM_SEEDS = (0, 1, 2)  # every other arm

GPU = Preset(
    name="gpu", experiment="countdown_gpu",
    # lr 5e-5 and 16 prompts x 8, group-std advantages: fixed by the calibration before any corrected arm ran
    # (docs/study/collapse_study.md); micro-batch 32 for every arm (64 ran the INT8 arm out of memory with 16 runs on
    # the GPU). Held-out: the trained weights on an exact engine every 10 steps (128 problems x 4), the deployed
    # model (the rollout's own format) every 30 steps and at the end, and both on 512 problems x 4 at the end. The
    # warm start's exact evaluation is one computation for all of a seed's arms (trainer.share_step0_eval).
    base=("trainer.checkpoint_every=0", "eval.grade_workers=1", "trainer.device=cuda", "trainer.micro_batch_size=32",
          "trainer.prompts_per_step=16", "trainer.eval_problems=128", "trainer.eval_through_rollout=false",
          "trainer.eval_deployed_every=30", "trainer.final_eval_problems=512",
          "data.countdown.min_attempts=1", "trainer.lr=5e-5", "trainer.share_step0_eval=true"),
    steps=150, eval_every=10, seeds=CORE_SEEDS, concurrency=16, threads_per_run=1,
    seed_overrides=("model.warm_start.seed={seed}",),
    # host waits asleep (parity.core.device.cuda_blocking_sync): 16 runs no longer spin 16 cores through every
    # synchronisation (48-57 CPU-seconds a run against 180-264 in the side-by-side of docs/PERFORMANCE.md, "The
    # levers side by side"); how the host waits, not arithmetic
    # Inductor compiles in the run's own process (TORCHINDUCTOR_COMPILE_THREADS=1): by default each process starts a
    # pool of as many compile workers as the machine has cores, each a Python importing torch, so 16 runs and their
    # rollout servers start some 300 processes on 16 cores before their first step; the same kernels, compiled
    # one after another in each process while the other runs use the other cores
    env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PARITY_CUDA_BLOCKING_SYNC": "1",
         "TORCHINDUCTOR_COMPILE_THREADS": "1"},
    # each run's kernels on a quarter of the SMs, so that four runs' small kernels run at once: 1.47x the rollout
    # tokens of uncapped processes (docs/PERFORMANCE.md, "Sixteen rollouts on one GPU"); scheduling, not arithmetic
    mps_sm_share=25,
    search=(arm("bf16"), arm("int8+int4kv"), arm("w4a4+int4kv"), *_dose((0.1, 0.2), 0.2)),
    # the calibration as it ran (docs/study/gpu_grpo_calibration.json): lr and batch shape of the reference, and
    # the mismatch sources at lr 1e-4, at trainer.micro_batch_size=32
    calibrate=(*(arm("bf16", extra=(f"trainer.lr={lr}", "trainer.micro_batch_size=32"), tag=lr)
                 for lr in ("5e-5", "1e-4", "2e-4")),
               arm("bf16", extra=("trainer.lr=1e-4", "trainer.micro_batch_size=32", "trainer.prompts_per_step=32",
                                  "rollout.n=4"), tag="1e-4 32x4"),
               *(arm(s, extra=("trainer.lr=1e-4", "trainer.micro_batch_size=32"), tag="1e-4")
                 for s in ("int8+int4kv", "w4a4+int4kv", sigma_source(0.1), sigma_source(0.2)))),
    # 16 arms. The dial at sigma 0.15: its mismatch matches W4A4 + INT4 KV's (mean abs(p - q) 0.0157-0.0162 over the
    # first 10 steps; sigma 0.1 gave 0.0102 and sigma 0.2 0.0206, calibration runs)
    arms=(arm("bf16", seeds=CORE_SEEDS),
          arm("int8+int4kv", seeds=ARM_SEEDS), arm("int8+int4kv", "score_centering", seeds=ARM_SEEDS),
          *(arm("fp8", c, seeds=ARM_SEEDS) for c in ("none", "dual", "dual_centered")),
          arm("w4a4+int4kv", seeds=CORE_SEEDS), arm("w4a4+int4kv", "score_centering", seeds=CORE_SEEDS),
          *(arm("w4a4+int4kv", c, seeds=ARM_SEEDS) for c in ("tis", "icepop", "mis (k3 < 0.02)",
                                                              "score_centering+tis", "dual", "dual (auto)",
                                                              "dual_centered")),
          arm(sigma_source(0.15), seeds=ARM_SEEDS)),
    note="one H200, runs side by side on the GPU (CUDA MPS) and its 16 cores; one part = one seed's arms from that "
         "seed's own warm start",
)

# ---- the second experiment: REINFORCE on the raw 0/1 reward under a fixed sampler bias -------------------------

LAPTOP_REINFORCE = Preset(
    name="laptop-reinforce", experiment="countdown_tiny",
    base=("trainer.checkpoint_every=0", "trainer.prompts_per_step=8", "rollout.max_new_tokens=96",
          "data.countdown.max_numbers=3", "model.warm_start.steps=400", "model.warm_start.eval_problems=64",
          "trainer.eval_problems=64",
          "eval.grade_workers=1", "trainer.lr=2e-4"),
    steps=40, eval_every=20, seeds=(0, 1, 2), concurrency=2, threads_per_run=1,
    search=(arm("bf16"), *_dose((0.1, 0.2, 0.4), 0.2), arm("int8+int4kv"),
            arm("bf16", objective="reinforce_raw"), *_dose((0.2, 0.4), 0.4, "reinforce_raw")),
    # the arms stage: 20 steps, the reference, the uncorrected mismatch, score centering and TIS, 3 seeds, under
    # REINFORCE on the raw reward: there the fixed sigma 0.2 collapses training (reward and held-out accuracy to
    # about 0 by step 17-20), while under GRPO it only slowed learning (`--objective grpo`: the same arms)
    arms=(arm("bf16", objective="reinforce_raw"), arm(sigma_source(0.2), objective="reinforce_raw"),
          arm(sigma_source(0.2), "score_centering", "reinforce_raw"), arm(sigma_source(0.2), "tis", "reinforce_raw")),
    arms_steps=20,
    note="2 CPU cores, <= 15 minutes for the arms stage: the reference, the failure and the rescue",
)

GPU_REINFORCE = Preset(
    name="gpu-reinforce", experiment="countdown_gpu",
    base=("trainer.checkpoint_every=0", "eval.grade_workers=1", "trainer.device=cuda", "trainer.micro_batch_size=32",
          "trainer.prompts_per_step=8", "trainer.eval_problems=128"),
    steps=40, eval_every=20, seeds=(0, 1, 2), concurrency=14, threads_per_run=1,
    # the arms stage: lr 5e-5 (the search's 2e-5 separated nothing within 20 steps) and
    # held-out accuracy at the start and the end only (each evaluation samples 128 problems x 4 at 512 tokens)
    arms_steps=40, arms_eval_every=40, arms_extra=("trainer.lr=5e-5",),
    env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    search=(arm("bf16"), *_dose((0.05, 0.1, 0.2, 0.4), 0.2), arm("int8+int4kv"), arm("w4a4+int4kv"),
            arm("bf16", objective="reinforce_raw"), *_dose((0.1, 0.2, 0.4), 0.2, "reinforce_raw")),
    # raw-reward REINFORCE, whose reward fell under a fixed sigma >= 0.1 in the search, every correction
    arms=(arm("bf16", objective="reinforce_raw"), *_full(sigma_source(0.2), "reinforce_raw", REINFORCE_CORRECTIONS)),
    note="one H200, runs packed on the GPU and its 16 cores: the warm start and 4 arms x 3 seeds in 413 s, the other "
         "5 arms in 312 s more",
)

CLUSTER = Preset(
    name="cluster", experiment="seed_qwen35_9b_int8_sc",
    base=("trainer.checkpoint_every=50",),
    steps=200, eval_every=25, seeds=(0, 1, 2), concurrency=1, threads_per_run=8,
    search=(arm("bf16"), arm("int8+int4kv"), arm(sigma_source(0.01)), arm(sigma_source(0.02))),
    arms=(arm("bf16"), *_full("int8+int4kv")),
    # the quick variant runs the same preset with the tiny model substituted, as the seed's quick preset does
    quick=("experiment=seed_qwen35_9b_int8_sc_quick",), topk=128,
    note="a real checkpoint with vLLM on a GPU cluster (Qwen3.5-9B, the seed's INT8 W8A8 + INT4 KV rollout)",
)

PRESETS = {p.name: p for p in (LAPTOP, GPU, LAPTOP_REINFORCE, GPU_REINFORCE, CLUSTER)}
