"""How Inductor's compiled q/k norm and rotary round, against the eager functions and against models of where the
rounding to the model dtype happens (decode_layers._rms and _rope, bf16, 64 rows x 8 heads x 128, random weights
and positions): the fraction of output values that differ.

The eager functions round the normed x, the weighted y, and x cos, rotate_half(x) sin and their sum each to bf16;
Inductor fuses them and elides downcast-upcast pairs between fused operators (its `emulate_precision_casts` is off
by default), and its reductions and rsqrt are its own. The fused pre-attention kernel (parity.rollout.pre_attention)
can match the eager arithmetic bit for bit (its `eager_rounding`), not a compiled function's: this prints by how
much the nearest rounding model still misses the compiled result on this device.

    python3 tests/bench/inductor_rounding.py [--device cuda]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from parity.rollout.decode_layers import _rms, _rope
    dev = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    B, H, D, P = 64, 8, 128, 40
    x = (torch.randn(B, H, D, generator=g) * 3).bfloat16().to(dev)
    w = (1 + 0.3 * torch.randn(D, generator=g)).bfloat16().to(dev)
    ang = torch.arange(P)[:, None] * (10000.0 ** (-torch.arange(D // 2) / (D // 2)))[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], 1).bfloat16().to(dev)
    sin = torch.cat([ang.sin(), ang.sin()], 1).bfloat16().to(dev)
    pos = torch.randint(0, P, (B,), generator=g).to(dev)
    c, s = cos[pos][:, None], sin[pos][:, None]

    def f(x, w, c, s):
        return _rope(_rms(x, w, 1e-6), c, s)

    eager = f(x, w, c, s)
    compiled = torch.compile(f, fullgraph=True, dynamic=False)(x, w, c, s)

    def model(round_xn: bool, round_y: bool, round_rope: bool) -> torch.Tensor:
        xf = x.float()
        xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        xn = xn.bfloat16().float() if round_xn else xn
        y = w.float() * xn
        y = y.bfloat16().float() if round_y else y
        rot = torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1)
        if round_rope:
            return ((y * c.float()).bfloat16().float() + (rot * s.float()).bfloat16().float()).bfloat16()
        return (y * c.float() + rot * s.float()).bfloat16()

    def frac(u, v) -> float:
        return float((u != v).float().mean())

    print(f"{torch.__version__} on {a.device}: compiled against eager, values differing {frac(compiled, eager):.4f}")
    for rx, ry, rr in itertools.product((False, True), repeat=3):
        m = model(rx, ry, rr)
        print(f"rounded: normed {rx!s:5s} weighted {ry!s:5s} rotary terms {rr!s:5s}   against compiled "
              f"{frac(m, compiled):.4f}   against eager {frac(m, eager):.4f}")


if __name__ == "__main__":
    main()
