"""The collapse alarm: a run has collapsed once its sampled reward stays below `fraction` of its running peak
for `patience` consecutive steps (trainer.collapse). From the step it fires on, every step's metrics carry
`train/collapsed` = 1 (0 before), and the run summary records `collapse_step`. The alarm's state is a pure
function of the reward series, so a resumed run rebuilds it from its metrics log."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig


class CollapseAlarm:
    def __init__(self, fraction: float = 0.5, patience: int = 10) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"config key `trainer.collapse.fraction`: must be in (0, 1], got {fraction}")
        if patience < 1:
            raise ValueError(f"config key `trainer.collapse.patience`: must be >= 1, got {patience}")
        self.fraction, self.patience = float(fraction), int(patience)
        self.peak = float("-inf")
        self.below = 0  # consecutive steps below fraction x peak
        self.fired_at: int | None = None

    @classmethod
    def from_config(cls, cfg: ParityConfig) -> CollapseAlarm:
        c = cfg.trainer.collapse
        return cls(float(c.fraction), int(c.patience))

    def update(self, step: int, reward: float) -> float:
        """Take step `step`'s mean sampled reward; return its train/collapsed value (1.0 once fired)."""
        if self.fired_at is None:
            low = self.peak > 0 and reward < self.fraction * self.peak
            self.below = self.below + 1 if low else 0
            self.peak = max(self.peak, reward)
            if self.below >= self.patience:
                self.fired_at = step
        return 0.0 if self.fired_at is None else 1.0

    def replay(self, rows: list[dict]) -> None:
        """Rebuild the state from a metrics log (rows with `step` and `reward/mean`), e.g. on resume."""
        for r in rows:
            if "reward/mean" in r:
                self.update(int(r["step"]), float(r["reward/mean"]))
