"""All-or-nothing weight updates of a live model, and reading a weight back by name.

An update runs in two phases so that a refused one never touches the live model:

1. **validate** on a *meta* twin of the model (same class and config, parameters on the
   ``meta`` device, no memory): the candidate weights, as shape-only meta tensors, go through
   the twin's own ``load_weights``. That exercises exactly the live code path: name mapping,
   fused shards, shape checks and, for a full checkpoint, that every parameter is filled.
2. **load** into the live parameters in place (``copy_``; parameter storage never moves, so
   anything holding their addresses stays valid).

For a checkpoint on disk the shapes come from the safetensors headers (no tensor is read
twice); other formats (.bin, GGUF) are streamed once for shapes, then again to load.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.layers.linear import LazyWeight, ShardedWeightLoader, get_weight_loader
from sglang.srt.model_loader.loader import (
    _default_dtype,
    as_weight_loadable,
    drop_skipped_layers,
    find_safetensors_files,
    iterate_weights,
)

logger = logging.getLogger(__name__)

# Text-config fields that change what a model computes without changing parameter shapes.
_COMPUTE_CONFIG_KEYS = (
    "intermediate_size",
    "tie_word_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "partial_rotary_factor",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    # Mixture-of-experts routing and layout (layers/moe.py).
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
_SHAPE_ATTRS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
)
# "flattened_bucket": the tensors were rebuilt from upstream's flat bucket (utils/
# multiprocessing_serializer, weight_sync/tensor_bucket) and load by HF names like None.
TENSOR_LOAD_FORMATS = (None, "auto", "direct", "flattened_bucket")


class WeightUpdateError(ValueError):
    """An update refused (nothing was changed) or failed; the message says which and why."""


def build_meta_model(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """A parameter-less twin of ``model``: same class and config, parameters on ``meta``."""
    with _default_dtype(model_config.dtype), torch.device("meta"):
        return type(model)(model_config.hf_config)


def check_config_compatible(live: ModelConfig, new: ModelConfig) -> None:
    """Raise WeightUpdateError naming every field in which ``new`` differs from ``live``
    in a way that would change shapes or what the (unchanged) model code computes."""
    diffs = [
        f"{name}: {getattr(live, name)!r} -> {getattr(new, name)!r}"
        for name in _SHAPE_ATTRS
        if getattr(live, name) != getattr(new, name)
    ]
    live_text, new_text = live.hf_config.get_text_config(), new.hf_config.get_text_config()
    for key in _COMPUTE_CONFIG_KEYS:
        old_value, new_value = getattr(live_text, key, None), getattr(new_text, key, None)
        if old_value != new_value:
            diffs.append(f"{key}: {old_value!r} -> {new_value!r}")
    if diffs:
        raise WeightUpdateError(
            f"the checkpoint at {new.model_path!r} does not fit the running model "
            f"({'; '.join(diffs)})"
        )


def checkpoint_shapes(
    model_config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, meta tensor)`` for every tensor of the checkpoint that a load reads (not those
    of layers a config override left out), without reading data when the checkpoint is
    safetensors. Raises FileNotFoundError when it holds no weights."""
    return drop_skipped_layers(_all_checkpoint_shapes(model_config, dtype), model_config)


