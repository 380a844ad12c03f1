"""Step metrics that do not depend on the micro-batch split, and the mismatch telemetry.

`StepMetrics` collects sums, counts and maxes per micro-batch (float64, on the tensors' device, no
host sync until `compute()`), and derives the step's values from them at the end, so a mean over a
step is the mean over all its tokens, not a mean of micro-batch means. Names are documented in
METRICS.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

Number = torch.Tensor | float | int
Derived = Callable[[Mapping[str, float]], float | None]


class StepMetrics:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sums: dict[str, torch.Tensor | float] = {}
        self._maxes: dict[str, torch.Tensor | float] = {}
        self._values: dict[str, float] = {}
        self._means: dict[str, tuple[str, str]] = {}
        self._derived: dict[str, Derived] = {}

    # -- accumulation -------------------------------------------------------------------------------
    def add_sum(self, key: str, value: Number) -> None:
        v = value.detach().to(torch.float64) if isinstance(value, torch.Tensor) else float(value)
        self._sums[key] = self._sums[key] + v if key in self._sums else v

    def add_max(self, key: str, value: Number) -> None:
        v = value.detach().to(torch.float64) if isinstance(value, torch.Tensor) else float(value)
        if key not in self._maxes:
            self._maxes[key] = v
        elif isinstance(v, torch.Tensor) or isinstance(self._maxes[key], torch.Tensor):
            self._maxes[key] = torch.maximum(torch.as_tensor(self._maxes[key], dtype=torch.float64),
                                             torch.as_tensor(v, dtype=torch.float64))
        else:
            self._maxes[key] = max(self._maxes[key], v)

    def add_mean(self, name: str, total: Number, count: Number) -> None:
        """Contribute `total` over `count` items to the step mean `name`."""
        self.add_sum(f"{name}#sum", total)
        self.add_sum(f"{name}#count", count)
        self._means[name] = (f"{name}#sum", f"{name}#count")

    def add_masked_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        v = torch.where(mask, values.detach().to(torch.float64), 0.0)
        self.add_mean(name, v.sum(), mask.sum())

    def add_masked_max(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        v = torch.where(mask, values.detach().to(torch.float64), float("-inf"))
        self.add_max(name, v.max() if v.numel() else torch.tensor(float("-inf"), dtype=torch.float64))

    def set_value(self, name: str, value: float) -> None:
        self._values[name] = float(value)

    def add_derived(self, name: str, fn: Derived) -> None:
        """`fn(sums)` computes `name` from the step's accumulated sums when `compute()` runs."""
        self._derived[name] = fn

    # -- data parallel --------------------------------------------------------------------------------
    def all_reduce(self, group: object = None, device: torch.device | None = None) -> None:
        """Combine the accumulators of every process of a torch.distributed group (data-parallel ranks, each
        holding its share of the step's rows): sums are added, maxes maxed, so `compute()` then gives the
        values one process would have computed on all the rows. Collective: every rank must call it. A rank
        that saw no rows may lack keys; the union is used (0 for a sum, -inf for a max)."""
        import torch.distributed as dist

        keys: list[list[list[str]] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, [sorted(self._sums), sorted(self._maxes)], group=group)
        sums = sorted({k for ks in keys for k in ks[0]})
        maxes = sorted({k for ks in keys for k in ks[1]})
        dev = device or torch.device("cpu")
        for names, store, op, empty in ((sums, self._sums, dist.ReduceOp.SUM, 0.0),
                                        (maxes, self._maxes, dist.ReduceOp.MAX, float("-inf"))):
            if not names:
                continue
            t = torch.tensor([float(store.get(k, empty)) for k in names], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=op, group=group)
            store.update(zip(names, t.cpu().tolist(), strict=True))

    # -- results ------------------------------------------------------------------------------------
    def sums(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._sums.items()}

    def compute(self) -> dict[str, float]:
        """The step's metric values (private accumulators, keys with '#', are left out)."""
        sums = self.sums()
        out: dict[str, float] = {}
        for name, (s, c) in self._means.items():
            if sums[c] > 0:
                out[name] = sums[s] / sums[c]
        for name, v in self._maxes.items():
            fv = float(v)
            if math.isfinite(fv):
                out[name] = fv
        for name, fn in self._derived.items():
            val = fn(sums)
            if val is not None:
                out[name] = float(val)
        out.update(self._values)
        out.update({k: v for k, v in sums.items() if "#" not in k})
        return out


