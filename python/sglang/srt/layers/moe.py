"""Sparse mixture-of-experts block: a router picks ``top_k`` experts per token, the block's
output is the experts' outputs weighted by the router's probabilities (Qwen2-MoE, Qwen3-MoE,
Mixtral: models/qwen2_moe.py, qwen3_moe.py and mixtral.py).

Each expert is an ordinary gated MLP module (its gate/up product column-parallel, its down
product row-parallel without the all-reduce), so experts load, split over tensor-parallel ranks,
pack for the CPU kernels and switch to batch-invariant products exactly like the dense layers'
projections. One step::

    probs   = softmax(float32(gate(x)))                 [tokens, num_experts]
    w, ids  = top_k(probs)  (w / sum(w) when renormalize)
    for each expert e hit by the step:                  one product per hit expert
        rows = the (token, rank) pairs routed to e
        out[rows] = w[rows] * expert_e(x[tokens of rows])
    y       = sum over each token's top_k outputs, in the router's order
    y      += sigmoid(shared_gate(x)) * shared_expert(x)                 (Qwen2-MoE)
    y       = all_reduce(y)                                              (tensor parallel)

Each token's experts, weights, products and sum order depend on that token alone (the
products take the layers' ``linear_fn``), so the block is batch-invariant whenever its
products are (deterministic mode).

With ``--enable-return-routed-experts`` each block records its choices in a
:class:`RoutedExpertsRecorder` (``meta_info["routed_experts"]``, docs/models.md).

The routing is data-dependent (which experts run, and on how many rows, is read back to the
host each step), so the block runs eagerly: ``torch.compile`` leaves it out of its graphs and
CUDA graphs are not captured for a model that has one (:func:`has_sparse_moe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.layers.linear import ReplicatedLinear, WeightSource, materialize


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, both ``[tokens, top_k]``: the ``top_k`` largest softmax
    probabilities of each row (computed in float32) and their experts; with ``renormalize``
    the weights of a row are divided by their sum. Weights come back in float32."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


class SparseMoE(nn.Module):
    """Top-k routed experts, with an optional (gated) shared expert.

    ``make_expert()`` builds one expert: a module mapping ``[rows, hidden]`` to this rank's
    partial ``[rows, hidden]`` (row-parallel down product without its all-reduce). The
    parameter names follow the checkpoints: ``gate.weight`` (the router, ``[num_experts,
    hidden]``), ``experts.<e>.*``, ``shared_expert.*`` and ``shared_expert_gate.weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        make_expert: Callable[[], nn.Module],
        shared_expert: nn.Module | None = None,
        shared_expert_gate: bool = False,
        layer_id: int = 0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts "
                f"({num_experts})"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.layer_id = layer_id  # the decoder layer's index (where its routing is recorded)
        # Set by the model runner under --enable-return-routed-experts.
        self.recorder: RoutedExpertsRecorder | None = None
        self.renormalize = renormalize
        self.tp_size = get_tp_group().world_size
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.shared_expert = shared_expert
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1) if shared_expert_gate else None

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]`` -> ``[tokens, hidden]`` (all-reduced over the ranks)."""
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.recorder is not None:
            self.recorder.record(self.layer_id, expert_ids)
        out = self._routed(x, weights.to(x.dtype), expert_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.tp_size > 1:
            out = get_tp_group().all_reduce(out.contiguous())
        return out

    def _routed(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Sum of ``weights * expert(x)`` over each token's experts, in the router's order.

        The (token, rank) pairs are numbered ``token * top_k + rank``; a stable sort of all
        pairs by expert groups each expert's rows, so every expert runs one product on a
        contiguous slice of the gathered inputs. The inputs are gathered and the outputs put
        back in one op each: per expert only its products and the weighting remain (on CPU, a
        decode step's few rows per expert made the per-expert ops as costly as the products).
        """
        num_tokens = x.shape[0]
        flat_ids = expert_ids.reshape(-1)
        pairs = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        grouped_x = x.index_select(0, pairs // self.top_k)
        grouped_w = weights.reshape(-1, 1).index_select(0, pairs)
        grouped_out = torch.empty_like(grouped_x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            end = start + count
            expert_out = self.experts[expert](grouped_x[start:end])
            grouped_out[start:end] = expert_out * grouped_w[start:end]
            start = end
        contributions = torch.empty_like(grouped_out)
        contributions[pairs] = grouped_out
        per_token = contributions.view(num_tokens, self.top_k, -1)
        out = per_token[:, 0]
        for rank in range(1, self.top_k):
            out = out + per_token[:, rank]
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}"


class RoutedExpertsRecorder:
    """``--enable-return-routed-experts``: the experts every MoE layer routed each token to,
    kept per KV slot (so a prefix computed for one request serves another's), read back when a
    request ends (rollout routing replay: a trainer replays these choices).

    ``host[slot, layer, j]`` is the ``j``-th expert (the router's order) of the token whose KV
    is in ``slot``, at decoder layer ``layer``; -1 in dense layers. Around each forward pass
    the model runner calls :meth:`begin` and :meth:`commit`; in between, each MoE block
    calls :meth:`record`. The commit writes the pass's choices to its tokens' slots,
    overwriting whatever an earlier token of a reused slot left. Owned by the model runner;
    only its forward pass writes.
    """

    def __init__(self, num_slots: int, num_layers: int, top_k: int) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.host = torch.full((num_slots, num_layers, top_k), -1, dtype=torch.int32)
        self._step: torch.Tensor | None = None

    def begin(self, num_tokens: int, device: torch.device) -> None:
        """Start a forward pass over ``num_tokens`` tokens (every layer -1 until recorded)."""
        shape = (num_tokens, self.num_layers, self.top_k)
        self._step = torch.full(shape, -1, dtype=torch.int32, device=device)

    def record(self, layer_id: int, expert_ids: torch.Tensor) -> None:
        """Layer ``layer_id``'s ``[num_tokens, top_k]`` choices for the current pass."""
        if self._step is None:
            raise RuntimeError("routed experts recorded outside a forward pass")
        self._step[:, layer_id] = expert_ids

    def commit(self, slots: torch.Tensor) -> None:
        """Store the pass's choices at the KV ``slots`` of its tokens (one per token)."""
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("no forward pass to commit")
        self.host[slots.cpu()] = step.cpu()

    def read(self, slots: torch.Tensor) -> bytes:
        """The choices of the tokens in ``slots``, in order: ``[len(slots), num_layers,
        top_k]`` int32, as little-endian bytes."""
        return self.host[slots.cpu()].numpy().astype("<i4").tobytes()


def has_sparse_moe(model: nn.Module) -> bool:
    """Whether ``model`` routes tokens through a :class:`SparseMoE` block (data-dependent
    control flow: no CUDA graph captures it)."""
    return any(isinstance(module, SparseMoE) for module in model.modules())


# transformers >= 5 keeps each MoE block's experts as two stacked tensors (``experts.gate_up_proj``
# [num_experts, 2 * intermediate, hidden], gate rows first, and ``experts.down_proj``
# [num_experts, hidden, intermediate]); its save_pretrained writes the per-expert names back,
# but a trainer that sends its live parameters (update_weights_from_tensor) sends these.
_STACKED_EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj")


def unstack_expert_weights(
    weights: Iterable[tuple[str, WeightSource]],
) -> Iterator[tuple[str, WeightSource]]:
    """``weights`` with every stacked expert tensor split into the per-expert checkpoint names
    (``<block>.experts.<e>.gate_up_proj.weight``: the fused gate/up rows, and
    ``<block>.experts.<e>.down_proj.weight``); every other tensor passes unchanged."""
    for name, tensor in weights:
        if not name.endswith(_STACKED_EXPERT_SUFFIXES):
            yield name, tensor
            continue
        block, _, proj = name.rpartition(".experts.")
        stacked = materialize(tensor)
        if stacked.dim() != 3:
            raise ValueError(
                f"{name}: a stacked expert tensor has 3 dimensions, got {tuple(stacked.shape)}"
            )
        for expert, expert_weight in enumerate(stacked.unbind(0)):
            yield f"{block}.experts.{expert}.{proj}.weight", expert_weight
