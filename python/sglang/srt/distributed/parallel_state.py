"""The tensor-parallel group of this process and the collectives the model layers call.

One scheduler process is one rank. A process that never calls
:func:`init_distributed_environment` is a group of one: every query answers rank 0 of 1 and
every collective returns its input, so single-process code pays nothing.

Each data-parallel replica is its own torch.distributed world of ``tp_size`` ranks (its own
rendezvous address); the ranks of one replica may span nodes. Two groups over the same ranks:

* ``device_group``: tensors of the forward pass (gloo on CPU, NCCL on CUDA);
* ``cpu_group``: gloo, for Python objects (each loop turn's inputs, broadcast by rank 0).

The names are upstream's (``get_tp_group``, ``get_tensor_model_parallel_rank``,
``tensor_model_parallel_all_reduce``, ...), so code written against them reads the same here.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "divide",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_gather_object",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_min",
]


@dataclass(frozen=True)
class GroupCoordinator:
    """A group of ranks and the collectives over it; ``world_size == 1`` makes each one a no-op."""

    rank: int
    world_size: int
    device_group: Any = None  # torch ProcessGroup for tensors; None for a group of one
    cpu_group: Any = None  # gloo ProcessGroup for Python objects; None for a group of one

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place; every rank gets the same bits (one reduction,
        then the result is shared), which keeps the ranks' sampling identical."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` concatenated along ``dim`` in rank order (same shape on every rank)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable) on every rank; other ranks' argument is ignored."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """On rank ``dst``: every rank's ``obj`` (picklable), in rank order; None elsewhere."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.cpu_group)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def barrier(self) -> None:
        """Return once every rank has called it."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


_SINGLE = GroupCoordinator(rank=0, world_size=1)
_TP: GroupCoordinator = _SINGLE


def init_distributed_environment(
    world_size: int,
    rank: int,
    init_method: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> GroupCoordinator:
    """Join the ``world_size`` ranks of this replica (blocks until all have joined) and make them
    the tensor-parallel group.

    ``init_method``: ``tcp://host:port`` of the rendezvous (rank 0 listens there); ``backend``:
    "gloo" (CPU) or "nccl" (CUDA; the current CUDA device must be set before). ``timeout_s``
    bounds the rendezvous and every later collective, so a rank that dies surfaces as an error
    on the others instead of a hang. RuntimeError when already initialized.
    """
    global _TP
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=timeout,
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    device_group = dist.group.WORLD
    _TP = GroupCoordinator(rank, world_size, device_group, cpu_group or device_group)
    return _TP


def destroy_distributed_environment() -> None:
    """Leave the group (if any); afterwards this process is a group of one again."""
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = _SINGLE


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group (a group of one when not initialized)."""
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """See :meth:`GroupCoordinator.all_reduce`."""
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """See :meth:`GroupCoordinator.all_gather`."""
    return _TP.all_gather(x, dim)


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``; ValueError naming both when it does not divide evenly."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


# ---- object collectives over the CPU group (the model's side of tensor parallelism) ---------
def tensor_model_parallel_all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (over the gloo CPU
    group, whatever the device). A group of one returns ``[obj]``."""
    group = get_tp_group()
    if group.world_size == 1:
        return [obj]
    gathered: list[Any] = [None] * group.world_size
    dist.all_gather_object(gathered, obj, group=group.cpu_group)
    return gathered


def tensor_model_parallel_min(value: int) -> int:
    """The smallest ``value`` over the ranks, on every rank (sizes that must agree, such as
    the KV pool's)."""
    return int(min(tensor_model_parallel_all_gather_object(int(value))))
