"""CPU used outside a process tree while a benchmark runs: the busy-host guard of the side-by-side benchmarks.

The machines these benchmarks run on are shared, and a CPU timing taken while another process holds a core is
worth little. `LoadMonitor` samples /proc/stat (every core's busy time) and the CPU time of every process in this
process's tree (itself and all descendants, from /proc/<pid>/stat) a few times a second in a thread; for any
wall-clock window afterwards, `foreign_cores(t0, t1)` is the busy time that was not the tree's (plus the time the
hypervisor stole), divided by the window: 0.0 on an idle host, 1.0 when another process held a whole core.

Linux only (reads /proc). A process that starts and exits between two samples is missed and its time counts as
foreign, which errs towards repeating a run."""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left

HZ = os.sysconf("SC_CLK_TCK")


def _host_ticks() -> tuple[int, int]:
    """(busy, steal) ticks over all cores since boot."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[1:9])
    return user + nice + system + irq + softirq, steal


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime ticks) of every process now."""
    out: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                s = f.read()
        except OSError:  # exited meanwhile
            continue
        rest = s[s.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
        out[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    return out


class LoadMonitor:
    """Samples the host and this process tree's CPU time every `interval_s` until `stop()` (None: only on entry
    and exit, for a short call, so the sampling thread takes no CPU from what is measured)."""

    def __init__(self, interval_s: float | None = 0.5, root: int | None = None) -> None:
        self.interval_s, self.root = interval_s, os.getpid() if root is None else root
        self.samples: list[tuple[float, int, int, int]] = []  # (time, host busy, host steal, tree ticks)
        self._seen: dict[int, int] = {}  # pid -> latest utime + stime of every tree process ever seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)

    def __enter__(self) -> LoadMonitor:
        self.sample()
        if self.interval_s:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s or 1.0):
            self.sample()

    def sample(self) -> None:
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.root]
        while todo:
            pid = todo.pop()
            if pid in table:
                self._seen[pid] = table[pid][1]
            todo.extend(children.get(pid, ()))
        busy, steal = _host_ticks()
        self.samples.append((time.time(), busy, steal, sum(self._seen.values())))

    def _at(self, t: float) -> tuple[float, float, float]:
        """(busy, steal, tree) ticks at wall time t, interpolated between samples."""
        ts = [s[0] for s in self.samples]
        i = min(max(bisect_left(ts, t), 1), len(ts) - 1)
        (t0, *a), (t1, *b) = self.samples[i - 1], self.samples[i]
        f = 0.0 if t1 <= t0 else min(max((t - t0) / (t1 - t0), 0.0), 1.0)
        return tuple(x + f * (y - x) for x, y in zip(a, b, strict=True))  # type: ignore[return-value]

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """Cores used in [t0, t1] (wall-clock seconds): by the tree, by everything else, stolen by the hypervisor."""
        if len(self.samples) < 2 or t1 <= t0:
            return {"tree_cores": float("nan"), "foreign_cores": float("nan"), "steal_cores": float("nan")}
        (b0, s0, r0), (b1, s1, r1) = self._at(t0), self._at(t1)
        dt = (t1 - t0) * HZ
        return {"tree_cores": round((r1 - r0) / dt, 3),
                "foreign_cores": round(max(0.0, (b1 - b0) - (r1 - r0) + (s1 - s0)) / dt, 3),
                "steal_cores": round((s1 - s0) / dt, 3)}

    def foreign_cores(self, t0: float, t1: float) -> float:
        return self.window(t0, t1)["foreign_cores"]


def host_description() -> dict[str, object]:
    """CPU model, core count and the SIMD flags that decide the compute dtype (bf16 native or emulated)."""
    model, flags = "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return {"cpu": model, "cores": os.cpu_count(), "simd": simd,
            "native_bf16": bool(flags & {"avx512_bf16", "amx_bf16"})}
