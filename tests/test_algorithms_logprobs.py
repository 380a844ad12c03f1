"""chunked_token_logprobs = log_softmax + gather, in value and gradient, without an [N x V] fp32 tensor."""

from __future__ import annotations

import pytest
import torch

from parity.algorithms import chunked_token_logprobs, masked_token_logprobs
from tests.tolerances import U32, UBF16, logprob_bound, logprob_grad_scales

N, H, V = 11, 6, 37


def _inputs(seed: int, m: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (N, m), generator=g)
    ids[:, -1] = ids[:, 0]  # a repeated id in a row must accumulate its gradient twice
    upstream = torch.randn(N, m, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), ids, upstream


def _reference(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, t: float) -> torch.Tensor:
    return torch.log_softmax(hidden @ weight.T / t, dim=-1).gather(1, ids)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_value_and_gradient_match_float64_log_softmax(chunk: int, m: int, temperature: float) -> None:
    hidden, weight, ids, upstream = _inputs(0, m)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = chunked_token_logprobs(h, w, ids, temperature, chunk)
    assert out.dtype == torch.float32 and out.shape == (N, m)
    (out.double() * upstream).sum().backward()

    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = _reference(h64, w64, ids, temperature)
    (ref * upstream).sum().backward()
    # float32 against float64: each lp within dlp (tolerances.logprob_bound: a 6-term dot product, a 37-term
    # log-sum-exp; at most 2.3e-5 for these inputs), inside atol + rtol |lp|
    dlp = logprob_bound(hidden, weight, temperature)
    assert dlp <= 1e-5 + 1e-5 * float(ref.detach().abs().min())
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    # gradients (tolerances.logprob_grad_scales): p within dlp relative, the upstream g exact up to its float32
    # rounding; the sum of the M <= 6 g's, ~6 roundings, and a sum over the V = 37 logits (h) or N = 11 rows (W)
    g_h, g_w = logprob_grad_scales(hidden, weight, ids, upstream, temperature)
    assert ((h.grad.double() - h64.grad).abs() <= (dlp + (V + 12) * U32) * g_h).all()
    assert ((w.grad.double() - w64.grad).abs() <= (dlp + (N + 12) * U32) * g_w).all()


def test_bf16_weights_follow_the_hf_logits_path() -> None:
    hidden, weight, ids, upstream = _inputs(1, 3, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = chunked_token_logprobs(h, w, ids, 1.0, 4)
    (out * upstream.float()).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    # what an HF model + .float() computes, the bf16 matmul taken on the same row blocks as the chunks of 4: another
    # row count may let the kernel sum in another order, and a float32 sum that moves across a bf16 rounding edge
    # moves a logit by a bf16 ulp (2^-8 relative), more than any difference this test looks for
    low = torch.cat([h2[s:s + 4] @ w2.T for s in range(0, N, 4)])
    ref = torch.log_softmax(low.float(), -1).gather(1, ids)
    (ref * upstream.float()).sum().backward()
    # the same bf16 logits, two float32 log-softmax evaluations: 2 dlp with dz = 0
    assert torch.allclose(out, ref, rtol=0, atol=2 * logprob_bound(hidden, weight, same_logits=True))
    assert w.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.bfloat16
    # p within dlp (dz = 0) in each; both round d/dz to bf16 and the matmul's output to bf16 (UBF16 each, so 2 UBF16
    # apart), and the reference adds its three W blocks in bf16 (2 UBF16 more); the float32 part twice
    g_h, g_w = logprob_grad_scales(hidden, weight, ids, upstream, 1.0)
    dlp = logprob_bound(hidden, weight, same_logits=True)
    assert ((w.grad.double() - w2.grad.double()).abs() <= (2 * dlp + 6 * UBF16 + 2 * (N + 12) * U32) * g_w).all()
    assert ((h.grad.double() - h2.grad.double()).abs() <= (2 * dlp + 4 * UBF16 + 2 * (V + 12) * U32) * g_h).all()


def test_no_tokens_by_vocab_tensor_is_saved_for_backward() -> None:
    hidden, weight, ids, _ = _inputs(2, 4)
    out = chunked_token_logprobs(hidden.requires_grad_(True), weight.requires_grad_(True), ids, 1.0, 3)
    saved = out.grad_fn.saved_tensors
    assert saved and all(t.numel() < N * V for t in saved if t is not weight)
    assert max(t.numel() for t in saved) == V * H  # the weight itself, nothing of size N x V


def test_masked_token_logprobs_scatters_back_and_zeroes_padding() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 5, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (3, 5), generator=g)
    mask = torch.arange(5)[None] < torch.tensor([5, 0, 2])[:, None]
    out = masked_token_logprobs(hidden, weight, ids, mask)
    full = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
    # two float32 evaluations (matmuls of other shapes, two log-softmax implementations): within 2 dlp
    assert torch.allclose(out[mask], full[mask], rtol=0, atol=2 * logprob_bound(hidden, weight))
    assert (out[~mask] == 0).all()


