"""The decode step of a Llama-family model on CPU as one flat loop over the C++ kernels.

In the module path a decode step's host work is the nesting around the kernels, not the
kernels' calls: per decoder layer about 250 Python calls (``nn.Module.__call__`` of the layer,
its norms, projections, activation and attention handle; the attention backend's dispatch;
the KV pool's and the fused ops' operand checks, each repeated per call). On SmolLM2-135M on 2
cores that is ~30% of a batch-1 step's main thread and ~13% at 48 requests. This loop runs the
same kernels in the same order on the same operands, called from one Python loop over the
layers: per layer the fused add + RMSNorm, the qkv product, (Qwen3: the per-head q/k norms,)
the fused RoPE, the fused K/V store, the decode-attention kernel, the o product, add + RMSNorm,
the gate/up product, SiLU * up and the down product. Each linear product is the layer's own
``linear_fn`` (the packed-weight dispatch of layers/cpu_prepack.py, which repacks an updated
weight), so the results are bitwise those of the module path (test_llama_cpu_decode.py).

The operand checks that the module path repeats on every call are made once here: when the
loop is built (:meth:`LlamaCpuDecodeLoop.unsupported_reason`: the model's structure, the
fused kernels switched on for its modules, no forward hooks) and per step
(:meth:`LlamaCpuDecodeLoop.applies`: a decode batch that the paged decode-attention kernel
serves). The model runner builds it on CPU unless ``--disable-cpu-decode-loop``, and not with
tensor parallelism (the all-reduces inside the layers), LoRA adapters (forward hooks on the
projections), ``--enable-torch-compile`` (its compiled layers) or deterministic mode (its own
attention backend). Prefill batches and every other case take the module path. A forward
hook put on one of the model's modules after the loop was built is not run by decode steps
(as in compiled code; module-wide hooks, ``register_module_forward_hook``, send the steps back
to the modules): code that hooks the model in the model process should build a runner with
``--disable-cpu-decode-loop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import torch

from sglang.srt.layers import cpu_fused_ops
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.attention.torch_native_backend import PagedDecodeMetadata
from sglang.srt.layers.cpu_decode_attention import decode_attention
from sglang.srt.layers.layernorm import RMSNorm, rms_norm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel


class _Linear(NamedTuple):
    """A projection as the loop calls it: ``linear_fn(x, weight, bias)``, which is its
    ``forward`` with one tensor-parallel rank."""

    linear_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, module: ReplicatedLinear) -> _Linear:
        return cls(module.linear_fn, module.weight, module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)


class _LayerPlan(NamedTuple):
    """What one decoder layer's decode step reads (parameters are held, not copied: weight
    updates write them in place and release/resume swaps their ``.data``)."""

    input_norm: tuple[torch.Tensor, float]
    qkv: _Linear
    qk_norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    layer_id: int
    scaling: float
    o: _Linear
    post_norm: tuple[torch.Tensor, float]
    gate_up: _Linear
    down: _Linear


def _norm(module: RMSNorm) -> tuple[torch.Tensor, float]:
    return module.weight, module.eps


def _plan(layer: LlamaDecoderLayer) -> _LayerPlan:
    # A dense MLP: unsupported_reason() refused the model otherwise.
    attn, mlp = layer.self_attn, cast(LlamaMLP, layer.mlp)
    qk_norms = None
    if attn.qk_norm:
        qk_norms = (_norm(attn.q_norm), _norm(attn.k_norm))
    return _LayerPlan(
        input_norm=_norm(layer.input_layernorm),
        qkv=_Linear.of(attn.qkv_proj),
        qk_norms=qk_norms,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        q_size=attn.q_size,
        kv_size=attn.kv_size,
        layer_id=attn.attn.layer_id,
        scaling=attn.attn.scaling,
        o=_Linear.of(attn.o_proj),
        post_norm=_norm(layer.post_attention_layernorm),
        gate_up=_Linear.of(mlp.gate_up_proj),
        down=_Linear.of(mlp.down_proj),
    )


def _global_hooks_registered() -> bool:
    """Whether forward hooks for every module are registered (``nn.modules.module.
    register_module_forward_hook`` and its pre-hook twin), which the module path would run."""
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _per_head_norm(
    x: torch.Tensor, heads: int, head_dim: int, norm: tuple[torch.Tensor, float]
) -> torch.Tensor:
    """Qwen3's q or k norm of ``x`` ``[T, heads * head_dim]``, computed as :class:`RMSNorm`
    computes it on ``[T, heads, head_dim]``."""
    out, _ = cpu_fused_ops.add_rms_norm(x.reshape(-1, heads, head_dim), None, *norm)
    return out.view(x.shape[0], -1)


class LlamaCpuDecodeLoop:
    """The decode forward of a :class:`LlamaForCausalLM` (and its Qwen2, Qwen3 and Mistral
    subclasses) on CPU without the module nesting; see the module docstring.

    Build it only where :meth:`unsupported_reason` is None, after the model runner has switched
    the model's modules to the fused CPU kernels and the weight prepack; it captures each
    module's ``linear_fn`` and parameters then. Per step: :meth:`forward` where
    :meth:`applies`, the model's own forward otherwise.
    """

    def __init__(self, model: torch.nn.Module, pool: MHATokenToKVPool) -> None:
        """Raises ValueError where :meth:`unsupported_reason` gives one."""
        reason = self.unsupported_reason(model, pool)
        if reason is not None or not isinstance(model, LlamaForCausalLM):
            raise ValueError(f"the CPU decode loop cannot serve this model: {reason}")
        self.model = model
        self.pool = pool
        self.layers = [
            _plan(layer) for layer in model.model.layers if isinstance(layer, LlamaDecoderLayer)
        ]

    @staticmethod
    def unsupported_reason(model: torch.nn.Module, pool: MHATokenToKVPool) -> str | None:
        """Why the loop would not compute what the model's forward computes, or None.

        It needs the Llama layer structure (dense MLPs, no MoE blocks) with one
        tensor-parallel rank, the fused CPU kernels switched on for every norm, activation and
        rotary embedding and for the KV pool (each of the module path's fused branches taken
        unconditionally), the plain RMSNorm, one dtype for the weights and the pool, and no
        forward hooks on any module (LoRA adds them) nor global ones.
        """
        if not isinstance(model, LlamaForCausalLM):
            return f"{type(model).__name__} is not a Llama-family model"
        if type(model).forward is not LlamaForCausalLM.forward:
            return f"{type(model).__name__} overrides the Llama forward"
        inner = model.model
        if type(inner) is not LlamaModel:
            return f"{type(inner).__name__} is not the Llama decoder stack"
        if not all(type(layer) is LlamaDecoderLayer for layer in inner.layers):
            return "a decoder layer is not a LlamaDecoderLayer"
        if not all(type(layer.mlp) is LlamaMLP for layer in inner.layers):
            return "a decoder layer's feed-forward block is not the dense LlamaMLP (MoE)"
        dtype = inner.embed_tokens.weight.dtype
        for name, module in model.named_modules():
            if module._forward_hooks or module._forward_pre_hooks:
                return f"{name or 'the model'} has forward hooks"
            if getattr(module, "tp_size", 1) != 1:
                return "tensor parallelism (the layers all-reduce)"
            if isinstance(module, RMSNorm) and (
                module.norm_fn is not rms_norm or module.weight.dtype != dtype
            ):
                return f"{name} is not the plain RMSNorm in the model's dtype"
            if isinstance(module, RMSNorm | SiluAndMul) and not module.use_cpu_fused_ops:
                return f"{name} does not use the fused CPU kernels"
        if not inner.rotary_emb.use_cpu_fused_ops:
            return "the rotary embedding does not use the fused CPU kernels"
        if _global_hooks_registered():
            return "global forward hooks are registered"
        if not pool.use_cpu_fused_ops or pool.dtype != dtype:
            return "the KV pool does not store through the fused CPU kernel in the model's dtype"
        return None

    def applies(self, forward_batch: ForwardBatch) -> bool:
        """Whether :meth:`forward` serves this batch: a decode batch whose attention the paged
        CPU kernel runs (the backend chose :class:`PagedDecodeMetadata` for it) on this loop's
        pool, with int64 positions and slots, and no global forward hooks registered since."""
        return (
            forward_batch.forward_mode == ForwardMode.DECODE
            and type(forward_batch.attn_metadata) is PagedDecodeMetadata
            and forward_batch.kv_pool is self.pool
            and forward_batch.positions.dtype == torch.int64
            and forward_batch.out_cache_loc.dtype == torch.int64
            and not _global_hooks_registered()
        )

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """The model's forward on a batch that :meth:`applies` to: the same logits, the same
        K/V written to the pool, bit for bit."""
        model = self.model
        inner = model.model
        positions = forward_batch.positions
        meta = forward_batch.attn_metadata
        assert isinstance(meta, PagedDecodeMetadata)
        rotary = inner.rotary_emb
        table = rotary.cos_sin_table(positions.device)
        head_dim, rotary_dim = rotary.head_dim, rotary.rotary_dim
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        loc = forward_batch.out_cache_loc
        k_buffers, v_buffers = self.pool.k_buffer, self.pool.v_buffer
        hidden = inner.embed_tokens(forward_batch.input_ids)
        num_tokens = hidden.shape[0]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = cpu_fused_ops.add_rms_norm(hidden, residual, *layer.input_norm)
            qkv = layer.qkv(x)
            q_size, kv_size = layer.q_size, layer.kv_size
            qk = qkv[:, : q_size + kv_size]
            if layer.qk_norms is not None:
                q_norm, k_norm = layer.qk_norms
                q = _per_head_norm(qk[:, :q_size], layer.num_heads, layer.head_dim, q_norm)
                k = _per_head_norm(qk[:, q_size:], layer.num_kv_heads, layer.head_dim, k_norm)
                qk = torch.cat([q, k], dim=-1)
            qk = cpu_fused_ops.rope(qk, positions, table, head_dim, rotary_dim)
            kv_shape = (num_tokens, layer.num_kv_heads, layer.head_dim)
            k_cache, v_cache = k_buffers[layer.layer_id], v_buffers[layer.layer_id]
            cpu_fused_ops.store_kv(
                k_cache,
                v_cache,
                loc,
                qk[:, q_size:].view(kv_shape),
                qkv[:, q_size + kv_size :].view(kv_shape),
            )
            attn_out = decode_attention(
                qk[:, :q_size],
                k_cache,
                v_cache,
                req_to_token,
                meta.req_pool_indices,
                meta.seq_lens,
                layer.scaling,
            )
            x, residual = cpu_fused_ops.add_rms_norm(layer.o(attn_out), residual, *layer.post_norm)
            hidden = layer.down(cpu_fused_ops.silu_and_mul(layer.gate_up(x)))
        if residual is None:  # a model without layers
            hidden = inner.norm(hidden)
        else:
            hidden, _ = inner.norm(hidden, residual)
        return model.logits_processor(hidden, model.lm_head.weight, forward_batch)
