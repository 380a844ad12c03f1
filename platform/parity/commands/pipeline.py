"""`python -m parity pipeline [overrides]`: the whole train-and-eval flow in this process. The stages are
quantize -> validate -> train -> evaluate -> register, with the same overrides a deployment run takes.

Without PREFECT_API_URL, Prefect starts a temporary local server for the run (its home under
<outputs>/prefect); with it (e.g. after `make run`) the flow run appears in that server's UI.
For scheduled and on-demand runs use the deployments: `prefect deployment run train-and-eval/local`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from parity.config_tree import repo_root

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

GROUPS = ["experiment", "model", "rollout", "precision", "algorithm", "eval"]
KEYS = [
    "trainer.total_steps, algorithm.correction.name: as for train",
    "tracking.tracking_uri, tracking.registry_url: where the run is recorded (MLflow, registry DB)",
]
EXAMPLES = [
    "python -m parity pipeline trainer.total_steps=10",
    "python -m parity pipeline +precision=w8a8_int8 algorithm.correction.name=tis",
]


def _overrides() -> list[str]:
    """The override strings this command was called with (the flow composes the config itself)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except ValueError:  # called outside a Hydra app (tests): no overrides to forward
        return []


def run(cfg: ParityConfig) -> dict:
    os.environ.setdefault("PREFECT_HOME", str(Path(str(cfg.outputs_dir)).resolve() / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if str(repo_root()) not in sys.path:  # flows/ and tasks/ live beside platform/, not in the package
        sys.path.insert(0, str(repo_root()))
    from flows.train_and_eval import train_and_eval

    return {"command": "pipeline", **train_and_eval(overrides=_overrides())}
