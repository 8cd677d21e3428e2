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

Rows are grouped by slot once per batch (:class:`LoRABatchInfo`), then every projection does
one gather, two small matmuls and one ``index_add_`` per adapter of the batch; rows of the base
model are skipped. No Python work per token.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sglang.srt.lora.adapter import PROJ_TO_MODULE, LoRAAdapter, LoRAError

_TARGET_RE = re.compile(
    r"layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$"
)


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


def _int_attr(module: nn.Module, name: str) -> int:
    value: Any = vars(module)[name]  # a plain int attribute, not a parameter or submodule
    return int(value)


def _shard_sizes(module: nn.Module, kind: str, out_features: int) -> list[int]:
    """Output rows of each shard of a fused layer, read from the layer's attributes (not its
    class: the layer classes are free to change)."""
    if kind == "qkv_proj":
        q, kv = _int_attr(module, "q_size"), _int_attr(module, "kv_size")
        return [q, kv, kv]
    if kind == "gate_up_proj":
        sizes = getattr(module, "output_sizes", None)
        return [int(s) for s in sizes] if sizes else [out_features // 2] * 2
    return [out_features]


class LoRATarget:
    """The slots of one projection and the hook that applies them."""

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
        sizes = _shard_sizes(module, kind, self.out_features)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes
        n = len(sizes)
        dev, dtype = weight.device, weight.dtype
        self.A = torch.zeros(num_slots, n * max_rank, self.in_features, dtype=dtype, device=dev)
        self.B = torch.zeros(num_slots, self.out_features, n * max_rank, dtype=dtype, device=dev)
        self.width = [0] * num_slots  # n * rank of the adapter in each slot (0: empty)
        self._get_batch = get_batch
        self.batch_invariant = batch_invariant
        self.handle = module.register_forward_hook(self._hook)

    def check(self, adapter: LoRAAdapter, proj: str, shard: int) -> None:
        """LoRAError unless ``adapter``'s weights of ``proj`` fit this layer's shard."""
        a, b = adapter.weights[(self.layer, proj)]
        if a.shape[1] != self.in_features or b.shape[0] != self.sizes[shard]:
            raise LoRAError(
                f"adapter {adapter.name!r}: layer {self.layer} {proj} has A {tuple(a.shape)}, "
                f"B {tuple(b.shape)}; the base model needs A [r, {self.in_features}] and "
                f"B [{self.sizes[shard]}, r]"
            )

    def write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Copy ``adapter``'s weights of this layer into ``slot`` (None: clear it)."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.width[slot] = 0
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
        self.width[slot] = len(self.sizes) * r

    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        batch = self._get_batch()
        if batch is None:
            return output
        x = inputs[0].reshape(-1, self.in_features)
        out = output.view(-1, self.out_features)
        if batch.padded is not None and not self.batch_invariant:
            self._apply_padded(x, out, batch.padded)
            return output
        product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            vars(module)["linear_fn"] if self.batch_invariant else _product
        )
        for slot, rows in batch.groups:
            k = self.width[slot]
            if k == 0:
                continue
            a, b = self.A[slot, :k], self.B[slot, :, :k]
            if rows is None:
                out.add_(product(product(x, a), b))
            else:
                out.index_add_(0, rows, product(product(x.index_select(0, rows), a), b))
        return output


    def _apply_padded(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]],
    ) -> None:
        """All groups at once: ``[G, n_max, in] @ A[G]^T @ B[G]^T`` (two bmm), ranks padded
        to the largest of the step (slot columns past an adapter's rank are zero)."""
        rows, mask, slots, slot_list = padded
        k = max(self.width[s] for s in slot_list)
        if k == 0:
            return
        num_groups = slots.numel()
        xs = x.index_select(0, rows).view(num_groups, -1, self.in_features)
        a = self.A.index_select(0, slots)[:, :k]  # [G, k, in]
        b = self.B.index_select(0, slots)[:, :, :k]  # [G, out, k]
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))
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
