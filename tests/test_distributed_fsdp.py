"""The FSDP2-sharded trainer (parity.training.sharded) on CPU over gloo, against the single-process Trainer.

1. Two gloo processes (the test's own and one spawned), one RL step on the same batch: the same loss, gathered
   gradients, updated weights, metrics and checkpoint state as the single-process Trainer, to float32 rounding, for
   token-mean (with the dual correction, whose step sums are added over ranks), seq-mean-token-sum-norm (two
   mini-batches: PPO's old log-probs, an idle pass on the rank with fewer rows), seq-mean-token-mean, and
   token-mean with gradient checkpointing; a checkpoint written by the sharded trainer (gathered, single-process
   layout) resumes into it and the next step matches two single-process steps; the weight-broadcast group (gloo)
   delivers the gathered weights bit for bit.
2. `train` with distributed.enabled=true and 2 trainer actors over a real local Ray completes, and its metrics and
   final weights match the single-process run to rounding, with the weights to the rollout through the object
   store and through the gloo broadcast group.
3. Bad sharding settings fail at config load, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from parity.config import as_plain, from_plain
from tests.tolerances import U32

# float32, the same model's forward and backward on the rows split over ranks: a gradient entry is a sum over the
# batch's ~130 response tokens (and, inside, the layers' own sums) taken in another order and over ranks, within
# n u of the sum of its terms' magnitudes; n ~ 300 gives RTOL = 2e-5 (335 u) of the entry, and ATOL covers the
# entries whose terms cancel (near 0 an entry keeps the absolute error of its terms' sum).
RTOL, ATOL = 2e-5, 2e-7
LR = 1e-3
BETAS, EPS = (0.9, 0.999), 1e-8  # the trainer's AdamW (trainer.betas' default, torch's eps)

CASES = {  # name -> config overrides
    "token_mean_dual": ["algorithm.loss_agg_mode=token-mean", "algorithm.correction.name=dual",
                        "trainer.micro_batch_size=2"],
    "seq_sum_norm_2mini": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "trainer.mini_batches=2",
                           "trainer.micro_batch_size=2"],
    "seq_mean_token_mean": ["algorithm.loss_agg_mode=seq-mean-token-mean", "trainer.micro_batch_size=3"],
    "token_mean_grad_ckpt": ["algorithm.loss_agg_mode=token-mean", "trainer.micro_batch_size=4",
                             "trainer.gradient_checkpointing=true"],
}
# the sharded trainer runs the model's own forward inside the FSDP root; the single-process reference runs the same
# one (not the shared-prefix forward it takes on CPU by default, equal only up to rounding)
BASE = ["model.dtype=float32", "trainer.device=cpu", f"trainer.lr={LR}", "trainer.grad_clip=0.5",
        "trainer.shared_prefix=off"]


def _make_batch(cfg, model_dir: Path):
    """A real rollout (3 prompts of uneven length x 3 samples = 9 rows: the ranks get 5 and 4) with rewards."""
    from parity.core.sampling import SamplingSpec
    from parity.rollout import build_engine

    engine = build_engine(cfg, model_dir)
    batch = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]],
                            SamplingSpec(temperature=1.0, max_new_tokens=10, n=3, seed=4))
    engine.close()
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    return batch


def _single(cfg, model_dir: Path, batch, steps: int = 1, state: dict | None = None):
    """The single-process trainer after `steps` steps, their metrics, and the gradients (clipped) that each of its
    optimizer steps applied: {name: [one tensor per optimizer step]}."""
    from transformers import AutoModelForCausalLM

    from parity.training.trainer import build_trainer

    tr = build_trainer(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg, torch.device("cpu"))
    if state is not None:
        tr.load_state_dict(state)
    applied: dict[str, list[torch.Tensor]] = {n: [] for n, _ in tr.model.named_parameters()}

    def record(*_: object) -> None:
        for n, p in tr.model.named_parameters():
            applied[n].append(p.grad.detach().clone())

    hook = tr.optimizer.register_step_pre_hook(record)
    metrics = [tr.step(batch) for _ in range(steps)]
    hook.remove()
    return tr, metrics, applied


def _rank_main(rank: int, world: int, port: int, plain_cfgs: dict, model_dir: str, batch, out: str) -> None:
    """One rank: for each case a fresh ShardedTrainer, one step; rank 0 writes what it gathered."""
    from datetime import timedelta

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from parity.distributed.weight_broadcast import WeightBroadcast, free_port
    from parity.training.checkpoint import CheckpointManager
    from parity.training.sharded import GatheredModel, ShardedTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=180))
    results: dict = {}
    try:
        for name, plain in plain_cfgs.items():
            cfg = from_plain(plain)
            tr = ShardedTrainer(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg,
                                torch.device("cpu"))
            m = tr.step(batch)
            grads = {n: p.grad.full_tensor() for n, p in tr.model.named_parameters()}
            weights = dict(tr.sync_weights())
            state = tr.state_dict()
            results[name] = {"metrics": m, "grads": grads, "weights": weights, "state": state}
            if name == "token_mean_dual":
                # checkpoint (gathered, single-process layout, written by rank 0), then resume from it
                full = tr.full_model_state()
                ckpts = CheckpointManager(Path(out).parent / "run", keep=2)
                if rank == 0:
                    ckpts.save(1, GatheredModel(tr.model, full), None, {"step": 1, "trainer": state})
                dist.barrier()
                tr2 = ShardedTrainer(AutoModelForCausalLM.from_pretrained(ckpts.path(1), dtype=torch.float32), cfg,
                                     torch.device("cpu"))
                tr2.load_state_dict(torch.load(ckpts.path(1) / "state.pt", weights_only=False)["trainer"])
                results["resumed_step2"] = {"metrics": tr2.step(batch), "weights": dict(tr2.sync_weights())}
        # weight broadcast over its own gloo group: rank 0 sends the gathered weights, rank 1 receives them
        wport = [free_port() if rank == 0 else 0]
        dist.broadcast_object_list(wport, src=0)
        wb = WeightBroadcast("127.0.0.1", wport[0], rank, world, "gloo", timeout_s=60)
        meta = [(n, tuple(p.shape), "float32") for n, p in tr.model.named_parameters()]
        # here rank 1 is both a trainer rank (gathering) and the receiver: gather everything first, else rank 0's
        # first broadcast would wait for rank 1 while rank 1 waits in the next gather for rank 0
        named = list(tr.sync_weights())
        if rank == 0:
            wb.send(named)
        else:
            results = {"received": dict(wb.receive(meta, "cpu"))}
        if rank == 0:
            torch.save(results, out)
        else:
            torch.save(results, out + ".rank1")
    finally:
        dist.destroy_process_group()


def _child(_: int, *args: object) -> None:
    """Rank 1 in a spawned process (rank 0 runs in the test's own process: one interpreter start, not two)."""
    _rank_main(1, *args)


def _free_port() -> int:
    from parity.distributed.weight_broadcast import free_port
    return free_port("127.0.0.1")


def _close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _adam_tolerance(grads: list[torch.Tensor], lr: float = LR) -> torch.Tensor:
    """Per entry, how far apart two runs' weights may be after len(grads) AdamW steps from a fresh state, where the
    reference applied `grads` and each step's gradient of the other run is within d = RTOL |g| + ATOL of it (the
    gradient comparison's own bound). Step k moves a weight by lr u_k, u_k = m_k / (sqrt(v_k) + eps) (bias-corrected
    moments), which rounding alone cannot make small: near g = 0 a gradient's rounding moves the weight by up to a
    whole step. One step: u = g / (|g| + eps) is monotone, so the bound is max(|u(g + d) - u(g)|, |u(g - d) - u(g)|),
    exactly (1% of a step at |g| = 100 eps). More steps: first order, sum_j |du_k / dg_j| d_j; where some d_j > |g_j|/4
    (no longer small) or beyond it, |u_k|'s own bound for any gradients, sqrt(sum_j a_j^2 / b_j) with m_k = sum a_j g_j,
    v_k = sum b_j g_j^2, twice. On top, each run computes u_k in float32 (the moments' updates, sqrt, bias
    corrections, eps, the division: ~9 roundings, within 9 u |u_k|): 20 u |u_k| per step between the two. Weight
    decay acts on weights equal to rounding: a second-order term."""
    b1, b2 = BETAS
    g = [x.double() for x in grads]
    d = [RTOL * x.abs() + ATOL for x in g]
    if len(g) == 1:
        def u(x: torch.Tensor) -> torch.Tensor:
            return x / (x.abs() + EPS)
        moved = torch.maximum((u(g[0] + d[0]) - u(g[0])).abs(), (u(g[0] - d[0]) - u(g[0])).abs())
        return lr * (moved + 20 * U32)
    total = torch.zeros_like(g[0])
    for k in range(1, len(g) + 1):
        a = [(1 - b1) * b1 ** (k - j) / (1 - b1 ** k) for j in range(1, k + 1)]
        b = [(1 - b2) * b2 ** (k - j) / (1 - b2 ** k) for j in range(1, k + 1)]
        m = sum(aj * gj for aj, gj in zip(a, g))
        root = torch.sqrt(sum(bj * gj * gj for bj, gj in zip(b, g)))
        first = sum((aj / (root + EPS) - m * bj * gj / (root * (root + EPS) ** 2).clamp_min(1e-300)).abs() * dj
                    for aj, bj, gj, dj in zip(a, b, g, d))
        cap = 2 * sum(aj * aj / bj for aj, bj in zip(a, b)) ** 0.5
        large = torch.stack([dj > gj.abs() / 4 for dj, gj in zip(d, g)]).any(0)
        total += torch.where(large, cap, torch.minimum(first, torch.tensor(cap, dtype=torch.float64))) + 10 * U32 * cap
    return lr * total


def _weights_close(got: torch.Tensor, want: torch.Tensor, grads: list[torch.Tensor], what: str,
                   lr: float = LR) -> None:
    """`got` and `want` after len(grads) AdamW steps whose gradients (of the reference) were `grads`: within
    _adam_tolerance, plus the float32 roundings of the weight itself (decay and update: 2 u |w| a step)."""
    tol = _adam_tolerance(grads, lr) + 2 * len(grads) * U32 * want.double().abs()
    bad = (got.double() - want.double()).abs() > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} entries apart by more than the bound; the "
                           f"worst {float((got.double() - want.double()).abs()[bad].max()):.3e}")


