"""Trainer -> rollout weights by collective broadcast (`distributed.weight_sync=broadcast`): a process group of
its own, rank 0 = trainer rank 0 (the sender), ranks 1..N = the rollout workers. NCCL when the trainer and the
rollout workers are on GPUs (device-to-device over NVLink/PCIe, no host copy), gloo on CPU (what the tests run).

The NCCL case has not been run yet (no multi-GPU host has run it); the same code runs over
gloo on CPU in tests/test_distributed_fsdp.py. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set in the Ray
processes' environment by parity.distributed.cluster): it can take a shared host's GPUs out of service.

The group is built from a TCPStore directly (ProcessGroupGloo / ProcessGroupNCCL), not through
init_process_group: the trainer ranks already use the default group for FSDP, and the rollout workers are no
part of it. No Ray here: the actors call these from their methods, the driver pairs the calls up."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

# (name, shape, dtype name) of every tensor sent, in order: the receivers allocate from it
Meta = list[tuple[str, tuple[int, ...], str]]


def free_port(host: str = "") -> int:
    """A port that was free a moment ago on this host (the caller binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_address() -> str:
    """An address of this node that the other processes of the group can reach (Ray's view of the node)."""
    try:
        import ray
        return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - outside Ray (tests, benchmarks): one host
        return "127.0.0.1"


class WeightBroadcast:
    def __init__(self, address: str, port: int, rank: int, world: int, backend: str, timeout_s: float = 300.0
                 ) -> None:
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"config key `distributed.backend`: weight broadcast needs gloo or nccl, got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world, self.backend = rank, world, backend
        self.store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
        if backend == "nccl":
            # not run yet on a multi-GPU host; the current CUDA device must be this process's GPU
            self.group = dist.ProcessGroupNCCL(self.store, rank, world)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world, timeout)

    def _broadcast(self, t: torch.Tensor) -> None:
        self.group.broadcast(t, 0).wait()

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: broadcast each tensor in the order of the receivers' Meta; returns bytes sent."""
        sent = 0
        for _, t in named:
            t = t.contiguous()
            self._broadcast(t)
            sent += t.numel() * t.element_size()
        return sent

    def receive(self, meta: Meta, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks 1..N: (name, tensor) one at a time, allocated here and filled by the broadcast. The caller must
        drain the iterator (every tensor is a collective)."""
        for name, shape, dtype in meta:
            t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
            self._broadcast(t)
            yield name, t

    def close(self) -> None:
        self.group = None
        self.store = None


def meta_of(named: Iterable[tuple[str, torch.Tensor]]) -> Meta:
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]


__all__ = ["WeightBroadcast", "Meta", "meta_of", "free_port", "node_address"]
