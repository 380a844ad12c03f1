"""Reliability and security (issue 14): faults, bad inputs and attacks, each through the real component.

Faults: non-finite training steps through the real loop, a full disk under a checkpoint write (a real
RLIMIT_FSIZE in a forked child), an in-process trainer SIGKILLed mid-run and resumed, the MLflow server
stopped and restarted under a training run, the registry database locked by another connection.
Bad inputs: datasets through the train command, grader attacks, configs. Security: services on
127.0.0.1, a dashboard without a write path, names that cannot leave outputs/, SQL as bound parameters,
no eval/exec anywhere, secrets kept out of logs, MLflow params and the dashboard.
docs/RELIABILITY.md maps every case to its test."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity.training.checkpoint import CheckpointManager
from parity.training.loop import MetricsLog, train
from parity.training.trainer import NonFiniteError

# ---------------------------------------------------------------- NaN / inf in the loss


class PoisonHidden:
    """Multiplies the trainer's hidden states by NaN or inf on chosen loop steps (a real forward hook on the
    model: the logits, the loss and every gradient become non-finite). The torch rollout engine runs its own
    forward, so only the update sees the poison. As a callback it learns which step comes next."""

    def __init__(self, steps: dict[int, float]) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

        self.steps, self.next_step, self.poisoned = steps, 0, []
        self._cls = Qwen3Model
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if isinstance(module, self._cls) and torch.is_grad_enabled() and self.next_step in self.steps:
            if self.next_step not in self.poisoned:
                self.poisoned.append(self.next_step)
            output.last_hidden_state = output.last_hidden_state * self.steps[self.next_step]
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


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> str:
    """One MLflow SQLite store for this module's tests (a new store runs MLflow's migrations: seconds)."""
    from parity.tracking import mlflow_log

    uri = f"sqlite:///{tmp_path_factory.mktemp('reliability-mlflow')}/mlflow.db"
    mlflow_log.experiment_id(mlflow_log.client(uri), "reliability", mlflow_log.default_artifact_dir(uri))
    return uri


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


# ---------------------------------------------------------------- bad inputs: datasets, grader attacks, configs


def _jsonl(rows: list[bytes]) -> bytes:
    return b"\n".join(rows) + b"\n"


@pytest.mark.parametrize(("content", "match"), [
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"problem": "2+2", "answer": ']), r"row 2 is not valid JSON"),
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"question": "2+2", "answer": "4"}']),
     r"row 2 has no string field `problem`"),
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"problem": "2+2"}']), r"row 2 has no answer in field `answer`"),
    (_jsonl([b'{"problem": "1+1", "answer": "2"}', b'{"problem": "\xff\xfe2", "answer": "4"}']),
     r"row 2 is not valid UTF-8"),
    (_jsonl([b'["1+1", "2"]']), r"row 1 is not a JSON object"),
    (b"\n  \n", r"dataset is empty"),
], ids=["malformed", "missing_problem", "missing_answer", "non_utf8", "not_an_object", "empty"])
def test_bad_training_dataset_is_one_clear_error_naming_file_and_row(quick_cfg, prepared_model, tmp_path, content,
                                                                     match):
    from parity.errors import DataError

    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match) as e:
        train(quick_cfg("trainer.run_name=bad-data", "data.name=jsonl", f"data.path={path}"))
    assert str(e.value).startswith(f"{path}: ")
    run = Path(quick_cfg().outputs_dir) / "runs" / "bad-data"
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()  # failed before step 0


ATTACKS = {  # boxed answers a policy can emit: each must score 0 within the per-item budget, none may hang
    "deep_parentheses": "\\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}",
    "deep_left_right": "\\boxed{" + "\\left(" * 290 + "1" + "\\right)" * 290 + "}",
    "deep_abs": "\\boxed{" + "|" * 2000 + "5" + "|" * 2000 + "}",
    "exponent_tower": "\\boxed{" + "2^{" * 800 + "2" + "}" * 800 + "}",
    "huge_factorial": "\\boxed{(10^{10})!}",
    "huge_float_exponent": "\\boxed{1e999999999}",
    "million_digits": "\\boxed{" + "9" * 1_000_000 + "}",
    "megabyte_of_braces": "\\boxed{" + "{" * 500_000 + "}" * 500_000 + "}",
    "hundred_thousand_boxes": "\\boxed{1}" * 100_000,
    "big_matrix": "\\boxed{\\begin{pmatrix}" + "\\\\".join(["&".join(["x"] * 60)] * 60) + "\\end{pmatrix}}",
}


def test_grader_attacks_score_zero_within_the_timeout_and_run_no_code(tmp_path):
    import os
    import time

    from parity.rewards.grader import GraderPool

    timeout, grace = 2.0, 0.5
    marker = tmp_path / "pwned"
    code = {  # model output that is Python: graded as math, never run
        "import_os": f"\\boxed{{__import__('os').system('touch {marker}')}}",
        "exec": f"\\boxed{{exec(\"open('{marker}', 'w')\")}}",
        "eval_open": f"\\boxed{{eval(\"open('{marker}', 'w')\")}}",
        "sympy_lambda": f"\\boxed{{Lambda(x, __import__('os').system('touch {marker}'))(1)}}",
        "dunder_walk": "\\boxed{().__class__.__bases__[0].__subclasses__()}",
        "plain_text": f"__import__('os').system('touch {marker}') so \\boxed{{4}}",
    }
    items = {**ATTACKS, **code}
    with GraderPool(workers=2, timeout_s=timeout, kill_grace_s=grace) as pool:
        pool.wait_ready()
        t0 = time.monotonic()
        res = pool.grade_detailed(list(items.values()) + ["\\boxed{5}"], ["5"] * (len(items) + 1))
        elapsed = time.monotonic() - t0
    status = {n: r.status for n, r in zip(items, res)}
    assert [r.score for r in res] == [0.0] * len(items) + [1.0], status  # the control item still grades right
    assert status["exponent_tower"] == status["huge_factorial"] == "timeout", status
    assert status["million_digits"] == status["megabyte_of_braces"] == "too_long", status
    slow = sum(r.status == "timeout" for r in res)
    assert elapsed < (slow / 2 + 2) * (timeout + grace) + 5.0, (elapsed, status)  # 2 workers, bounded items
    assert not marker.exists() and not os.path.exists("pwned")


@pytest.mark.parametrize(("overrides", "key"), [
    (["trainer.lr=fast"], "trainer.lr"),  # wrong types
    (["trainer.total_steps=1.5"], "trainer.total_steps"),
    (["rollout.n=[4]"], "rollout.n"),
    (["trainer.resume=perhaps"], "trainer.resume"),
    (["trainer.lr=-1e-4"], "trainer.lr"),  # out of range
    (["trainer.lr=0"], "trainer.lr"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["rollout.top_p=1.5"], "rollout.top_p"),
    (["trainer.max_bad_steps=0"], "trainer.max_bad_steps"),
    (["model.tiny.vocab_size=99", "rollout.topk_logprobs=128"], "rollout.topk_logprobs"),  # top-K above vocab
    (["rollout.topk_logprobs=-1"], "rollout.topk_logprobs"),
    (["algorithm.correction.name=score_centering", "algorithm.policy_loss=ppo_clip", "rollout.topk_logprobs=8"],
     "algorithm.policy_loss"),  # conflicting options
    (["algorithm.correction.name=score_centering", "algorithm.policy_loss=reinforce", "rollout.topk_logprobs=0"],
     "rollout.topk_logprobs"),
    (["algorithm.correction.name=tis+icepop"], "algorithm.correction.name"),
    (["algorithm.routing_replay=true"], "algorithm.routing_replay"),
    (["algorithm.correction.name=nope"], "algorithm.correction.name"),
    (["trainer.nope=1"], "nope"),  # unknown key
])
def test_bad_config_is_one_clear_error_naming_the_key(overrides, key):
    from hydra.errors import ConfigCompositionException

    from parity.config import ConfigError, load_config

    with pytest.raises((ConfigCompositionException, ConfigError)) as e:
        load_config(overrides)
    msg = f"{e.value} {e.value.__cause__ or ''}"
    assert key in msg, msg


# ---------------------------------------------------------------- security: services, dashboard, paths, SQL, eval, secrets

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    import psutil

    return sorted({(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN and c.pid in pids})


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _make_recipe(target: str) -> str:
    import subprocess

    from tests.conftest import REPO

    out = subprocess.run(["make", "-n", "-s", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_local_services_listen_on_loopback_only(quick_cfg, tmp_path):
    """What this project starts on a machine (a local Ray, the dashboard, the MLflow UI, the Prefect server)
    listens on 127.0.0.1; the compose file publishes on PARITY_BIND_ADDRESS (tests/test_docker_compose.py)."""
    import inspect
    import os
    import shlex
    import socket
    import subprocess
    import time

    import ray

    from parity.distributed.cluster import ray_session
    from scripts import run_local
    from tests.conftest import REPO

    # a local Ray as `distributed.enabled=true` starts it, with an actor (a worker process) running
    dcfg = quick_cfg("distributed.enabled=true", "distributed.num_rollout_workers=1", "distributed.num_cpus=1").distributed
    # listeners this test process already had (servers of earlier tests in the same session) are not Ray's
    before = set(_listening(_tree(os.getpid())))
    with ray_session(dcfg) as info:
        assert info["started"]

        @ray.remote(num_cpus=0)
        class Probe:
            def pid(self) -> int:
                return os.getpid()

        probe = Probe.remote()
        assert ray.get(probe.pid.remote()) in _tree(os.getpid())
        ray_socks = [x for x in _listening(_tree(os.getpid())) if x not in before]
        ray.kill(probe)
    assert len({pid for _, _, pid in ray_socks}) >= 3, ray_socks  # GCS, raylet, agents, the actor: really seen
    assert {ip for ip, _, _ in ray_socks} <= LOOPBACK, ray_socks
    assert info["address"].startswith("127.0.0.1:")

    # the dashboard, started with `make dashboard`'s own command line
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = shlex.split(_make_recipe("dashboard")) + ["--server.port", str(port)]
    assert "--server.address" in cmd and cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    env = {**os.environ, "PARITY_OUTPUTS": str(tmp_path), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline, socks = time.monotonic() + 120, []
        while not any(p == port for _, p, _ in socks):
            assert proc.poll() is None, "the dashboard exited"
            assert time.monotonic() < deadline, "the dashboard did not listen within 120 s"
            time.sleep(0.25)
            socks = _listening(_tree(proc.pid))
        assert {ip for ip, _, _ in socks} <= LOOPBACK, socks
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)

    # the MLflow UI and the Prefect server of `make run`: their command lines bind 127.0.0.1
    ui = shlex.split(_make_recipe("mlflow-ui"))
    assert ui[ui.index("--host") + 1] == "127.0.0.1"
    src = inspect.getsource(run_local.start_server)
    assert '"--host", "127.0.0.1"' in src and run_local.prefect_env(tmp_path)["PREFECT_SERVER_API_HOST"] == "127.0.0.1"


WRITE_CALLS = {  # MLflow / registry / filesystem writes: none may appear in the dashboard's code
    "log_metric", "log_param", "log_params", "log_metrics", "log_batch", "log_artifact", "log_artifacts", "set_tag",
    "set_terminated", "create_run", "create_experiment", "delete_run", "delete_experiment", "update_run",
    "create_registered_model", "create_model_version", "transition_model_version_stage", "delete_tag",
    "start_pipeline", "finish_pipeline", "start_stage", "end_stage", "add_artifact", "add_evaluation",
    "set_baseline", "add_regression_check", "set_mlflow_model_version", "set_pipeline_mlflow_run",
    "write_text", "write_bytes", "mkdir", "unlink", "rmdir", "rmtree", "touch", "executescript", "create_all",
    "drop_all", "to_sql", "to_parquet",
}
# generic method names that write only on these receivers (sqlalchemy's insert/update/delete, os/shutil moves)
WRITE_ON = {"sa": {"insert", "update", "delete"}, "sqlalchemy": {"insert", "update", "delete"},
            "os": {"remove", "rename", "replace", "makedirs"}, "shutil": {"move", "copy", "copyfile", "copytree"}}


def _sources(*roots: str) -> list[Path]:
    from tests.conftest import REPO

    return sorted(p for r in roots for p in (REPO / r).rglob("*.py") if "__pycache__" not in p.parts)


def _writes(source: str, file: str) -> list[str]:
    """Calls and SQL in `source` that could write."""
    import ast
    import re

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in WRITE_CALLS or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                                       and name in WRITE_ON.get(f.value.id, ())):
                found.append(f"{file}:{node.lineno} {name}()")
            if name == "open" and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                      and set(a.value) & set("wax+") for a in node.args[1:]):
                found.append(f"{file}:{node.lineno} open(..., write mode)")
            if name == "to_csv" and (node.args or any(k.arg == "path_or_buf" for k in node.keywords)):
                found.append(f"{file}:{node.lineno} to_csv(path)")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                r"(?i)\b(insert\s+into|update\s+\w+\s+set|delete\s+from|drop\s+table|create\s+table|alter\s+table)\b",
                node.value):
            found.append(f"{file}:{node.lineno} SQL that writes")
    return found


def test_dashboard_has_no_write_path():
    """No call in dashboards/ can write: no MLflow or registry write API, no file write, no SQL that changes
    data. (Its stores are opened read-only too: tests/test_dashboard_frames.py, tests/test_dashboard_pages.py.)"""
    files = _sources("dashboards")
    assert len(files) >= 8
    assert [w for p in files for w in _writes(p.read_text(), p.name)] == []
    probe = ('c.log_metric(r, "k", 1)\nopen(p, "w")\nsa.insert(t)\nq = "DELETE FROM runs"\nos.remove(p)\n'
             'reg.add_evaluation(1)\ndf.to_csv("x.csv")\n')
    assert len(_writes(probe, "probe.py")) == 7  # the scan sees each kind of write


@pytest.mark.parametrize(("where", "overrides", "key"), [
    ("train", ["trainer.run_name=../../escaped"], "trainer.run_name"),
    ("train", ["trainer.run_name=.."], "trainer.run_name"),
    ("train", ["trainer.run_name=/tmp/escaped"], "trainer.run_name"),
    ("prepare", ["model.name=../../escaped"], "model.name"),
    ("evaluate", ["eval.run_name=../../escaped"], "eval.run_name"),
    ("evaluate", ["eval.out_dir={root}/escaped"], "eval.out_dir"),
    ("evaluate", ["eval.out_dir={outputs}/../escaped"], "eval.out_dir"),
    ("evaluate", ["eval.out_dir={outputs}/link/escaped"], "eval.out_dir"),  # a symlink inside outputs/ to outside
])
def test_user_names_and_paths_cannot_leave_outputs(quick_cfg, prepared_model, tmp_path, where, overrides, key):
    from parity.commands import evaluate as evaluate_cmd
    from parity.errors import ParityError
    from parity.models.prepare import prepare_model

    outputs = Path(quick_cfg().outputs_dir)
    root = tmp_path / "outside"
    root.mkdir()
    link = outputs / "link"
    if not link.is_symlink():
        link.symlink_to(root, target_is_directory=True)
    over = [o.format(root=root, outputs=outputs) for o in overrides]
    if where == "evaluate":
        over += ["eval.suite=[arithmetic]", "eval.limit=2", "eval.max_new_tokens=4", "eval.grade_workers=1"]
    cfg = quick_cfg(*over)
    run = {"train": train, "prepare": prepare_model, "evaluate": evaluate_cmd.run}[where]
    with pytest.raises(ParityError, match=rf"config key `{key}`"):
        run(cfg)
    assert list(root.iterdir()) == []  # nothing written outside
    assert not (outputs.parent / "escaped").exists() and not (outputs / "runs" / "escaped").exists()


def _formatted_sql(node) -> bool:
    import ast

    if not isinstance(node, ast.Call) or not node.args:
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in {"execute", "executemany", "executescript", "exec_driver_sql", "text"}:
        return False
    a = node.args[0]
    return (isinstance(a, ast.JoinedStr) or (isinstance(a, ast.BinOp) and isinstance(a.op, ast.Mod | ast.Add))
            or (isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr == "format"))


EVIL = "x'); DROP TABLE pipelines; -- \" OR 1=1"


def test_sql_goes_through_bound_parameters(quick_cfg, mlflow_store, tmp_path):
    import ast

    from omegaconf import OmegaConf

    from dashboards import mlflow_sql
    from parity.tracking import mlflow_log
    from parity.tracking.registry import Registry
    from tasks.recording import close_pipeline, open_pipeline, stage

    formatted = [f"{p.name}:{n.lineno}" for p in _sources("platform", "tasks", "flows", "dashboards", "scripts")
                 for n in ast.walk(ast.parse(p.read_text())) if _formatted_sql(n)]
    assert formatted == []  # no SQL text is built by formatting values into it
    assert _formatted_sql(ast.parse('c.execute(f"SELECT {x}")').body[0].value)  # the scan can see one

    uri, reg_url = mlflow_store, f"sqlite:///{tmp_path}/registry.db"
    cfg = quick_cfg(f"tracking.tracking_uri={uri}", f"tracking.registry_url={reg_url}")
    OmegaConf.update(cfg, "trainer.run_name", EVIL)
    ref = open_pipeline("train-and-eval", cfg, [f"trainer.run_name={EVIL}"])
    with stage(ref, EVIL) as st:
        st.done({"note": EVIL})
    close_pipeline(ref, ok=True)
    with Registry(reg_url) as reg:
        p = reg.pipeline(ref.pipeline_id)
        assert p["overrides"] == [f"trainer.run_name={EVIL}"] and p["status"] == "completed"
        assert p["stages"][0]["name"] == EVIL and p["stages"][0]["result"] == {"note": EVIL}
        assert reg.count("pipelines") == 1 and reg.count("stages") == 1  # every table still there
    c = mlflow_log.client(uri)
    assert c.get_run(ref.run_id).data.params["trainer.run_name"] == EVIL
    eng = mlflow_sql.engine(uri)  # the dashboard's read path reads it back literally
    runs = {r.run_name: r for r in mlflow_sql.fetch_runs(eng)}
    assert EVIL in runs and runs[f"train-and-eval-{ref.pipeline_id}"].params["trainer.run_name"] == EVIL
    assert mlflow_sql.metric_history(eng, [runs[EVIL].run_id, EVIL], [EVIL, "reward/mean"]).empty


def test_no_eval_or_exec_anywhere_in_the_sources():
    """Model output is graded as mathematics (math-verify) and compared, never run: no eval/exec/compile in the
    platform, its tasks, flows, dashboards, scripts or Docker helpers (the grader's side of it is
    test_grader_attacks_score_zero_within_the_timeout_and_run_no_code)."""
    import ast

    files = _sources("platform", "tasks", "flows", "dashboards", "scripts", "docker")
    assert len(files) > 50
    found = []
    for path in files:
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.Call):
                f = n.func
                if (isinstance(f, ast.Name) and f.id in {"eval", "exec", "compile", "__import__"}) or (
                        isinstance(f, ast.Attribute) and f.attr in {"eval", "exec"}
                        and isinstance(f.value, ast.Name) and f.value.id == "builtins"):
                    found.append(f"{path.relative_to(path.parents[len(path.parts) - 2])}:{n.lineno}")
    assert found == []


SECRET = "s3cr3t-Pa55w0rd"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _page_bytes(at) -> bytes:
    out: list[bytes] = []

    def walk(node) -> None:
        proto = getattr(node, "proto", None)
        if proto is not None and hasattr(proto, "SerializeToString"):
            out.append(proto.SerializeToString())
        for child in (getattr(node, "children", None) or {}).values():
            walk(child)

    walk(at._tree)
    return b"".join(out)


def test_secrets_stay_out_of_logs_mlflow_params_and_the_dashboard(quick_cfg, mlflow_store, tmp_path, caplog,
                                                                  monkeypatch):
    from omegaconf import OmegaConf
    from streamlit.testing.v1 import AppTest

    from dashboards import data
    from parity.config import flatten, to_yaml
    from parity.tracking import mlflow_log
    from parity.tracking.mlflow_log import MlflowCallback
    from parity.tracking.registry import Registry, RegistryError
    from parity.tracking.secrets import mask_url
    from tests.conftest import REPO

    port = _closed_port()
    pg = f"postgresql+psycopg://parity:{SECRET}@127.0.0.1:{port}/registry?connect_timeout=2"
    http = f"http://parity:{SECRET}@127.0.0.1:{port}"
    uri = mlflow_store  # holds the other tests' runs too: none may show a secret
    cfg = quick_cfg(f"tracking.tracking_uri={uri}")
    OmegaConf.update(cfg, "tracking.registry_url", pg)
    with caplog.at_level(logging.DEBUG):
        c = mlflow_log.client(uri)
        run_id = mlflow_log.start_run(c, mlflow_log.experiment_id(c, "secrets", mlflow_log.default_artifact_dir(uri)),
                                      "pipeline")
        mlflow_log.log_params(c, run_id, flatten(cfg))  # what open_pipeline logs
        (tmp_path / "config.yaml").write_text(mask_url(to_yaml(cfg)))
        mlflow_log.log_artifact(c, run_id, tmp_path / "config.yaml")
        mlflow_log.log_metrics(c, run_id, {"reward/mean": 0.5}, step=1)
        with pytest.raises(RegistryError) as down:
            Registry(pg)
        cb = MlflowCallback(http, run_id, retry_after_s=0.0)
        cb.on_step(1, {"reward/mean": 0.5})
        assert not cb.close(wait_s=0.0)
    assert "MLflow logging paused" in caplog.text and "parity:***@127.0.0.1" in caplog.text
    assert SECRET not in caplog.text and SECRET not in str(down.value)
    params = c.get_run(run_id).data.params
    assert params["tracking.registry_url"] == pg.replace(SECRET, "***") and SECRET not in repr(params)
    art = Path(c.download_artifacts(run_id, "config.yaml", str(tmp_path / "dl")))
    assert "parity:***@" in art.read_text() and SECRET not in art.read_text()

    # the dashboard on these stores: every element of every page, dataframes and charts included
    monkeypatch.setenv("PARITY_TRACKING_URI", uri)
    monkeypatch.setenv("PARITY_REGISTRY_URL", pg)
    monkeypatch.setenv("PARITY_OUTPUTS", str(tmp_path))
    shown = b""
    for page in [None, "compare", "benchmarks", "regression", "precision"]:
        at = AppTest.from_file(str(REPO / "dashboards" / "app.py"), default_timeout=120).run()
        if page:
            at.switch_page(f"views/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        blob = _page_bytes(at)
        assert SECRET.encode() not in blob, page
        shown += blob
    assert b"parity:***@127.0.0.1" in shown  # the registry URL was shown, masked
    with pytest.raises(data.SourceUnavailable) as e:
        data.mlflow_client(http)  # an MLflow server with credentials in its URL, down
    assert SECRET not in str(e.value) and "unreachable" in str(e.value)
    monkeypatch.setenv("PARITY_TRACKING_URI", http)
    assert data.load_sources().mlflow_ui == f"http://127.0.0.1:{port}"  # the UI links carry no credentials
