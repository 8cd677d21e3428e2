"""Batch-invariant, prefill/decode-consistent attention for deterministic mode (DESIGN §7).

Every query token is computed the same way whether it is decoded or prefilled, alone or in a
batch, in one chunk or several: as a single query over its own keys ``0..p`` (p = its absolute
position), read from the KV pool, padded with masked dummy keys to ``bucket(p) = roundup(p + 1,
KEY_BLOCK)``. Queries with the same bucket share one SDPA call::

    query at position p  ->  SDPA(q [n, KVH, G, D], K/V [n, KVH, bucket(p), D], mask [n,1,1,bucket])

The CPU SDPA kernel reduces over the key axis in a way that depends on the padded length (not
on the batch size, nor on what the other rows hold), so a fixed padded length per query is what
makes its result bitwise reproducible. In float32 that holds only with MKL's strict
reproducibility mode, which the scheduler process turns on in this mode
(:func:`sglang.srt.layers.batch_invariant.pin_cpu_blas_numerics`).

Prefill pays for it: each query attends over its whole bucket (about twice the causal work) in
``ceil(len / KEY_BLOCK)`` calls per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

KEY_BLOCK = 64


@dataclass
class QueryGroup:
    """Queries sharing a padded key length (one SDPA call per layer)."""

    rows: torch.Tensor  # [n] rows of the flattened new tokens
    slot_ids: torch.Tensor  # [n * padded_len] KV slots, row-major; padding -> dummy slot 0
    mask: torch.Tensor  # [n, 1, 1, padded_len] True where the key is visible
    padded_len: int
    shared_keys: bool  # all n queries read the same keys (one request): gather them once


class DeterministicAttnBackend(AttentionBackend):
    """Same numerics for a query whatever its batch, chunking or cache state."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        table = forward_batch.req_to_token_pool.req_to_token
        positions = forward_batch.positions.tolist()
        groups: list[QueryGroup] = []
        row = 0
        if forward_batch.is_decode:
            by_bucket: dict[int, list[int]] = {}
            for i, pos in enumerate(positions):
                by_bucket.setdefault(_bucket(pos), []).append(i)
            for padded_len, rows in sorted(by_bucket.items()):
                pool_rows = forward_batch.req_pool_indices[rows]
                seq_lens = torch.tensor([positions[i] + 1 for i in rows], device=table.device)
                groups.append(_group(table, rows, pool_rows, seq_lens, padded_len, shared=False))
            forward_batch.attn_metadata = groups
            return
        for pool_row, new_len in zip(
            forward_batch.req_pool_indices.tolist(), forward_batch.extend_seq_lens_cpu
        ):
            by_bucket = {}
            for i in range(row, row + new_len):
                by_bucket.setdefault(_bucket(positions[i]), []).append(i)
            for padded_len, rows in sorted(by_bucket.items()):
                seq_lens = torch.tensor([positions[i] + 1 for i in rows], device=table.device)
                pool_rows = torch.tensor([pool_row], device=table.device)
                groups.append(_group(table, rows, pool_rows, seq_lens, padded_len, shared=True))
            row += new_len
        forward_batch.attn_metadata = groups

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        self.store_kv(k, v, layer, forward_batch)
        k_cache, v_cache = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        out = torch.empty_like(q)
        for group in forward_batch.attn_metadata:
            n = group.rows.numel()
            keys_per_row = 1 if group.shared_keys else n
            kv_shape = (keys_per_row, group.padded_len, num_kv_heads, head_dim)
            keys = k_cache.index_select(0, group.slot_ids).view(kv_shape).transpose(1, 2)
            values = v_cache.index_select(0, group.slot_ids).view(kv_shape).transpose(1, 2)
            group_out = F.scaled_dot_product_attention(
                q.index_select(0, group.rows).reshape(n, num_kv_heads, -1, head_dim),
                keys.expand(n, -1, -1, -1).to(q.dtype),
                values.expand(n, -1, -1, -1).to(q.dtype),
                attn_mask=group.mask,
                scale=layer.scaling,
            )
            out.index_copy_(0, group.rows, group_out.reshape(n, -1))
        return out

    # Decode and prefill go through the very same computation: that is the point.
    forward_decode = forward_extend


def _bucket(position: int) -> int:
    return (position // KEY_BLOCK + 1) * KEY_BLOCK


def _group(
    table: torch.Tensor,
    rows: list[int],
    pool_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    padded_len: int,
    shared: bool,
) -> QueryGroup:
    """Slots of ``pool_rows`` padded to ``padded_len`` and each query's visibility mask."""
    key_pos = torch.arange(padded_len, device=table.device)
    mask = key_pos[None, :] < seq_lens[:, None]  # [n, padded_len]
    real_len = int(seq_lens.max())
    slots = table.index_select(0, pool_rows)[:, :padded_len].clone()
    slots[:, real_len:] = 0  # beyond the request's KV: the dummy slot
    if not shared:
        slots = slots.masked_fill(~mask, 0)
    return QueryGroup(
        rows=torch.tensor(rows, dtype=torch.int64, device=table.device),
        slot_ids=slots.reshape(-1),
        mask=mask[:, None, None, :],
        padded_len=padded_len,
        shared_keys=shared,
    )
