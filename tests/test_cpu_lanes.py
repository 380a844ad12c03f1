"""CPU lanes (parity.cpu_lanes): the row split, the thread pool, and that neither user changes the numbers: the
torch engine's batch in lanes equals one call's on one thread bit for bit (shared prefill on and off, fp32 and
bf16), and a trainer step in lanes equals one without them in float64 (weights, loss, gradient norm, metrics)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from parity.cpu_lanes import check_lanes, in_lane, run_in_lanes, split_rows
from tests.test_training_shared_prefix import _batch, _model, _norm_in_input_dtype


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_split_rows_cuts_at_group_boundaries_near_equal_shares():
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    assert split_rows(g, 2) == [slice(0, 6), slice(6, 12)]
    assert split_rows(g, 3) == [slice(0, 3), slice(3, 9), slice(9, 12)]  # shares of 4: boundaries 3 and 9 nearest
    assert split_rows(g, 4) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    # fewer groups than lanes: one range per group, never an empty one
    assert split_rows(torch.tensor([5, 5, 7, 7]), 4) == [slice(0, 2), slice(2, 4)]
    assert split_rows(torch.tensor([4, 4, 4]), 2) == [slice(0, 3)]
    assert split_rows(torch.tensor([0, 0, 0, 1]), 2) == [slice(0, 3), slice(3, 4)]  # the nearest boundary
    assert split_rows(torch.tensor([3]), 2) == [slice(0, 1)]
    assert split_rows(g, 1) == [slice(0, 12)]
    for lanes in range(1, 6):  # the ranges tile the rows in order
        parts = split_rows(torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4]), lanes)
        assert parts[0].start == 0 and parts[-1].stop == 9 and all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        assert all(p.stop > p.start for p in parts) and len(parts) <= lanes


def test_lanes_run_on_one_thread_each_in_order_and_raise_the_first_error():
    with _threads(2):
        got = run_in_lanes(lambda i: (i, torch.get_num_threads(), in_lane()), [0, 1])
        assert got == [(0, 1, True), (1, 1, True)]
        assert torch.get_num_threads() == 2 and not in_lane()  # the caller keeps its threads
        # a call from inside a lane runs there (no second fan-out)
        assert run_in_lanes(lambda i: run_in_lanes(lambda j: (i, j, in_lane()), [0, 1]), [0, 1]) == [
            [(0, 0, True), (0, 1, True)], [(1, 0, True), (1, 1, True)]]

        def boom(i: int) -> int:
            if i == 1:
                raise KeyError("lane 1")
            return i
        with pytest.raises(KeyError, match="lane 1"):
            run_in_lanes(boom, [0, 1, 2])
    assert run_in_lanes(lambda i: i * 2, [3]) == [6]  # one item: the calling thread


def test_lane_threads_keep_one_thread_and_later_threads_get_the_callers_count():
    """torch gives a thread its OpenMP count at its first parallel op, from the value the process's last
    set_num_threads left: lanes started before the caller changed its count still run on one thread, and a thread
    started after the lanes gets the caller's count, not the lanes' one."""
    import threading

    with _threads(2):
        run_in_lanes(lambda i: i, [0, 1, 2, 3])  # four lanes started, no torch op in them yet
    with _threads(1), _threads(2):
        assert run_in_lanes(lambda i: torch.get_num_threads(), [0, 1, 2, 3]) == [1, 1, 1, 1]
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start(), t.join()
        assert seen == [2]


def test_lane_count_keys_are_checked(quick_cfg, tmp_path):
    assert check_lanes(2, "trainer.cpu_lanes") == 2
    for bad in (0, -1, "two", 1.5):
        with pytest.raises(ValueError, match="trainer.cpu_lanes"):
            check_lanes(bad, "trainer.cpu_lanes")
    from parity.config.validate import ConfigError
    with pytest.raises(ConfigError, match="rollout.cpu_lanes"):
        quick_cfg("rollout.cpu_lanes=0")
    with pytest.raises(ConfigError, match="trainer.cpu_lanes"):
        quick_cfg("trainer.cpu_lanes=0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_batch_in_lanes_is_one_threads_batch_bit_for_bit(prepared_model, dtype):
    """The default prepared model, 16 prompts x 8 samples of the default task: lanes 2 and 3, shared prefill on and
    off, against one call without sharing on one thread (the reference every runner agrees with)."""
    from transformers import AutoTokenizer

    from parity.core.sampling import SamplingSpec
    from parity.rollout.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    prompts = [tok(f"{a}+{b}=")["input_ids"] for a, b in zip(range(3, 99, 6), range(50, 2, -3))]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=12, n=8, topk_logprobs=4, seed=3)
    with _threads(1):
        ref = TorchEngine(prepared_model, dtype=dtype, share_prefill=False, cpu_lanes=1).generate(prompts, spec)
    fields = ("prompts", "prompt_mask", "responses", "response_mask", "rollout_logprobs", "topk_ids", "topk_logprobs",
              "truncated", "group_ids", "prompt_ids")
    with _threads(2):
        for share in (True, False):
            for lanes in (2, 3):
                got = TorchEngine(prepared_model, dtype=dtype, share_prefill=share, cpu_lanes=lanes).generate(prompts, spec)
                for f in fields:
                    assert torch.equal(getattr(got, f), getattr(ref, f)), (share, lanes, f)


@pytest.fixture
def float64_norms(monkeypatch):
    """Qwen3's RMSNorm in the input's dtype (it computes in float32 otherwise): float64 comparisons are float64's.
    Not for the engine test: the model's own norm is what makes its batch independent of the shapes."""
    from transformers.models.qwen3 import modeling_qwen3
    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _norm_in_input_dtype)


