"""Llama-family decoder (Llama, Mistral; Qwen2/Qwen3 reuse it with a different LlamaArch).

One decoder layer::

    hidden, residual = input_layernorm(hidden, residual)      # fused residual add
    hidden = o_proj(attn(rope(q_norm?(q), k_norm?(k)), v))    # q,k,v from one qkv_proj matmul
    hidden, residual = post_attention_layernorm(hidden, residual)
    hidden = down_proj(silu(gate) * up)                       # gate,up from one gate_up_proj

Sliding-window attention (old Mistral, some Qwen2 configs) is not implemented: attention is
full, which is exact for sequences shorter than the window.

Tensor parallelism (docs/distributed.md): qkv_proj and gate_up_proj are column-parallel (each
rank has ``num_heads / tp`` query heads, ``max(1, num_kv_heads / tp)`` KV heads and
``intermediate_size / tp`` MLP columns), o_proj and down_proj row-parallel (one all-reduce
each), the embedding and LM head vocabulary-parallel. The checkpoint names are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    WeightSource,
    get_weight_loader,
    kv_heads_per_rank,
)
from sglang.srt.layers.logits_processor import (
    LogitsProcessor,
    LogitsProcessorOutput,
    last_token_rows,
)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_params_from_config
from sglang.srt.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass(frozen=True)
class LlamaArch:
    """The knobs in which the Llama-family models differ."""

    qkv_bias: bool = False  # bias on the q/k/v projections
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False  # bias on gate/up/down
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)


def get_head_dim(config: PretrainedConfig) -> int:
    """``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_tensor_parallel_fit(
    config: PretrainedConfig, tp_size: int, mlp_widths: dict[str, int] | None = None
) -> None:
    """Raise ValueError naming the numbers when the model cannot be split over ``tp_size``
    ranks: query heads and every MLP width (``mlp_widths``: config field -> value; by default
    ``intermediate_size``) must divide evenly, and the KV heads must either divide evenly or
    (fewer KV heads than ranks) be replicated evenly (tp a multiple of them)."""
    if mlp_widths is None:
        mlp_widths = {"intermediate_size": config.intermediate_size}
    num_heads = config.num_attention_heads
    problems = []
    if num_heads % tp_size:
        problems.append(
            f"num_attention_heads ({num_heads}) is not divisible by --tp-size ({tp_size})"
        )
    for field, width in mlp_widths.items():
        if width % tp_size:
            problems.append(f"{field} ({width}) is not divisible by --tp-size ({tp_size})")
    try:
        kv_heads_per_rank(getattr(config, "num_key_value_heads", None) or num_heads, tp_size)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise ValueError(f"cannot split the model over {tp_size} ranks: {'; '.join(problems)}")


