"""A distributed run whose driver is SIGKILLed after a checkpoint, resumed by rerunning the same command with
trainer.resume=true, ends like an uninterrupted run: the same steps once each, the same metrics, the same
weights (the run is deterministic: per-row sampling seeds, one thread per actor). The drivers are real
`python -m parity train` subprocesses joining this module's local Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from parity.distributed.cluster import ray_session  # noqa: E402
from parity.training.loop import MetricsLog  # noqa: E402
from tests.conftest import QUICK, REPO  # noqa: E402

DIST = ["algorithm.correction.name=dual", "distributed.enabled=true", "distributed.num_rollout_workers=2",
        "distributed.rollout_cpus=1", "distributed.trainer_cpus=1", "distributed.num_cpus=4",
        "trainer.total_steps=4", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=2", "trainer.eval_every=2"]


@pytest.fixture(scope="module")
def cluster(quick_cfg, prepared_model):
    with ray_session(quick_cfg(*DIST).distributed) as info:
        yield info


def _cmd(outputs_dir: Path, address: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "parity", "train", f"outputs_dir={outputs_dir}", *QUICK, *DIST,
            f"distributed.address={address}", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kill_after_checkpoint(cmd: list[str], ckpt: Path) -> int:
    """Start the driver, SIGKILL it (and its process group: grader workers) once `ckpt` is complete."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=REPO,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (ckpt / "MANIFEST.json").is_file():
            assert proc.poll() is None, f"driver exited with {proc.returncode} before {ckpt.name} was written"
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode


def _non_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "faults/"))} for r in rows]


def test_killed_driver_resumes_to_the_uninterrupted_result(cluster, outputs_dir: Path) -> None:
    address = cluster["address"]
    whole = _run(_cmd(outputs_dir, address, "trainer.run_name=whole"))

    run_dir = outputs_dir / "runs" / "killed"
    rc = _kill_after_checkpoint(_cmd(outputs_dir, address, "trainer.run_name=killed"),
                                run_dir / "checkpoints" / "step_000002")
    assert rc == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()  # it really died mid-run
    assert len(MetricsLog(run_dir / "metrics.jsonl").read()) < 5
    resumed = _run(_cmd(outputs_dir, address, "trainer.run_name=killed", "trainer.resume=true"))
    assert resumed["start_step"] >= 2

    rows, ref = MetricsLog(run_dir / "metrics.jsonl").read(), MetricsLog(Path(whole["run_dir"]) / "metrics.jsonl").read()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # no step missing, none twice
    assert _non_perf(rows) == _non_perf(ref)
    assert rows[4]["correction/lambda"] != rows[1]["correction/lambda"]  # correction state moved and was restored
    a, b = load_file(f"{resumed['latest_checkpoint']}/model.safetensors"), load_file(f"{whole['latest_checkpoint']}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state_a = torch.load(Path(resumed["latest_checkpoint"]) / "state.pt", weights_only=False)
    state_b = torch.load(Path(whole["latest_checkpoint"]) / "state.pt", weights_only=False)
    assert state_a["data"] == state_b["data"] and state_a["trainer"]["corrections"] == state_b["trainer"]["corrections"]
