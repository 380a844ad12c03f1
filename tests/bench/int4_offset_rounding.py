"""How much the rotated INT4 attention's output bits depend on the order of its float32 sums (CPU, no Triton).

    python tests/bench/int4_offset_rounding.py

The kernel's P V product takes the codes into fp16 tensor-core operands as 1024 + code and takes the offset off
after the loop through the weights' sum: u = sum_j w_j (1024 + n_j) - (1024 sum_j w_j + sum_j w_j z_j)
(parity/rollout/int4_attention.py). The subtraction cancels about 2^10 times the result, so a reordering of the
same float32 additions, which moves a sum by a float32 rounding, moves u by a thousand times as much or more. This
computes u for random heads (fp16 weights of a softmax, codes 0-15, zero points 6-9, 256 slots) with the sums in
slot order and in a random order, and prints each order's error against float64 and the share of bf16 values that
differ between the two orders: a change of the loop that only reorders its sums (as loading the key mask an
iteration ahead did on the device: 12.9% of the bf16 outputs differed, the same float64 error;
docs/PERFORMANCE.md) shows here as a comparable share with the same error.
"""

from __future__ import annotations

import torch


def offset_sums(pw: torch.Tensor, n: torch.Tensor, z: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """u [heads, D] from fp16-valued weights pw [heads, L], codes n [heads, L, D] and zero points z [heads, L],
    float32 sums over the slots in `order`, through the 1024 offset as the kernel does."""
    w = torch.zeros(pw.shape[0])
    zh = torch.zeros(pw.shape[0])
    acc = torch.zeros(n.shape[0], n.shape[2])
    for j in order.tolist():
        w = w + pw[:, j]
        zh = zh + pw[:, j] * z[:, j]
        acc = acc + (1024 + n[:, j]) * pw[:, j, None]
    return acc - (1024 * w + zh)[:, None]


def main() -> None:
    g = torch.Generator().manual_seed(0)
    heads, L, D = 4096, 256, 64
    p = torch.softmax(torch.randn(heads, L, generator=g) * 2.0, 1)
    pw = (p * (0.5 + 0.5 * torch.rand(heads, L, generator=g))).half().float()
    n = torch.randint(0, 16, (heads, L, D), generator=g).float()
    z = torch.randint(6, 10, (heads, L), generator=g).float()
    want = ((n - z[:, :, None]).double() * pw[:, :, None].double()).sum(1)
    a = offset_sums(pw, n, z, torch.arange(L))
    b = offset_sums(pw, n, z, torch.randperm(L, generator=g))
    for name, u in (("slot order", a), ("random order", b)):
        print(f"{name:13s} relative error against float64: {float((u.double() - want).norm() / want.norm()):.3e}")
    print(f"bf16 values that differ between the two orders: {float((a.bfloat16() != b.bfloat16()).float().mean()):.1%}")
    print("largest difference over its head's largest value: "
          f"{float(((a - b).abs().amax(1) / a.abs().amax(1)).max()):.2e}")


if __name__ == "__main__":
    main()
