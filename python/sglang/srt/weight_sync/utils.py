"""``update_weights``: push a batch of a trainer's weights into an engine from every rank of a
tensor-parallel group (upstream's ``sglang.srt.weight_sync.utils``; verl's SGLang rollout
calls it once per weight bucket).

Each trainer rank holds the same weights (full tensors, or FSDP ``DTensor`` shards that are
gathered first) next to one engine TP rank. Each serializes its own copy
(:class:`~sglang.srt.utils.multiprocessing_serializer.MultiprocessingSerializer`: a CUDA IPC
handle for a CUDA tensor, the bytes for a CPU one); the group's first rank collects the
payloads and hands the engine one ``(name, LocalSerializedTensor(values=[payload of rank 0,
payload of rank 1, ...]))`` per weight, so that engine TP rank r opens the copy of trainer
rank r, which lives on its own GPU. docs/weights.md, "Trainer ranks: update_weights".
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.entrypoints.EngineBase import EngineBase
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang.srt.model_executor.model_runner import LocalSerializedTensor
from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions


async def update_weights(
    engine: EngineBase | None,
    params_batch: list[tuple[str, torch.Tensor]],
    device_mesh_key: str,
    device_mesh: DeviceMesh,
    load_format: str | None = None,
) -> Any:
    """Load ``params_batch`` into ``engine``; a collective over the 1-D group
    ``device_mesh[device_mesh_key]`` (typically ``"infer_tp"``), whose size is the engine's TP
    size: every rank of it calls this with the same names in the same order.

    Every rank patches torch's CUDA reductions (:func:`monkey_patch_torch_reductions`, so the
    engine finds the GPU whatever its ``CUDA_VISIBLE_DEVICES``), gathers ``DTensor`` values
    to full tensors and serializes its tensors; the group's first rank (local rank 0) gathers
    the payloads (``torch.distributed.gather_object``) and alone calls ``engine`` (the other
    ranks may pass None). The senders must keep CUDA tensors alive until that call returned.

    The call, on local rank 0, is as upstream's: the engine's ``update_weights_from_tensor``
    with ``flush_cache`` and ``abort_all_requests`` at their defaults (flush, keep requests)
    and ``load_format``. This package's :class:`Engine` gets the ``(name,
    LocalSerializedTensor)`` pairs (through its ``async_`` twin) and the result is its
    ``(success, message)``; any other engine (verl's ``HttpServerAdapter``, an ``Engine``
    subclass that overrides the method) gets an ``UpdateWeightsFromTensorReqInput`` whose
    ``serialized_named_tensors`` holds those pairs serialized, once per TP rank, and the
    result is what it returns (awaited when awaitable). Other ranks return None. A refused
    update is reported in that result, not raised. ValueError when the ranks' names differ.
    """
    group_mesh = device_mesh[device_mesh_key]
    tp_size = group_mesh.size()
    tp_rank = group_mesh.get_local_rank()
    monkey_patch_torch_reductions()
    payloads = [
        (name, MultiprocessingSerializer.serialize(
            _preprocess_tensor_for_update_weights(tensor.detach())
        ))
        for name, tensor in params_batch
    ]
    gathered: list[Any] | None = [None] * tp_size if tp_rank == 0 else None
    dist.gather_object(
        payloads,
        gathered,
        dst=int(group_mesh.mesh.flatten()[0]),  # a global rank, as gather_object wants
        group=group_mesh.get_group(),
    )
    if gathered is None:
        return None
    if engine is None:
        raise ValueError("update_weights: the group's first rank must pass the engine")
    named_tensors = _per_rank_tensors(gathered)
    if getattr(type(engine), "update_weights_from_tensor", None) is (
        Engine.update_weights_from_tensor
    ):
        assert isinstance(engine, Engine)
        return await engine.async_update_weights_from_tensor(
            named_tensors, load_format=load_format
        )
    request = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(named_tensors)] * tp_size,
        load_format=load_format,
    )
    # Upstream's calling convention for these engines: one request object, positionally.
    adapter: Any = engine
    reply = adapter.update_weights_from_tensor(request)
    return await reply if inspect.isawaitable(reply) else reply


def _per_rank_tensors(gathered: list[Any]) -> list[tuple[str, LocalSerializedTensor]]:
    """The gathered ``[(name, payload), ...]`` lists of the ranks (in rank order) as one
    ``(name, LocalSerializedTensor)`` pair per weight. ValueError when the ranks sent
    different names, or as many in another order."""
    names = [[name for name, _ in rank_payloads] for rank_payloads in gathered]
    for rank, rank_names in enumerate(names[1:], start=1):
        if rank_names == names[0]:
            continue
        pairs = enumerate(zip(names[0], rank_names))
        first = next((i for i, (ours, theirs) in pairs if ours != theirs), None)
        if first is None:
            what = f"{len(rank_names)} weights, rank 0 sent {len(names[0])}"
        else:
            what = f"{rank_names[first]!r} as weight {first}, rank 0 {names[0][first]!r}"
        raise ValueError(
            f"update_weights: local rank {rank} sent {what}; every rank of the group must "
            "send the same names in the same order"
        )
    return [
        (name, LocalSerializedTensor(values=[rank_payloads[i][1] for rank_payloads in gathered]))
        for i, name in enumerate(names[0])
    ]


def _preprocess_tensor_for_update_weights(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``tensor``: a ``DTensor`` (FSDP2 shard) is gathered with
    ``full_tensor()`` (a collective over its mesh: every rank holding a shard must call this
    too), anything else is returned as it is (Megatron hands full tensors already)."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor()
    return tensor
