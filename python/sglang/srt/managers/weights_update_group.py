"""The frontend's side of upstream's broadcast weight sync (``init_weights_update_group`` /
``update_weights_from_distributed``): the TokenizerManager joins the trainer's
torch.distributed group, receives the broadcast tensors, and loads them through the same path
as ``update_weights_from_tensor``.

The group is built like upstream's custom process groups, so a trainer that creates its side
with ``init_method="tcp://addr:port"`` and ``group_name`` meets it: a TCPStore rendezvous at
``master_address:master_port`` and the group's keys under the prefix ``"<group_name>/"``.
Rank 0 is the trainer (the broadcast source); this engine is rank ``rank_offset``. Backends:
``gloo`` (CPU tensors) and ``nccl`` (CUDA tensors). Every method blocks: call them off the
event loop.
"""

from __future__ import annotations

import datetime
from typing import Any

from sglang.srt.managers.control_validation import TENSOR_LOAD_FORMATS
from sglang.srt.managers.io_struct import (
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
)

# How long joining the group waits for the other ranks.
_RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=5)


class WeightsUpdateGroups:
    """The weight-broadcast groups this process joined, by group name."""

    def __init__(self) -> None:
        self._groups: dict[str, tuple[Any, str]] = {}  # name -> (process group, device)

    def init_group(self, obj: InitWeightsUpdateGroupReqInput, rank_in_engine: int = 0) -> None:
        """Join group ``obj.group_name`` as rank ``obj.rank_offset + rank_in_engine`` (blocks
        until every rank joined). ValueError for bad arguments or a name already joined;
        RuntimeError when the rendezvous fails."""
        self.check_init(obj, rank_in_engine)
        import torch
        import torch.distributed as dist

        rank = obj.rank_offset + rank_in_engine
        store = dist.TCPStore(
            obj.master_address, int(obj.master_port), obj.world_size, is_master=False,
            timeout=_RENDEZVOUS_TIMEOUT,
        )
        prefixed = dist.PrefixStore(f"{obj.group_name}/", store)
        if obj.backend == "gloo":
            group: Any = dist.ProcessGroupGloo(prefixed, rank, obj.world_size, _RENDEZVOUS_TIMEOUT)
            device = "cpu"
        else:
            group = dist.ProcessGroupNCCL(
                prefixed, rank, obj.world_size, dist.ProcessGroupNCCL.Options()
            )
            device = f"cuda:{torch.cuda.current_device()}"
        self._groups[obj.group_name] = (group, device)

    def check_init(self, obj: InitWeightsUpdateGroupReqInput, rank_in_engine: int = 0) -> None:
        """ValueError unless :meth:`init_group` may join with these arguments (nothing joined)."""
        import torch

        if obj.group_name in self._groups:
            raise ValueError(f"weights update group {obj.group_name!r} already exists")
        if not 0 < obj.rank_offset + rank_in_engine < obj.world_size:
            raise ValueError(
                f"rank_offset + engine rank must be in [1, world_size), got {obj.rank_offset} + "
                f"{rank_in_engine} of {obj.world_size}"
            )
        if obj.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {obj.backend!r}")
        if obj.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA; use 'gloo' on CPU")

    def receive(self, obj: UpdateWeightsFromDistributedReqInput) -> list[tuple[str, Any]]:
        """The tensors rank 0 broadcasts, in order, as ``(name, tensor)``. ValueError for an
        unknown group or inconsistent names/dtypes/shapes."""
        import torch

        if obj.group_name not in self._groups:
            raise ValueError(f"no weights update group {obj.group_name!r}; initialize it first")
        group, device = self._groups[obj.group_name]
        if obj.load_format not in TENSOR_LOAD_FORMATS:
            raise ValueError(
                f"unsupported load_format {obj.load_format!r} for update_weights_from_distributed;"
                " use None or 'flattened_bucket'"
            )
        names, dtypes, shapes = _specs(obj)
        received = []
        for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
            dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype_name!r} for {name!r}")
            received.append((name, torch.empty(list(shape), dtype=dtype, device=device)))
        if obj.load_format == "flattened_bucket":
            # One broadcast of the whole bucket: the sender flattens the same names, dtypes and
            # shapes with FlattenedTensorBucket, so both sides lay it out alike.
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            bucket = FlattenedTensorBucket(named_tensors=received)
            group.broadcast(bucket.get_flattened_tensor(), 0).wait()
            return bucket.reconstruct_tensors()
        for _, tensor in received:
            group.broadcast(tensor, 0).wait()
        return received

    def destroy(self, group_name: str) -> None:
        """Leave group ``group_name``. ValueError when it was never joined."""
        if self._groups.pop(group_name, None) is None:
            raise ValueError(f"no weights update group {group_name!r}")


def _specs(obj: UpdateWeightsFromDistributedReqInput) -> tuple[list[Any], list[Any], list[Any]]:
    names: list[Any]
    dtypes: list[Any]
    shapes: list[Any]
    if obj.names is not None:
        names, dtypes, shapes = obj.names, obj.dtypes or [], obj.shapes or []
    elif obj.name is not None:
        names, dtypes, shapes = [obj.name], [obj.dtype], [obj.shape or []]
    else:
        raise ValueError("give 'name', 'dtype', 'shape' or 'names', 'dtypes', 'shapes'")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes must have the same length")
    return list(names), list(dtypes), list(shapes)
