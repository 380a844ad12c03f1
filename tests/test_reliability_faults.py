"""Reliability under faults, each through the real component: non-finite training steps through the
real loop, a full disk under a checkpoint write (a real RLIMIT_FSIZE in a forked child), an in-process trainer
SIGKILLed mid-run and resumed, the MLflow server stopped and restarted under a training run, the registry database
locked by another connection. docs/RELIABILITY.md maps every case to its test."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity.commands.train import train
from parity.training.checkpoint import CheckpointManager
from parity.training.loop import MetricsLog
from parity.training.trainer import NonFiniteError

# ---------------------------------------------------------------- NaN / inf in the loss


class PoisonHidden:
    """Multiplies the trainer's normed hidden states by NaN or inf on chosen loop steps (a real forward hook on
    every RMSNorm of the model, so the plain forward and the shared-prefix forward alike: the logits, the loss and
    every gradient become non-finite). The torch rollout engine runs its own forward without gradients, so only
    the update sees the poison. As a callback it learns which step comes next."""

    def __init__(self, steps: dict[int, float]) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.steps, self.next_step, self.poisoned = steps, 0, []
        self._cls = Qwen3RMSNorm
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if isinstance(module, self._cls) and torch.is_grad_enabled() and self.next_step in self.steps:
            if self.next_step not in self.poisoned:
                self.poisoned.append(self.next_step)
            return output * self.steps[self.next_step]
        return output

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.next_step = step  # row `step` is written after loop step step-1: the next loop step is `step`

    def remove(self) -> None:
        self._handle.remove()


def test_nonfinite_steps_are_skipped_counted_alarmed_and_three_in_a_row_stop(quick_cfg, prepared_model, caplog):
    # dual: its lambda is state that a NaN step must not poison
    over = ["algorithm.correction.name=dual", "trainer.total_steps=7", "trainer.keep_checkpoints=3"]
    poison = PoisonHidden({1: math.nan, 3: math.inf, 4: math.nan, 5: -math.inf})
    try:
        with caplog.at_level(logging.WARNING, logger="parity.training.trainer"), \
                pytest.raises(NonFiniteError, match=r"3 consecutive .*trainer\.max_bad_steps`=3"):
            train(quick_cfg("trainer.run_name=nan", *over), callbacks=[poison])
    finally:
        poison.remove()
    assert poison.poisoned == [1, 3, 4, 5]
    run = Path(quick_cfg("trainer.run_name=nan").outputs_dir) / "runs" / "nan"
    rows = MetricsLog(run / "metrics.jsonl").read()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # the failing step wrote nothing
    assert [r["train/skipped_in_step"] for r in rows[1:]] == [0, 1, 0, 1, 1]
    assert [r["train/skipped_steps"] for r in rows[1:]] == [0, 1, 1, 2, 3]
    assert [r["train/bad_steps_in_a_row"] for r in rows[1:]] == [0, 1, 0, 1, 2]
    assert [r["train/optimizer_steps"] for r in rows[1:]] == [1, 0, 1, 0, 0]
    assert math.isnan(rows[2]["train/loss"]) and math.isfinite(rows[3]["train/loss"])
    assert all(math.isfinite(r["correction/lambda_next"]) for r in rows[1:])  # lambda survived the NaN step
    alarms = [r for r in caplog.records if "optimizer step skipped" in r.getMessage()]
    assert [r.levelno for r in alarms] == [logging.WARNING] * 3
    # earlier checkpoints intact: skipped steps left the weights alone, the latest one resumes
    ck = CheckpointManager(run, keep=3)
    assert [CheckpointManager.step_of(p) for p in ck.list()] == [3, 4, 5] and ck.latest_valid() == ck.path(5)
    w = [load_file(str(p / "model.safetensors")) for p in ck.list()]
    assert all(torch.equal(w[0][k], w[i][k]) for k in w[0] for i in (1, 2))
    resumed = train(quick_cfg("trainer.run_name=nan", *over, "trainer.total_steps=6", "trainer.resume=true"))
    assert resumed["start_step"] == 5
    rows = MetricsLog(run / "metrics.jsonl").read()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert rows[6]["train/optimizer_steps"] == 1 and rows[6]["train/bad_steps_in_a_row"] == 0


# ---------------------------------------------------------------- disk full under a checkpoint write

def _save_under_file_size_limit(run_dir, model, tok, state, limit: int, conn) -> None:
    """In a forked child: the kernel refuses file data past `limit` bytes (RLIMIT_FSIZE, with SIGXFSZ ignored
    the write fails with EFBIG), as a full disk refuses it; then try to write checkpoint 2."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        CheckpointManager(run_dir, keep=3).save(2, model, tok, state)
        conn.send(None)
    except BaseException as e:
        conn.send(f"{type(e).__name__}: {e}")


