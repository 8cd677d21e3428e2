"""Coroutines behind ``Engine``'s weight methods (docs/weights.md); they run on the engine's
private loop and turn the TokenizerManager's replies into SGLang's return values."""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.entrypoints import replies
from sglang.srt.managers.io_struct import (
    GetWeightsByNameReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.weight_sync.tensor_bucket import bucket_to_named_tensors


async def update_from_disk(
    tm: TokenizerManager, obj: UpdateWeightFromDiskReqInput
) -> tuple[bool, str, int]:
    out = await tm.update_weights_from_disk(obj)
    return out.success, out.message, out.num_paused_requests


def tensor_request(
    named_tensors: Any,
    load_format: str | None,
    flush_cache: bool,
    weight_version: str | None,
    abort_all_requests: bool,
) -> UpdateWeightsFromTensorReqInput:
    """The request for ``update_weights_from_tensor``. Views into a larger storage (a slice of
    a flat bucket, say) are copied first: pickling a view would ship its whole storage.

    With ``load_format="flattened_bucket"``, ``named_tensors`` is, as upstream's Engine takes
    it, the list of serialized bucket payloads (one per tensor-parallel rank), or the bucket
    itself (``{"flattened_tensor", "metadata"}`` or a ``FlattenedTensorBucket``). ValueError
    for a bucket whose metadata does not fit."""
    if load_format == "flattened_bucket":
        if isinstance(named_tensors, list) and all(
            isinstance(p, (str, bytes)) for p in named_tensors
        ):
            return UpdateWeightsFromTensorReqInput(
                [], load_format, flush_cache, abort_all_requests, weight_version,
                serialized_named_tensors=list(named_tensors),
            )
        return UpdateWeightsFromTensorReqInput(
            bucket_to_named_tensors(named_tensors), load_format, flush_cache,
            abort_all_requests, weight_version,
        )
    if isinstance(named_tensors, dict):
        if "flattened_tensor" in named_tensors:
            raise ValueError("a flattened bucket needs load_format='flattened_bucket'")
        named_tensors = list(named_tensors.items())
    items = [(name, _own_storage(tensor)) for name, tensor in named_tensors]
    return UpdateWeightsFromTensorReqInput(
        items, load_format, flush_cache, abort_all_requests, weight_version
    )


def _own_storage(tensor: Any) -> Any:
    if not isinstance(tensor, torch.Tensor):
        return tensor  # refused with a clear message by the scheduler's validation
    whole = tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    if whole and tensor.is_contiguous():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


async def update_from_tensor(
    tm: TokenizerManager, obj: UpdateWeightsFromTensorReqInput
) -> tuple[bool, str]:
    out = await tm.update_weights_from_tensor(obj)
    return out.success, out.message


async def get_weights(tm: TokenizerManager, name: str, truncate_size: int) -> list:
    out = await tm.get_weights_by_name(GetWeightsByNameReqInput(name, truncate_size))
    if out.parameter is None:
        raise ValueError(out.message)
    return out.parameter


async def update_version(
    tm: TokenizerManager, obj: UpdateWeightVersionReqInput
) -> dict[str, Any]:
    out = await tm.update_weight_version(obj)
    if not out.success:
        raise ValueError(out.message)
    return replies.weight_version_reply(out)
