"""Mixtral: the Mistral decoder whose every feed-forward block is a sparse mixture of
``num_local_experts`` experts of ``intermediate_size`` columns, the top ``num_experts_per_tok``
weighted by their renormalised router probabilities (layers/moe.py).

Checkpoint names: ``block_sparse_moe.gate`` (router) and ``block_sparse_moe.experts.<e>.w1``
(gate), ``.w3`` (up), ``.w2`` (down), mapped onto the MoE block's ``mlp.gate`` and
``mlp.experts.<e>.gate_up_proj`` / ``down_proj``; transformers' stacked expert tensors are
accepted as well. Sliding-window attention is not implemented (models/llama.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.linear import WeightSource
from sglang.srt.layers.moe import SparseMoE, unstack_expert_weights
from sglang.srt.models.llama import LlamaArch, LlamaForCausalLM, LlamaMLP

# Mixtral's expert names -> (our fragment, shard id in the fused parameter).
_EXPERT_NAMES = (
    (".w1.", ".gate_up_proj.", 0),
    (".w3.", ".gate_up_proj.", 1),
    (".w2.", ".down_proj.", None),
)


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_id: int, arch: LlamaArch) -> nn.Module:
        return SparseMoE(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            renormalize=True,
            make_expert=lambda: LlamaMLP(config, arch, reduce_results=False),
            layer_id=layer_id,
        )

    def _map_weight_name(self, name: str) -> tuple[str, Hashable | None]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.experts." in name:
            for checkpoint_part, our_part, shard_id in _EXPERT_NAMES:
                if checkpoint_part in name:
                    return name.replace(checkpoint_part, our_part), shard_id
        return super()._map_weight_name(name)

    def load_weights(
        self, weights: Iterable[tuple[str, WeightSource]], *, strict: bool = True
    ) -> None:
        super().load_weights(unstack_expert_weights(weights), strict=strict)


EntryClass = [MixtralForCausalLM]
