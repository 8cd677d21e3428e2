"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm,
explicit head_dim) with Qwen2-MoE's sparse blocks, without the shared expert."""

from __future__ import annotations

from transformers import PretrainedConfig

from sglang.srt.models.llama import LlamaArch
from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    has_shared_expert = False

    @classmethod
    def arch_from_config(cls, config: PretrainedConfig) -> LlamaArch:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaArch(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)


EntryClass = [Qwen3MoeForCausalLM]
