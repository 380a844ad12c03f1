"""The preloaded launcher (parity.study.preload): children forked from one process that imported torch start with
it imported and behave as `python -m MODULE` processes (on a GPU machine each uses CUDA): argv, working directory,
environment, log, exit code, stdin empty, torch's thread count from their own OMP_NUM_THREADS; kill and wait as
subprocess.Popen's; a request with another PYTHONPATH is refused with the reason; `parity study --preload` trains
its runs through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from parity.study.preload import Preloader, PreloadError

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}", **extra}


def test_children_start_with_torch_imported_and_act_as_their_own_processes(tmp_path) -> None:
    env = _env(OMP_NUM_THREADS="1")
    with Preloader(env, log=tmp_path / "launcher.log", modules=("torch",)) as pre:
        kids = []
        for i, code in enumerate((0, 3)):
            log = tmp_path / f"child{i}.log"
            kids.append((log, pre.popen(["-m", "tests.preload_probe", str(code), f"arg{i}"],
                                        env=_env(PROBE=f"p{i}", OMP_NUM_THREADS="2"), log=log, cwd=ROOT)))
        assert [p.wait(timeout=60) for _, p in kids] == [0, 3]
        assert pre.preload_s is not None
    for i, (log, p) in enumerate(kids):
        got = json.loads(log.read_text().strip().splitlines()[-1])
        assert got == {"cuda": 2.0 if torch.cuda.is_available() else None, "argv": [str((0, 3)[i]), f"arg{i}"], "cwd": str(ROOT), "probe": f"p{i}",
                       "torch_preloaded": True, "threads": 2, "pid": p.pid, "stdin": ""}
    first = json.loads((tmp_path / "launcher.log").read_text().splitlines()[0])
    assert isinstance(first["preload"]["torch"], float) and first["threads"] == len(first["thread_names"]) >= 1


def test_the_launcher_quiets_pythons_fork_warning_and_no_other() -> None:
    """Python 3.12 warns at each fork of a process with threads (the launcher's log would get two lines a run, and
    its first line would not be its record); other deprecation warnings stay."""
    import warnings

    from parity.study.preload import quiet_fork_warning
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        quiet_fork_warning()
        warnings.warn("This process (pid=9652) is multi-threaded, use of fork() may lead to deadlocks in the child.",
                      DeprecationWarning, stacklevel=1)
        warnings.warn("something else is deprecated", DeprecationWarning, stacklevel=1)
    assert [str(w.message) for w in got] == ["something else is deprecated"]


def test_kill_wait_and_a_refused_request(tmp_path) -> None:
    with Preloader(_env(), modules=("json",)) as pre:
        p = pre.popen(["-m", "time"], env=_env(), log=tmp_path / "t.log", cwd=ROOT)
        p.wait(timeout=30)  # `python -m time` is not runnable: an error in the log, code 1
        assert p.returncode == 1 and "time" in (tmp_path / "t.log").read_text()
        sleeper = pre.popen(["-m", "tests.preload_probe", "sleep"], env=_env(), log=tmp_path / "s.log", cwd=ROOT)
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=0.5)
        assert sleeper.poll() is None
        sleeper.kill()
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(PreloadError, match="PYTHONPATH '/elsewhere' is not the launcher's"):
            pre.popen(["-m", "tests.preload_probe", "0"], env={**_env(), "PYTHONPATH": "/elsewhere"},
                      log=tmp_path / "x.log", cwd=ROOT)


def test_a_launcher_that_cannot_serve_falls_back_to_plain_processes(tmp_path) -> None:
    """A launcher that died before listening: the run starts as a plain `python -m` process, and `fallback` says
    why."""
    with Preloader(_env(), modules=("json",), timeout_s=30) as pre:
        pre.proc.send_signal(signal.SIGKILL)
        pre.proc.wait()
        Path(pre._ready).unlink(missing_ok=True)
        p = pre.popen(["-m", "tests.preload_probe", "4"], env=_env(PROBE="plain"), log=tmp_path / "x.log", cwd=ROOT)
        assert isinstance(p, subprocess.Popen) and p.wait(timeout=60) == 4
        assert pre.fallback == "the preloaded launcher exited with -9 before listening"
    got = json.loads((tmp_path / "x.log").read_text().strip().splitlines()[-1])
    assert got["probe"] == "plain" and got["torch_preloaded"] is False


def test_a_study_with_preload_trains_its_runs_through_the_launcher(tmp_path) -> None:
    """`parity study --preload`: two runs at a time forked from the launcher train and read back as subprocess runs
    do; the launcher's log says what it imported; each run's start (summary.json's startup_s) counts from its fork."""
    from parity.commands.study import main
    out = tmp_path / "study"
    t0 = time.time()
    res = main(["--preset", "laptop-reinforce", "--quick", "--arms", "bf16 / none,sigma=0.2 / none", "--extra",
                "model.dtype=float32", "--concurrency", "2", "--preload", "--outputs-dir", str(tmp_path / "outputs"),
                "--out", str(out)])
    assert res["failed"] == 0 and res["runs"] == 2
    head = json.loads((out / "logs" / "preload.log").read_text().splitlines()[0])
    assert isinstance(head["preload"]["torch"], float) and isinstance(head["preload"]["transformers"], float)
    study = json.loads((out / "study.json").read_text())
    assert all(r["steps"] == 2 and len(r["curves"]["reward/mean"]) == 2 for r in study["runs"])
    for r in study["runs"]:
        summary = json.loads((tmp_path / "outputs" / "runs" / r["name"] / "summary.json").read_text())
        assert 0 < summary["startup_s"]["imports"] < time.time() - t0
