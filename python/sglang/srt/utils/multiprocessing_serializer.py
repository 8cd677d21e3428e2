"""``MultiprocessingSerializer``: upstream's payload format for tensors sent to
``update_weights_from_tensor`` (in-process and over HTTP as base64 strings).

``serialize`` pickles with :class:`multiprocessing.reduction.ForkingPickler`, so CUDA tensors
travel as CUDA IPC handles (torch's reductions: no copy, the sender must keep them alive until
the update returned) while CPU tensors travel by value (their bytes are in the payload), which
any process can rebuild, HTTP servers included.

``deserialize`` unpickles with an allowlist: only tensors, dtypes, devices, plain Python
containers and scalars, and the two weight-sync dataclasses (flattened-bucket metadata,
``LocalSerializedTensor``, whose state is checked and whose payloads go through this same
allowlist when a rank loads one) can come out of a payload, so a crafted payload cannot run code
through arbitrary classes. Anything else raises :class:`pickle.UnpicklingError` naming what it
refused.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

# Names a payload may refer to, per module. torch's CUDA IPC reductions name the rebuild
# functions of torch.multiprocessing.reductions and torch's tensor and storage classes.
_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset({
        "list", "tuple", "dict", "set", "frozenset", "int", "float", "bool", "str", "bytes",
        "bytearray", "complex", "slice",
    }),
    "collections": frozenset({"OrderedDict"}),
    "torch": frozenset({"Size", "Tensor", "UntypedStorage", "TypedStorage", "device", "dtype"}),
    "torch.storage": frozenset({"UntypedStorage", "TypedStorage"}),
    "torch.multiprocessing.reductions": frozenset({
        "rebuild_cuda_tensor", "rebuild_tensor", "rebuild_typed_storage",
        "rebuild_typed_storage_child", "rebuild_meta_tensor",
    }),
    "torch._utils": frozenset({"_rebuild_tensor", "_rebuild_tensor_v2"}),
    __name__: frozenset({"_rebuild_cpu_tensor"}),
    # The metadata entries of a load_format="flattened_bucket" payload (a plain dataclass).
    "sglang.srt.weight_sync.tensor_bucket": frozenset({"FlattenedTensorMetadata"}),
    # Per-rank payloads (weight_sync.utils.update_weights): a dataclass whose state is checked
    # to be a list of bytes/str, each deserialized with this allowlist only when a rank loads.
    "sglang.srt.model_executor.model_runner": frozenset({"LocalSerializedTensor"}),
    # CUDA tensors pickled after monkey_patch_torch_reductions (device named by UUID).
    "sglang.srt.utils.patch_torch": frozenset({"_rebuild_cuda_tensor_modified"}),
}


def _rebuild_cpu_tensor(data: bytes, dtype_name: str, shape: tuple[int, ...]) -> Any:
    """The CPU tensor that :class:`_Pickler` wrote as raw bytes (a writable copy)."""
    import torch

    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a torch dtype: {dtype_name!r}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8
    )
    return flat.view(dtype).reshape(shape)


class _Pickler(ForkingPickler):
    """ForkingPickler that writes CPU tensors by value instead of as shared-memory handles
    (which only processes started by the sender could open)."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        cpu = isinstance(obj, torch.Tensor) and obj.device.type == "cpu"
        if cpu and obj.layout == torch.strided:
            data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            dtype_name = str(obj.dtype).removeprefix("torch.")
            return _rebuild_cpu_tensor, (data, dtype_name, tuple(obj.shape))
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"payload refers to {module}.{name}, which is not allowed")


class MultiprocessingSerializer:
    """Upstream's serializer for named-tensor payloads (same static methods)."""

    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        """``obj`` (typically ``[(name, tensor), ...]``) as bytes, or as a base64 string with
        ``output_str`` (the form JSON bodies carry)."""
        import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reductions)

        buf = io.BytesIO()
        _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode("ascii") if output_str else data

    @staticmethod
    def deserialize(data: bytes | str) -> Any:
        """The object that :meth:`serialize` wrote (a base64 string is decoded first).
        ValueError for invalid base64; pickle.UnpicklingError for a refused or broken payload."""
        import torch.multiprocessing  # noqa: F401

        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except binascii.Error as e:
                raise ValueError(f"invalid base64 payload: {e}") from None
        try:
            return _Unpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError:
            raise
        except Exception as e:
            raise pickle.UnpicklingError(f"broken payload: {e}") from None


def decode_named_tensors(
    serialized: list[str | bytes], tp_rank: int = 0, load_format: str | None = None
) -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` list in entry ``tp_rank`` of upstream's
    ``serialized_named_tensors`` (one entry per tensor-parallel rank). With
    ``load_format="flattened_bucket"`` the entry is a flattened bucket (``{"flattened_tensor",
    "metadata"}``, see ``sglang.srt.weight_sync.tensor_bucket``) and its tensors are rebuilt.
    A ``LocalSerializedTensor`` value is replaced by its payload for rank ``tp_rank``.
    ValueError when the entry is missing, does not decode, or holds something else."""
    import torch

    if not isinstance(serialized, list) or len(serialized) <= tp_rank:
        raise ValueError(
            f"serialized_named_tensors needs an entry for tensor-parallel rank {tp_rank}"
        )
    try:
        named = MultiprocessingSerializer.deserialize(serialized[tp_rank])
    except (pickle.UnpicklingError, ValueError) as e:
        raise ValueError(f"serialized_named_tensors[{tp_rank}]: {e}") from None
    if load_format == "flattened_bucket":
        from sglang.srt.weight_sync.tensor_bucket import bucket_to_named_tensors

        try:
            return bucket_to_named_tensors(named)
        except ValueError as e:
            raise ValueError(f"serialized_named_tensors[{tp_rank}]: {e}") from None
    if isinstance(named, dict) and "flattened_tensor" in named:
        raise ValueError(
            f"serialized_named_tensors[{tp_rank}] is a flattened bucket: send it with "
            "load_format='flattened_bucket'"
        )
    if isinstance(named, dict):
        named = list(named.items())
    pairs = isinstance(named, list) and all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in named
    )
    if pairs and not all(isinstance(value, torch.Tensor) for _, value in named):
        # LocalSerializedTensor values: this rank's own payload of each (model_runner imported
        # only here; the unpickler already imported it for such a value).
        from sglang.srt.model_executor.model_runner import unwrap_local_serialized

        try:
            named = unwrap_local_serialized([(name, value) for name, value in named], tp_rank)
        except ValueError as e:
            raise ValueError(f"serialized_named_tensors[{tp_rank}]: {e}") from None
    if not (pairs and all(isinstance(value, torch.Tensor) for _, value in named)):
        raise ValueError(
            f"serialized_named_tensors[{tp_rank}] must hold a list of (name, tensor) pairs"
        )
    return [(name, tensor) for name, tensor in named]
