"""A sweep's members: every arm once per seed, each with its override list and its run name. `python -m parity
study` (arms of a preset) and the Prefect sweep (flows/sweep.py: one arm per correction) both define their runs
here, so a member means the same thing whichever way the sweep is run.

A member's overrides are, in order: the overrides common to every member, the arm's own, then `trainer.seed=<s>`
(left out when the sweep gives no seeds: each member then runs with the config's seed). The run name is the
caller's (`run_name(arm, seed)`), since each keeps the names its finished runs are found under."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunSpec:
    name: str  # the run's folder under <outputs>/runs (trainer.run_name)
    arm: str
    seed: int | None  # None: no trainer.seed override
    overrides: tuple[str, ...]  # without trainer.run_name
    # what the arm varies, for tables and legends: source (bf16 | sigma=0.02 fixed | int8+int4kv ...), correction,
    # objective (grpo | reinforce_raw), optimizer
    labels: dict = field(default_factory=dict)

    def override_list(self) -> list[str]:
        """The member's overrides with its run name (`trainer.run_name`) last."""
        return [*self.overrides, f"trainer.run_name={self.name}"]


def correction_arm(correction: str) -> tuple[str, list[str]]:
    """The arm that sets only the correction (the Prefect sweep's arms)."""
    return correction, [f"algorithm.correction.name={correction}"]


def expand(arms: Iterable[tuple[str, Sequence[str]]], seeds: Sequence[int] | None, common: Sequence[str],
           run_name: Callable[[str, int | None], str],
           labels: Mapping[str, dict] | None = None, seed_overrides: Sequence[str] = (),
           arm_seeds: Mapping[str, Sequence[int]] | None = None) -> list[RunSpec]:
    """Every (arm name, arm overrides) once per seed, arm-major; once with seed None when `seeds` is empty.
    `seed_overrides` follow trainer.seed, "{seed}" replaced by the seed (e.g. the warm start's own seed);
    `arm_seeds` restricts an arm to those of `seeds` it names."""
    out = []
    for arm, overrides in arms:
        allowed = None if arm_seeds is None or arm not in arm_seeds else {int(x) for x in arm_seeds[arm]}
        for s in seeds or [None]:
            seed = None if s is None else int(s)
            if seed is not None and allowed is not None and seed not in allowed:
                continue
            tail = () if seed is None else (f"trainer.seed={seed}", *(o.format(seed=seed) for o in seed_overrides))
            out.append(RunSpec(run_name(arm, seed), arm, seed, (*common, *overrides, *tail),
                               dict((labels or {}).get(arm, {}))))
    return out