def test_disk_full_during_checkpoint_write_keeps_the_previous_one(prepared_model, tmp_path):
    import multiprocessing as mp

    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    model = AutoModelForCausalLM.from_pretrained(str(prepared_model), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    m = CheckpointManager(run, keep=3)
    size = (m.save(1, model, tok, {"step": 1}) / "model.safetensors").stat().st_size
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # checkpoint 2 would hold other weights
    state = {"step": 2, "optimizer": torch.zeros((size + (2 << 20)) // 4)}  # a state.pt bigger than the model
    ctx, errors = mp.get_context("fork"), []
    for limit in (size // 4, size + (1 << 20)):  # fails inside model.safetensors; inside state.pt after the model
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_save_under_file_size_limit, args=(run, model, tok, state, limit, send))
        child.start()
        errors.append(recv.recv() if recv.poll(120) else "no answer")
        child.join(60)
        assert child.exitcode == 0
    assert all(e and e.startswith("CheckpointWriteError: could not write checkpoint") and "step_000002" in e
               and "earlier checkpoints (step_000001) are intact" in e for e in errors), errors  # both failed
    assert "File too large" in errors[0]  # EFBIG from the kernel, inside model.safetensors
    assert m.list() == [m.path(1)] and m.latest_valid() == m.path(1)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]  # no temporary folder left
    loaded = AutoModelForCausalLM.from_pretrained(str(m.path(1)), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(prepared_model), dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ref.state_dict().values()))
    assert torch.load(m.path(1) / "state.pt", weights_only=False)["step"] == 1


# ---------------------------------------------------------------- the trainer SIGKILLed mid-run, then resumed


def _non_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "faults/"))} for r in rows]


