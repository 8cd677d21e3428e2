"""``monkey_patch_torch_reductions``: CUDA tensors pickled for another process name their GPU by
UUID instead of by index (upstream's ``sglang.srt.utils.patch_torch``, which verl calls before
serializing weights).

torch's CUDA IPC reduction writes the storage's device *index*. The index is relative to the
sender's ``CUDA_VISIBLE_DEVICES``: a trainer that sees one GPU as ``cuda:0`` and an engine that
sees the same GPU as ``cuda:3`` would open the handle on the wrong device. After the patch the
payload carries the GPU's UUID, which every process agrees on, and the receiver maps it back to
its own index. The receiving side needs no patch of its own: the payload names
:func:`_rebuild_cuda_tensor_modified` (which the engine's unpickler allows), and that function
accepts an index (an unpatched sender) as well as a UUID.

CPU tensors are untouched: :class:`~sglang.srt.utils.multiprocessing_serializer.
MultiprocessingSerializer` writes them by value before torch's reductions are consulted, and
plain ``ForkingPickler`` users keep torch's shared-memory path.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing import reductions

# Set on torch's reductions module by the first patch: torch's own reduce_tensor, which the
# patched one wraps. Its presence is what makes the patch idempotent, across re-imports too.
_ORIGINAL_REDUCE_ATTR = "_sglang_reduce_tensor_by_device_index"


@functools.cache
def _device_arg_index() -> int:
    """Position of the storage's device in the rebuild arguments (``storage_device``; 6 in
    every torch release since CUDA IPC exists, read from the signature so that a torch that
    moves it keeps working)."""
    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    return params.index("storage_device") if "storage_device" in params else 6


def monkey_patch_torch_reductions() -> None:
    """Make torch's CUDA tensor reduction (used by ``ForkingPickler`` and so by
    ``MultiprocessingSerializer.serialize``) write the GPU's UUID instead of its index.

    Idempotent (a second call does nothing) and safe on a machine without CUDA: nothing
    touches a GPU until a CUDA tensor is pickled. Affects the whole process."""
    if hasattr(reductions, _ORIGINAL_REDUCE_ATTR):
        return
    setattr(reductions, _ORIGINAL_REDUCE_ATTR, reductions.reduce_tensor)
    reductions.reduce_tensor = _reduce_tensor_modified
    # ForkingPickler holds the reducer it was registered with; register the patched one.
    reductions.init_reductions()


def _reduce_tensor_modified(tensor: torch.Tensor) -> tuple[Callable[..., Any], tuple]:
    """torch's reduction of ``tensor``; for a CUDA tensor the device index becomes the UUID
    and the rebuild function :func:`_rebuild_cuda_tensor_modified`."""
    original = getattr(reductions, _ORIGINAL_REDUCE_ATTR)
    fn, args = original(tensor)
    if fn is not reductions.rebuild_cuda_tensor:  # this module never replaces it
        return fn, args  # CPU shared memory, meta: no device index inside
    i = _device_arg_index()
    args = (*args[:i], _device_uuid(args[i]), *args[i + 1 :])
    return _rebuild_cuda_tensor_modified, args


def _rebuild_cuda_tensor_modified(*args: Any) -> torch.Tensor:
    """Rebuild a CUDA tensor from torch's IPC arguments whose device is a UUID (a patched
    sender) or an index (an unpatched one). The name is upstream's: payloads refer to it, so
    either side may be built by either implementation. RuntimeError when no visible GPU has
    that UUID."""
    i = _device_arg_index()
    if i < len(args):
        args = (*args[:i], _device_index(args[i]), *args[i + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(device: int | str) -> int:
    """This process's index of ``device`` (an index is kept as it is)."""
    if isinstance(device, int):
        return device
    if not isinstance(device, str):
        raise TypeError(f"a CUDA device must be an index or a UUID string, got {device!r}")
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == device:
            return index
    raise RuntimeError(f"no visible CUDA device has UUID {device} (check CUDA_VISIBLE_DEVICES)")
