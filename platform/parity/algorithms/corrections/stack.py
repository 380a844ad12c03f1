"""`build_corrections(cfg) -> CorrectionStack`: import the modules of corrections defined outside parity, parse
`algorithm.correction.name` ('a+b'), build each correction from its config section, check that they compose,
and run them as one."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from parity.algorithm_config import EXTERNAL, SECTIONS, import_modules
from parity.algorithms.corrections.base import CORRECTIONS, KEY, Correction, require
from parity.mismatch_tolerance import DEFAULT_TOLERANCE
from parity.types import RolloutBatch

STATE_VERSION = 1


class AutoTolerance:
    """`algorithm.correction.tolerance=auto` without a validate report: c = multiple x the mean discrepancy of the
    first `steps` steps (the dual's own discrepancy when the dual is stacked, else mismatch/abs_prob_diff_mean)."""

    def __init__(self, multiple: float, steps: int) -> None:
        require(multiple > 0, f"{KEY}.tolerance_multiple", f"must be > 0, got {multiple}")
        require(steps >= 1, f"{KEY}.tolerance_steps", f"must be >= 1, got {steps}")
        self.multiple, self.steps = float(multiple), int(steps)
        self.seen: list[float] = []

    def observe(self, discrepancy: float | None) -> float | None:
        """Take one step's discrepancy; the tolerance once `steps` finite ones were seen, else None."""
        if discrepancy is not None and math.isfinite(discrepancy):
            self.seen.append(float(discrepancy))
        if len(self.seen) < self.steps:
            return None
        return self.multiple * sum(self.seen[: self.steps]) / self.steps


class CorrectionStack:
    """The configured corrections, applied in the order named. `tolerance` None: being measured (AutoTolerance)."""

    def __init__(self, corrections: list[Correction], tolerance: float | None,
                 auto: AutoTolerance | None = None) -> None:
        self.corrections = corrections
        self.tolerance = None if tolerance is None else float(tolerance)
        self.auto = auto

    def __iter__(self) -> Iterator[Correction]:
        return iter(self.corrections)

    def __len__(self) -> int:
        return len(self.corrections)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.corrections]

    @property
    def needs_topk(self) -> bool:
        return any(c.needs_topk for c in self.corrections)

    @property
    def top_k(self) -> int:
        """Leading top-K columns of the batch that are used (0 = all)."""
        return max((c.top_k for c in self.corrections if c.needs_topk), default=0)

    @property
    def is_weight(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The token-level IS rule of the stack (tis or icepop), if any, for score centering's head."""
        for c in self.corrections:
            if c.provides_token_is_weight:
                return c.is_weight
        return None

    def check(self, policy_loss: str | None = None, topk_logprobs: int | None = None) -> None:
        for c in self.corrections:
            c.check([o for o in self.corrections if o is not c], policy_loss, topk_logprobs)

    def check_batch(self, batch: RolloutBatch) -> None:
        for c in self.corrections:
            c.check_batch(batch)

    def step_sums(self) -> dict[str, float]:
        """Every correction's step accumulators, keyed `<name>/<key>` (Correction.step_sums)."""
        return {f"{c.name}/{k}": v for c in self.corrections for k, v in c.step_sums().items()}

    def set_step_sums(self, sums: dict[str, float]) -> None:
        for c in self.corrections:
            own = {k.split("/", 1)[1]: v for k, v in sums.items() if k.split("/", 1)[0] == c.name}
            if own:
                c.set_step_sums(own)

    def end_step(self, observed: dict[str, float] | None = None) -> dict[str, float]:
        """Update per-step state (e.g. lambda) and return the correction/* metrics of the step. `observed`: the
        step's other metrics (mismatch/*), from which an auto tolerance is measured."""
        out: dict[str, float] = {}
        for c in self.corrections:
            out.update(c.end_step())
        if self.tolerance is None and self.auto is not None:
            seen = out.get("correction/dual_delta_mean", (observed or {}).get("mismatch/abs_prob_diff_mean"))
            value = self.auto.observe(seen)
            if value is not None:
                self.set_tolerance(value)
        if self.tolerance is not None:
            out["correction/tolerance"] = self.tolerance
        return out

    def set_tolerance(self, c: float) -> None:
        self.tolerance = float(c)
        for corr in self.corrections:
            corr.set_tolerance(c)

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "names": self.names, "tolerance": self.tolerance,
                "auto_seen": list(self.auto.seen) if self.auto is not None else None,
                "corrections": {c.name: c.state_dict() for c in self.corrections}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or "corrections" not in state:
            raise ValueError(f"not a correction state (version {state.get('version')!r}, expected {STATE_VERSION})")
        saved = state["corrections"]
        for c in self.corrections:
            own = saved.get(c.name)
            if own is None:
                if c.state_dict():
                    raise ValueError(f"the checkpoint has no state for correction {c.name!r} "
                                     f"(it was saved with {state.get('names')})")
                continue
            c.load_state_dict(own)
        if self.auto is not None and state.get("auto_seen") is not None:
            self.auto.seen = [float(x) for x in state["auto_seen"]]
        if self.tolerance is None and state.get("tolerance") is not None:
            self.set_tolerance(float(state["tolerance"]))


def parse_names(name: str) -> list[str]:
    parts = [p.strip() for p in str(name).split("+")]
    require(all(parts), f"{KEY}.name", f"empty part in {name!r}; join registered names with '+'")
    for p in parts:
        CORRECTIONS.get(p)  # raises naming algorithm.correction.name
    require(len(set(parts)) == len(parts), f"{KEY}.name", f"a correction appears twice in {name!r}")
    if len(parts) > 1:
        parts = [p for p in parts if p != "none"]
    return parts


def _section(cfg: Any, key: str | None) -> Any:
    if key is None or cfg is None:
        return None
    if hasattr(cfg, "get") and not hasattr(cfg, "__dataclass_fields__"):
        return cfg.get(key)
    return getattr(cfg, key, None)


def resolve_tolerance(value: Any, measured: float | None = None, multiple: float = 1.0) -> float | None:
    """The tolerance c of `algorithm.correction.tolerance`: a number as given; `auto` = multiple x `measured` (the
    validate stage's mean |p_train - p_inf| for this precision), or None when nothing was measured yet; None gives
    the schema's default."""
    if value is None:
        return DEFAULT_TOLERANCE
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None if measured is None else float(multiple) * float(measured)
    try:
        c = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{KEY}.tolerance: must be a number >= 0 or auto, got {value!r}") from None
    require(c >= 0, f"{KEY}.tolerance", f"the mismatch tolerance c must be >= 0, got {c}")
    return c


def build_corrections(cfg: Any, policy_loss: str | None = None, topk_logprobs: int | None = None,
                      measured_discrepancy: float | None = None) -> CorrectionStack:
    """The CorrectionStack for `cfg` = the `algorithm.correction` config (DictConfig, dataclass or dict).

    `policy_loss` (algorithm.policy_loss) and `topk_logprobs` (rollout.topk_logprobs), when given, are
    checked against the corrections' needs; `measured_discrepancy` is what a validate report measured, for
    tolerance=auto. Every error is a ValueError naming the offending key."""
    import_modules(_section(cfg, "modules"))
    name = _section(cfg, "name") if cfg is not None else None
    name = "none" if name is None else name
    raw = _section(cfg, "tolerance")
    multiple = _section(cfg, "tolerance_multiple")
    multiple = 1.0 if multiple is None else float(multiple)
    tolerance = resolve_tolerance(raw, measured_discrepancy, multiple)
    auto = None
    if tolerance is None:
        steps = _section(cfg, "tolerance_steps")
        auto = AutoTolerance(multiple, 3 if steps is None else int(steps))
    corrections = []
    for n in parse_names(name):
        cls = CORRECTIONS.get(n)
        key = cls.config_key
        # a built-in correction's section is algorithm.correction.<key>; another's, algorithm.correction.external.<key>
        own = _section(cfg, key) if key in SECTIONS else _section(_section(cfg, EXTERNAL), key)
        corrections.append(cls(own, tolerance))
    weighted = [c.name for c in corrections if c.weights_tokens]
    require(len(weighted) <= 1, f"{KEY}.name",
            f"at most one importance-weight correction may be stacked, got {'+'.join(weighted)}")
    stack = CorrectionStack(corrections, tolerance, auto)
    stack.check(policy_loss, topk_logprobs)
    return stack
