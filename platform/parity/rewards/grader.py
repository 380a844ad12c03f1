"""Math-verify reward: one item in this process, or many through a pool of worker processes.

Why processes: math-verify times itself out with signal.alarm (main thread only), and some inputs
hang inside C code (a power tower makes sympy build a gigantic integer) where no signal is seen.
So each item runs in a worker's main thread under a soft per-item timer, and the pool enforces a
hard deadline on top: a worker that overruns it, or dies, is killed and replaced, its item scores 0
and is counted, and the other items carry on. The pool never waits on a worker without a deadline.

Workers come from a forkserver that preloads math-verify once (parity.rewards._preload), so the
trainer process (which holds torch and its threads) is never forked, and replacing a killed worker
is a cheap fork rather than a fresh interpreter importing sympy. As with any 'spawn'/'forkserver'
multiprocessing, a worker re-imports the parent's main *script* (not `python -m pkg`), so a script that
creates a pool must keep its top level import-safe (`if __name__ == "__main__":`); workers that keep
dying before they are ready make grading raise instead of retrying forever.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from parity.rewards.extract import last_boxed
from parity.rewards.mathverify import (
    CRASH,
    ERROR,
    TIMEOUT,
    TRUNCATED,
    GradeResult,
    grade_one,
    serve,
)

__all__ = ["GradeResult", "GraderPool", "PoolStats", "grade_answer", "status_counts"]

_PRELOAD = ["parity.rewards._preload"]


def grade_answer(response: str, answer: str, timeout_s: float | None = 5.0) -> tuple[float, str | None]:
    """(score, extracted): 1.0 if math-verify accepts the last \\boxed{} of `response` as `answer`
    (parsed as \\boxed{answer}), else 0.0; unparsable or missing answers score 0. Runs in this
    process (timeout only in the main thread); use GraderPool for untrusted batches."""
    r = grade_one(response, answer, timeout_s)
    return r.score, r.extracted


def status_counts(results: list[GradeResult]) -> dict[str, int]:
    return dict(Counter(r.status for r in results))


@dataclass
class PoolStats:
    graded: int = 0  # items answered (any status, truncated included)
    correct: int = 0
    truncated: int = 0
    timeouts: int = 0  # soft (worker timer) plus hard (worker killed)
    crashes: int = 0  # worker died while grading an item
    errors: int = 0  # math-verify raised on an item (scored 0, worker kept)
    restarts: int = 0  # workers replaced (after a hard timeout or a crash)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Worker:
    def __init__(self, proc: Any, conn: Connection, boot_deadline: float) -> None:
        self.proc = proc
        self.conn = conn
        self.ready = False  # set by the worker's first message, once its imports are done
        self.job: int | None = None
        self.deadline = boot_deadline  # of the boot while not ready, of the item while busy


class GraderPool:
    """Process pool grading (response, answer) pairs with math-verify.

    timeout_s is the per-item budget, enforced inside the worker; a worker still busy kill_grace_s
    later is killed and replaced. Boxed answers longer than max_answer_chars score 0 unparsed (no
    reference answer is near that long). Calls from several threads are serialised by a lock.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, kill_grace_s: float = 0.5,
                 max_answer_chars: int = 4096, start_method: str = "forkserver",
                 boot_timeout_s: float = 120.0) -> None:
        if workers < 1:
            raise ValueError(f"GraderPool: workers must be >= 1, got {workers}")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"GraderPool: timeout_s must be > 0, got {timeout_s}")
        if start_method not in ("forkserver", "spawn"):
            # 'fork' would copy the trainer's torch threads and locks into the worker.
            raise ValueError(f"GraderPool: start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.n_workers = workers
        self.timeout_s = float(timeout_s)
        self.kill_grace_s = float(kill_grace_s)
        self.max_answer_chars = int(max_answer_chars)
        self.boot_timeout_s = float(boot_timeout_s)
        self.stats = PoolStats()
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(_PRELOAD)
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        self._boot_error: BaseException | None = None
        self._boot_failures = 0
        # Starting the forkserver imports math-verify (seconds): do it behind the caller's back so
        # that building the pool overlaps with loading the model; grading waits for it.
        self._boot = threading.Thread(target=self._boot_workers, name="parity-grader-boot", daemon=True)
        self._boot.start()

    def _boot_workers(self) -> None:
        try:
            for _ in range(self.n_workers):
                self._workers.append(self._start_worker())
        except BaseException as e:  # surfaced by the first grade() call
            self._boot_error = e

    def _wait_booted(self) -> None:
        self._boot.join()
        if self._boot_error is not None:
            raise RuntimeError(f"GraderPool: starting the workers failed: {self._boot_error!r}") \
                from self._boot_error

    # --- lifecycle -------------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=serve, args=(child, self.timeout_s, self.max_answer_chars),
                                 daemon=True, name="parity-grader")
        proc.start()
        child.close()
        return _Worker(proc, parent, time.monotonic() + self.boot_timeout_s)

    def _stop_worker(self, w: _Worker, kill: bool) -> None:
        try:
            if kill:
                w.proc.kill()
            else:
                w.conn.send(None)
        except (BrokenPipeError, OSError, ValueError):
            pass
        w.proc.join(timeout=0.0 if kill else 2.0)
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(timeout=5.0)
        w.conn.close()

    def _replace(self, i: int) -> None:
        self._stop_worker(self._workers[i], kill=True)
        self._workers[i] = self._start_worker()
        self.stats.restarts += 1

    def _boot_failed(self, i: int) -> None:
        """A worker died or hung before its first message: replace it, unless they all keep failing
        (math-verify cannot import, no memory...), which no retry will fix."""
        self._boot_failures += 1
        if self._boot_failures > 3 * self.n_workers:
            raise RuntimeError(f"GraderPool: {self._boot_failures} workers in a row died before "
                               "becoming ready; see their stderr above")
        self._replace(i)

    def wait_ready(self) -> None:
        """Block until every worker has finished starting (for timing; grading does not need it)."""
        with self._lock:
            self._wait_booted()
            while True:
                booting = {w.conn: i for i, w in enumerate(self._workers) if not w.ready}
                if not booting:
                    return
                wait_s = max(0.0, min(self._workers[i].deadline for i in booting.values()) - time.monotonic())
                for conn in wait(list(booting), timeout=wait_s):
                    i = booting[conn]  # type: ignore[index]
                    try:
                        msg = conn.recv()  # type: ignore[union-attr]
                    except (EOFError, OSError):
                        self._boot_failed(i)
                        continue
                    self._boot_failures = 0
                    if msg[0] == "fatal":
                        raise RuntimeError(f"GraderPool: a worker cannot grade at all: {msg[1]}")
                    self._workers[i].ready = msg[0] == "ready"
                now = time.monotonic()
                for i in booting.values():
                    if not self._workers[i].ready and self._workers[i].deadline <= now:
                        self._boot_failed(i)

    def worker_pids(self) -> list[int]:
        self._wait_booted()
        return [int(w.proc.pid) for w in self._workers]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._boot.join()
            self._closed = True
            for w in self._workers:
                self._stop_worker(w, kill=False)
            self._workers = []

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # --- grading ---------------------------------------------------------------------------
    def grade(self, responses: list[str], answers: list[str],
              truncated: list[bool] | torch.Tensor | None = None) -> torch.Tensor:
        """float32 [N] of 1.0/0.0; truncated responses score 0 without being graded."""
        res = self.grade_detailed(responses, answers, truncated)
        return torch.tensor([r.score for r in res], dtype=torch.float32)

    def grade_detailed(self, responses: list[str], answers: list[str],
                       truncated: list[bool] | torch.Tensor | None = None) -> list[GradeResult]:
        n = len(responses)
        if len(answers) != n:
            raise ValueError(f"GraderPool.grade: {n} responses but {len(answers)} answers")
        trunc = [False] * n if truncated is None else [bool(t) for t in list(truncated)]
        if len(trunc) != n:
            raise ValueError(f"GraderPool.grade: {n} responses but {len(trunc)} truncated flags")
        out: list[GradeResult | None] = [None] * n
        jobs = []
        for i in range(n):
            if trunc[i]:
                out[i] = GradeResult(0.0, last_boxed(responses[i]), TRUNCATED)
            else:
                jobs.append(i)
        with self._lock:
            if self._closed:
                raise RuntimeError("GraderPool.grade called after close()")
            self._wait_booted()
            for i, r in self._dispatch(jobs, responses, answers).items():
                out[i] = r
        results = [r for r in out if r is not None]
        assert len(results) == n
        self.stats.graded += n
        self.stats.truncated += sum(trunc)
        self.stats.correct += sum(r.score == 1.0 for r in results)
        self.stats.timeouts += sum(r.status == TIMEOUT for r in results)
        self.stats.crashes += sum(r.status == CRASH for r in results)
        self.stats.errors += sum(r.status == ERROR for r in results)
        return results

    def _dispatch(self, jobs: list[int], responses: list[str], answers: list[str]) -> dict[int, GradeResult]:
        pending = deque(jobs)
        done: dict[int, GradeResult] = {}
        send_failures: Counter[int] = Counter()
        hard = self.timeout_s + self.kill_grace_s

        def fail(i: int, status: str) -> None:
            job = self._workers[i].job
            if job is not None:
                done[job] = GradeResult(0.0, last_boxed(responses[job]), status)
            self._replace(i)

        while pending or any(w.job is not None for w in self._workers):
            for i, w in enumerate(self._workers):
                if not (w.ready and w.job is None and pending):
                    continue
                job = pending.popleft()
                try:
                    w.conn.send((job, responses[job], answers[job]))
                except (BrokenPipeError, OSError):
                    # The worker died while idle: not this item's fault, so it goes to another
                    # worker (a bound keeps a pool whose workers always die from spinning).
                    self._replace(i)
                    send_failures[job] += 1
                    if send_failures[job] > self.n_workers + 1:
                        done[job] = GradeResult(0.0, last_boxed(responses[job]), CRASH)
                    else:
                        pending.appendleft(job)
                    continue
                w.job, w.deadline = job, time.monotonic() + hard
            watched = {w.conn: i for i, w in enumerate(self._workers) if w.job is not None or not w.ready}
            if not watched:
                continue
            now = time.monotonic()
            wait_s = max(0.0, min(self._workers[i].deadline for i in watched.values()) - now)
            for conn in wait(list(watched), timeout=wait_s):
                i = watched[conn]  # type: ignore[index]
                w = self._workers[i]
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    if w.job is None:
                        self._boot_failed(i)
                    else:
                        fail(i, CRASH)
                    continue
                self._boot_failures = 0
                if msg[0] == "fatal":
                    raise RuntimeError(f"GraderPool: a worker cannot grade at all: {msg[1]}")
                if msg[0] == "ready":
                    w.ready = True
                    continue
                job, score, extracted, status = msg
                done[job] = GradeResult(float(score), extracted, status)
                w.job = None
            now = time.monotonic()
            for i in watched.values():
                w = self._workers[i]
                if w.deadline <= now and w.job is not None:
                    fail(i, TIMEOUT)
                elif w.deadline <= now and not w.ready:
                    self._boot_failed(i)
        return done
