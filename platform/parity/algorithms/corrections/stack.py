"""`build_corrections(cfg) -> CorrectionStack`: import the modules of corrections defined outside parity, parse
`algorithm.correction.name` ('a+b'), build each correction from its config section, check that they compose,
and run them as one."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from parity.algorithms.corrections.base import CORRECTIONS, KEY, Correction, require
from parity.types import RolloutBatch

STATE_VERSION = 1


class CorrectionStack:
    """The configured corrections, applied in the order named."""

    def __init__(self, corrections: list[Correction], tolerance: float = 0.0037) -> None:
        self.corrections = corrections
        self.tolerance = float(tolerance)

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
        return max((int(getattr(c, "top_k", 0)) for c in self.corrections if c.needs_topk), default=0)

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

    def end_step(self) -> dict[str, float]:
        """Update per-step state (e.g. lambda) and return the correction/* metrics of the step."""
        out: dict[str, float] = {}
        for c in self.corrections:
            out.update(c.end_step())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "names": self.names,
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


def import_modules(modules: Iterable[str] | None) -> None:
    """Import the modules of `algorithm.correction.modules`; each registers its corrections when first imported
    (a module imported before is not run again)."""
    for m in modules or ():
        try:
            importlib.import_module(str(m))
        except ImportError as e:
            raise ValueError(f"{KEY}.modules: cannot import {str(m)!r}: {e}") from e


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


def build_corrections(cfg: Any, policy_loss: str | None = None, topk_logprobs: int | None = None) -> CorrectionStack:
    """The CorrectionStack for `cfg` = the `algorithm.correction` config (DictConfig, dataclass or dict).

    `policy_loss` (algorithm.policy_loss) and `topk_logprobs` (rollout.topk_logprobs), when given, are
    checked against the corrections' needs. Every error is a ValueError naming the offending key."""
    import_modules(_section(cfg, "modules"))
    name = _section(cfg, "name") if cfg is not None else None
    name = "none" if name is None else name
    tolerance = _section(cfg, "tolerance")
    tolerance = 0.0037 if tolerance is None else float(tolerance)
    require(tolerance >= 0, f"{KEY}.tolerance", f"the mismatch tolerance c must be >= 0, got {tolerance}")
    corrections = []
    for n in parse_names(name):
        cls = CORRECTIONS.get(n)
        corrections.append(cls(_section(cfg, cls.config_key), tolerance))
    weighted = [c.name for c in corrections if type(c).weights is not Correction.weights]
    require(len(weighted) <= 1, f"{KEY}.name",
            f"at most one importance-weight correction may be stacked, got {'+'.join(weighted)}")
    stack = CorrectionStack(corrections, tolerance)
    stack.check(policy_loss, topk_logprobs)
    return stack
