"""Linear layers split over the tensor-parallel group; their parameters load checkpoint tensors.

Every parameter carries a :class:`WeightLoader` (attached by :func:`set_weight_loader`, read
back by :func:`get_weight_loader`): ``loader(param, loaded_weight, shard_id=None)``, where
``loaded_weight`` is always the FULL checkpoint tensor (or a :class:`LazyWeight` standing for
it) and the loader copies this rank's rows or columns into ``param``. Every loading path
(disk, GGUF, tensor updates, broadcasts from a trainer, custom loaders calling
``load_weights``) therefore works the same with any number of ranks.

How the layers split (``tp`` ranks, rank ``r``; one rank is exactly the unsplit layer)::

    ColumnParallelLinear    weight [out/tp, in]   rows [r*out/tp, (r+1)*out/tp) of the checkpoint
    MergedColumnParallel    each fused part split like a column-parallel one, then stacked
    QKVParallelLinear       q: heads [r*H/tp, (r+1)*H/tp); k, v: KV heads likewise, or (fewer
                            KV heads than ranks) the single KV head r * KVH // tp, replicated
    RowParallelLinear       weight [out, in/tp]   columns [r*in/tp, ...); output all-reduced,
                            bias (whole) added once after the reduction
    ReplicatedLinear        weight [out, in] on every rank

Fused parameters hold several checkpoint tensors (shard ids) along dim 0. Per rank::

    QKVParallelLinear.weight rows   [0, q)      [q, q+kv)    [q+kv, q+2kv)
    shard id                        "q"         "k"          "v"
    (q = heads_per_rank * head_dim, kv = kv_heads_per_rank * head_dim)

    MergedColumnParallelLinear.weight rows  [0, o0/tp)  [o0/tp, o0/tp + o1/tp)  ...
    shard id                                0           1
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import NamedTuple, Protocol, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group

# The attribute of a parameter that holds its loader (the name upstream's loaders also read).
_WEIGHT_LOADER_ATTR = "weight_loader"


class LazyWeight(ABC):
    """A checkpoint tensor that has not been read yet: its shape is known, and a loader reads
    only the rows or columns it needs (each tensor-parallel rank reads its own shard)."""

    shape: torch.Size

    @abstractmethod
    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read ``[start, start+length)`` along ``dim`` (cast to the load dtype)."""

    @abstractmethod
    def materialize(self) -> torch.Tensor:
        """Read the whole tensor."""


# What a weight loader receives: a tensor, or a lazy one read on demand.
WeightSource: TypeAlias = torch.Tensor | LazyWeight


def materialize(loaded_weight: WeightSource) -> torch.Tensor:
    """``loaded_weight`` as a tensor (a lazy one is read whole)."""
    if isinstance(loaded_weight, LazyWeight):
        return loaded_weight.materialize()
    return loaded_weight


class WeightLoader(Protocol):
    """Copies this rank's part of a full checkpoint tensor into ``param`` in place
    (``shard_id``: which part of a fused parameter; None for a whole tensor). Raises
    ValueError on a shape or shard mismatch, before changing anything."""

    def __call__(
        self, param: torch.Tensor, loaded_weight: WeightSource, shard_id: Hashable | None = None
    ) -> None: ...