class LlamaAttention(nn.Module):
    """Fused qkv projection, optional q/k norm, RoPE, paged attention, output projection."""

    def __init__(
        self, config: PretrainedConfig, layer_id: int, arch: LlamaArch, rotary_emb: RotaryEmbedding
    ) -> None:
        super().__init__()
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = get_head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, arch.qkv_bias
        )
        # This rank's heads (all of them with one rank).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim, config.hidden_size, arch.o_bias
        )
        self.qk_norm = arch.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # One instance (one cos/sin cache) shared by all layers; it holds no parameters.
        self.rotary_emb = rotary_emb
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        rope_stores = self.rotary_emb.stores_kv(positions, forward_batch.token_to_kv_pool)
        q, k, v = self.project_qkv(positions, hidden_states, rotate=not rope_stores)
        return self.o_proj(self.attend(positions, q, k, v, forward_batch, rope_stores))

    def attend(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        rope_stores: bool,
    ) -> torch.Tensor:
        """Attention of ``q``/``k``/``v`` from :meth:`project_qkv`. ``rope_stores``: they are
        not rotated yet; one kernel rotates q and k and writes k and v to the KV pool
        (``RotaryEmbedding.rotate_and_store``), and the backend reads them from there."""
        if not rope_stores:
            return self.attn(q, k, v, forward_batch)
        k_buf, v_buf = forward_batch.kv_pool.get_kv_buffer(self.attn.layer_id)
        q = self.rotary_emb.rotate_and_store(
            positions, q, k, v, k_buf, v_buf, forward_batch.out_cache_loc
        )
        return self.attn(q, None, None, forward_batch)

    def project_qkv(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, rotate: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` of ``hidden_states``: the qkv product, q/k norms, RoPE on q and k
        (not with ``rotate`` False)."""
        qkv = self.qkv_proj(hidden_states)
        qk_size = self.q_size + self.kv_size
        qk, v = qkv[:, :qk_size], qkv[:, qk_size:]
        if self.qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).view(-1, self.kv_size)
            qk = torch.cat([q, k], dim=-1)
        if rotate:
            # q and k side by side are rotated in one pass (fewer small ops per layer).
            qk = self.rotary_emb.rotate(positions, qk)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        return q, k, v


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul.

    ``intermediate_size`` defaults to the config's; ``reduce_results`` False leaves the down
    product's tensor-parallel partial sums unreduced (an MoE expert: the block reduces once).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        arch: LlamaArch,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], arch.mlp_bias
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, arch.mlp_bias, reduce_results=reduce_results
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# Builds the feed-forward block of decoder layer ``layer_id``: a LlamaMLP, or an MoE block
# (LlamaForCausalLM.make_mlp). None: a LlamaMLP in every layer.
MLPFactory = Callable[[PretrainedConfig, int, LlamaArch], nn.Module]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        layer_id: int,
        arch: LlamaArch,
        rotary_emb: RotaryEmbedding,
        make_mlp: MLPFactory | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, arch, rotary_emb)
        self.mlp = make_mlp(config, layer_id, arch) if make_mlp else LlamaMLP(config, arch)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; their sum is the layer's output. With
        ``keep_rows`` (the last layer, see LlamaModel.forward) both hold those rows only: every
        token's K/V is written and attended as before, the rest of the layer runs on them."""
        rope_stores = self.self_attn.rotary_emb.stores_kv(positions, forward_batch.token_to_kv_pool)
        q, k, v, residual = self.pre_attention(positions, hidden_states, residual, not rope_stores)
        attn_out = self.self_attn.attend(positions, q, k, v, forward_batch, rope_stores)
        if keep_rows is not None:
            attn_out = attn_out.index_select(0, keep_rows)
            residual = residual.index_select(0, keep_rows)
        return self.post_attention(attn_out, residual)

    # The layer around its attention call, as two functions of tensors only (no ForwardBatch):
    # --enable-torch-compile compiles each into one graph shared by all layers
    # (model_executor/cpu_torch_compile.py).
    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        rotate: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (with the residual add) and q/k/v: ``(q, k, v, residual stream)``;
        ``rotate`` as for :meth:`LlamaAttention.project_qkv`."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        q, k, v = self.self_attn.project_qkv(positions, hidden_states, rotate)
        return q, k, v, residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, post-attention norm (with the residual add) and MLP:
        ``(mlp output, residual stream)``."""
        hidden_states = self.self_attn.o_proj(attn_out)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (no LM head)."""

    def __init__(
        self, config: PretrainedConfig, arch: LlamaArch, make_mlp: MLPFactory | None = None
    ) -> None:
        super().__init__()
        rope_theta, rope_scaling, partial_rotary_factor = rope_params_from_config(config)
        rotary_emb = get_rope(
            get_head_dim(config),
            rope_theta,
            config.max_position_embeddings,
            rope_scaling,
            partial_rotary_factor,
        )
        # Shared by the layers' attention modules; its per-pass cache is reset in forward().
        self.rotary_emb = rotary_emb
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, arch, rotary_emb, make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states ``[num_tokens, hidden_size]``, or with ``keep_rows`` those
        rows only: the last layer runs its output projection and MLP on them alone (in a
        prefill, where only each request's last token feeds the LM head, that skips ~0.8 of a
        layer's products for every other prompt token)."""
        self.rotary_emb.start_forward()
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rows = keep_rows if i == last else None
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual, rows)
        if residual is None:  # a model without layers
            hidden_states = self.norm(hidden_states)
            return hidden_states if keep_rows is None else hidden_states.index_select(0, keep_rows)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head. Subclasses change ``arch_from_config``, and the MoE models
    ``make_mlp``, ``mlp_widths`` and the weight-name mapping."""

    # HF checkpoint name fragment -> (fragment of our fused parameter, shard id in it).
    stacked_params_mapping: ClassVar[tuple[tuple[str, str, Hashable], ...]] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )
    # Checkpoint tensors that are not parameters here (recomputed buffers).
    ignored_weight_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    @classmethod
    def arch_from_config(cls, config: PretrainedConfig) -> LlamaArch:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaArch(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_id: int, arch: LlamaArch) -> nn.Module:
        """The feed-forward block of layer ``layer_id`` (an :data:`MLPFactory`)."""
        return LlamaMLP(config, arch)

    @classmethod
    def mlp_widths(cls, config: PretrainedConfig) -> dict[str, int]:
        """The MLP widths that tensor parallelism splits (config field -> value)."""
        return {"intermediate_size": config.intermediate_size}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        check_tensor_parallel_fit(config, tp_size, self.mlp_widths(config))
        self.config = config
        self.model = LlamaModel(config, self.arch_from_config(config), self.make_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            # Same module, same Parameter: named_parameters() lists it once, as the embedding.
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        """Run all layers over the batch's new tokens (writing their K/V to the pool)."""
        rows = last_token_rows(forward_batch)
        hidden_states = self.model(input_ids, positions, forward_batch, rows)
        return self.logits_processor(
            hidden_states, self.lm_head.weight, forward_batch, rows_are_last=rows is not None
        )

    def _map_weight_name(self, name: str) -> tuple[str, Hashable | None]:
        for checkpoint_part, fused_part, shard_id in self.stacked_params_mapping:
            if checkpoint_part in name:
                return name.replace(checkpoint_part, fused_part), shard_id
        return name, None

    def _required_shards(self, param_name: str) -> set[Hashable | None]:
        shards = {s for _, fused, s in self.stacked_params_mapping if fused in param_name}
        return shards or {None}

    def load_weights(
        self, weights: Iterable[tuple[str, WeightSource]], *, strict: bool = True
    ) -> None:
        """Copy HF-named checkpoint tensors into the parameters (in place). Each tensor is the
        full checkpoint tensor (or a LazyWeight for it); the weight loaders take this rank's part.

        Raises ValueError for a name that maps to no parameter and, when ``strict``, for a
        parameter (or fused shard) that no tensor filled. ``strict=False`` allows partial
        updates, e.g. weight buckets pushed by a trainer.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set[Hashable | None]] = {}
        for name, tensor in weights:
            if name.endswith(self.ignored_weight_suffixes):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            param_name, shard_id = self._map_weight_name(name)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            get_weight_loader(param)(param, tensor, shard_id)
            loaded.setdefault(param_name, set()).add(shard_id)
        if strict:
            self._check_all_loaded(params, loaded)

    def _check_all_loaded(
        self, params: dict[str, Any], loaded: dict[str, set[Hashable | None]]
    ) -> None:
        missing = []
        for param_name in params:
            got = loaded.get(param_name, set())
            if None in got:  # loaded whole (an already fused checkpoint tensor)
                continue
            absent = self._required_shards(param_name) - got
            missing += [param_name if s is None else f"{param_name}[{s}]" for s in absent]
        if missing:
            raise ValueError(f"weights not found in the checkpoint: {sorted(missing)}")


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral checkpoints use Llama's layout and weight names."""


EntryClass = [LlamaForCausalLM, MistralForCausalLM]
