"""Triton paged attention: every query token alone over its request's keys (CUDA, or CPU under
``TRITON_INTERPRET=1``).

Each query token is one program per KV head (``sgl_kernel.batch_invariant``); its keys are
read from the KV pool in fixed steps (up to 32 keys, set by the head sizes), so its result
does not depend on its batch, on how its prompt was chunked, or on whether it is decoded or
prefilled. That is the attention half of
``--enable-deterministic-inference`` on CUDA (``triton`` is the default backend there). Without
that flag it works as an ordinary backend; prefill re-reads each key once per query, which is
fine for decode-heavy RL rollouts but slower than a tiled prefill kernel for long prompts.

Outside deterministic mode, decode steps too small to fill the GPU with per-query programs
split each token's keys over several programs (``sgl_kernel.decode_attention``; 1 token of
SmolLM2 on an H100: 7 us a layer instead of 15-38). Its partition depends on the token's
position alone, and the choice of kernel on the batch size alone; it is not the prefill's
order, which is what deterministic mode keeps (:class:`TritonDeterministicAttnBackend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_kernel.batch_invariant import paged_attention_per_query
from sgl_kernel.decode_attention import paged_decode_attention, split_pays_off
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class PerQueryMetadata:
    pool_rows: torch.Tensor  # [T] req_to_token row of each new token's request
    positions: torch.Tensor  # [T] absolute position of each new token


class TritonAttnBackend(AttentionBackend):
    """Stateless apart from the per-batch metadata it puts on the batch."""

    # Small decode steps through the split-KV kernel (False: the per-query kernel always).
    split_decode = True

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pool_rows = forward_batch.req_pool_indices
        if not forward_batch.is_decode:
            new_lens = torch.tensor(forward_batch.extend_seq_lens_cpu, device=pool_rows.device)
            pool_rows = pool_rows.repeat_interleave(new_lens)
        forward_batch.attn_metadata = PerQueryMetadata(pool_rows, forward_batch.positions)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, forward_batch)
        k_cache, v_cache = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        meta: PerQueryMetadata = forward_batch.attn_metadata
        kernel = paged_attention_per_query
        if (
            forward_batch.is_decode
            and self.split_decode
            and split_pays_off(q.shape[0], layer.num_kv_heads, q.device)
        ):
            kernel = paged_decode_attention
        out = kernel(
            q.view(-1, layer.num_heads, layer.head_dim),
            k_cache,
            v_cache,
            forward_batch.req_to_token_pool.req_to_token,
            meta.pool_rows,
            meta.positions,
            layer.scaling,
        )
        return out.view(-1, layer.num_heads * layer.head_dim)

    # A decode step is a prefill of one token per request (only the kernel may differ).
    forward_decode = forward_extend


class TritonDeterministicAttnBackend(TritonAttnBackend):
    """Deterministic mode: decode through the per-query kernel too, so that a token decoded
    gets the bits it would get prefilled (prefill/decode consistency)."""

    split_decode = False
