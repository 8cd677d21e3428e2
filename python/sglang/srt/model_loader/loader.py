"""Build a model from its ModelConfig and stream its weights in.

Weight sources, picked by ``load_format``:

| load_format  | source                                                                 |
|--------------|------------------------------------------------------------------------|
| auto         | GGUF when the config is GGUF, else safetensors, else pytorch_model*.bin |
| safetensors  | model.safetensors or the shards named by model.safetensors.index.json   |
| gguf         | the model's .gguf file (dequantized to float)                           |
| dummy        | no files: parameters get small seeded random values                     |

Every tensor is cast to the model dtype on the CPU as it streams (halving host->device
traffic for 16-bit models) and handed to the model's ``load_weights``, which places it.

With ``lazy=True`` (what model loading uses) safetensors and GGUF tensors are handed over as
:class:`~sglang.srt.layers.linear.LazyWeight` objects: the weight loader of a split parameter
reads only this tensor-parallel rank's rows or columns (safetensors: ``get_slice``; GGUF:
see gguf_loader). A lazy weight must be used before the iterator advances (its file may
close). ``pytorch_model*.bin`` files are read whole on every rank.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from tqdm import tqdm

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.linear import LazyWeight, WeightSource

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_DUMMY_SEED = 1234  # fixed so that every TP rank and every run draws the same dummy weights


@runtime_checkable
class WeightLoadable(Protocol):
    """A model that places HF-named checkpoint tensors into its parameters, in place: a name
    it has no parameter for is a ValueError, and so is, with ``strict``, an unfilled one."""

    def load_weights(
        self, weights: Iterable[tuple[str, WeightSource]], *, strict: bool = True
    ) -> None: ...


def as_weight_loadable(model: torch.nn.Module) -> WeightLoadable:
    """``model`` itself, typed as :class:`WeightLoadable`; TypeError when it is not one."""
    if not isinstance(model, WeightLoadable):
        raise TypeError(f"{type(model).__name__} has no load_weights method")
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make ``dtype`` torch's default float dtype inside the block; restore it afterwards."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _files_from_index(model_dir: str, index_name: str) -> list[str]:
    with open(os.path.join(model_dir, index_name), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    # dict.fromkeys keeps the first-seen order of the shards and drops duplicates.
    return [os.path.join(model_dir, name) for name in dict.fromkeys(weight_map.values())]


def find_safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files holding a model: the index's shards, else every ``*.safetensors``
    (``model*.safetensors`` preferred, to skip stray consolidated copies). May be empty."""
    if os.path.isfile(os.path.join(model_dir, _SAFETENSORS_INDEX)):
        return _files_from_index(model_dir, _SAFETENSORS_INDEX)
    files = sorted(glob.glob(os.path.join(model_dir, "model*.safetensors")))
    return files or sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def find_bin_files(model_dir: str) -> list[str]:
    """The ``pytorch_model*.bin`` files of a model (the index's shards when indexed)."""
    if os.path.isfile(os.path.join(model_dir, _BIN_INDEX)):
        return _files_from_index(model_dir, _BIN_INDEX)
    return sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    # Integer tensors (position ids, quantization metadata) keep their type.
    if dtype is None or not tensor.is_floating_point():
        return tensor
    return tensor.to(dtype)


class SafetensorsWeight(LazyWeight):
    """One tensor of an open safetensors file, read (and cast to ``dtype``) on demand."""

    def __init__(self, handle: Any, name: str, dtype: torch.dtype | None) -> None:
        self._handle = handle
        self._name = name
        self._dtype = dtype
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return _cast(self._slice[tuple(index)], self._dtype)

    def materialize(self) -> torch.Tensor:
        return _cast(self._handle.get_tensor(self._name), self._dtype)


def iterate_safetensors(
    files: list[str], dtype: torch.dtype | None = None, progress: bool = True, lazy: bool = False
) -> Iterator[tuple[str, WeightSource]]:
    """Yield ``(name, tensor)`` for every tensor of the given safetensors files, one at a time
    (``lazy``: a :class:`SafetensorsWeight` instead, read when a loader narrows it).

    Floating tensors are cast to ``dtype`` when given. Memory stays at about one tensor.
    """
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not progress) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    if lazy:
                        yield name, SafetensorsWeight(f, name, dtype)
                    else:
                        yield name, _cast(f.get_tensor(name), dtype)
                    bar.update(1)