def test_trainer_sigkilled_mid_checkpoint_write_resumes_to_the_uninterrupted_result(quick_cfg, prepared_model,
                                                                                  outputs_dir):
    """`python -m parity train` (the in-process loop) is SIGKILLed while it writes checkpoint 2 (or, if that
    write is missed, right after it); rerunning with trainer.resume=true ends exactly like an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import QUICK, REPO

    steps = ["trainer.total_steps=3", "trainer.keep_checkpoints=3"]
    ckdir = outputs_dir / "runs" / "sigkill" / "checkpoints"
    # one thread here and in the child: the runs are compared bit for bit (reduction order depends on threads)
    threads = torch.get_num_threads()
    proc = subprocess.Popen([sys.executable, "-m", "parity", "train", f"outputs_dir={outputs_dir}", *QUICK, *steps,
                             "trainer.run_name=sigkill"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    mid_write = False
    try:
        deadline = time.monotonic() + 600
        while True:
            names = {e.name for e in os.scandir(ckdir)} if ckdir.is_dir() else set()
            if any(n.startswith(".tmp_step_000002") for n in names) or "step_000002" in names:
                os.killpg(proc.pid, signal.SIGKILL)
                mid_write = "step_000002" not in names
                break
            assert proc.poll() is None, f"train exited with {proc.returncode} before checkpoint 2"
            assert time.monotonic() < deadline
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    print(f"SIGKILL landed {'inside the write of' if mid_write else 'after'} checkpoint 2")
    run = ckdir.parent
    assert not (run / "summary.json").exists()
    torch.set_num_threads(threads)

    def train_in_child(*overrides: str) -> dict:
        # a child like the killed one: one thread, and none of the torch state this test process may carry
        # (vLLM's CPU worker, loaded by earlier tests, refuses torch.set_num_threads here)
        done = subprocess.run([sys.executable, "-m", "parity", "train", f"outputs_dir={outputs_dir}", *QUICK, *steps,
                               *overrides], cwd=REPO, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    resumed = train_in_child("trainer.run_name=sigkill", "trainer.resume=true")
    whole = train_in_child("trainer.run_name=sigkill-ref")
    assert resumed["start_step"] == (1 if mid_write else 2), mid_write
    assert not list(ckdir.glob(".tmp_step_*"))  # the killed writer's half checkpoint is gone
    rows, ref = MetricsLog(run / "metrics.jsonl").read(), MetricsLog(Path(whole["run_dir"]) / "metrics.jsonl").read()
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # every step once
    assert _non_perf(rows) == _non_perf(ref)
    a = load_file(f"{resumed['latest_checkpoint']}/model.safetensors")
    b = load_file(f"{whole['latest_checkpoint']}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_corrupt_latest_checkpoint_is_detected_and_resume_falls_back_to_the_previous(quick_cfg, prepared_model,
                                                                                     caplog):
    steps = ["trainer.total_steps=3", "trainer.keep_checkpoints=3"]
    first = train(quick_cfg("trainer.run_name=corrupt", *steps))
    run = Path(first["run_dir"])
    before = MetricsLog(run / "metrics.jsonl").read()
    weights = run / "checkpoints" / "step_000003" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the tensor data: the file still loads, wrongly
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="parity.training.checkpoint"):
        resumed = train(quick_cfg("trainer.run_name=corrupt", *steps, "trainer.total_steps=4", "trainer.resume=true"))
    assert resumed["start_step"] == 2
    assert "step_000003 is corrupt (model.safetensors checksum mismatch); falling back" in caplog.text
    rows = MetricsLog(run / "metrics.jsonl").read()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # step 3 redone once, not twice
    assert _non_perf(rows[:4]) == _non_perf(before)  # and redone exactly
    assert CheckpointManager(run).verify(run / "checkpoints" / "step_000003") is None  # rewritten intact


# ---------------------------------------------------------------- the MLflow server down for a while


class Outage:
    """Stops the tracking server before step `down` is logged and starts it again before step `up`."""

    def __init__(self, server, down: int, up: int) -> None:
        self.server, self.down, self.up, self.seen = server, down, up, []

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.seen.append(step)
        if step == self.down:
            self.server.stop()
        if step == self.up:
            self.server.start()


def test_training_goes_on_while_mlflow_is_down_and_every_step_arrives_once(quick_cfg, prepared_model, mlflow_store,
                                                                          tmp_path, caplog):
    import time

    from parity.tracking import mlflow_log
    from parity.tracking.mlflow_log import MlflowCallback
    from tests.test_tracking_mlflow import MlflowServer

    server = MlflowServer(mlflow_store, str(tmp_path / "artifacts"))
    server.start()
    try:
        c = mlflow_log.client(server.uri)
        run_id = mlflow_log.start_run(c, mlflow_log.experiment_id(c, "outage-train"), "train")
        outage, cb = Outage(server, down=1, up=4), MlflowCallback(server.uri, run_id, retry_after_s=0.0)
        slowest = []

        class Timed:
            def on_step(self, step, metrics):
                t0 = time.monotonic()
                cb.on_step(step, metrics)
                slowest.append(time.monotonic() - t0)

        with caplog.at_level(logging.WARNING, logger="parity.tracking.mlflow_log"):
            summary = train(quick_cfg("trainer.run_name=mlflow-outage", "trainer.total_steps=5"),
                            callbacks=[outage, Timed()])
        assert summary["steps"] == 5 and outage.seen == [0, 1, 2, 3, 4, 5]
        assert max(slowest) < 3.0  # a down store costs a refused connect, not MLflow's minutes of retries
        assert cb.close(wait_s=10.0) and cb.buffer == [] and cb.outages == 1 and cb.dropped == 0
        hist = c.get_metric_history(run_id, "reward/mean")
        assert sorted(m.step for m in hist) == [1, 2, 3, 4, 5]  # steps 1-3 were buffered, none lost or doubled
        rows = MetricsLog(Path(summary["run_dir"]) / "metrics.jsonl").read()
        assert {m.step: m.value for m in hist} == {r["step"]: pytest.approx(r["reward/mean"]) for r in rows[1:]}
        assert [m.step for m in c.get_metric_history(run_id, "eval/accuracy")] == [0]
        text = caplog.text
        assert "MLflow logging paused" in text and "buffered metrics written" in text
    finally:
        server.stop()


# ---------------------------------------------------------------- the registry database locked


def test_locked_registry_fails_that_write_clearly_and_writes_nothing_half(tmp_path):
    import sqlite3
    import time

    from parity.tracking.registry import Registry, RegistryError

    db = tmp_path / "registry.db"
    url = f"sqlite:///{db}"
    with Registry(url, busy_timeout_s=1.0) as reg:
        pid = reg.start_pipeline("train-and-eval")
        reg.end_stage(reg.start_stage(pid, "train"), "completed", {"steps": 3})
        samples = [{"problem_id": f"p{i}", "sample": 0, "score": 1.0} for i in range(500)]
        locker = sqlite3.connect(db, isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        try:
            t0 = time.monotonic()
            with pytest.raises(RegistryError) as e:
                reg.add_evaluation("aime24", 1, 500, {"avg@k": 1.0}, samples, pipeline_id=pid)
            assert time.monotonic() - t0 < 10  # waited for the lock (busy timeout 1 s), then gave up
            assert str(e.value) == f"registry {url}: add_evaluation failed: database is locked"
            assert reg.pipeline(pid)["stages"][0]["result"] == {"steps": 3}  # WAL: reads go on under the lock
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert reg.count("evaluation_results") == 0 and reg.count("evaluation_samples") == 0  # nothing half
        rid = reg.add_evaluation("aime24", 1, 500, {"avg@k": 1.0}, samples, pipeline_id=pid)  # lock gone: it works
        assert reg.count("evaluation_samples") == 500 and reg.evaluation(rid)["problems"] == 500
