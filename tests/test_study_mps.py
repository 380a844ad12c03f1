"""parity.study.mps on a machine without the MPS daemon (the GPU side runs in tests/bench/gpu_study_throughput.py and
gpu_rollout_contention.py): what the runs' processes are given, what the study records, and the errors."""

from __future__ import annotations

import pytest

from parity.study.mps import SM_SHARE_ENV, MpsDaemon, child_env


def test_sm_share_travels_to_the_runs_and_is_recorded(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv(SM_SHARE_ENV, raising=False)
    d = MpsDaemon("off", pipe_dir=str(tmp_path / "p"), log_dir=str(tmp_path / "l"), sm_share=25)
    assert d.env() == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "p"), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "l"),
                       SM_SHARE_ENV: "25"}
    with d:
        assert d.status == {"mode": "off", "used": False, "sm_share": 25, "reason": "off"}
        assert child_env(d) == {}  # no daemon: the runs get nothing to reach
    assert SM_SHARE_ENV not in MpsDaemon("off").env()


def test_sm_share_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SM_SHARE_ENV, "40")
    assert MpsDaemon("off").status["sm_share"] == 40
    assert MpsDaemon("off", sm_share=10).env()[SM_SHARE_ENV] == "10"  # the argument wins
    monkeypatch.setenv(SM_SHARE_ENV, "half")
    with pytest.raises(ValueError, match=SM_SHARE_ENV):
        MpsDaemon("off")


@pytest.mark.parametrize("bad", [0, 101, -5])
def test_sm_share_out_of_range(bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SM_SHARE_ENV, raising=False)
    with pytest.raises(ValueError, match="a percentage, 1-100"):
        MpsDaemon("auto", sm_share=bad)


def test_without_the_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control on it, whatever the machine has
    monkeypatch.delenv(SM_SHARE_ENV, raising=False)
    with MpsDaemon("auto", pipe_dir=str(tmp_path / "p")) as d:
        assert d.status["used"] is False and "not on PATH" in d.status["reason"]
        assert child_env(d) == {}
    with pytest.raises(RuntimeError, match="MPS requested"), MpsDaemon("on", pipe_dir=str(tmp_path / "p")):
        pass
    with pytest.raises(ValueError, match="expected auto, on or off"):
        MpsDaemon("yes")


def test_blocking_host_waits_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """PARITY_CUDA_BLOCKING_SYNC: unset or 0 does nothing; any other value than 0 / 1 is refused naming the
    variable; 1 without a CUDA driver (none loadable) is nothing to do, not an error."""
    import ctypes.util

    from parity.core.device import BLOCKING_SYNC_ENV, blocking_sync_from_env, cuda_blocking_sync
    from parity.errors import ConfigError

    monkeypatch.delenv(BLOCKING_SYNC_ENV, raising=False)
    assert blocking_sync_from_env() is False
    monkeypatch.setenv(BLOCKING_SYNC_ENV, "0")
    assert blocking_sync_from_env() is False
    monkeypatch.setenv(BLOCKING_SYNC_ENV, "yes")
    with pytest.raises(ConfigError, match=BLOCKING_SYNC_ENV):
        blocking_sync_from_env()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libparity-no-such-driver.so")
    monkeypatch.setenv(BLOCKING_SYNC_ENV, "1")
    assert cuda_blocking_sync() is False and blocking_sync_from_env() is False



def test_gpu_preset_runs_wait_asleep(tmp_path) -> None:
    """The `gpu` study hands its runs PARITY_CUDA_BLOCKING_SYNC=1 (preset env, merged into every run's environment by
    parity.study.runs.run_all): a process started with that environment passes the training loop's check of it (on
    a machine without a CUDA driver the setting is nothing to do)."""
    import os
    import subprocess
    import sys

    from parity.core.device import BLOCKING_SYNC_ENV
    from parity.study.presets import PRESETS

    env = dict(os.environ, **PRESETS["gpu"].env)
    code = ("import os; from parity.core.device import blocking_sync_from_env; "
            f"print(os.environ[{BLOCKING_SYNC_ENV!r}], blocking_sync_from_env())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    value, applied = out.split()
    assert value == "1" and applied in ("True", "False")


def test_gpu_preset_runs_compile_in_their_own_process() -> None:
    """The `gpu` study's runs (and its rollout servers, which get the same environment) compile with Inductor in
    their own process: a process started with the preset's environment has one compile thread, so it starts no
    pool of compile workers, where one started without it has one a core (at least two here)."""
    import os
    import subprocess
    import sys

    from parity.study.presets import PRESETS

    code = "import torch._inductor.config as c; print(c.compile_threads)"
    env = dict(os.environ, **PRESETS["gpu"].env)
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "1"
    plain = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    assert int(subprocess.run([sys.executable, "-c", code], env=plain, capture_output=True, text=True,
                              check=True).stdout.strip()) == min(32, len(os.sched_getaffinity(0)))
