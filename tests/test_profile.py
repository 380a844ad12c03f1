"""The step profiler's summary (parity.core.profile), checked by hand on a constructed trace, and a profiled step
of a real CPU run."""

import json

import pytest

from parity.core.profile import StepProfiler, profiled_steps, summarize_trace


def test_summary_of_a_constructed_trace_by_hand():
    events = [
        {"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 10.0},
        {"cat": "kernel", "name": "gemm", "ts": 5.0, "dur": 10.0},  # overlaps the first by 5 us
        {"cat": "kernel", "name": "norm", "ts": 40.0, "dur": 2.0},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 3.0},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 20.0, "dur": 5.0},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 30.0, "dur": 1_000_000.0},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},
    ]
    s = summarize_trace(events, wall_s=1.5, cpu_s=0.25)
    assert s["kernels"] == 3
    assert s["kernel_s"] == pytest.approx(22e-6)  # 10 + 10 + 2 us
    assert s["kernel_busy_s"] == pytest.approx(17e-6)  # [0, 15] and [40, 42]
    assert s["kernel_mean_us"] == pytest.approx(22 / 3, abs=0.01)
    assert s["runtime"]["cudaGraphLaunch"] == [2, pytest.approx(8e-6)]
    assert list(s["runtime"])[0] == "cudaStreamSynchronize"  # the largest time first
    assert s["top"][0] == {"name": "gemm", "count": 2, "total_us": 20.0, "mean_us": 10.0}
    assert (s["wall_s"], s["cpu_s"]) == (1.5, 0.25)


def test_profiled_steps_from_the_environment(monkeypatch):
    monkeypatch.setenv("PARITY_PROFILE_STEPS", "3, 5")
    assert profiled_steps() == {3, 5}
    monkeypatch.setenv("PARITY_PROFILE_STEPS", "three")
    with pytest.raises(ValueError, match="PARITY_PROFILE_STEPS"):
        profiled_steps()


def test_a_listed_step_is_profiled_and_written(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("PARITY_PROFILE_STEPS", "2")
    prof = StepProfiler()
    x = torch.randn(64, 64)
    with prof.phase(1, "rollout"):  # not listed: nothing recorded
        x @ x
    with prof.phase(2, "rollout"):
        for _ in range(3):
            x = torch.tanh(x @ x)
    prof.write(1, tmp_path)
    prof.write(2, tmp_path)
    assert not (tmp_path / "profile_step1.json").exists()
    got = json.loads((tmp_path / "profile_step2.json").read_text())
    assert set(got) == {"rollout"}
    assert got["rollout"]["wall_s"] > 0 and got["rollout"]["kernels"] == 0  # CPU: no device kernels


def test_the_startup_clock_counts_the_processs_compile_seconds():
    """StartupClock's detail["compile_s"]: torch.compile's own account of this process's compiling, read at each mark
    (Dynamo's tracing with the eager backend here: no Inductor needed), growing by what was compiled in between."""
    import torch

    from parity.core.profile import StartupClock, compile_seconds

    clock = StartupClock()
    clock.mark("before")
    before = compile_seconds()
    fn = torch.compile(lambda x: (x * 2).sin() + 1, backend="eager")
    assert torch.equal(fn(torch.ones(3)), (torch.ones(3) * 2).sin() + 1)
    clock.mark("after")
    clock.mark("before")  # a mark is kept at its first point
    assert compile_seconds() > before
    spent = clock.detail["compile_s"]
    assert spent["after"] == round(compile_seconds(), 2) >= spent["before"] == round(before, 2)
