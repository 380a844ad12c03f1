"""chunked_token_logprobs = log_softmax + gather, in value and gradient, without an [N x V] fp32 tensor."""

from __future__ import annotations

import pytest
import torch

from parity.algorithms import chunked_token_logprobs, masked_token_logprobs

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
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_bf16_weights_follow_the_hf_logits_path() -> None:
    hidden, weight, ids, upstream = _inputs(1, 3, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = chunked_token_logprobs(h, w, ids, 1.0, 4)
    (out * upstream.float()).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref = torch.log_softmax((h2 @ w2.T).float(), -1).gather(1, ids)  # what an HF model + .float() computes
    (ref * upstream.float()).sum().backward()
    assert torch.allclose(out, ref, atol=1e-5)
    assert w.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.bfloat16
    assert torch.allclose(w.grad.float(), w2.grad.float(), rtol=2e-2, atol=2e-2)
    assert torch.allclose(h.grad.float(), h2.grad.float(), rtol=2e-2, atol=2e-2)


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
    assert torch.allclose(out[mask], full[mask], atol=1e-6)
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
    torch.testing.assert_close(fused[0], eager[0], rtol=0, atol=2e-6)
    for a, b in zip(fused[1:], eager[1:]):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = _reference(h64, w64, ids, temperature)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(fused[1].double(), h64.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fused[2].double(), w64.grad, rtol=3e-2, atol=3e-2)


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
