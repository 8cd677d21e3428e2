"""``FlattenedTensorBucket``: many named tensors packed into one flat 1-D tensor plus metadata,
the payload of ``update_weights_from_tensor(load_format="flattened_bucket")`` (slime, miles).

Upstream's names, fields and methods: a trainer builds ``FlattenedTensorBucket(named_tensors=...)``
and sends ``{"flattened_tensor": bucket.get_flattened_tensor(), "metadata":
bucket.get_metadata()}`` through ``MultiprocessingSerializer``; the server rebuilds the tensors
with :meth:`FlattenedTensorBucket.reconstruct_tensors`.

Packing is by bytes (``supports_multi_dtypes``): the flat tensor is ``uint8`` and each entry's
``start_idx``/``end_idx``/``numel`` count bytes, so one bucket mixes dtypes. Buckets from older
senders, flat in the tensors' own (single) dtype with element offsets, are read too.
:func:`check_bucket` validates a received bucket (bounds, sizes, dtypes) before anything is
rebuilt from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_META_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


@dataclass
class FlattenedTensorMetadata:
    """Where tensor ``name`` lies in the flat tensor: ``[start_idx, end_idx)``, ``numel`` long
    (bytes in a ``uint8`` bucket, elements in a bucket of the tensors' own dtype)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Named tensors packed into one flat tensor, and back.

    Build from ``named_tensors`` (a trainer), or from a received ``flattened_tensor`` and its
    ``metadata`` (the server).
    """

    # Senders check this to put tensors of different dtypes in one bucket.
    supports_multi_dtypes = True

    def __init__(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]] | None = None,
        flattened_tensor: torch.Tensor | None = None,
        metadata: list[FlattenedTensorMetadata] | None = None,
    ) -> None:
        if named_tensors is not None:
            if len(named_tensors) == 0:
                raise ValueError("Cannot create empty tensor bucket")
            self.metadata: list[FlattenedTensorMetadata] = []
            pieces: list[torch.Tensor] = []
            offset = 0
            for name, tensor in named_tensors:
                raw = _as_bytes(tensor)
                self.metadata.append(
                    FlattenedTensorMetadata(
                        name=name,
                        shape=tensor.shape,
                        dtype=tensor.dtype,
                        start_idx=offset,
                        end_idx=offset + raw.numel(),
                        numel=raw.numel(),
                    )
                )
                pieces.append(raw)
                offset += raw.numel()
            self.flattened_tensor: torch.Tensor = torch.cat(pieces)
            return
        if flattened_tensor is None or metadata is None:
            raise ValueError(
                "Must provide either named_tensors or both flattened_tensor and metadata"
            )
        self.flattened_tensor = flattened_tensor
        self.metadata = list(metadata)

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every entry: views into the flat tensor where the layout
        allows (a copy otherwise). ValueError when the metadata does not fit (see
        :func:`check_bucket`)."""
        check_bucket(self.flattened_tensor, self.metadata)
        return [(_field(m, "name"), _rebuild(self.flattened_tensor, m)) for m in self.metadata]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    flat = tensor.detach().reshape(-1).contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)


def _field(meta: Any, key: str) -> Any:
    """A metadata entry's field: upstream's dataclass, or a plain dict with the same keys."""
    if isinstance(meta, dict):
        return meta[key]
    return getattr(meta, key)


def _rebuild(flat: torch.Tensor, meta: Any) -> torch.Tensor:
    start, end = _field(meta, "start_idx"), _field(meta, "end_idx")
    dtype, shape = _field(meta, "dtype"), tuple(_field(meta, "shape"))
    piece = flat[start:end]
    if flat.dtype == torch.uint8 and dtype != torch.uint8:
        if dtype == torch.bool:
            return piece.to(torch.bool).reshape(shape)
        try:
            return piece.view(dtype).reshape(shape)
        except RuntimeError:  # an offset not aligned to the element size
            return piece.clone().view(dtype).reshape(shape)
    tensor = piece.reshape(shape)
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def check_bucket(flattened_tensor: Any, metadata: Any) -> None:
    """ValueError naming the first problem: the flat tensor is not a 1-D tensor, the metadata
    is not a non-empty list of entries with upstream's fields, or an entry's dtype, shape,
    bounds or size does not fit (``end_idx - start_idx == numel``, ``numel`` equal to the
    shape's size in bytes for a ``uint8`` bucket, in elements otherwise)."""
    if not isinstance(flattened_tensor, torch.Tensor) or flattened_tensor.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D torch.Tensor")
    if not isinstance(metadata, (list, tuple)) or not metadata:
        raise ValueError("metadata must be a non-empty list of FlattenedTensorMetadata")
    total = flattened_tensor.numel()
    by_bytes = flattened_tensor.dtype == torch.uint8
    for i, meta in enumerate(metadata):
        where = f"metadata[{i}]"
        try:
            name, shape, dtype, start, end, numel = (_field(meta, k) for k in _META_FIELDS)
        except (KeyError, AttributeError) as e:
            raise ValueError(f"{where} lacks field {e.args[0]!r} (needs {_META_FIELDS})") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty string")
        where = f"metadata[{i}] ({name!r})"
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}.dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"{where}.shape must be a list of non-negative ints, got {shape!r}")
        for key, value in (("start_idx", start), ("end_idx", end), ("numel", numel)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{where}.{key} must be a non-negative int, got {value!r}")
        if not start <= end <= total:
            raise ValueError(
                f"{where}: [{start}, {end}) is outside the flattened tensor of {total} "
                f"{'bytes' if by_bytes else 'elements'}"
            )
        if end - start != numel:
            raise ValueError(f"{where}: end_idx - start_idx = {end - start} but numel = {numel}")
        elements = math.prod(shape)
        if by_bytes:
            itemsize = 1 if dtype == torch.bool else torch.empty((), dtype=dtype).element_size()
            expected, unit = elements * itemsize, "bytes"
        else:
            expected, unit = elements, "elements"
            if not (
                dtype.is_floating_point
                and flattened_tensor.dtype.is_floating_point
                or dtype == flattened_tensor.dtype
            ):
                raise ValueError(
                    f"{where}.dtype {dtype} does not fit a flattened tensor of "
                    f"{flattened_tensor.dtype}"
                )
        if numel != expected:
            raise ValueError(
                f"{where}: numel {numel} but shape {list(shape)} of {dtype} needs {expected} {unit}"
            )


def bucket_to_named_tensors(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a ``load_format="flattened_bucket"`` payload: upstream's
    dict ``{"flattened_tensor", "metadata"}`` or a :class:`FlattenedTensorBucket`. Each tensor
    gets its own storage (the flat tensor is not kept alive, nor pickled once per tensor).
    ValueError for anything else or for metadata that does not fit."""
    if isinstance(payload, FlattenedTensorBucket):
        flat, metadata = payload.flattened_tensor, payload.metadata
    elif isinstance(payload, dict):
        missing = [k for k in ("flattened_tensor", "metadata") if k not in payload]
        if missing:
            raise ValueError(
                f"a flattened_bucket payload needs the keys 'flattened_tensor' and 'metadata' "
                f"(missing: {', '.join(missing)})"
            )
        flat, metadata = payload["flattened_tensor"], payload["metadata"]
    else:
        raise ValueError(
            "a flattened_bucket payload must be a dict {'flattened_tensor': ..., 'metadata': "
            f"[...]}}, got {type(payload).__name__}"
        )
    check_bucket(flat, metadata)
    return [
        (_field(m, "name"), _rebuild(flat, m).clone(memory_format=torch.contiguous_format))
        for m in metadata
    ]