# ---- mismatch telemetry ----------------------------------------------------------------------------
_P = "mismatch/"
_N = f"{_P}#n"


def _ratio(num: str, den: str = _N) -> Derived:
    return lambda s: s[num] / s[den] if s.get(den, 0) > 0 else None


def _ess(s: Mapping[str, float]) -> float | None:
    n, sw, sw2 = s.get(_N, 0.0), s[f"{_P}#w"], s[f"{_P}#w2"]
    return (sw * sw) / (n * sw2) if n > 0 and sw2 > 0 else None


def _pearson(s: Mapping[str, float]) -> float | None:
    n = s.get(_N, 0.0)
    if n < 2:
        return None
    mx, my = s[f"{_P}#x"] / n, s[f"{_P}#y"] / n
    cov = s[f"{_P}#xy"] / n - mx * my
    vx, vy = s[f"{_P}#xx"] / n - mx * mx, s[f"{_P}#yy"] / n - my * my
    if vx <= 0 or vy <= 0:
        return None
    return cov / math.sqrt(vx * vy)


def record_mismatch(metrics: StepMetrics, train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                    mask: torch.Tensor, tolerance: float | None) -> None:
    """Accumulate the mismatch between pi_train and pi_inf on the sampled tokens of one micro-batch.

    r = p_train / p_inf; y ~ pi_inf, so k1 = E[-log r] and k3 = E[r - 1 - log r] estimate
    KL(pi_inf || pi_train) and chi2 = E[(r - 1)^2] the chi-square divergence. `tolerance` None (an auto
    tolerance not measured yet): no frac_over_tol."""
    lt = torch.where(mask, train_logprobs.detach().to(torch.float64), 0.0)
    li = torch.where(mask, rollout_logprobs.detach().to(torch.float64), 0.0)
    m = mask.to(torch.float64)
    lr = lt - li
    r = torch.exp(lr) * m
    pt, pi = torch.exp(lt) * m, torch.exp(li) * m
    d = (pt - pi).abs()
    # probabilities sit near 1 for most tokens: shifting by 1 keeps the raw moments well conditioned
    x, y = (pt - 1.0) * m, (pi - 1.0) * m
    lengths = mask.sum(dim=-1)
    has = lengths > 0
    seq_ppl_ratio = torch.where(has, torch.exp(-lr.sum(-1) / lengths.clamp_min(1)), 0.0)
    sums = {
        _N: m.sum(), f"{_P}#d": d.sum(), f"{_P}#k1": (-lr).sum(), f"{_P}#k3": ((r - 1.0 - lr) * m).sum(),
        f"{_P}#chi2": (((r - 1.0) ** 2) * m).sum(), f"{_P}#w": r.sum(), f"{_P}#w2": (r * r).sum(),
        f"{_P}#x": x.sum(), f"{_P}#y": y.sum(),
        f"{_P}#xx": (x * x).sum(), f"{_P}#yy": (y * y).sum(), f"{_P}#xy": (x * y).sum(),
        f"{_P}#seqs": has.sum(), f"{_P}#ppl": seq_ppl_ratio.sum(),
    }
    if tolerance is not None:
        sums[f"{_P}#over"] = ((d > tolerance) & mask).sum()
    for k, v in sums.items():
        metrics.add_sum(k, v)
    metrics.add_masked_max(f"{_P}abs_prob_diff_max", d, mask)
    for name, fn in {
        "abs_prob_diff_mean": _ratio(f"{_P}#d"), "k1_kl": _ratio(f"{_P}#k1"), "k3_kl": _ratio(f"{_P}#k3"),
        "chi2": _ratio(f"{_P}#chi2"), "ess": _ess,
        "prob_pearson": _pearson, "ppl_ratio": _ratio(f"{_P}#ppl", f"{_P}#seqs"),
    }.items():
        metrics.add_derived(f"{_P}{name}", fn)
    metrics.add_derived(f"{_P}tokens", lambda s: s.get(_N))
    if tolerance is not None:
        metrics.add_derived(f"{_P}frac_over_tol", _ratio(f"{_P}#over"))
