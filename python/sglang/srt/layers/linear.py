"""Dense linear layers whose parameters know how to load checkpoint tensors.

Every parameter carries a :class:`WeightLoader`, attached by :func:`set_weight_loader` and read
back by :func:`get_weight_loader`: ``loader(param, loaded_weight, shard_id=None)``. Fused
layers (QKV, gate/up) own one weight whose rows are split into named shards; the loader copies
a checkpoint tensor into its shard's rows::

    QKVLinear.weight rows   [0, q)         [q, q+kv)       [q+kv, q+2kv)
    shard id                "q"            "k"             "v"
    (q = num_heads * head_dim, kv = num_kv_heads * head_dim)

    MergedLinear.weight rows  [0, o0)  [o0, o0+o1)  ...
    shard id                  0        1

Single-device only: tensor-parallel sharding would split these rows further per rank.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# The attribute of a parameter that holds its loader (the name upstream's loaders also read).
_WEIGHT_LOADER_ATTR = "weight_loader"


class WeightLoader(Protocol):
    """Copies a checkpoint tensor into ``param`` in place (``shard_id``: which rows of a fused
    parameter; None for a whole tensor). Raises ValueError on a shape or shard mismatch."""

    def __call__(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None: ...


def default_weight_loader(
    param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
) -> None:
    """Copy ``loaded_weight`` into ``param`` in place (casting dtype/device).

    Raises ValueError when a shard id is given (this parameter is not fused) or the shapes differ.
    """
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}")
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
            f"{tuple(loaded_weight.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded_weight)


def set_weight_loader(param: torch.Tensor, loader: WeightLoader) -> None:
    """Attach ``loader`` to ``param`` (a tensor takes extra Python attributes; its static type
    does not declare them, hence this typed accessor pair)."""
    setattr(param, _WEIGHT_LOADER_ATTR, loader)


def get_weight_loader(param: torch.Tensor) -> WeightLoader:
    """The loader attached to ``param`` by :func:`set_weight_loader`, else
    :func:`default_weight_loader`."""
    loader: WeightLoader = getattr(param, _WEIGHT_LOADER_ATTR, default_weight_loader)
    return loader


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; a single bfloat16 row without bias on CPU goes through
    ``torch.mv``.

    oneDNN's bfloat16 GEMM is slow for one row (batch-1 decode): ``mv`` is 1.3-1.6x faster there
    (the LM head: 3.2 -> 2.0 ms on 2 cores) and gives the same values (float32 accumulation, one
    rounding; see test_linear_single_row). With a bias, whether F.linear rounds the product
    before adding it depends on the CPU (AVX512-BF16 or not), so that case stays on F.linear.
    """
    if (
        bias is None
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
    ):
        return torch.mv(weight, x[0]).unsqueeze(0)
    return F.linear(x, weight, bias)


class _ShardLoader:
    """weight_loader of a fused parameter: ``shard_id -> (row offset, row count)`` along dim 0."""

    def __init__(self, shards: dict[Hashable, tuple[int, int]]) -> None:
        self.shards = shards

    def __call__(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if shard_id is None:  # an already fused checkpoint tensor
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shards)}")
        offset, size = self.shards[shard_id]
        target = param.narrow(0, offset, size)
        if target.shape != loaded_weight.shape:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: expected {tuple(target.shape)}, "
                f"got {tuple(loaded_weight.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded_weight)


class ReplicatedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``[out_features, in_features]``.

    Parameters are allocated uninitialised in the default dtype: they must be loaded.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # The product used by forward(); deterministic mode swaps in batch_invariant_linear.
        self.linear_fn = linear
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_loader(self.weight, self._make_loader())
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_loader(self.bias, self._make_loader())
        else:
            self.register_parameter("bias", None)

    def _make_loader(self) -> WeightLoader:
        """The weight_loader given to this layer's parameters (fused subclasses override it)."""
        return default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(ReplicatedLinear):
    """Several linear layers of the same input fused along the output rows (shard ids 0, 1, ...).

    Used for the MLP's gate/up projection: one matmul, then ``SiluAndMul`` splits the result.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        self._shards: dict[Hashable, tuple[int, int]] = {
            i: (offsets[i], size) for i, size in enumerate(self.output_sizes)
        }
        super().__init__(in_features, sum(self.output_sizes), bias)

    def _make_loader(self) -> _ShardLoader:
        return _ShardLoader(self._shards)


class QKVLinear(ReplicatedLinear):
    """The q, k and v projections fused into one matmul (shard ids "q", "k", "v").

    ``forward`` returns ``[..., (num_heads + 2 * num_kv_heads) * head_dim]``; split it with
    ``[q_size, kv_size, kv_size]``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self._shards: dict[Hashable, tuple[int, int]] = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def _make_loader(self) -> _ShardLoader:
        return _ShardLoader(self._shards)
