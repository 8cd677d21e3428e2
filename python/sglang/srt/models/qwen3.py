"""Qwen3: the Llama decoder with per-head RMSNorm on q and k (before RoPE), explicit head_dim."""

from __future__ import annotations

from transformers import PretrainedConfig

from sglang.srt.models.llama import LlamaArch, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_from_config(cls, config: PretrainedConfig) -> LlamaArch:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaArch(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)


EntryClass = [Qwen3ForCausalLM]
