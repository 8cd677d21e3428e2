"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention over the KV pool.

    Per batch: the model runner calls ``init_forward_metadata(forward_batch)`` once, then the
    model calls ``forward`` once per layer. ``forward_extend``/``forward_decode`` must first write
    the new ``k``/``v`` at ``forward_batch.out_cache_loc`` of layer ``layer.layer_id``, then
    attend over each request's KV slots ``req_to_token[req_pool_indices[i], :seq_lens[i]]``,
    causally within the new tokens (new token j of request i sits at position
    ``extend_prefix_lens_cpu[i] + j`` and sees keys ``0 ..`` that position), with GQA (query head
    h reads KV head ``h // (num_heads // num_kv_heads)``).

    Shapes: ``q [T, H*D]``, ``k``/``v`` ``[T, KVH*D]``, result ``[T, H*D]`` in q's dtype.
    ``k`` and ``v`` are None when the model wrote them to the pool itself (one fused kernel
    with the rotary embedding on CUDA): :meth:`store_kv` then writes nothing, and
    :meth:`store_and_read_kv` reads them back.
    """

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Precompute what every layer needs into ``forward_batch.attn_metadata`` (mutates it)."""

    def release_memory(self) -> None:  # noqa: B027 (a hook: stateless backends keep nothing)
        """Drop whatever the backend keeps across batches (the KV pool is being released)."""

    @staticmethod
    def store_kv(
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> None:
        """Write the new K/V at ``forward_batch.out_cache_loc`` of layer ``layer.layer_id``;
        nothing when they are None (the model wrote them already)."""
        if k is None or v is None:
            return
        forward_batch.kv_pool.set_kv_buffer(
            layer.layer_id,
            forward_batch.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            v.view(-1, layer.num_kv_heads, layer.head_dim),
        )

    @classmethod
    def store_and_read_kv(
        cls,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`store_kv`, and the new K/V as ``[T, KVH, D]`` tensors for a backend that
        reads them other than through the pool (read back from it when they were None: a
        gather per layer, which the Triton backend never needs)."""
        cls.store_kv(k, v, layer, forward_batch)
        if k is None or v is None:
            k_cache, v_cache = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
            return k_cache[forward_batch.out_cache_loc], v_cache[forward_batch.out_cache_loc]
        shape = (-1, layer.num_kv_heads, layer.head_dim)
        return k.view(shape), v.view(shape)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Dispatch on the forward mode; see the class docstring for the contract."""
        if forward_batch.is_decode:
            return self.forward_decode(q, k, v, layer, forward_batch)
        return self.forward_extend(q, k, v, layer, forward_batch)

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """Prefill (possibly after a cached prefix): any number of new tokens per request."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """One new token per request."""