def test_bad_ids_are_reported() -> None:
    hidden, weight, ids, _ = _inputs(4, 2)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 37\)"):
        chunked_token_logprobs(hidden, weight, ids + V)
    with pytest.raises(TypeError, match="int64"):
        chunked_token_logprobs(hidden, weight, ids.int())
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, weight, ids, temperature=0.0)


@pytest.mark.parametrize("m,temperature", [(1, 1.0), (6, 0.7)])
def test_kernel_path_matches_the_eager_path(m: int, temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's structure (row log-sum-exp and softmax-times-factor blocks, the one-hot part added in torch;
    run here with the torch references of the two kernels, bf16 on CPU): forward values and gradients, with a
    repeated id in every row, equal the eager path's to bf16 rounding of the gradients, and the float64 reference."""
    import parity.algorithms.logprobs as lp

    hidden, weight, ids, upstream = _inputs(3, m, torch.bfloat16)

    def run(kernels: bool) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(lp, "_kernels", (lambda low: (lp._row_logsumexp_ref, lp._softmax_times_ref))
                            if kernels else (lambda low: None))
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = chunked_token_logprobs(h, w, ids, temperature, 4)
        (out * upstream.float()).sum().backward()
        return out, h.grad, w.grad

    fused, eager = run(True), run(False)
    # the same bf16 logits (same matmuls on the same chunks), two float32 log-softmax evaluations: 2 dlp with dz = 0
    same = logprob_bound(hidden, weight, temperature, same_logits=True)
    torch.testing.assert_close(fused[0], eager[0], rtol=0, atol=2 * same)
    # gradients: p within 2 dlp of each other, d/dz and the matmul's output each rounded to bf16 (2 UBF16 apart each)
    g_h, g_w = logprob_grad_scales(hidden, weight, ids, upstream, temperature)
    for a, b, scale, n in ((fused[1], eager[1], g_h, V), (fused[2], eager[2], g_w, N)):
        assert a.dtype == b.dtype == torch.bfloat16
        assert ((a.double() - b.double()).abs() <= (2 * same + 4 * UBF16 + 2 * (n + 12) * U32) * scale).all()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = _reference(h64, w64, ids, temperature)
    (ref * upstream).sum().backward()
    # against float64: bf16 logits (tolerances.logprob_bound with logits_dtype bf16) carry p's error; d/dz and the
    # output rounded to bf16 once each
    dlp = logprob_bound(hidden, weight, temperature, logits_dtype=torch.bfloat16)
    assert ((fused[1].double() - h64.grad).abs() <= (dlp + 2 * UBF16 + (V + 12) * U32) * g_h).all()
    assert ((fused[2].double() - w64.grad).abs() <= (dlp + 2 * UBF16 + (N + 12) * U32) * g_w).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,vocab,temperature", [(1024, 151_936, 1.0), (37, 5_000, 0.7), (3, 2_047, 1.3)])
def test_cuda_head_kernels_match_their_references(rows: int, vocab: int, temperature: float) -> None:
    import parity.algorithms.logprobs as lp
    from parity.algorithms import head_triton

    assert head_triton.available()
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    low = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
    lse = head_triton.row_logsumexp(low, temperature)
    ref = torch.logsumexp(low.double() / temperature, dim=-1)
    torch.testing.assert_close(lse.double(), ref, rtol=1e-6, atol=1e-5)
    factor = torch.randn(rows, 1, device="cuda", generator=g)
    out = head_triton.softmax_times(low, lse, factor, temperature)
    want = lp._softmax_times_ref(low, lse, factor, temperature)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want.float(), rtol=1.6e-2, atol=1e-6)
