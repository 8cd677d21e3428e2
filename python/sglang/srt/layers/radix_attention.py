"""The attention layer of a model: a thin handle that the attention backend executes."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def _run_backend(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: RadixAttention,
    forward_batch: ForwardBatch,
) -> torch.Tensor:
    """The backend's attention step. It is never traced: ``--enable-torch-compile`` compiles a
    decoder layer's ``pre_attention`` and ``post_attention`` hooks only, and the layer calls
    attention between them (model_executor/cpu_torch_compile.py), so the backends' Python stays
    eager. (No ``torch.compiler.disable`` here: that decorator imports torch._dynamo, ~0.9 s of
    every scheduler's start-up.)"""
    if forward_batch.attn_backend is None:
        raise RuntimeError("forward_batch.attn_backend is not set")
    return forward_batch.attn_backend.forward(q, k, v, layer, forward_batch)


class RadixAttention(nn.Module):
    """Per-layer attention description; the math lives in ``forward_batch.attn_backend``.

    Attributes read by backends: ``num_heads``, ``num_kv_heads``, ``head_dim``, ``scaling``
    (softmax scale, usually ``head_dim ** -0.5``) and ``layer_id`` (index into the KV pool).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """``q [T, H*D]``, ``k``/``v`` ``[T, KVH*D]`` -> ``[T, H*D]``; writes k/v to the KV pool
        (``k``/``v`` None: the caller has written them there already)."""
        return _run_backend(q, k, v, self, forward_batch)

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}"
        )
