"""The batch layout every sampler shares (parity.core.layout), by hand: rows, left padding, per-row seeds that do
not depend on the batch, the prompt forward's mask, the cache's key slots, positions, and the RolloutBatch."""

from __future__ import annotations

import pytest
import torch

from parity.core.layout import key_slots, layout_batch, left_pad, positions, prefill_mask, row_seed
from parity.core.sampling import SamplingSpec


def test_rows_padding_and_batch_by_hand() -> None:
    lay = layout_batch([[5, 6, 7], [8]], SamplingSpec(n=2, max_new_tokens=3, seed=4), prompt_ids=[10, 20], pad_id=0)
    assert lay.rows == [(0, 0), (0, 1), (1, 0), (1, 1)] and lay.size == 4 and lay.width == 3
    assert lay.prompts.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8], [0, 0, 8]]
    assert lay.prompt_mask.tolist() == [[True] * 3] * 2 + [[False, False, True]] * 2
    wide = layout_batch([[5, 6, 7], [8]], SamplingSpec(n=1, pad_prompts_to=5), pad_id=9)
    assert wide.prompts.tolist() == [[9, 9, 5, 6, 7], [9, 9, 9, 9, 8]]
    r = torch.arange(12).view(4, 3)
    batch = lay.rollout_batch(r, r > 2, r.float() / 10, torch.tensor([True, False, False, True]),
                              meta={"engine": "x"})
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.prompt_ids.tolist() == [10, 10, 20, 20]
    assert batch.rewards.dtype == torch.float32 and batch.rewards.tolist() == [0.0] * 4
    assert batch.truncated.tolist() == [True, False, False, True] and batch.meta == {"engine": "x"}
    assert torch.equal(batch.input_ids[:, 3:], r) and batch.topk_ids is None


def test_a_row_draws_the_same_in_any_batch() -> None:
    spec = SamplingSpec(n=2, max_new_tokens=5, seed=3)
    both = layout_batch([[1, 2], [3]], spec, prompt_ids=[7, 9])
    alone = layout_batch([[3, 4, 5]], spec, prompt_ids=[9])  # prompt 9 in another batch, padded differently
    assert torch.equal(both.uniforms()[2:], alone.uniforms())
    assert both.uniforms().dtype == torch.float64 and both.uniforms().shape == (4, 5)
    g = torch.Generator().manual_seed(row_seed(3, 7, 1))
    assert torch.equal(both.uniforms()[1], torch.rand(5, generator=g, dtype=torch.float64))
    assert row_seed(3, 7, 1) != row_seed(3, 7, 1, namespace="validate") != row_seed(3, 7, 0)
    assert 0 <= row_seed(3, 7, 1) < 1 << 63


def test_masks_and_positions_by_hand() -> None:
    pmask = torch.tensor([[False, True, True], [True, True, True]])
    assert positions(pmask).tolist() == [[0, 0, 1], [0, 1, 2]]
    m = prefill_mask(pmask)
    # row 0: the pad query 0 sees itself only; query 1 sees key 1; query 2 sees keys 1, 2
    assert m[0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert m[1].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert key_slots(pmask, 2).tolist() == [[False, True, True, True, True], [True] * 5]
    assert key_slots(pmask, 2, slots=7)[0].tolist() == [False, True, True, True, True, False, False]


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        layout_batch([[1], []], SamplingSpec())
    with pytest.raises(ValueError, match="at least one prompt"):
        layout_batch([], SamplingSpec())
    with pytest.raises(ValueError, match=r"prompt \(4\) \+ max_new_tokens \(8\) exceeds .* \(10\)"):
        layout_batch([[1, 2, 3, 4]], SamplingSpec(max_new_tokens=8), max_positions=10)
    ids, mask = left_pad([[1], [2, 3]], pad_id=0)
    assert ids.tolist() == [[0, 1], [2, 3]] and mask.tolist() == [[False, True], [True, True]]