def default_weight_loader(
    param: torch.Tensor, loaded_weight: WeightSource, shard_id: Hashable | None = None
) -> None:
    """Copy ``loaded_weight`` into ``param`` in place (casting dtype/device): a replicated
    parameter, the same on every rank.

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
        param.copy_(materialize(loaded_weight))


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


class TPShard(NamedTuple):
    """Where one checkpoint tensor lives in a split parameter, along the loader's ``dim``.

    The rank holds ``local_size`` rows (or columns) at ``local_offset`` of its parameter; they
    are rows ``[starts[rank], starts[rank] + local_size)`` of the ``full_size`` checkpoint rows,
    cut at ``full_size`` (the rest is zero padding: a vocabulary padded to a multiple of tp).
    Replicated KV heads make several ranks' ranges equal.
    """

    local_offset: int
    local_size: int
    full_size: int
    starts: tuple[int, ...]  # one per rank

    def valid_size(self, rank: int) -> int:
        """Checkpoint rows rank ``rank`` holds (``local_size`` unless it reaches the padding)."""
        return max(0, min(self.local_size, self.full_size - self.starts[rank]))


def even_shard(full_size: int, tp_size: int, local_offset: int = 0) -> TPShard:
    """``full_size`` split in ``tp_size`` equal contiguous parts (it must divide evenly)."""
    if full_size % tp_size:
        raise ValueError(f"{full_size} is not divisible by the tensor-parallel size {tp_size}")
    size = full_size // tp_size
    return TPShard(local_offset, size, full_size, tuple(r * size for r in range(tp_size)))


class ShardedWeightLoader:
    """weight_loader of a parameter split along ``dim`` over the ranks and possibly fused
    from several checkpoint tensors (``shards``: shard id -> :class:`TPShard`; a single
    unfused tensor has the shard id None).

    Only this rank's rows of ``loaded_weight`` are read (``narrow``: lazy sources read nothing
    else). Every check runs before the first copy.
    """

    def __init__(self, dim: int, shards: dict[Hashable | None, TPShard], rank: int) -> None:
        self.dim = dim
        self.shards = shards
        self.rank = rank

    @property
    def fused(self) -> bool:
        return None not in self.shards

    def __call__(
        self, param: torch.Tensor, loaded_weight: WeightSource, shard_id: Hashable | None = None
    ) -> None:
        if shard_id is None and self.fused:
            # An already fused checkpoint tensor: the full shards one after another.
            self._check(param, loaded_weight, sum(s.full_size for s in self.shards.values()), None)
            base = 0
            for shard in self.shards.values():
                self._copy(param, loaded_weight, shard, base)
                base += shard.full_size
            return
        if shard_id not in self.shards:
            if not self.fused:
                raise ValueError(
                    f"parameter of shape {tuple(param.shape)} has no shard {shard_id!r}"
                )
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shards)}")
        shard = self.shards[shard_id]
        self._check(param, loaded_weight, shard.full_size, shard_id)
        self._copy(param, loaded_weight, shard, 0)

    def _check(
        self, param: torch.Tensor, loaded: WeightSource, full_size: int, shard_id: Hashable | None
    ) -> None:
        expected = list(param.shape)
        expected[self.dim] = full_size
        if list(loaded.shape) != expected:
            where = "" if shard_id is None else f" for shard {shard_id!r}"
            raise ValueError(
                f"shape mismatch{where}: expected {tuple(expected)}, got {tuple(loaded.shape)}"
            )

    def _copy(self, param: torch.Tensor, loaded: WeightSource, shard: TPShard, base: int) -> None:
        target = param.narrow(self.dim, shard.local_offset, shard.local_size)
        num_valid = shard.valid_size(self.rank)
        with torch.no_grad():
            if num_valid:
                source = loaded.narrow(self.dim, base + shard.starts[self.rank], num_valid)
                target.narrow(self.dim, 0, num_valid).copy_(source)
            if num_valid < shard.local_size:  # vocabulary padding
                target.narrow(self.dim, num_valid, shard.local_size - num_valid).zero_()


def _tp_rank_size(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """(rank, size): the given ones, else those of this process's tensor-parallel group."""
    group = get_tp_group()
    rank = group.rank if tp_rank is None else tp_rank
    size = group.world_size if tp_size is None else tp_size
    return rank, size


class ReplicatedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``[out_features, in_features]``,
    the whole matrix on every rank.

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
        """The weight_loader given to this layer's parameters (split subclasses override it)."""
        return default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split over the ranks: rank r computes ``out/tp`` of them.

    ``gather_output`` all-gathers the full output; otherwise each rank keeps its slice (the
    input of a :class:`RowParallelLinear`). ``tp_rank``/``tp_size`` default to this process's
    group.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = _tp_rank_size(tp_rank, tp_size)
        self.gather_output = gather_output
        self._shards = self._make_shards(out_features)
        local_out = sum(s.local_size for s in self._shards.values())
        super().__init__(in_features, local_out, bias)
        self.out_features_total = out_features

    def _make_shards(self, out_features: int) -> dict[Hashable | None, TPShard]:
        return {None: even_shard(out_features, self.tp_size)}

    def _make_loader(self) -> WeightLoader:
        return ShardedWeightLoader(0, self._shards, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_fn(x, self.weight, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = get_tp_group().all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of the same input fused along the output rows (shard
    ids 0, 1, ...); each is split over the ranks. The MLP's gate/up projection."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        gather_output: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(self.output_sizes), bias, gather_output, tp_rank, tp_size)

    def _make_shards(self, out_features: int) -> dict[Hashable | None, TPShard]:
        shards: dict[Hashable | None, TPShard] = {}
        offset = 0
        for i, size in enumerate(self.output_sizes):
            shards[i] = even_shard(size, self.tp_size, offset)
            offset += shards[i].local_size
        return shards


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds: ``total / tp``, or 1 (replicated) when there are fewer KV
    heads than ranks. ValueError when neither divides the other."""
    if total_num_kv_heads >= tp_size:
        if total_num_kv_heads % tp_size:
            raise ValueError(
                f"num_key_value_heads ({total_num_kv_heads}) is not divisible by the "
                f"tensor-parallel size ({tp_size})"
            )
        return total_num_kv_heads // tp_size
    if tp_size % total_num_kv_heads:
        raise ValueError(
            f"the tensor-parallel size ({tp_size}) is not a multiple of num_key_value_heads "
            f"({total_num_kv_heads}), so the KV heads cannot be replicated evenly"
        )
    return 1


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused into one matmul (shard ids "q", "k", "v"), split by
    attention head: rank r has query heads ``[r*H/tp, (r+1)*H/tp)`` and KV heads
    ``[r*KVH/tp, (r+1)*KVH/tp)``, or, when ``KVH < tp``, the one KV head ``r * KVH // tp``
    (replicated on ``tp / KVH`` ranks).

    ``forward`` returns ``[..., (num_heads + 2 * num_kv_heads) * head_size]`` (per-rank head
    counts); split it with ``[q_size, kv_size, kv_size]``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        rank, size = _tp_rank_size(tp_rank, tp_size)
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        if total_num_heads % size:
            raise ValueError(
                f"num_attention_heads ({total_num_heads}) is not divisible by the "
                f"tensor-parallel size ({size})"
            )
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = total_num_heads // size
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, size)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(
            hidden_size,
            (total_num_heads + 2 * total_num_kv_heads) * head_size,
            bias,
            tp_rank=rank,
            tp_size=size,
        )

    def _make_shards(self, out_features: int) -> dict[Hashable | None, TPShard]:
        size, d = self.tp_size, self.head_size
        q = even_shard(self.total_num_heads * d, size)
        # First KV head of each rank: upstream's rule, rank * KVH // tp when replicated.
        if self.total_num_kv_heads >= size:
            kv_starts = tuple(r * self.num_kv_heads * d for r in range(size))
        else:
            kv_starts = tuple(r * self.total_num_kv_heads // size * d for r in range(size))
        full_kv = self.total_num_kv_heads * d
        return {
            "q": q,
            "k": TPShard(self.q_size, self.kv_size, full_kv, kv_starts),
            "v": TPShard(self.q_size + self.kv_size, self.kv_size, full_kv, kv_starts),
        }


class RowParallelLinear(ReplicatedLinear):
    """Input features split over the ranks: rank r multiplies its ``in/tp`` input columns
    (the output of a column-parallel layer) and the partial products are summed by an
    all-reduce (``reduce_results``); the bias, whole on every rank, is added once after it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        reduce_results: bool = True,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = _tp_rank_size(tp_rank, tp_size)
        self.reduce_results = reduce_results
        self._shard = even_shard(in_features, self.tp_size)
        super().__init__(self._shard.local_size, out_features, bias)
        self.in_features_total = in_features
        set_weight_loader(self.weight, ShardedWeightLoader(1, {None: self._shard}, self.tp_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # exactly the unsplit layer (bias inside the product)
            return self.linear_fn(x, self.weight, self.bias)
        out = self.linear_fn(x, self.weight, None).contiguous()
        if self.reduce_results:
            out = get_tp_group().all_reduce(out)
        # Unreduced partial sums get the bias on rank 0 only, so that their sum has it once.
        if self.bias is not None and (self.reduce_results or self.tp_rank == 0):
            out = out + self.bias
        return out