def _all_checkpoint_shapes(
    model_config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    files = [] if model_config.is_gguf else find_safetensors_files(model_config.model_path)
    if not files or model_config.load_format not in ("auto", "safetensors"):
        # GGUF tensors come lazily: their shapes without dequantizing anything.
        for name, tensor in iterate_weights(model_config, dtype, progress=False, lazy=True):
            if isinstance(tensor, LazyWeight):
                yield name, torch.empty(tensor.shape, dtype=dtype, device="meta")
            else:
                yield name, _meta_like(tensor, dtype)
        return
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                shape = f.get_slice(name).get_shape()
                yield name, torch.empty(shape, dtype=dtype, device="meta")


def _meta_like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise WeightUpdateError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    keep = not tensor.is_floating_point() or dtype is None
    return torch.empty(tensor.shape, dtype=tensor.dtype if keep else dtype, device="meta")


def validate_checkpoint(meta_model: nn.Module, model_config: ModelConfig) -> None:
    """Dry-run a full load of ``model_config``'s checkpoint into ``meta_model`` (strict: every
    parameter must be filled). Raises WeightUpdateError with the first problem found."""
    loadable = as_weight_loadable(meta_model)
    try:
        with torch.no_grad():
            loadable.load_weights(checkpoint_shapes(model_config, model_config.dtype))
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as e:
        raise WeightUpdateError(f"the checkpoint at {model_config.model_path!r}: {e}") from e


def validate_tensors(
    meta_model: nn.Module, named_tensors: list[tuple[str, Any]], load_format: str | None
) -> None:
    """Dry-run a partial update with ``named_tensors`` on ``meta_model``; raises
    WeightUpdateError for an unknown load_format, name, or a shape mismatch."""
    if load_format not in TENSOR_LOAD_FORMATS:
        raise WeightUpdateError(
            f"unsupported load_format {load_format!r} for tensors; use None, 'direct', "
            "'flattened_bucket' or a custom loader listed by --custom-weight-loader"
        )
    if not isinstance(named_tensors, (list, tuple)) or not named_tensors:
        raise WeightUpdateError("named_tensors must be a non-empty list of (name, tensor)")
    try:
        metas = []
        for item in named_tensors:
            name, tensor = item
            if not isinstance(name, str):
                raise WeightUpdateError(f"a weight name must be a str, got {name!r}")
            metas.append((name, _meta_like(tensor)))
        _apply_tensors(meta_model, metas, load_format)
    except WeightUpdateError:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise WeightUpdateError(f"refused tensor update: {e}") from e


def resolve_custom_loader(
    load_format: str, allowed: Iterable[str]
) -> Callable[[nn.Module, list[tuple[str, torch.Tensor]]], Any]:
    """The function named by ``load_format`` ("pkg.module.func"), which must be one of
    ``allowed`` (the server's ``--custom-weight-loader`` list), as upstream's
    ``dynamic_import``. WeightUpdateError when it is not listed, does not import or is not
    callable."""
    allowed = list(allowed)
    if load_format not in allowed:
        listed = ", ".join(repr(a) for a in allowed) or "none"
        raise WeightUpdateError(
            f"load_format {load_format!r} is not a registered custom weight loader "
            f"(--custom-weight-loader lists: {listed})"
        )
    module_name, _, attr = load_format.rpartition(".")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise WeightUpdateError(f"cannot import custom weight loader {load_format!r}: {e}") from e
    if not callable(func):
        raise WeightUpdateError(f"custom weight loader {load_format!r} is not callable")
    return func


def load_with_custom_loader(
    model: nn.Module,
    loader: Callable[[nn.Module, list[tuple[str, torch.Tensor]]], Any],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """Call ``loader(model, named_tensors)`` as upstream does (the tensors on the model's
    device), then let modules refresh what they derive from their weights. Nothing can be
    validated beforehand: the loader decides what the tensors mean.

    Upstream's ``model.load_weights(named_tensors)`` loads any subset, which loaders rely on
    (SkyRL's loads the tensors of one IPC request); ours is strict by default, so during the
    call ``model.load_weights`` defaults to ``strict=False``."""
    device = next(model.parameters()).device
    moved = [
        (name, t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in named_tensors
    ]
    loadable = as_weight_loadable(model)
    strict_load = loadable.load_weights

    def load_weights(
        weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = False
    ) -> None:
        strict_load(weights, strict=strict)

    # An instance attribute shadows the method for the duration of the call only.
    model.__dict__["load_weights"] = load_weights
    try:
        with torch.no_grad():
            loader(model, moved)
    finally:
        del model.__dict__["load_weights"]
    _after_loading(model)


def load_checkpoint(model: nn.Module, model_config: ModelConfig) -> None:
    """Stream ``model_config``'s checkpoint into ``model`` in place (progress bar on).
    Precondition: :func:`validate_checkpoint` passed for it."""
    with torch.no_grad():
        as_weight_loadable(model).load_weights(
            iterate_weights(model_config, model_config.dtype, lazy=True)
        )
    _after_loading(model)


def load_tensors(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], load_format: str | None
) -> None:
    """Copy ``named_tensors`` into ``model`` in place: HF names through ``load_weights`` (fused
    shards placed by it), or with ``load_format="direct"`` parameter names copied as a whole.
    Precondition: :func:`validate_tensors` passed for them."""
    _apply_tensors(model, named_tensors, load_format)
    _after_loading(model)


def _apply_tensors(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], load_format: str | None
) -> None:
    with torch.no_grad():
        if load_format == "direct":
            params = dict(model.named_parameters(remove_duplicate=False))
            for name, tensor in named_tensors:
                if name not in params:
                    raise WeightUpdateError(f"no parameter named {name!r}")
                _copy_whole(params[name], tensor, name)
        else:
            as_weight_loadable(model).load_weights(named_tensors, strict=False)


def _copy_whole(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """Copy the FULL parameter ``tensor`` (as get_weights_by_name returns it) into ``param``:
    a split parameter takes this rank's part through its weight loader."""
    loader = get_weight_loader(param)
    if isinstance(loader, ShardedWeightLoader):
        try:
            loader(param, tensor, None)
        except ValueError as e:
            raise WeightUpdateError(f"{name!r}: {e}") from e
        return
    if param.shape != tensor.shape:
        raise WeightUpdateError(
            f"shape mismatch for {name!r}: parameter {tuple(param.shape)} vs "
            f"{tuple(tensor.shape)}"
        )
    param.copy_(tensor)


def _after_loading(model: nn.Module) -> None:
    """Let modules refresh what they derive from their weights (vLLM's hook name)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()


def get_weights_by_name(model: nn.Module, name: str, truncate_size: int = 100) -> list:
    """The values of weight ``name`` as nested float lists, first dimension cut to
    ``truncate_size`` (SGLang's format). ``name`` is a parameter name or a checkpoint (HF)
    name; an HF name of a fused shard (``q_proj``, ``gate_proj``, ...) returns that shard's rows.
    With tensor parallelism the FULL weight is returned: the ranks' parts are all-gathered
    (a collective: every rank must handle the same request, as the schedulers do).
    Raises WeightUpdateError when no parameter has that name (on every rank alike)."""
    param, shard_id = _lookup(model, name)
    weight = full_weight(param, shard_id)
    return weight[: max(truncate_size, 0)].detach().to("cpu", torch.float32).tolist()


def full_weight(param: torch.Tensor, shard_id: Hashable | None = None) -> torch.Tensor:
    """The whole checkpoint tensor behind ``param`` (only shard ``shard_id`` of a fused one):
    the local tensor with one rank, else the ranks' parts gathered and put in place (a
    replicated KV head is written by each rank holding it, with the same values)."""
    loader = get_weight_loader(param)
    if not isinstance(loader, ShardedWeightLoader):
        return param
    if shard_id is not None and shard_id not in loader.shards:
        raise WeightUpdateError(f"cannot locate shard {shard_id!r}")
    shard_ids = [shard_id] if shard_id is not None else list(loader.shards)
    group = get_tp_group()
    parts = []
    for sid in shard_ids:
        shard = loader.shards[sid]
        local = param.narrow(loader.dim, shard.local_offset, shard.local_size)
        if group.world_size == 1:
            parts.append(local)
            continue
        gathered = group.all_gather(local.detach(), dim=loader.dim)
        full_shape = list(param.shape)
        full_shape[loader.dim] = shard.full_size
        full = gathered.new_empty(full_shape)
        for rank in range(group.world_size):
            num_valid = shard.valid_size(rank)
            if num_valid:
                piece = gathered.narrow(loader.dim, rank * shard.local_size, num_valid)
                full.narrow(loader.dim, shard.starts[rank], num_valid).copy_(piece)
        parts.append(full)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=loader.dim)


def _lookup(model: nn.Module, name: str) -> tuple[torch.Tensor, Hashable | None]:
    params = dict(model.named_parameters(remove_duplicate=False))
    if name in params:
        return params[name], None
    # Llama-family models expose their checkpoint-name mapping (HF name -> fused param, shard).
    mapper = getattr(model, "_map_weight_name", None)
    param_name, shard_id = mapper(name) if mapper is not None else (name, None)
    param = params.get(param_name)
    if param is None:
        raise WeightUpdateError(f"no weight named {name!r}")
    if shard_id is not None:
        loader = get_weight_loader(param)
        if not isinstance(loader, ShardedWeightLoader) or shard_id not in loader.shards:
            raise WeightUpdateError(f"cannot locate shard {shard_id!r} of {name!r}")
    return param, shard_id
