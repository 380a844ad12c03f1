"""Where a step's time goes on the GPU: one step's rollout and trainer phases under torch.profiler, summarised.

Set `PARITY_PROFILE_STEPS` to a comma-separated list of RL steps (1-based, as the metrics log numbers them); the loop
then profiles those steps' rollout and learner phases and writes `profile_step<N>.json` into the run folder. Each
phase's summary says whether it waited on the device or on the host:

- `wall_s`: the phase's host time; `cpu_s`: this process's CPU seconds in it (all threads);
- `kernels`: kernel launches the device ran for this process (inside CUDA graph replays too), `kernel_s` the sum
  of their durations, `kernel_busy_s` the union of their intervals (kernels of one process on one stream do not
  overlap, so the two agree unless several streams ran), `kernel_mean_us`;
- `runtime`: the host's CUDA runtime calls by name (count, seconds): graph launches, kernel launches,
  synchronisations and copies (a synchronisation's seconds are host time spent waiting for the device);
- `top`: the kernels with the largest total time (name, count, total and mean microseconds).

`kernel_busy_s` near `wall_s` means the device was working on this process's kernels (or had them queued
behind other processes' work) the whole phase; far below it, the host is the wait. Comparing a run alone with
the same run beside others says which kernels slow down under sharing. Profiling adds host overhead per launch, so
`wall_s` of a profiled step is an upper bound; the kernel counts and durations are the measurement."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ENV = "PARITY_PROFILE_STEPS"


def profiled_steps() -> set[int]:
    raw = os.environ.get(ENV, "")
    try:
        return {int(x) for x in raw.split(",") if x.strip()}
    except ValueError as e:
        raise ValueError(f"{ENV}={raw!r}: expected comma-separated step numbers") from e


def summarize_trace(events: list[dict], wall_s: float, cpu_s: float, top: int = 15) -> dict:
    """The summary above from a Chrome trace's events (torch.profiler's export): kernels are events of category
    `kernel`, runtime calls of category `cuda_runtime` (durations in microseconds)."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of the intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(float(e["dur"]))
    runtime: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "dur" in e:
            r = runtime.setdefault(e["name"], [0, 0.0])
            r[0] += 1
            r[1] += float(e["dur"]) / 1e6
    total = sum(float(e["dur"]) for e in kernels)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"wall_s": round(wall_s, 4), "cpu_s": round(cpu_s, 4), "kernels": len(kernels),
            "kernel_s": round(total / 1e6, 7), "kernel_busy_s": round(busy / 1e6, 7),
            "kernel_mean_us": round(total / len(kernels), 2) if kernels else None,
            "runtime": {k: [v[0], round(v[1], 7)] for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][1])},
            "top": [{"name": n[:120], "count": len(d), "total_us": round(sum(d), 1), "mean_us": round(sum(d) / len(d), 2)}
                    for n, d in ranked]}


class StepProfiler:
    """`with prof.phase(step, "rollout"):` profiles that phase when `step` is listed in PARITY_PROFILE_STEPS;
    `write(step, folder)` writes the step's phases as profile_step<N>.json."""

    def __init__(self) -> None:
        self.steps = profiled_steps()
        self.phases: dict[int, dict] = {}

    @contextlib.contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            with profile(activities=acts) as prof:
                yield
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
        finally:
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
        self.phases.setdefault(step, {})[name] = summarize_trace(events, wall, cpu)

    def write(self, step: int, folder: Path) -> None:
        if step in self.phases:
            (Path(folder) / f"profile_step{step}.json").write_text(json.dumps(self.phases.pop(step), indent=1))


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime), so that the
    interpreter's start and the imports count too; None where /proc does not say."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (Dynamo tracing and Inductor's code generation and
    kernel compiles, torch's own account of them); 0.0 before torch._dynamo is imported or where torch keeps no
    such account."""
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", None) if utils is not None else None
    if not isinstance(metrics, dict):
        return 0.0
    return float(sum(metrics.get("_compile.compile_inner", ())))


class StartupClock:
    """Where a run's time goes before its steps: mark(name) records the seconds since the process started (since
    the clock was made where /proc is missing) at each point; `marks` is what summary.json's `startup_s` holds, and
    `detail["compile_s"]` the seconds of torch.compile the process had spent by each point."""

    def __init__(self) -> None:
        age = process_age_s()
        self._t0 = time.perf_counter() - (age if age is not None else 0.0)
        self.marks: dict[str, float] = {}
        self.detail: dict[str, object] = {}  # summary.json's `startup_detail`: what a mark's stretch was made of

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, round(time.perf_counter() - self._t0, 2))
        self.detail.setdefault("compile_s", {}).setdefault(name, round(compile_seconds(), 2))


__all__ = ["StepProfiler", "StartupClock", "compile_seconds", "process_age_s", "summarize_trace", "profiled_steps", "ENV"]
