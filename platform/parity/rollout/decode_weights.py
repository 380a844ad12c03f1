"""The decode path's weights as its layer functions take them (parity.rollout.cuda_decode): a projection as
(weight, scale, bias, kind), projections that read the same input stacked into one product (`_Fused`), and the
INT8 products' shapes that the decoder pins tile configurations for, simulated products' dequantized weights
kept for a call (`_Prepared`), and one layer's arguments (`_layer_args`). A cohort's projection (parity.rollout.cohort)
carries the runs first in every tensor ([N, out, in]); these stack it along the output rows the same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.precision.linear import PREPARED, is_simulated, simulated_weight


def _lin_of(mod: torch.nn.Module) -> tuple:
    stacked = getattr(mod, "decode_lin", None)  # a cohort's projection of every run (parity.rollout.cohort)
    if stacked is not None:
        return stacked()
    if isinstance(mod, torch.nn.Linear):
        return (mod.weight, None, mod.bias, None)
    return (mod.weight, mod.weight_scale, mod.bias, (mod.weights, mod.activations, mod.path))


@dataclass
class _Fused:
    """Projections that read the same input (q/k/v; gate/up) stacked into one weight, so a decode step runs one
    product instead of three or two: at batch 64 each product is latency-bound, and the INT8 path quantizes the
    input once. The stacked copies are refreshed from the modules at every call (`refresh`), so in-place weight
    updates between calls are seen."""
    mods: list
    lin: tuple
    sizes: tuple[int, ...]

    @classmethod
    def build(cls, mods: list) -> _Fused | None:
        lins = [_lin_of(m) for m in mods]
        w0, _, b0, k0 = lins[0]
        if any(k != k0 or w.dtype != w0.dtype or (b is None) != (b0 is None) for w, _, b, k in lins):
            return None  # mixed formats: one product each
        # stacked along the output rows: weight and scale [(N,) out, ...] on dim -2, bias [(N,) out] on dim -1 (a
        # cohort's tensors carry the runs first)
        cat = [None if lins[0][i] is None else torch.cat([lin[i] for lin in lins], dim=_CAT_DIM[i]) for i in range(3)]
        return cls(mods=mods, lin=(cat[0], cat[1], cat[2], k0), sizes=tuple(int(w.shape[-2]) for w, *_ in lins))

    def refresh(self) -> None:
        for i in range(3):
            if self.lin[i] is not None:
                torch.cat([_lin_of(m)[i] for m in self.mods], dim=_CAT_DIM[i], out=self.lin[i])


_CAT_DIM = (-2, -2, -1)  # weight, scale, bias: the output rows' dimension


def _int8_triton_shapes(layers: list) -> list[tuple[int, int]]:
    """(N, K) of every product through int8_triton's kernel (W8A8, and integer codes of other widths) among the
    layers' arguments (_layer_args: q/k/v, o, gate/up, down, stacked ones as stacked)."""
    out = []
    for pre, post in layers:
        for lins in (pre[2], (post[1],), post[4], (post[6],)):
            out += [(int(w.shape[-2]), int(w.shape[-1])) for w, _, _, kind in lins
                    if kind is not None and kind[2] in ("int8_triton", "int_codes_triton")]
    return out


@dataclass
class _Prepared:
    """A simulated product's float32 weight (w_hat = codes x scales: W4A4 and other mixed formats) kept computed
    instead of dequantized inside every product: one dequantization a call, not one a layer and decode step. The
    product is the same (quant_linear_forward's PREPARED path multiplies by the same w_hat). `refresh` recomputes it
    from its source (a module's tensors or a _Fused stack, refreshed first) at every call, so in-place weight
    updates between calls are seen."""
    source: tuple
    lin: tuple

    @classmethod
    def wrap(cls, lin: tuple, prepared: list | None) -> tuple:
        """`lin` itself, or for a simulated product when `prepared` is a list (the decoder's _PREPARE_SIMULATED on),
        the lin of a new record appended to it."""
        w, scale, bias, kind = lin
        if prepared is None or kind is None or not is_simulated(kind[2], *kind[:2]):
            return lin
        rec = cls(source=lin, lin=(simulated_weight(w, scale, kind[0]), None, bias, (*kind[:2], PREPARED)))
        prepared.append(rec)
        return rec.lin

    def refresh(self) -> None:
        w, scale, _, kind = self.source
        self.lin[0].copy_(simulated_weight(w, scale, kind[0]))


def _group(mods: list, fused: list, prepared: list | None = None, stack: bool = True
           ) -> tuple[tuple, tuple[int, ...]]:
    """(lins, sizes) for _project: one fused entry when `stack` and the modules can be stacked, else one per
    module."""
    f = _Fused.build(mods) if stack else None
    if f is None:
        return tuple(_Prepared.wrap(_lin_of(m), prepared) for m in mods), tuple(m.out_features for m in mods)
    fused.append(f)
    return (_Prepared.wrap(f.lin, prepared),), f.sizes


def _layer_args(layer: torch.nn.Module, fused: list, prepared: list | None = None,
                stack: bool = True) -> tuple[tuple, tuple]:
    """The tensors (and constants) of one decoder layer for _pre_attention / _post_attention: the modules' own
    tensors (a replay sees in-place weight updates) except stacked q/k/v and gate/up weights, whose _Fused
    records are appended to `fused` for refreshing (`stack` False: one product per module), and simulated
    products' dequantized weights, whose _Prepared records go to `prepared` (refreshed after `fused`; None: not
    prepared)."""
    a, m = layer.self_attn, layer.mlp
    pre = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
           *_group([a.q_proj, a.k_proj, a.v_proj], fused, prepared, stack), a.q_norm.weight, a.k_norm.weight,
           a.q_norm.variance_epsilon)
    post = (a.scaling, _Prepared.wrap(_lin_of(a.o_proj), prepared), layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.variance_epsilon, *_group([m.gate_proj, m.up_proj], fused, prepared, stack),
            _Prepared.wrap(_lin_of(m.down_proj), prepared))
    return pre, post
