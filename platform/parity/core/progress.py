"""Progress lines with an ETA for the long loops (the warm start, the RL steps, the evaluation).

A line goes to the logger `parity.progress` at INFO each time another tenth of the work is done, and once at the
end; where a tenth takes longer than `every_s` seconds, a line every `every_s` seconds instead (a tenth done
within half of that after such a line adds none). A run writes about a dozen lines, not one a step:

    warm start: 350/700 steps (50%), ETA 2m47s, 2.10 steps/s, 2m47s elapsed, loss 0.412

The rate and the ETA count the work done since this process started (a resumed run's earlier steps are not
part of its rate). The CLI shows these lines through Hydra's logging; a Prefect task forwards them to its run's
log (tasks/stages.py), which `prefect deployment run ... --watch` (and so `make run`) prints as they come."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

LOGGER = "parity.progress"


def duration(seconds: float) -> str:
    """12s, 4m05s, 1h02m."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """`update(n, **postfix)` after each piece of work; returns the line when it wrote one."""

    def __init__(self, desc: str, total: int, unit: str = "step", *, initial: int = 0, every_frac: float = 0.1,
                 every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> None:
        self.desc, self.total, self.unit = desc, max(0, int(total)), unit
        self.initial = self.done = int(initial)
        self.every_s = float(every_s)
        self.stride = max(1, math.ceil(self.total * float(every_frac)))  # items a tenth of the work spans
        self.clock = clock
        self.log = logger or logging.getLogger(LOGGER)
        self.t0 = self.t_last = clock()
        self.next_mark = (self.done // self.stride + 1) * self.stride
        self.by_time = False  # whether the last line was written for the time since the one before
        self.postfix: dict[str, Any] = {}

    def update(self, n: int = 1, **postfix: Any) -> str | None:
        self.done += int(n)
        self.postfix.update(postfix)
        now = self.clock()
        since = now - self.t_last
        tenth = self.done >= self.next_mark
        if tenth:
            self.next_mark = (self.done // self.stride + 1) * self.stride
        if self.done < self.total:
            if tenth and self.by_time and since < self.every_s / 2:
                return None
            if not tenth and since < self.every_s:
                return None
        self.by_time = not tenth and self.done < self.total
        self.t_last = now
        text = self.line(now)
        self.log.info("%s", text)
        return text

    def line(self, now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.t0
        worked = self.done - self.initial
        rate = worked / elapsed if worked > 0 and elapsed > 0 else None
        pct = 100.0 * self.done / self.total if self.total else 100.0
        parts = [f"{self.desc}: {self.done}/{self.total} {self.unit}s ({pct:.0f}%)"]
        if self.done >= self.total:
            parts.append("done")
        else:
            parts.append(f"ETA {duration((self.total - self.done) / rate)}" if rate else "ETA unknown")
        if rate is not None:
            parts.append(f"{rate:.2f} {self.unit}s/s" if rate >= 1 else f"{1 / rate:.1f} s/{self.unit}")
        parts.append(f"{duration(elapsed)} elapsed")
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        return ", ".join(parts)

