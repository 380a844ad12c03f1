"""CUDA MPS (the Multi-Process Service) for a study's runs on one GPU.

Without it, the kernels of separate processes on one GPU take turns: the device time-slices between their
contexts, and a study of 16 small runs (a 26 M-parameter model: decode kernels of a few microseconds on a handful
of the 132 SMs) queues each run's kernels behind the others' while most of the chip idles. Under MPS the runs'
processes share one context on the device, so their kernels run side by side. The arithmetic is the same kernels on
the same inputs: a run's numbers do not depend on whether MPS is on (docs/PERFORMANCE.md, "Study throughput").

`MpsDaemon` starts the control daemon (`nvidia-cuda-mps-control -d`) for the length of a `with` block and quits it
after, unless one was already running (then it is left as found). Clients find the daemon through
CUDA_MPS_PIPE_DIRECTORY, which `env()` gives to the runs' processes.

`sm_share` (a percentage) limits each run's process to that share of the SMs at a time
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). A study run's decode kernels are small but each spreads over the whole chip,
so under MPS they still queue behind one another; capped, several processes' kernels run on different SMs at once.
Measured on one H200 with the `gpu` preset's 16 formats decoding side by side (docs/PERFORMANCE.md, "Sixteen
rollouts on one GPU"): 25% gave 1.47x the tokens a second of the uncapped processes. A cap changes which SMs a
kernel runs on, not its arithmetic; a library that sizes its launches by the SM count it is shown may pick another
split of a sum (rounding-level differences, as between two GPUs of the same kind)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
SM_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def check_sm_share(value: int, what: str) -> int:
    """`value` if it is a percentage of the SMs (1-100), else a ValueError naming `what` (the option or variable)."""
    if not 1 <= value <= 100:
        raise ValueError(f"{what} {value!r}: a percentage, 1-100")
    return value


class MpsDaemon:
    """The MPS control daemon for the processes started inside the block.

    `mode`: "auto" starts it where the binary and a CUDA device exist, and goes on without it otherwise; "on"
    raises if it cannot start; "off" does nothing. `status` says what happened, for the study's record."""

    def __init__(self, mode: str = "auto", pipe_dir: str | None = None, log_dir: str | None = None,
                 sm_share: int | None = None) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"mps mode {mode!r}: expected auto, on or off")
        inherited = os.environ.get(SM_SHARE_ENV)
        if sm_share is None and inherited:
            sm_share = int(inherited) if inherited.strip().isdigit() else -1
        if sm_share is not None:
            check_sm_share(sm_share, f"MPS SM share (--mps-sm-share or {SM_SHARE_ENV})")
        self.mode = mode
        self.sm_share = sm_share
        self.pipe_dir = Path(pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
        self.log_dir = Path(log_dir or os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/tmp/nvidia-mps-log")
        self.started = False
        self.status: dict = {"mode": mode, "used": False, "sm_share": sm_share}

    def _control(self, command: str, timeout: float = 10.0) -> subprocess.CompletedProcess:
        return subprocess.run([CONTROL], input=command + "\n", text=True, capture_output=True, timeout=timeout,
                              env=dict(os.environ, **self.env()))

    def running(self) -> bool:
        """Whether a control daemon answers on the pipe directory."""
        if shutil.which(CONTROL) is None or not (self.pipe_dir / "control").exists():
            return False
        try:
            return self._control("get_server_list", timeout=5.0).returncode == 0
        except (subprocess.TimeoutExpired, OSError):
            return False

    def env(self) -> dict[str, str]:
        out = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}
        if self.sm_share is not None:
            out[SM_SHARE_ENV] = str(self.sm_share)
        return out

    def __enter__(self) -> MpsDaemon:
        if self.mode == "off":
            self.status["reason"] = "off"
            return self
        reason = None
        if shutil.which(CONTROL) is None:
            reason = f"{CONTROL} not on PATH"
        elif not Path("/dev/nvidiactl").exists():
            reason = "no NVIDIA device (/dev/nvidiactl)"
        if reason is None and self.running():
            self.status.update(used=True, reason="already running", pipe_dir=str(self.pipe_dir))
            return self
        if reason is None:
            self.pipe_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            p = subprocess.run([CONTROL, "-d"], env=dict(os.environ, **self.env()), capture_output=True, text=True)
            deadline = time.monotonic() + 10.0
            while p.returncode == 0 and time.monotonic() < deadline and not self.running():
                time.sleep(0.2)
            if p.returncode == 0 and self.running():
                self.started = True
                self.status.update(used=True, reason="started", pipe_dir=str(self.pipe_dir))
                return self
            reason = f"{CONTROL} -d failed (exit {p.returncode}): {(p.stderr or p.stdout).strip()[-300:]}"
        if self.mode == "on":
            raise RuntimeError(f"MPS requested (mps=on) but unavailable: {reason}")
        self.status["reason"] = reason
        return self

    def __exit__(self, *exc: object) -> None:
        if self.started:
            try:
                self._control("quit", timeout=30.0)
            except (subprocess.TimeoutExpired, OSError):
                pass
            self.started = False


def child_env(daemon: MpsDaemon) -> dict[str, str]:
    """What a run's process needs to reach the daemon (nothing when MPS is not in use)."""
    return daemon.env() if daemon.status.get("used") else {}
