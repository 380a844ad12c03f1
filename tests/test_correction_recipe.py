"""docs/ADD_A_CORRECTION.md, followed from this file alone: a correction registered here (its config dataclass
beside it, one registration) is selectable by name, its section is `algorithm.correction.external.drop_rare` (a typo
or a wrong type in it fails at load naming the key), and it trains two steps in-process and over Ray, where the
trainer actor imports this module through `algorithm.correction.modules`; both runs log the same metrics. Its
state (the tokens dropped over the run) is summed over the step with `step_sums`, so a trainer sharded over two
gloo ranks counts what the single-process one counts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from parity.algorithms.corrections import CORRECTIONS, Correction, CorrectionContext
from parity.algorithms.corrections.base import require
from parity.algorithms.mismatch import StepMetrics

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the Ray actors run one OpenMP thread each


@dataclass
class DropRareConfig:
    min_prob: float = 0.0  # tokens the rollout sampled with p_inf below this are dropped from the loss


@CORRECTIONS.register("drop_rare", config=DropRareConfig)
class DropRare(Correction):
    """Drop tokens that the rollout engine sampled with a probability below `min_prob`."""

    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        super().__init__(cfg, tolerance)
        require(0.0 <= self.cfg.min_prob < 1.0, self.key("min_prob"), f"must be in [0, 1), got {self.cfg.min_prob}")
        self.dropped_total = 0.0  # state: tokens dropped over the run (checkpointed)
        self._dropped = 0.0  # this step's, summed over its micro-batches (and, sharded, over the ranks)

    def _kept(self, ctx: CorrectionContext) -> torch.Tensor:
        return ctx.rollout_logprobs.exp() >= self.cfg.min_prob

    def keep_mask(self, ctx: CorrectionContext) -> torch.Tensor:
        return self._kept(ctx) & ctx.mask

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        metrics.add_masked_mean("correction/drop_rare_frac", (~self._kept(ctx)).float(), ctx.mask)
        self._dropped += float((~self._kept(ctx) & ctx.mask).sum())

    def step_sums(self) -> dict[str, float]:
        return {"dropped": self._dropped}

    def set_step_sums(self, sums: dict[str, float]) -> None:
        self._dropped = float(sums["dropped"])

    def end_step(self) -> dict[str, float]:
        self.dropped_total += self._dropped
        self._dropped = 0.0
        return {"correction/drop_rare_total": self.dropped_total}

    def state_dict(self) -> dict[str, Any]:
        return {"dropped_total": self.dropped_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dropped_total = float(state["dropped_total"])


MIN_PROB = 0.2
RECIPE = ["algorithm.correction.name=drop_rare", f"algorithm.correction.external.drop_rare.min_prob={MIN_PROB}",
          f"algorithm.correction.modules=[{__name__}]", "trainer.checkpoint_every=0"]


def _rows(run_dir: str) -> list[dict]:
    from parity.training.loop import MetricsLog
    return MetricsLog(Path(run_dir) / "metrics.jsonl").read()


def _non_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "faults/", "data/"))} for r in rows]


def test_the_section_is_in_the_schema_and_checked(quick_cfg) -> None:
    from hydra.errors import ConfigCompositionException

    from parity.algorithm_config import section_class
    from parity.config import ConfigError

    assert CORRECTIONS.get("drop_rare") is DropRare and DropRare.config_key == "drop_rare"
    assert section_class("algorithm.correction.external.drop_rare") is DropRareConfig  # its registration declared it
    cfg = quick_cfg(*RECIPE)
    assert cfg.algorithm.correction.external == {"drop_rare": {"min_prob": MIN_PROB}}
    for bad, key in [("algorithm.correction.external.drop_rare.min_probb=0.1", "min_probb"),
                     ("algorithm.correction.external.drop_rare.min_prob=often", "min_prob")]:
        with pytest.raises((ConfigCompositionException, ConfigError)) as e:  # an unknown key, or a wrong type
            quick_cfg(*RECIPE, bad)
        assert key in f"{e.value} {e.value.__cause__}"
    with pytest.raises(ConfigError, match=r"algorithm\.correction\.external\.drop_rare\.min_prob: must be in \[0, 1\)"):
        quick_cfg(*RECIPE, "algorithm.correction.external.drop_rare.min_prob=1.5")
    with pytest.raises(ConfigError, match=r"algorithm\.correction\.modules: cannot import 'no_such_module'"):
        quick_cfg("algorithm.correction.modules=[no_such_module]")


def test_it_trains_in_process_and_over_ray(quick_cfg, prepared_model, monkeypatch) -> None:
    pytest.importorskip("ray")
    from parity.commands.train import train

    local = train(quick_cfg(*RECIPE, "trainer.run_name=recipe-local"))
    rows = _rows(local["run_dir"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    dropped = [r["correction/drop_rare_frac"] for r in rows[1:]]
    assert all(0.0 < d < 1.0 for d in dropped)  # it ran, and min_prob reached it: some tokens dropped, not all
    # the objective counts the tokens the correction drops among those masked out of the loss
    assert all(r["correction/masked_frac"] >= r["correction/drop_rare_frac"] for r in rows[1:])

    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{__import__('os').environ.get('PYTHONPATH', '')}".rstrip(":"))
    dist = train(quick_cfg(*RECIPE, "trainer.run_name=recipe-ray", "distributed.enabled=true",
                           "distributed.num_rollout_workers=1", "distributed.rollout_cpus=1",
                           "distributed.trainer_cpus=1", "distributed.num_cpus=2"))
    got, want = _non_perf(_rows(dist["run_dir"])), _non_perf(rows)
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    # mismatch statistics of ~1e-8 are float noise of two processes' reductions; everything else is exact
    assert got == [pytest.approx(r, rel=1e-6, abs=1e-6) for r in want]


def test_it_trains_sharded_over_two_gloo_ranks(quick_cfg, prepared_model, tmp_path) -> None:
    """One step of the trainer sharded over two gloo ranks (rank 1 imports this module through
    algorithm.correction.modules): the same step metrics and correction state as the single-process trainer; the
    rows split 5 / 4 over the ranks, so a count left rank-local would differ."""
    from tests.test_distributed_fsdp import BASE, _make_batch, _metrics_close, _single, two_gloo_ranks

    cfg = quick_cfg(*BASE, *RECIPE, "algorithm.loss_agg_mode=token-mean", "trainer.micro_batch_size=2")
    batch = _make_batch(cfg, prepared_model)
    got, _ = two_gloo_ranks({"recipe": cfg}, prepared_model, batch, tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, (want,), _ = _single(cfg, prepared_model, batch)
    finally:
        torch.set_num_threads(before)
    sharded = got["recipe"]
    _metrics_close(sharded["metrics"], want, "recipe sharded")
    total = want["correction/drop_rare_total"]
    assert total > 0 and sharded["metrics"]["correction/drop_rare_total"] == total  # token counts: exact
    assert sharded["state"]["corrections"]["corrections"]["drop_rare"] == {"dropped_total": total}
    assert ref.state_dict()["corrections"]["corrections"]["drop_rare"] == {"dropped_total": total}
