"""parity.moe codec (compact routing transport) and the streaming vs naive decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity.moe import (
    DecodeStats,
    RoutingBatch,
    decode_naive,
    decode_streaming,
    encode_routing,
    routing_dtype,
)

L, K = 3, 2


def _random_batch(lengths: list[int], num_experts: int, seed: int = 0) -> tuple[RoutingBatch, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    raw = [torch.randint(0, num_experts, (n, L, K), generator=g) for n in lengths]
    return RoutingBatch.from_responses(raw, num_experts), raw


@pytest.mark.parametrize(("num_experts", "dtype", "itemsize"), [(8, np.uint8, 1), (256, np.uint8, 1),
                                                              (257, np.int16, 2), (1000, np.int16, 2)])
def test_codec_round_trip_8_and_16_bit(num_experts: int, dtype: type, itemsize: int) -> None:
    batch, raw = _random_batch([5, 0, 7], num_experts)
    # the extreme id must survive (255 in uint8, 999 in int16: no wrap-around)
    raw[0][0, 0, 0] = num_experts - 1
    batch = RoutingBatch.from_responses(raw, num_experts)
    assert routing_dtype(num_experts) == dtype
    assert all(a.dtype == dtype for a in batch.responses)
    assert batch.nbytes == (5 + 0 + 7) * L * K * itemsize  # response tokens only, no padding
    back = RoutingBatch.from_bytes(batch.to_bytes())
    assert (back.n_layers, back.top_k, back.num_experts) == (L, K, num_experts)
    assert back.lengths() == [5, 0, 7]
    for a, r in zip(back.responses, raw):
        assert torch.equal(torch.from_numpy(a.astype(np.int64)), r)
    assert int(back.responses[0][0, 0, 0]) == num_experts - 1


def test_codec_bytes_size_is_header_lengths_and_payload() -> None:
    batch, _ = _random_batch([4, 2], 300)
    data = batch.to_bytes()
    assert len(data) == 21 + 8 * 2 + (4 + 2) * L * K * 2


def test_select_and_concat_keep_rows() -> None:
    batch, raw = _random_batch([2, 3, 4], 16)
    sub = batch.select([2, 0])
    assert sub.lengths() == [4, 2]
    assert np.array_equal(sub.responses[0], raw[2].numpy().astype(np.uint8))
    both = RoutingBatch.concat([sub, batch.select([1])])
    assert both.lengths() == [4, 2, 3]
    with pytest.raises(IndexError, match="index 3 out of range for 3"):
        batch.select([3])
    other, _ = _random_batch([1], 300)
    with pytest.raises(ValueError, match="disagree"):
        RoutingBatch.concat([batch, other])


def test_from_steps_keeps_each_rows_sampled_positions() -> None:
    steps = [torch.tensor([[[t, 7]] * L, [[t + 1, 6]] * L]) for t in range(4)]  # B=2, each [2, L, K]
    batch = RoutingBatch.from_steps(steps, [4, 2], num_experts=8)
    assert batch.lengths() == [4, 2]
    assert batch.responses[1][:, 0, 0].tolist() == [1, 2]
    assert batch.responses[0][:, 2, :].tolist() == [[0, 7], [1, 7], [2, 7], [3, 7]]
    with pytest.raises(ValueError, match="one routing step per sampled token"):
        RoutingBatch.from_steps(steps, [5, 2], num_experts=8)


def test_codec_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"response 1: expert id out of range \[0, 8\): min 8, max 8"):
        RoutingBatch.from_responses([torch.zeros(2, L, K, dtype=torch.long), torch.full((1, L, K), 8)], 8)
    with pytest.raises(ValueError, match="min -1"):
        encode_routing(torch.full((1, L, K), -1), 8)
    with pytest.raises(ValueError, match=r"\[tokens, n_layers, top_k\]"):
        encode_routing(torch.zeros(L, K, dtype=torch.long), 8)
    with pytest.raises(ValueError, match="does not fit the int16"):
        routing_dtype(40000)
    with pytest.raises(TypeError, match="response 0: expected a numpy uint8"):
        RoutingBatch([np.zeros((1, L, K), np.int64)], L, K, 8)
    with pytest.raises(ValueError, match="response 0: shape"):
        RoutingBatch([np.zeros((1, L + 1, K), np.uint8)], L, K, 8)


def test_from_bytes_rejects_corrupt_data() -> None:
    batch, _ = _random_batch([3, 2], 8)
    data = bytearray(batch.to_bytes())
    with pytest.raises(ValueError, match="bad magic"):
        RoutingBatch.from_bytes(b"XXXX" + bytes(data[4:]))
    with pytest.raises(ValueError, match="header and lengths describe"):
        RoutingBatch.from_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match="shorter than"):
        RoutingBatch.from_bytes(bytes(data[:5]))
    data[-1] = 200  # an id of 200 with 8 experts
    with pytest.raises(ValueError, match=r"response 1 has an expert id outside \[0, 8\)"):
        RoutingBatch.from_bytes(bytes(data))


R = 6
LENGTHS = [0, 3, R, R + 5, 1, 0, R - 1]  # empty, short, exact, truncated, ...


@pytest.mark.parametrize(("dtype", "pad", "num_experts"), [
    (torch.int64, -1, 8), (torch.int32, -7, 8), (torch.int16, 0, 8), (torch.uint8, 255, 8),
    (torch.int64, -1, 300), (torch.int32, -7, 300), (torch.int16, 0, 300)])
def test_streaming_equals_naive_bit_for_bit(dtype: torch.dtype, pad: int, num_experts: int) -> None:
    batch, raw = _random_batch(LENGTHS, num_experts)
    ref = decode_naive(batch, R, pad_value=pad, dtype=dtype)
    out = torch.empty((len(LENGTHS), R, L, K), dtype=dtype)
    got = decode_streaming(RoutingBatch.from_bytes(batch.to_bytes()), out, pad_value=pad)
    assert got is out
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape == (len(LENGTHS), R, L, K)
    assert torch.equal(got, ref)
    # the content itself, by hand: kept prefix, padding, truncation, empty rows
    assert torch.equal(got[1, :3].long(), raw[1]) and bool((got[1, 3:] == pad).all())
    assert torch.equal(got[3].long(), raw[3][:R])
    assert bool((got[0] == pad).all()) and bool((got[5] == pad).all())


def test_streaming_writes_into_a_view_and_leaves_the_rest() -> None:
    batch, raw = _random_batch(LENGTHS, 8, seed=3)
    full = torch.full((len(LENGTHS), R + 4, L, K), 99, dtype=torch.int64)
    decode_streaming(batch, full[:, 2:2 + R], pad_value=-1)
    assert torch.equal(full[:, 2:2 + R], decode_naive(batch, R, pad_value=-1))
    assert bool((full[:, :2] == 99).all()) and bool((full[:, 2 + R:] == 99).all())


def test_decode_temporaries_one_response_vs_all() -> None:
    batch, _ = _random_batch(LENGTHS, 8)
    s_stream, s_naive = DecodeStats(), DecodeStats()
    decode_streaming(batch, torch.empty((len(LENGTHS), R, L, K), dtype=torch.int64), stats=s_stream)
    decode_naive(batch, R, stats=s_naive)
    per_token = L * K * 8
    assert s_stream.peak_temp_bytes == 0  # widened inside copy_, from a view of the compact ids
    assert s_naive.peak_temp_bytes == sum(LENGTHS) * per_token  # every response, truncated ones in full
    assert s_stream.responses == s_naive.responses == len(LENGTHS)


def test_decode_errors() -> None:
    batch, _ = _random_batch([2, 1], 8)
    with pytest.raises(ValueError, match=r"expected \[B=2, R, n_layers=3, top_k=2\]"):
        decode_streaming(batch, torch.empty((3, R, L, K), dtype=torch.int64))
    with pytest.raises(ValueError, match="pad_value -1 does not fit"):
        decode_streaming(batch, torch.empty((2, R, L, K), dtype=torch.uint8), pad_value=-1)
    with pytest.raises(TypeError, match="integer dtype"):
        decode_streaming(batch, torch.empty((2, R, L, K), dtype=torch.float32))
    wide, _ = _random_batch([2, 1], 300)
    with pytest.raises(TypeError, match="torch.uint8 cannot hold expert ids up to 299"):
        decode_streaming(wide, torch.empty((2, R, L, K), dtype=torch.uint8), pad_value=0)
    with pytest.raises(TypeError, match="torch.uint8 cannot hold expert ids up to 299"):
        decode_naive(wide, R, pad_value=0, dtype=torch.uint8)
