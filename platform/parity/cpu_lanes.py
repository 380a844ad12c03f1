"""CPU lanes: a batch's rows split over a few threads, each running torch ops on its own intra-op threads.

The default models are small (hidden 192 on two cores): each op of a forward or backward is tens of microseconds
of arithmetic, and OpenMP's intra-op threading costs about as much again a call, waking the team and joining it
(the more so under OMP_WAIT_POLICY=PASSIVE, which the CLI sets because spinning threads slow a shared machine
many times over). A lane is a Python thread holding one OpenMP thread (or cores / lanes): two lanes each run half
the rows with no team to wake, while torch releases the GIL inside every kernel. On the default step two lanes
take the trainer's forward + backward and the rollout well below one call on two OpenMP threads under PASSIVE,
and hold up when another process is busy on a core (docs/CPU_PERFORMANCE.md, CPU lanes).

Users: the torch engine's plain loop (rollout.cpu_lanes: prompts sharded over the lanes as over Ray rollout workers,
parity.rollout.sharding, so the batch is the same as one call's on one thread, bit for bit) and the trainer
(trainer.cpu_lanes: the rows of a micro-batch split at prompt-group boundaries, each lane's forward and backward on
its own, the parameter gradients summed in lane order)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()
_local = threading.local()


def _init_lane(threads: int) -> None:
    # torch sets a thread's OpenMP count lazily, at its first parallel op, from the process-wide value the last
    # set_num_threads left: get_num_threads() makes that happen now, so the count set next is not overwritten later
    torch.get_num_threads()
    torch.set_num_threads(threads)  # this thread's OpenMP and MKL thread count (the caller keeps its own)
    _local.in_lane = True


def _new_pool(lanes: int, threads: int) -> ThreadPoolExecutor:
    """`lanes` threads, all started and set up before it is returned; then the process-wide value that torch gives
    threads started later (which each lane's set_num_threads changed) is the caller's again."""
    mine = torch.get_num_threads()
    pool = ThreadPoolExecutor(lanes, thread_name_prefix=f"parity-lane{threads}t", initializer=_init_lane,
                              initargs=(threads,))
    barrier = threading.Barrier(lanes)
    for f in [pool.submit(barrier.wait) for _ in range(lanes)]:  # one task per thread: each waits for the others
        f.result()
    torch.set_num_threads(mine)
    return pool


def in_lane() -> bool:
    """True inside a lane's thread (work there must not fan out again)."""
    return bool(getattr(_local, "in_lane", False))


def threads_per_lane(lanes: int) -> int:
    """The calling thread's torch threads shared out over `lanes` (at least one each)."""
    return max(1, torch.get_num_threads() // max(1, lanes))


def run_in_lanes(fn: Callable[[T], Any], items: Sequence[T]) -> list[Any]:
    """fn(item) for each item, one lane (thread) each, results in order; the first error is raised here after
    every lane has finished. One item (or a call from inside a lane) runs in the calling thread."""
    if len(items) <= 1 or in_lane():
        return [fn(x) for x in items]
    key = (len(items), threads_per_lane(len(items)))
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = _new_pool(*key)
    futures = [pool.submit(fn, x) for x in items]
    errors = [f.exception() for f in futures]  # waits for all: no lane still running on shared state afterwards
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]


def check_lanes(value: Any, key: str) -> int:
    """A lane count from the config: an int >= 1 (1 = off)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(value).strip() != str(n):
        raise ValueError(f"config key `{key}`: a whole number of lanes >= 1 (1 = off), got {value!r}")
    return n


def split_rows(group_ids: torch.Tensor, lanes: int) -> list[slice]:
    """Contiguous row ranges, one per lane, cut where the group id changes (so a prompt's rows stay together and
    the shared-prefix forward still computes each prompt once), each cut at the boundary nearest to an equal
    share; fewer ranges when there are fewer groups than lanes. Never an empty range."""
    b = int(group_ids.shape[0])
    if lanes <= 1 or b <= 1:
        return [slice(0, b)]
    change = (group_ids[1:] != group_ids[:-1]).nonzero().flatten() + 1
    bounds = change.tolist()
    if not bounds:
        return [slice(0, b)]
    cuts = []
    for i in range(1, lanes):
        target = i * b / lanes
        cut = min(bounds, key=lambda c: (abs(c - target), c))
        if (not cuts or cut > cuts[-1]) and 0 < cut < b:
            cuts.append(cut)
    edges = [0, *cuts, b]
    return [slice(s, e) for s, e in zip(edges, edges[1:]) if e > s]


__all__ = ["run_in_lanes", "split_rows", "check_lanes", "threads_per_lane", "in_lane"]
