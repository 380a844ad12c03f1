"""Pure pieces of the distributed loop (no Ray): sharding, merging shard batches, weight packing, placement
bundles and config checks."""

from __future__ import annotations

import pytest
import torch

from parity.config.distributed import check_distributed
from parity.config.schema import DistributedConfig
from parity.core.sampling import SamplingSpec
from parity.distributed.cluster import bundles, local_num_cpus
from parity.distributed.weights import pack_weights, unpack_weights
from parity.errors import ParityError
from parity.rollout.sharding import Shard, global_spec, merge_batches, shard_prompts
from parity.types import RolloutBatch


def test_shards_are_contiguous_near_equal_and_skip_idle_workers() -> None:
    assert shard_prompts(5, 2) == [Shard(0, 0, 3), Shard(1, 3, 5)]
    assert shard_prompts(6, 3) == [Shard(0, 0, 2), Shard(1, 2, 4), Shard(2, 4, 6)]
    assert shard_prompts(2, 4) == [Shard(0, 0, 1), Shard(1, 1, 2)]  # workers 2 and 3 get nothing
    for n in range(0, 12):
        for k in range(1, 5):
            s = shard_prompts(n, k)
            assert [i for sh in s for i in range(sh.start, sh.stop)] == list(range(n))
            assert all(sh.stop > sh.start for sh in s)
            if s:
                assert max(sh.stop - sh.start for sh in s) - min(sh.stop - sh.start for sh in s) <= 1
    with pytest.raises(ValueError, match="num_rollout_workers"):
        shard_prompts(3, 0)


def test_global_spec_pads_every_shard_to_the_longest_prompt() -> None:
    spec = global_spec(SamplingSpec(seed=3), [[1, 2], [1, 2, 3, 4, 5], [7]])
    assert spec.pad_prompts_to == 5 and spec.seed == 3
    assert global_spec(SamplingSpec(pad_prompts_to=9), [[1]]).pad_prompts_to == 9


def _batch(rows: int, P: int, R: int, first_group: int, fill: float, K: int = 2) -> RolloutBatch:
    n = rows
    return RolloutBatch(
        prompts=torch.full((n, P), 5), prompt_mask=torch.ones(n, P, dtype=torch.bool),
        responses=torch.full((n, R), 7), response_mask=torch.ones(n, R, dtype=torch.bool),
        rollout_logprobs=torch.full((n, R), fill), rewards=torch.zeros(n), truncated=torch.ones(n, dtype=torch.bool),
        group_ids=torch.arange(n) // 2, prompt_ids=first_group + torch.arange(n) // 2,
        topk_ids=torch.ones(n, R, K, dtype=torch.int32), topk_logprobs=torch.full((n, R, K), fill),
        texts=[f"t{first_group}"] * n, answers=[f"a{first_group}"] * n, meta={"engine": "torch"})


def test_merge_offsets_groups_and_pads_shorter_responses_like_one_engine_call() -> None:
    a, b = _batch(4, 3, 5, first_group=0, fill=-1.0), _batch(2, 3, 2, first_group=2, fill=-2.0)
    m = merge_batches([(2, b), (0, a)], pad_token_id=0)  # given out of order on purpose
    assert m.batch_size == 6 and m.responses.shape == (6, 5) and m.topk_ids.shape == (6, 5, 2)
    assert m.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert m.prompt_ids.tolist() == [0, 0, 1, 1, 2, 2]
    # the short shard's padding: pad id, mask False, log-prob 0, top-k zeros
    assert m.responses[4:, 2:].eq(0).all() and not m.response_mask[4:, 2:].any()
    assert m.rollout_logprobs[4:, 2:].eq(0).all() and m.rollout_logprobs[4:, :2].eq(-2).all()
    assert m.topk_logprobs[4:, 2:].eq(0).all() and m.topk_ids[4:, 2:].eq(0).all()
    assert m.rollout_logprobs[:4].eq(-1).all() and m.response_lengths().tolist() == [5, 5, 5, 5, 2, 2]
    assert m.texts == ["t0"] * 4 + ["t2"] * 2 and m.meta == {"engine": "torch"}


def test_merge_refuses_shards_padded_differently() -> None:
    with pytest.raises(ValueError, match="pad_prompts_to"):
        merge_batches([(0, _batch(2, 3, 2, 0, -1.0)), (1, _batch(2, 4, 2, 1, -1.0))], pad_token_id=0)


def test_weights_round_trip_bit_exact_through_numpy() -> None:
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 4, generator=g).to(torch.bfloat16)), ("b", torch.randn(5, generator=g)),
             ("c", torch.tensor([float("inf"), -0.0, 1e-40]).to(torch.bfloat16))]
    packed = pack_weights(named)
    assert packed["a"][0] == "bfloat16" and packed["a"][1].dtype.name == "int16"
    back = dict(unpack_weights(packed))
    for name, t in named:
        assert back[name].dtype == t.dtype
        assert torch.equal(back[name].view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32),
                           t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32))
    with pytest.raises(TypeError, match="'i'"):
        pack_weights([("i", torch.ones(2, dtype=torch.int64))])


def _dcfg(**kw: object):
    base = {"num_rollout_workers": 2, "rollout_cpus": 1.0, "rollout_gpus": 0.0, "trainer_cpus": 2.0,
            "trainer_gpus": 0.0, "max_worker_restarts": 1, "max_shard_retries": 1, "placement_strategy": "PACK",
            "start_attempts": 1, "num_cpus": None}
    return DistributedConfig(**{**base, **kw})


def test_bundles_one_per_worker_then_trainer_and_local_cpus() -> None:
    assert bundles(_dcfg()) == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 2.0}]
    assert bundles(_dcfg(rollout_gpus=1, trainer_gpus=0.5)) == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"CPU": 2.0, "GPU": 0.5}]
    assert local_num_cpus(_dcfg(rollout_cpus=0.5, trainer_cpus=0.5)) == 2
    assert local_num_cpus(_dcfg(num_cpus=8)) == 8


@pytest.mark.parametrize(("key", "value"), [("num_rollout_workers", 0), ("rollout_cpus", -1.0),
                                            ("placement_strategy", "BEST"), ("max_shard_retries", -1)])
def test_bad_distributed_config_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ParityError, match=f"distributed.{key}"):
        check_distributed(_dcfg(**{key: value}))