def _metrics_close(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), f"{what}: {k} {got[k]} != {want[k]}"


def two_gloo_ranks(cfgs: dict, model_dir: Path, batch, tmp_path: Path) -> tuple[dict, dict]:
    """One step of a fresh ShardedTrainer a config over two gloo ranks (this process and a spawned one), on one
    torch thread: what rank 0 gathered ({name: metrics, grads, weights, state}) and what rank 1 received."""
    out = str(tmp_path / "rank0.pt")
    plain = {n: as_plain(c) for n, c in cfgs.items()}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = (2, _free_port(), plain, str(model_dir), batch, out)
        child = mp.start_processes(_child, args=args, nprocs=1, join=False, start_method="spawn")
        try:
            _rank_main(0, *args)
        finally:
            while not child.join():  # raises with the child's traceback if rank 1 failed
                pass
    finally:
        torch.set_num_threads(before)
    return torch.load(out, weights_only=False), torch.load(out + ".rank1", weights_only=False)["received"]


def test_two_gloo_ranks_match_the_single_process_trainer(quick_cfg, prepared_model, tmp_path) -> None:
    cfgs = {name: quick_cfg(*BASE, *over) for name, over in CASES.items()}
    batch = _make_batch(cfgs["token_mean_dual"], prepared_model)
    got, received = two_gloo_ranks(cfgs, prepared_model, batch, tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, cfg in cfgs.items():
            ref, (m,), applied = _single(cfg, prepared_model, batch)
            g = got[name]
            assert g["metrics"]["train/loss"] == pytest.approx(m["train/loss"], rel=1e-5, abs=1e-7), name
            _metrics_close(g["metrics"], m, name)
            for n, p in ref.model.named_parameters():
                _close(g["grads"][n], p.grad, f"{name} grad {n}")
                _weights_close(g["weights"][n], p.detach(), applied[n], f"{name} weight {n}")  # 1 or 2 steps
            # the checkpoint state is in the single-process layout, with the same moments
            s_ref = ref.state_dict()
            c_got, c_ref = g["state"]["corrections"], s_ref["corrections"]
            assert c_got["names"] == c_ref["names"]
            for cname, st in c_ref["corrections"].items():
                assert c_got["corrections"][cname] == pytest.approx(st, rel=1e-5), f"{name} correction {cname}"
            assert g["state"]["optimizer"]["param_groups"] == s_ref["optimizer"]["param_groups"]
            for i, st in s_ref["optimizer"]["state"].items():
                for k, v in st.items():
                    _close(g["state"]["optimizer"]["state"][i][k], v, f"{name} optimizer {i}.{k}")
            if name == "token_mean_dual":
                assert m["correction/lambda_next"] != m["correction/lambda"]  # the dual sums moved lambda
                ref2, (_, m2), applied2 = _single(cfg, prepared_model, batch, steps=2)
                r2 = got["resumed_step2"]
                _metrics_close(r2["metrics"], m2, "resumed step 2")
                for n, p in ref2.model.named_parameters():
                    _weights_close(r2["weights"][n], p.detach(), applied2[n], f"resumed weight {n}")
                saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_000001" / "model.safetensors"))
                assert saved.keys() == dict(ref.model.named_parameters()).keys()
                for n, p in ref.model.named_parameters():
                    _weights_close(saved[n], p.detach(), applied[n], f"checkpoint {n}")
        # what the weight group delivered is bit for bit what rank 0 gathered (the last case's weights)
        last = got[list(CASES)[-1]]["weights"]
        assert received.keys() == last.keys()
        assert all(torch.equal(received[k], last[k]) for k in last)
    finally:
        torch.set_num_threads(before)


# 2. over Ray: one rollout worker, two sharded trainer actors (gloo), one CPU each; one local Ray for both runs
RAY = ["distributed.enabled=true", "distributed.num_rollout_workers=1", "distributed.trainer_workers=2",
       "distributed.rollout_cpus=1", "distributed.trainer_cpus=1", "distributed.num_cpus=3"]
RUN = ["model.dtype=float32", "algorithm.correction.name=dual", "trainer.lr=1e-4", "trainer.shared_prefix=off"]


def _rows(run_dir: str) -> list[dict]:
    from parity.training.loop import MetricsLog
    rows = MetricsLog(Path(run_dir) / "metrics.jsonl").read()
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "faults/", "data/"))} for r in rows]


