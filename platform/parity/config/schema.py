"""Schema of the Hydra config. Registered as a structured config, so an unknown key or a value of the
wrong type fails at composition with an error that names the full key (e.g. `trainer.lr`).
Range checks that types cannot express live in `validate()` (parity.config.validate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

# the `algorithm` section, written beside the corrections' section declarations so that parity.algorithms reads it
# without importing this package
from parity.algorithm_config import AlgorithmConfig, CorrectionConfig


@dataclass
class TinyModelConfig:
    vocab_size: int = 0  # 0 = size of the character tokenizer
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    # MoE only (model.arch=qwen3_moe)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True


@dataclass
class WarmStartConfig:
    steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    eval_problems: int = 256
    seed: int = 0
    # An imperfect teacher: with probability `teacher_error_rate` a warm-start target carries a systematic
    # slip instead of the right answer: last_digit (last digit one too high, mod 10) | drop_sign (a negative
    # result written without its minus) | none. RL with the verifiable reward has to un-learn it.
    teacher_error: str = "none"
    teacher_error_rate: float = 0.0


@dataclass
class ModelConfig:
    # "tiny" builds the embedded default with `prepare`; "hf" loads `path` (local folder or hub id).
    source: str = "tiny"
    arch: str = "qwen3"  # qwen3 | qwen3_moe (tiny only)
    path: str | None = None  # HF checkpoint folder or hub id (source=hf); prepared folder otherwise
    name: str = "tiny_qwen3"
    # compute dtype of trainer forward and rollout engine: auto = bfloat16 on CUDA and on CPUs with native
    # bf16 (AMX / AVX512-BF16), float32 elsewhere (bf16 is emulated, and slow, on AVX2 CPUs: docs/CONFIGURATION.md)
    dtype: str = "auto"
    # tiny models: char (one token a printable character) | bpe (byte-level BPE trained by `prepare` on the task's
    # prompts and teacher responses, at most tokenizer_vocab_size entries, cached under outputs/tokenizers/)
    tokenizer: str = "char"
    tokenizer_vocab_size: int = 2048
    tokenizer_corpus_size: int = 20000  # teacher responses the BPE is trained on
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)


@dataclass
class ArithmeticConfig:
    ops: list[str] = field(default_factory=lambda: ["+", "-", "*"])
    max_level: int = 3  # level L uses operands of up to L digits (and for level >= 3, three operands)
    min_level: int = 1
    n_test: int = 256
    seed: int = 1234


@dataclass
class CountdownConfig:
    """Countdown (parity.data.countdown): reach the target from the numbers, each used once."""

    min_numbers: int = 3  # numbers in a problem: its difficulty level
    max_numbers: int = 4
    max_number: int = 9  # numbers are drawn from 1..max_number
    ops: list[str] = field(default_factory=lambda: ["+", "-", "*"])  # of + - * /
    min_target: int = 10
    max_target: int = 100
    max_value: int = 999  # intermediate results must stay in 1..max_value (integers; / only when exact)
    max_attempts: int = 8  # the warm-start teacher gives up after this many missed attempts (a wrong answer)
    # null: the teacher always searches up to max_attempts; a number: its budget is drawn per demonstration uniformly
    # from [min_attempts, max_attempts], so the warm-started model gives up early at some rate that RL can lower
    min_attempts: int | None = None
    n_test: int = 256
    seed: int = 1234


@dataclass
class DataConfig:
    name: str = "arithmetic"  # arithmetic | countdown | math_train | jsonl (data.path)
    path: str | None = None  # jsonl for name=jsonl
    datasets_dir: str = "${oc.env:PARITY_DATASETS,../shared/datasets}"
    problem_field: str = "problem"
    answer_field: str = "answer"
    min_difficulty: float | None = None
    prompt_template: str = "{problem} Answer in \\boxed{{}}.\n"
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    countdown: CountdownConfig = field(default_factory=CountdownConfig)
    shuffle_seed: int = 0


@dataclass
class PrecisionValidationConfig:
    """`python -m parity validate`: quantized vs BF16 on held-out prompts; a None threshold is not checked."""

    num_prompts: int = 32
    samples_per_prompt: int = 2
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    max_mean_abs_prob_diff: float | None = 0.02
    max_p99_abs_prob_diff: float | None = None
    max_k3_kl: float | None = 0.01
    min_top1_agreement: float | None = 0.9
    max_ppl_ratio: float | None = 1.1
    max_accuracy_drop: float | None = None


@dataclass
class PerturbationConfig:
    """A controlled mismatch (parity.precision.perturbation): the rollout engine's weights are theta + Delta with
    Delta = sigma * eps * |theta_0| (eps ~ N(0, 1) per weight, theta_0 the run's starting model), re-applied after
    every weight sync; the trainer is never perturbed. Composes with the formats (perturbed, then quantized)."""

    sigma: float = 0.0  # 0 = off (bit-identical to no perturbation)
    mode: str = "fixed"  # fixed: one Delta for the whole run (from seed) | redraw: a new Delta at every sync
    seed: int | None = None  # the draws' seed; null = the run's trainer.seed (each seed its own Delta)


@dataclass
class PrecisionConfig:
    weights: str = "bf16"  # bf16 | int8 | fp8 | int4 | int3  (int4 / int3: torch engine only)
    activations: str = "bf16"  # bf16 | int8 | fp8 | int4  (per-token dynamic; int4: torch engine only)
    kv_cache: str = "bf16"  # bf16 | int8 | int4_per_token_head | fp8 | fp8_per_token_head
    kv_hadamard: bool = True  # int4 KV: rotate by vLLM's randomized Hadamard transform before quantizing
    # `quantize` writes <export_dir>/<model>-W8A8-INT8/ (checkpoint + config.json), the seed's path pattern
    export_dir: str = "${outputs_dir}/precision_validation"
    perturbation: PerturbationConfig = field(default_factory=PerturbationConfig)
    validation: PrecisionValidationConfig = field(default_factory=PrecisionValidationConfig)


@dataclass
class RolloutConfig:
    name: str = "torch"  # torch | vllm
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    n: int = 8  # responses per prompt (G)
    topk_logprobs: int = 0  # K of the returned top-K log-probs; 0 = off (score centering needs it)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    capture_routing: bool = False  # MoE: record routed experts for R3
    # torch engine, plain (CPU) loop: one prompt forward per distinct prompt, copied to its rollout.n rows
    # (docs/CPU_PERFORMANCE.md). The same batch bit for bit as a prompt forward per row, on one thread and however the
    # prompts are sharded (lanes, Ray rollout workers), in fp32 and bf16 on an AVX2 AMD EPYC and an AVX512/AMX Xeon
    # (tests/test_foundation_engine.py); on several OpenMP threads per call the products may round differently
    shared_prefill: bool = True
    # torch engine, plain (CPU) loop: the prompts sharded over this many threads of cores / lanes OpenMP threads each
    # (parity.cpu_lanes; no more lanes than the process has threads); the batch is one call's on one thread, bit for
    # bit. 1 = one call on all the process's threads
    cpu_lanes: int = 2
    max_model_len: int = 256
    gpu_memory_utilization: float = 0.3
    seed: int = 0
    # SOCKET#i: sample through a cohort's rollout server (parity.rollout.cohort_server) as its member i, the runs of
    # one rollout format decoded in one engine call; empty: the run's own engine
    cohort: str = ""
    # torch engine's decode path (CUDA): once at most half of a call's rows (of every run, in a cohort) are still
    # sampling, they go on in a state of half as many rows (then a quarter, ...) instead of the whole batch decoding
    # until its longest response ends; each row's arithmetic is the same except where a float product depends on
    # its row count (parity.rollout.cuda_decode, `_COMPACT_TAIL`)
    compact_tail: bool = False
    # torch engine's decode path (CUDA, compiled layers): the prompt forward's two layer halves compiled by Inductor
    # as well (faster for a large model's long prompts: docs/PERFORMANCE.md, "Compiled prefill"); false: the same
    # functions eager, no compile at the engine's first call (a small model's prefill is a few ms either way, its
    # compile 6-25 s of a start on a shared host; parity.rollout.cuda_decode)
    compile_prefill: bool = True
    # vLLM engine (rollout.name=vllm): in-process engine core (no extra process; starts in seconds on CPU),
    # eager mode (no torch.compile / CUDA graphs), and how a W8A8 INT8/FP8 engine takes new weights:
    # requantize (in place, re-prepacking each quantized linear layer) | rebuild (restart on a new checkpoint)
    vllm_in_process: bool = True
    vllm_enforce_eager: bool = True
    vllm_quantized_sync: str = "requantize"


@dataclass
class VllmEngineKwargs:
    linear_backend: str | None = None
    attention_backend: str | None = None
    kv_cache_dtype: str | None = None


@dataclass
class EngineKwargs:
    vllm: VllmEngineKwargs = field(default_factory=VllmEngineKwargs)


@dataclass
class SeedRolloutConfig:
    """verl-style rollout block of the seed experiments; when `quantization` is set it selects the
    rollout precision (see parity.precision)."""

    # accepted so that the seed block loads verbatim (DESIGN.md), and not read: model.dtype is the one compute dtype
    # of the trainer and the rollout engine (the seed's quick variants pin it to another value on purpose)
    dtype: str | None = None
    quantization: str | None = None
    quantization_config_file: str | None = None
    engine_kwargs: EngineKwargs = field(default_factory=EngineKwargs)


@dataclass
class ActorRolloutRefConfig:
    rollout: SeedRolloutConfig = field(default_factory=SeedRolloutConfig)


@dataclass
class CollapseConfig:
    """The collapse alarm (parity.training.collapse): `train/collapsed` turns 1 once the step's sampled reward
    has stayed below `fraction` x its running peak for `patience` consecutive steps."""

    fraction: float = 0.5
    patience: int = 10


@dataclass
class TrainerConfig:
    total_steps: int = 40
    prompts_per_step: int = 16
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per RL step
    micro_batch_size: int = 32
    lr: float = 2e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    resume: bool = False
    run_name: str = "${experiment_name}"
    eval_every: int = 10
    eval_problems: int = 256
    # held-out evaluation: greedy (0), or sampled at this temperature, eval_samples responses a problem (a search
    # task such as Countdown loops under greedy decoding: its presets sample)
    eval_temperature: float = 0.0
    eval_samples: int = 1
    # rows (problems x eval_samples) a held-out engine call decodes: fewer, larger calls start fewer kernels for
    # the same work on a GPU shared by many runs; each call's KV cache grows with it
    eval_rows: int = 128
    # with a quantized (or perturbed) rollout, evaluations also measure the trainer's weights without it
    # (`eval/accuracy_unquantized`, torch engine in the compute dtype in the loop's process, either runner): what
    # training did to the policy apart from what deploying it quantized costs
    eval_unquantized: bool = True
    # false: with eval_unquantized and such a rollout, evaluate only the trainer's weights on the plain engine (a
    # study that compares trained weights needs no second generation through the rollout engine)
    eval_through_rollout: bool = True
    # with eval_through_rollout=false: still evaluate through the rollout engine (the deployed model: the trained
    # weights in the rollout's own format) at every evaluation whose step is a multiple of this, and at the last
    # step; 0 = never
    eval_deployed_every: int = 0
    # at the last step, also held-out accuracy on this many problems (x eval_samples) through the rollout engine
    # (`eval/final_accuracy`) and, for a rollout that changes the numerics, the plain engine
    # (`eval/final_accuracy_unquantized`): the larger sample where arms' differences are decided; 0 = off
    final_eval_problems: int = 0
    # runs that start from the same weights share their step-0 evaluations: the plain engine's
    # (`eval/accuracy_unquantized`: one computation however many formats, arms and corrections start from the warm
    # start) and the rollout's (`eval/accuracy`: one for the runs of one format and seed, whatever their correction);
    # the first run to reach one computes it under a file lock in ${outputs_dir}/eval0/, the others read it; the
    # study's GPU preset turns it on (16 runs evaluating one warm start at once); false = each run its own
    share_step0_eval: bool = False
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    max_bad_steps: int = 3  # consecutive non-finite steps before the run stops
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    gradient_checkpointing: bool = False
    # each prompt's forward computed once for its rollout.n responses, padded columns left out
    # (parity.training.shared_prefix): auto = on CPU (off on CUDA, where the compiled HF layers are measured) | on | off
    shared_prefix: str = "auto"
    # torch.compile each decoder layer (Inductor; parity.core.fast_compile): fused norms / rotary / SiLU /
    # residual kernels. Compiles on the first steps and once more when batch shapes change (then with dynamic
    # shapes). Worth it for long GPU runs; measured speed-ups: docs/PERFORMANCE.md, "Settings for long GPU runs".
    compile_layers: bool = False
    # with compile_layers: "reduce-overhead" also replays the compiled layers (forward and backward) as CUDA graphs
    # (Inductor's cudagraph trees): the host launches a graph per layer instead of its kernels one by one, which
    # matters where the step is host-bound (figures: docs/PERFORMANCE.md, "Settings for long GPU runs").
    # Recorded for the first batch shape; shapes that change from step to step run without graphs (dynamic shapes)
    compile_mode: str = "default"
    # CPU trainer: each micro-batch's rows split at prompt-group boundaries over this many threads (parity.cpu_lanes),
    # each lane's forward and backward on its own, the gradients summed in lane order. Part of the arithmetic (the
    # sums' rounding), so a fixed number, not the machine's cores; 1 = off. Not with gradient_checkpointing,
    # compile_layers, MoE routing replay or the data-parallel trainer
    cpu_lanes: int = 2
    # pad each step's batch, prompts (on the left) and responses (on the right), to a multiple of this many tokens,
    # padded positions masked: a compiled trainer then meets a few batch shapes instead of a new one most steps, so
    # compile_mode=reduce-overhead replays its recorded CUDA graphs instead of recording again (RL batches vary in
    # length). The same loss and gradients up to the order of the attention's sums; more tokens to compute, and the
    # forward takes a [micro-batch, L, L] boolean mask (parity.training.trainer.attention_mask_4d). 0 = off
    pad_to_multiple: int = 0


@dataclass
class EvalConfig:
    """`evaluate` (parity.evaluation). Sampling keys are defaults that `benchmarks.<name>` overrides per
    benchmark (temperature, top_p, max_new_tokens, k, prompt_template, limit, and the hub_* keys)."""

    suite: list[str] = field(default_factory=lambda: ["arithmetic"])
    source: str = "local"  # local (data.datasets_dir) | hub (public HF datasets, needs `datasets` + network)
    prompt_template: str | None = None  # None = data.prompt_template
    chat_template: bool = False  # wrap the prompt with the tokenizer's chat template (instruct models)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 16
    k: int = 1  # samples per problem: avg@k, pass@k, maj@k
    seed: int = 0
    batch_size: int = 256  # response rows per engine call
    max_model_len: int | None = None  # None = the model's own limit; longer prompts are left-truncated
    grade_timeout_s: float = 5.0
    grade_workers: int = 2
    limit: int | None = None  # problems per benchmark (None = all)
    bootstrap: int = 1000
    ci_level: float = 0.95
    benchmarks: dict[str, Any] = field(default_factory=dict)  # per-benchmark overrides
    model_path: str | None = None  # checkpoint folder to evaluate; else run_name's latest checkpoint; else prepare's
    run_name: str | None = None  # a training run (outputs/runs/<run_name>) whose latest checkpoint is evaluated
    # a registered model, NAME or NAME:VERSION (default the latest), looked up in tracking.registry_url, then
    # in the MLflow model registry of tracking.tracking_uri (parity.tracking.registered)
    registered_model: str | None = None
    out_dir: str | None = None  # None = ${outputs_dir}/eval/<run or model>-<timestamp>


@dataclass
class DistributedConfig:
    """The RL loop over Ray actors (parity.distributed): N rollout workers and one trainer (or `trainer_workers`
    sharded ones), placed together by one placement group (bundle i = rollout worker i, then the trainer's)."""

    enabled: bool = False
    # "" = start a local Ray (and shut it down); "auto" or "ray://host:port" joins a cluster
    address: str = "${oc.env:PARITY_RAY_ADDRESS,''}"
    num_rollout_workers: int = 1
    rollout_cpus: float = 1.0
    rollout_gpus: float = 0.0
    trainer_cpus: float = 1.0  # per trainer worker
    trainer_gpus: float = 0.0  # per trainer worker (1 each when sharded on GPUs)
    # > 1: the trainer sharded with FSDP2 over that many actors (parity.training.sharded), data parallel; the
    # bundles after the rollout workers' are the trainer workers', rank 0 first
    trainer_workers: int = 1
    backend: str = "auto"  # torch.distributed backend of the trainers: auto (nccl on GPUs, else gloo) | gloo | nccl
    # trainer -> rollout weights: object_store (trainer rank 0 gathers, one ray.put) | broadcast (a gloo/nccl group of
    # trainer rank 0 and the rollout workers; a dead rollout worker then ends the run) | auto (= object_store)
    weight_sync: str = "auto"
    init_timeout_s: float = 300.0  # process-group rendezvous and collective timeout
    max_worker_restarts: int = 3  # Ray restarts of a dead rollout worker (its shard is then retried)
    max_shard_retries: int = 2  # attempts after the first of one shard of one rollout call
    restart_timeout_s: float = 120.0  # how long to wait for a restarted worker to come back
    off_policy_overlap: bool = False  # roll out step t+1 before the trainer's step t (staleness 1; either runner)
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    # local Ray only: logical CPUs (None = what the placement group asks for), object store size
    num_cpus: int | None = None
    object_store_mb: int = 512
    start_attempts: int = 3  # a loaded machine can miss Ray's 15 s agent start deadline; start again


@dataclass
class RegressionConfig:
    """`benchmark-regression` flow: the registered model's `candidate` against its `champion` (MLflow aliases of
    tracking.model_name), each in its deploy precision, paired bootstrap per problem."""

    margin: float = 0.02  # fail when the mean per-problem drop exceeds this and its CI lies below 0
    bootstrap: int = 2000
    ci_level: float = 0.95
    seed: int = 0
    unquantized: bool = True  # also evaluate each model unquantized (BF16) when it deploys quantized (recorded)
    promote: bool = False  # a candidate that passes becomes the champion (else a person moves the alias)
    cron: str = "0 2 * * *"  # schedule of the benchmark-regression/nightly deployment


@dataclass
class TrackingConfig:
    """MLflow (tracking_uri) and the registry DB (registry_url). The flows always record; `enabled` turns
    MLflow logging on for a plain `python -m parity train` (parity.tracking.train_run)."""

    enabled: bool = False
    tracking_uri: str = "${oc.env:PARITY_TRACKING_URI,sqlite:///${outputs_dir}/mlflow.db}"
    registry_url: str = "${oc.env:PARITY_REGISTRY_URL,sqlite:///${outputs_dir}/registry.db}"
    experiment: str = "${experiment_name}"  # the MLflow experiment: one per experiment_name unless set
    model_name: str = "parity-${experiment_name}"  # MLflow registered model of the pipeline's trained model
    log_model: bool = True  # log the trained checkpoint as an MLflow artifact and register a version
    flush_wait_s: float = 10.0  # after training, how long to retry writing metrics buffered during an outage
    flush_every_s: float = 5.0  # per-step metrics are written to MLflow in batches at most this often (0 = each step)
    regression: RegressionConfig = field(default_factory=RegressionConfig)


@dataclass
class ParityConfig:
    experiment_name: str = "default"
    outputs_dir: str = "${oc.env:PARITY_OUTPUTS,outputs}"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


__all__ = ["AlgorithmConfig", "CorrectionConfig", "ParityConfig", "MISSING"]