@pytest.mark.usefixtures("float64_norms")
def test_trainer_step_in_lanes_equals_one_pass_float64(quick_cfg, prepared_model):
    """One trainer step in float64 from the same weights with 1, 2 and 3 lanes (micro-batches of 4 rows over 3
    prompt groups, so lanes cut inside micro-batches and gradients accumulate over them), shared prefix on and off."""
    from parity.training.trainer import build_trainer

    batch = _batch()
    batch.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    for prefix in ("on", "off"):
        out, weights = {}, {}
        for lanes in (1, 2, 3):
            model = _model("qwen3")
            cfg = quick_cfg("model.dtype=float32", f"trainer.shared_prefix={prefix}", "trainer.micro_batch_size=4",
                            f"trainer.cpu_lanes={lanes}")
            tr = build_trainer(model, cfg, torch.device("cpu"))
            tr.compute_dtype = torch.float64
            tr._autocast = contextlib.nullcontext  # type: ignore[method-assign]
            assert tr.lanes == lanes
            out[lanes] = tr.step(batch)
            weights[lanes] = {k: p.detach().clone() for k, p in model.named_parameters()}
        # float64 throughout (norms included): lanes change only how sums of a few hundred terms are grouped,
        # n 2^-53 ~ 1e-14 of their terms; 1e-9 relative / 1e-12 absolute is far from both that and any real change
        for lanes in (2, 3):
            assert out[lanes].keys() == out[1].keys()
            for key, v in out[1].items():
                assert out[lanes][key] == pytest.approx(v, rel=1e-9, abs=1e-12), (prefix, lanes, key)
            for k in weights[1]:
                assert torch.allclose(weights[lanes][k], weights[1][k], atol=1e-12, rtol=0), (prefix, lanes, k)


def test_lanes_are_off_where_the_trainer_does_not_run_its_own_forward(quick_cfg, prepared_model):
    from parity.training.trainer import build_trainer

    assert build_trainer(_model("qwen3"), quick_cfg(), torch.device("cpu")).lanes == 2  # the default
    assert build_trainer(_model("qwen3"), quick_cfg("trainer.gradient_checkpointing=true"), torch.device("cpu")).lanes == 1


def test_shared_prefill_batch_does_not_depend_on_the_sharding(prepared_model):
    """Long prompts of different lengths (one forward of all the distinct prompts moved a long prompt's log-probs by
    1e-7 between calls of 2 prompts and of 1): shards of 2 and 3 prompts, through lanes and merged by hand as the Ray
    rollout pool merges its workers' shards, give the one-call batch bit for bit, on one thread a call. (A shard of
    3 rows is not held to it: the decode steps' products of 3 rows and of 18 may take different kernels, with or
    without the shared prefill.)"""
    from parity.core.sampling import SamplingSpec
    from parity.rollout.sharding import global_spec, merge_batches, shard_prompts
    from parity.rollout.torch_engine import TorchEngine

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (200, 61, 60, 140, 7, 99)]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=10, n=3, topk_logprobs=2, seed=7)
    eng = TorchEngine(prepared_model, dtype=torch.float32, share_prefill=True, cpu_lanes=1)
    with _threads(1):
        whole = eng.generate(prompts, spec)
        for workers in (2, 3):
            shared = global_spec(spec, prompts)
            parts = [(s.start, eng.generate(prompts[s.start:s.stop], shared, prompt_ids=list(range(s.start, s.stop))))
                     for s in shard_prompts(len(prompts), workers)]
            merged = merge_batches(parts, eng.pad_id)
            for f in ("responses", "rollout_logprobs", "topk_logprobs"):
                assert torch.equal(getattr(merged, f), getattr(whole, f)), (workers, f)
    with _threads(2):
        for lanes in (2, 3):
            got = TorchEngine(prepared_model, dtype=torch.float32, share_prefill=True, cpu_lanes=lanes).generate(prompts, spec)
            for f in ("responses", "rollout_logprobs", "topk_logprobs"):
                assert torch.equal(getattr(got, f), getattr(whole, f)), (lanes, f)
