"""Qwen2: the Llama decoder with biased q/k/v projections (and an unbiased o_proj)."""

from __future__ import annotations

from transformers import PretrainedConfig

from sglang.srt.models.llama import LlamaArch, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_from_config(cls, config: PretrainedConfig) -> LlamaArch:
        return LlamaArch(qkv_bias=True)


EntryClass = [Qwen2ForCausalLM]
