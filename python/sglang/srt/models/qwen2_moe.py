"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder whose feed-forward blocks are
sparse mixtures of experts with a gated shared expert (layers/moe.py).

Layer ``i`` is sparse when ``i`` is not in ``mlp_only_layers`` and ``(i + 1)`` is a multiple of
``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``. Experts have
``moe_intermediate_size`` columns, the shared expert ``shared_expert_intermediate_size``.
Checkpoint names: ``mlp.gate`` (router), ``mlp.experts.<e>.{gate,up,down}_proj``,
``mlp.shared_expert.*``, ``mlp.shared_expert_gate``; transformers' stacked expert tensors
are accepted as well (:func:`~sglang.srt.layers.moe.unstack_expert_weights`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.linear import WeightSource
from sglang.srt.layers.moe import SparseMoE, unstack_expert_weights
from sglang.srt.models.llama import LlamaArch, LlamaForCausalLM, LlamaMLP


def is_sparse_layer(config: PretrainedConfig, layer_id: int) -> bool:
    """Whether decoder layer ``layer_id`` has an MoE block (the Qwen MoE configs' rule)."""
    num_experts = getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = getattr(config, "mlp_only_layers", None) or []
    return num_experts > 0 and layer_id not in only_dense and (layer_id + 1) % step == 0


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    # Whether the sparse blocks have the gated shared expert (Qwen3-MoE has none).
    has_shared_expert = True

    @classmethod
    def arch_from_config(cls, config: PretrainedConfig) -> LlamaArch:
        return LlamaArch(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_id: int, arch: LlamaArch) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return LlamaMLP(config, arch)
        shared = None
        if cls.has_shared_expert:
            shared = LlamaMLP(
                config, arch, config.shared_expert_intermediate_size, reduce_results=False
            )
        return SparseMoE(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            make_expert=lambda: LlamaMLP(
                config, arch, config.moe_intermediate_size, reduce_results=False
            ),
            shared_expert=shared,
            shared_expert_gate=shared is not None,
            layer_id=layer_id,
        )

    @classmethod
    def mlp_widths(cls, config: PretrainedConfig) -> dict[str, int]:
        num_layers = config.num_hidden_layers
        sparse = [is_sparse_layer(config, i) for i in range(num_layers)]
        widths = {}
        if not all(sparse):
            widths["intermediate_size"] = config.intermediate_size
        if any(sparse):
            widths["moe_intermediate_size"] = config.moe_intermediate_size
            if cls.has_shared_expert:
                widths["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        return widths

    def load_weights(
        self, weights: Iterable[tuple[str, WeightSource]], *, strict: bool = True
    ) -> None:
        super().load_weights(unstack_expert_weights(weights), strict=strict)


EntryClass = [Qwen2MoeForCausalLM]