def iterate_bin_files(
    files: list[str], dtype: torch.dtype | None = None, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from ``pytorch_model*.bin`` files, loaded with
    ``weights_only=True`` (no pickled code runs) one file at a time."""
    for path in tqdm(files, desc="Loading .bin shards", unit="shard", disable=not progress):
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        for name, tensor in state_dict.items():
            yield name, _cast(tensor, dtype)
        del state_dict


def iterate_gguf(
    path: str, dtype: torch.dtype | None = None, progress: bool = True, lazy: bool = False
) -> Iterator[tuple[str, WeightSource]]:
    """Yield the HF-named, dequantized weights of a GGUF file, cast to ``dtype`` (``lazy``:
    as :class:`~sglang.srt.model_loader.gguf_loader.GGUFWeight`, dequantized on demand)."""
    from sglang.srt.model_loader.gguf_loader import iterate_gguf_weights

    for name, tensor in iterate_gguf_weights(path, progress, lazy=lazy, dtype=dtype):
        yield name, tensor if isinstance(tensor, LazyWeight) else _cast(tensor, dtype)


def iterate_weights(
    model_config: ModelConfig,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    lazy: bool = False,
) -> Iterator[tuple[str, WeightSource]]:
    """Stream the checkpoint weights of ``model_config`` as ``(hf_name, cpu tensor)``
    (``lazy``: safetensors and GGUF tensors as LazyWeight objects, see the module docstring).

    ``dtype`` defaults to ``model_config.dtype``. Raises ``FileNotFoundError`` (eagerly, before
    the first tensor) when the directory holds no weights of the requested format, and
    ``ValueError`` for ``load_format="dummy"`` (which has no files) or an unknown format.
    """
    return drop_skipped_layers(_iterate_files(model_config, dtype, progress, lazy), model_config)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_Named = TypeVar("_Named")


def drop_skipped_layers(
    weights: Iterator[tuple[str, _Named]], model_config: ModelConfig
) -> Iterator[tuple[str, _Named]]:
    """``weights`` without the tensors of layers from ``model_config.skip_layers_from`` on (a
    config override asked for fewer layers than the checkpoint has); all of them otherwise."""
    first = model_config.skip_layers_from
    if first is None:
        return weights
    return (
        (name, tensor) for name, tensor in weights
        if (match := _LAYER_INDEX.search(name)) is None or int(match.group(1)) < first
    )


def _iterate_files(
    model_config: ModelConfig, dtype: torch.dtype | None, progress: bool, lazy: bool
) -> Iterator[tuple[str, WeightSource]]:
    """:func:`iterate_weights` before any tensor is dropped."""
    dtype = model_config.dtype if dtype is None else dtype
    load_format = model_config.load_format
    if load_format == "dummy":
        raise ValueError("load_format='dummy' has no weight files to iterate")
    if load_format not in ("auto", "safetensors", "gguf"):
        raise ValueError(f"unknown load_format {load_format!r}")
    if model_config.gguf_file is not None and load_format in ("auto", "gguf"):
        return iterate_gguf(model_config.gguf_file, dtype, progress, lazy)
    model_dir = model_config.model_path
    files = find_safetensors_files(model_dir)
    if files:
        return iterate_safetensors(files, dtype, progress, lazy)
    if load_format == "auto":
        files = find_bin_files(model_dir)
        if files:
            return iterate_bin_files(files, dtype, progress)
    wanted = "*.safetensors" if load_format == "safetensors" else "*.safetensors or *.bin"
    raise FileNotFoundError(f"no weight files ({wanted}) in {model_dir!r}")


def initialize_dummy_weights(
    model: torch.nn.Module, low: float = -1e-3, high: float = 1e-3
) -> None:
    """Fill every floating parameter of ``model`` in place with seeded uniform values.

    Small values keep activations finite through deep stacks; buffers (rotary caches) keep
    what the model computed.
    """
    generator = torch.Generator(device="cpu").manual_seed(_DUMMY_SEED)
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            values = torch.empty(param.shape, dtype=torch.float32).uniform_(
                low, high, generator=generator
            )
            param.copy_(values.to(param.dtype))


def load_weights_into(
    model: torch.nn.Module, model_config: ModelConfig, weights: Iterable | None = None
) -> None:
    """Stream checkpoint weights (``iterate_weights(model_config)`` unless ``weights`` is
    given) into ``model.load_weights``; this mutates the model's parameters in place."""
    with torch.no_grad():
        loadable = as_weight_loadable(model)
        loadable.load_weights(iterate_weights(model_config) if weights is None else weights)


def get_model(model_config: ModelConfig, device: str) -> torch.nn.Module:
    """Instantiate the registered class for ``model_config.architectures`` on ``device`` in
    ``model_config.dtype`` and load its weights (or dummy ones). Returns it in eval mode.

    The global default dtype is changed only while the model is built and restored after,
    even on error. Unsupported architectures raise from the model registry.
    """
    from sglang.srt.models.registry import get_model_class

    model_class = get_model_class(model_config.architectures)
    if model_config.load_format != "dummy":
        # Fails fast on missing files, before building; each rank reads only its shards.
        weights = iterate_weights(model_config, lazy=True)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_class(model_config.hf_config)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model)
    else:
        load_weights_into(model, model_config, weights)
    logger.info(
        "loaded %s (%s) on %s in %s", model_class.__name__, model_config.model_path, device,
        model_config.dtype,
    )
    return model.eval()
