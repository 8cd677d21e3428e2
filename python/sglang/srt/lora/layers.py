"""The adapter slots of one fused projection, and the batched LoRA matmul applied to its output.

Each adapted projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` of every
decoder layer) gets a :class:`LoRATarget`: per slot, the adapter's A rows of every shard stacked
and its (scaled) B written into the shard's output rows::

    shard s of a fused layer (q, k, v  or  gate, up), adapter of rank r in slot i:
      A[i, s*r:(s+1)*r, :]                 = lora_A of shard s      [r, in_features]
      B[i, off_s:off_s+size_s, s*r:(s+1)*r] = scaling * lora_B of s  [size_s, r]
    delta rows of slot i = (x_i @ A[i, :n*r].T) @ B[i, :, :n*r].T    (n shards)

A shard the adapter leaves alone keeps zeros. The base layer is not replaced: a forward hook
adds the delta to its output, so its own ``forward`` (and the ``linear_fn`` that deterministic
mode and the CPU prepack swap in), its parameter names and its weight loaders stay as they are.

Rows are grouped by slot once per batch (:class:`LoRABatchInfo`); every projection then runs
three phases, so that a kernel can replace the first and the last:

    shrink   h = x[rows] @ A.T            per slot group               [n, k]
    reduce   h summed over the TP ranks   row-parallel layers only     [n, k]
    expand   out[rows] += h @ B.T         index_add into the output    [n, out]

Rows of the base model are skipped. No Python work per token. On CUDA (outside deterministic
mode) the rows are described as segments instead, and two segment-grouped Triton kernels
(lora/triton_ops.py) do the shrink and the expand with no gather or scatter.

Tensor parallelism: each rank holds the slice of an adapter that matches its slice of the base
layer (read from the layer's own weight loader, so the LoRA split can never disagree with the
base split; ``tp`` ranks, rank ``r``)::

    layer split          A (r x in)                   B (out x r)
    column (qkv, gate_up) whole                        rows of this rank's output shard: its q
                                                       heads, its (possibly replicated) KV
                                                       heads, its gate / up halves
    row (o, down)        columns of this rank's input whole

For a row-parallel layer the rank's shrink ``x_r @ A_r.T`` is a partial sum. The hook runs
after the layer's ``forward``, i.e. after its own all-reduce, when every rank holds the full
output; so the partial shrinks are all-reduced too and every rank adds the same full delta
``(sum_r x_r @ A_r.T) @ B.T`` to that (replicated) output: the delta is counted once. A layer
that leaves its output unreduced (``reduce_results=False``) gets the partial delta
``(x_r @ A_r.T) @ B.T`` instead; the later reduction sums it with the partial outputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import tensor_model_parallel_all_reduce
from sglang.srt.layers.linear import ShardedWeightLoader, TPShard, get_weight_loader
from sglang.srt.lora.adapter import PROJ_TO_MODULE, LoRAAdapter, LoRAError
from sglang.srt.lora.triton_ops import LoRASegments, lora_expand, lora_shrink

_TARGET_RE = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$"
)

# A product ``(x, weight) -> x @ weight.T``: plain, or the layer's batch-invariant one.
Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class LoRABatchInfo:
    """Which rows of the step's flattened tokens use which slot: ``(slot, rows)`` per adapter
    in the batch; ``rows`` None means every row (the whole batch uses that one adapter).

    With several adapters of similar row counts (decode), ``padded`` holds the same grouping
    as one ``[G, n_max]`` table so every projection does a fixed number of ops whatever G::

        padded_rows [G*n_max]  row of x for each (group, position); padding repeats a real row
        padded_mask [G*n_max, 1]  1.0 for real positions, 0.0 for padding
        slots       [G]        the slot of each group
    """

    groups: list[tuple[int, torch.Tensor | None]]
    padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None = None
    # On CUDA (and not in deterministic mode): the rows as segments for the Triton kernels
    # (lora/triton_ops.py), which then replace the gather / matmul / index_add path.
    segments: LoRASegments | None = None


@dataclass(frozen=True)
class TPSplit:
    """How a base layer is split over the tensor-parallel ranks, as its weight loader says.

    ``dim`` 0: output rows split (column-parallel; one :class:`TPShard` per fused part, in
    the layer's row order); ``dim`` 1: input columns split (row-parallel; one shard).
    ``reduce``: the layer all-reduces its output, so a LoRA shrink must be all-reduced too.
    """

    dim: int
    shards: tuple[TPShard, ...]
    rank: int
    reduce: bool

    @staticmethod
    def of(module: nn.Module) -> TPSplit:
        """The split of ``module`` (a layer of layers/linear.py). ValueError for a layer
        whose weight has no sharded loader (LoRA only adapts the parallel linear layers)."""
        loader = get_weight_loader(module.weight)  # type: ignore[arg-type]
        if not isinstance(loader, ShardedWeightLoader):
            raise ValueError(f"{type(module).__name__} is not a parallel linear layer")
        shards = tuple(loader.shards.values())
        tp_size = len(shards[0].starts)
        reduce = loader.dim == 1 and tp_size > 1 and bool(vars(module).get("reduce_results"))
        return TPSplit(loader.dim, shards, loader.rank, reduce)


class LoRATarget:
    """The slots of one projection (this rank's slice of every adapter) and the hook that
    applies them."""

    def __init__(
        self,
        module: nn.Module,
        layer: int,
        kind: str,
        num_slots: int,
        max_rank: int,
        get_batch: Callable[[], LoRABatchInfo | None],
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant``: compute the delta with the layer's own ``linear_fn`` (the
        batch-invariant product of deterministic mode), so each row's delta is bitwise
        independent of the other rows of the step."""
        weight = module.weight
        assert isinstance(weight, torch.Tensor), f"{kind} of layer {layer} has no weight tensor"
        self.layer, self.kind = layer, kind
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.split = TPSplit.of(module)
        if self.split.dim == 0:  # fused parts, each this rank's rows of the checkpoint's
            self.sizes = [s.local_size for s in self.split.shards]
            self.offsets = [s.local_offset for s in self.split.shards]
            self.full_sizes = [s.full_size for s in self.split.shards]
            self.full_in_features = self.in_features
        else:
            self.sizes, self.offsets = [self.out_features], [0]
            self.full_sizes = [self.out_features]
            self.full_in_features = self.split.shards[0].full_size
        n = len(self.sizes)
        dev, dtype = weight.device, weight.dtype
        self.A = torch.zeros(num_slots, n * max_rank, self.in_features, dtype=dtype, device=dev)
        self.B = torch.zeros(num_slots, self.out_features, n * max_rank, dtype=dtype, device=dev)
        self.width = [0] * num_slots  # n * rank of the adapter in each slot (0: empty)
        # The same widths on the device, for the Triton kernels (read there without a sync).
        self.width_dev = torch.zeros(num_slots, dtype=torch.int32, device=dev)
        self._get_batch = get_batch
        self.batch_invariant = batch_invariant
        self.handle = module.register_forward_hook(self._hook)

    # ---- adapter weights ---------------------------------------------------------------------
    def check(self, adapter: LoRAAdapter, proj: str, shard: int) -> None:
        """LoRAError unless ``adapter``'s FULL (unsplit) weights of ``proj`` fit the full base
        layer's part ``shard``."""
        a, b = adapter.weights[(self.layer, proj)]
        if a.shape[1] != self.full_in_features or b.shape[0] != self.full_sizes[shard]:
            raise LoRAError(
                f"adapter {adapter.name!r}: layer {self.layer} {proj} has A {tuple(a.shape)}, "
                f"B {tuple(b.shape)}; the base model needs A [r, {self.full_in_features}] and "
                f"B [{self.full_sizes[shard]}, r]"
            )

    def local_weights(
        self, shard: int, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of full weights ``a`` [r, in], ``b`` [out_shard, r] that passed
        :meth:`check`: B's rows of the rank's output shard (column-parallel) or A's columns
        of its input shard (row-parallel); copies, so the full tensors can be freed."""
        part = self.split.shards[0 if self.split.dim == 1 else shard]
        start = part.starts[self.split.rank]
        if self.split.dim == 0:
            return a.clone(), b.narrow(0, start, part.local_size).clone()
        return a.narrow(1, start, part.local_size).clone(), b.clone()

    def write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Copy ``adapter``'s (this rank's) weights of this layer into ``slot`` (None: clear
        it)."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        self._set_width(slot, 0)
        if adapter is None:
            return
        r = adapter.rank
        for proj, (kind, shard) in PROJ_TO_MODULE.items():
            pair = adapter.weights.get((self.layer, proj)) if kind == self.kind else None
            if pair is None:
                continue
            a, b = pair
            off, size = self.offsets[shard], self.sizes[shard]
            self.A[slot, shard * r : (shard + 1) * r].copy_(a)
            self.B[slot, off : off + size, shard * r : (shard + 1) * r].copy_(b)
        self._set_width(slot, len(self.sizes) * r)

    def _set_width(self, slot: int, width: int) -> None:
        self.width[slot] = width
        self.width_dev[slot] = width

    # ---- the forward hook: shrink, reduce, expand --------------------------------------------
    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        # Every decision below (groups, widths) is the same on every TP rank: they prepared
        # the same batch with the same slots, so they run the same collectives.
        batch = self._get_batch()
        if batch is None:
            return output
        x = inputs[0].reshape(-1, self.in_features)
        out = output.view(-1, self.out_features)
        if batch.segments is not None and not self.batch_invariant:
            h = lora_shrink(x, self.A, self.width_dev, batch.segments)
            h = self._reduce([h])[0]  # zero columns past a slot's width sum to zero
            lora_expand(h, self.B, self.width_dev, batch.segments, out, self.offsets)
            return output
        if batch.padded is not None and not self.batch_invariant:
            padded_rows, mask, slots, slot_list = batch.padded
            k = max(self.width[s] for s in slot_list)
            if k > 0:
                h = self._reduce([self._shrink_padded(x, padded_rows, slots, k)])[0]
                self._expand_padded(h, out, padded_rows, mask, slots, k)
            return output
        product: Product = vars(module)["linear_fn"] if self.batch_invariant else _product
        groups = [(slot, rows) for slot, rows in batch.groups if self.width[slot] > 0]
        shrunk = [self._shrink(x, slot, rows, product) for slot, rows in groups]
        for (slot, rows), h in zip(groups, self._reduce(shrunk)):
            self._expand(out, slot, rows, h, product)
        return output

    def _shrink(
        self, x: torch.Tensor, slot: int, rows: torch.Tensor | None, product: Product
    ) -> torch.Tensor:
        """``x[rows] @ A[slot].T`` [n, k] (``rows`` None: every row)."""
        xs = x if rows is None else x.index_select(0, rows)
        return product(xs, self.A[slot, : self.width[slot]])

    def _reduce(self, shrunk: list[torch.Tensor]) -> list[torch.Tensor]:
        """The shrinks summed over the TP ranks (one all-reduce for all of them) when the
        layer's output is reduced; else as they are."""
        if not self.split.reduce or not shrunk:
            return shrunk
        if len(shrunk) == 1:
            return [tensor_model_parallel_all_reduce(shrunk[0].contiguous())]
        flat = tensor_model_parallel_all_reduce(torch.cat([h.reshape(-1) for h in shrunk]))
        return [
            part.view_as(h) for part, h in zip(flat.split([h.numel() for h in shrunk]), shrunk)
        ]

    def _expand(
        self,
        out: torch.Tensor,
        slot: int,
        rows: torch.Tensor | None,
        h: torch.Tensor,
        product: Product,
    ) -> None:
        """``out[rows] += h @ B[slot].T``."""
        delta = product(h, self.B[slot, :, : self.width[slot]])
        if rows is None:
            out.add_(delta)
        else:
            out.index_add_(0, rows, delta)

    def _shrink_padded(
        self, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, k: int
    ) -> torch.Tensor:
        """All groups at once: ``[G, n_max, in] @ A[G]^T`` -> ``[G, n_max, k]``, ranks padded
        to the largest of the step (slot rows past an adapter's width are zero)."""
        num_groups = slots.numel()
        xs = x.index_select(0, rows).view(num_groups, -1, self.in_features)
        a = self.A.index_select(0, slots)[:, :k]  # [G, k, in]
        return torch.bmm(xs, a.transpose(1, 2))

    def _expand_padded(
        self,
        h: torch.Tensor,
        out: torch.Tensor,
        rows: torch.Tensor,
        mask: torch.Tensor,
        slots: torch.Tensor,
        k: int,
    ) -> None:
        """``out[rows] += (h @ B[G]^T) * mask`` (padding positions add zero)."""
        b = self.B.index_select(0, slots)[:, :, :k]  # [G, out, k]
        delta = torch.bmm(h, b.transpose(1, 2))
        out.index_add_(0, rows, delta.view(-1, self.out_features) * mask)


def find_targets(model: nn.Module) -> list[tuple[str, nn.Module, int, str]]:
    """``(name, module, layer, kind)`` of every projection LoRA can adapt, in model order."""
    found = []
    for name, module in model.named_modules():
        m = _TARGET_RE.search(name)
        if m is not None and isinstance(getattr(module, "weight", None), torch.Tensor):
            found.append((name, module, int(m.group(1)), m.group(2)))
    return found


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T