@pytest.fixture(scope="module")
def one_thread_ray(quick_cfg):
    """A local Ray for the module, and one torch thread here: the actors run one each, the reference too."""
    pytest.importorskip("ray")
    from parity.distributed.cluster import ray_session

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ray_session(quick_cfg(*RAY).distributed) as info:
            yield info
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference_run(one_thread_ray, quick_cfg, prepared_model) -> dict:
    """The single-process run, with the gradients each of its optimizer steps applied ({name: [per step]}) under
    "applied": the bound on the sharded run's weights is derived from them (_adam_tolerance)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from transformers import AutoModelForCausalLM

    from parity.commands.train import train

    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(prepared_model).named_parameters()]
    applied: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def record(optimizer: torch.optim.Optimizer, *_: object) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert len(params) == len(names)
        for n, p in zip(names, params, strict=True):
            applied[n].append(p.grad.detach().clone())

    hook = register_optimizer_step_pre_hook(record)
    try:
        out = train(quick_cfg(*RUN, "trainer.run_name=fsdp_ref"))
    finally:
        hook.remove()
    return {**out, "applied": applied}


@pytest.mark.parametrize("sync", ["object_store", "broadcast"])
def test_sharded_trainer_over_ray_matches_the_single_process_run(sync, one_thread_ray, reference_run, quick_cfg,
                                                                 prepared_model) -> None:
    """object_store: rank 0 gathers, one ray.put; broadcast: the gloo weight group (the NCCL path on GPUs)."""

    from parity.commands.train import train

    ref = reference_run
    dist = train(quick_cfg(*RUN, *RAY, f"distributed.weight_sync={sync}", f"trainer.run_name=fsdp_{sync}"))
    assert dist["distributed"]["trainer_workers"] == 2 and dist["distributed"]["weight_sync"] == sync
    got, want = _rows(dist["run_dir"]), _rows(ref["run_dir"])
    assert [r["step"] for r in got] == [0, 1, 2]
    for g, w in zip(got, want, strict=True):
        _metrics_close(g, w, f"step {w['step']}")
    assert got[2]["train/optimizer_steps"] == 1.0 and got[2]["correction/lambda"] != got[1]["correction/lambda"]
    w_dist = load_file(str(Path(dist["latest_checkpoint"]) / "model.safetensors"))
    w_ref = load_file(str(Path(ref["latest_checkpoint"]) / "model.safetensors"))
    w0 = load_file(str(Path(prepared_model) / "model.safetensors"))
    assert w_dist.keys() == w_ref.keys()
    for k in w_ref:
        _weights_close(w_dist[k], w_ref[k], ref["applied"][k], f"checkpoint {k}", lr=1e-4)
    assert any(not torch.equal(w_ref[k], w0[k]) for k in w0)  # training moved the weights


@pytest.mark.parametrize(("overrides", "key"), [
    (["distributed.trainer_workers=0"], "distributed.trainer_workers"),
    (["distributed.backend=mpi"], "distributed.backend"),
    (["distributed.weight_sync=nfs"], "distributed.weight_sync"),
    (["distributed.backend=nccl"], "distributed.backend"),  # nccl without GPUs
    (["distributed.trainer_workers=2", "distributed.trainer_gpus=0.5"], "distributed.trainer_gpus"),
    (["distributed.weight_sync=broadcast", "distributed.rollout_gpus=1"], "distributed.weight_sync"),
])
def test_bad_sharding_config_names_the_key(quick_cfg, overrides: list[str], key: str) -> None:
    from parity.config import ConfigError
    with pytest.raises(ConfigError, match=f"`{key}`"):
        quick_cfg("distributed.enabled=true", *overrides)


def test_sharded_trainer_config_needs_the_ray_loop_and_no_routing_replay(quick_cfg) -> None:
    from parity.config import ConfigError
    with pytest.raises(ConfigError, match="`distributed.trainer_workers`.*distributed.enabled=true"):
        quick_cfg("distributed.trainer_workers=2")
    with pytest.raises(ConfigError, match="`distributed.trainer_workers`.*routing replay"):
        quick_cfg("distributed.enabled=true", "distributed.trainer_workers=2", "model.arch=qwen3_moe",
                  "algorithm.routing_replay=true", "rollout.capture_routing=true")
