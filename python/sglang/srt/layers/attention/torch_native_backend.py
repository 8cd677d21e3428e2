"""Attention with ``torch.nn.functional.scaled_dot_product_attention`` (the CPU path).

DECODE is one SDPA call per layer for the whole batch (or, when a long tail of lengths would
make padding costly, for each of a few length groups; see ``group_by_length``). Per batch, the
KV slots of every request are laid out in a padded ``[B, max_len]`` table (padding -> the dummy
slot 0) with a key mask.
Per layer the K/V rows are gathered with one ``index_select`` and the query heads of each KV
head are folded into SDPA's query-length axis::

    q      [B, H*D]            -> [B, KVH, G, D]      (G = H / KVH query heads per KV head)
    keys   [B*max_len, KVH, D] -> [B, KVH, max_len, D] (a transposed view, no copy)
    mask   [B, 1, 1, max_len]     True for real keys, broadcast over KVH and G

so GQA needs neither ``repeat_interleave`` nor ``enable_gqa``.

On CPU the per-layer gather is avoided altogether: the K/V rows of the running requests are kept
in a :class:`~sglang.srt.layers.attention.decode_kv_mirror.DecodeKVMirror` (one dense row per
request, updated with only the new tokens each step) and SDPA reads it in place. The gather
remains the path for CUDA, for a mirror over its memory budget, and a lone request whose slots
are consecutive is read as a view of the pool. Measured on 2 CPU cores
(B=64, max_len~500, H=9, KVH=3, D=64, float32, per layer): this layout ~4.2 ms; SDPA with
``enable_gqa`` ~4.7 ms; repeat_interleave'd K/V ~40-50 ms; a matmul/softmax version ~13 ms;
gathering with advanced indexing instead of ``index_select`` adds ~4 ms. The two gathers
themselves cost ~2 ms each (float32, one thread), which is what the mirror saves.

EXTEND loops over requests: a request without a cached prefix attends over its own contiguous
new K/V with ``is_causal=True``; one with a prefix gathers its full KV and uses an explicit
bottom-right-aligned causal mask (SDPA's ``is_causal`` is top-left aligned). On CPU, with the
kernels enabled, EXTEND is instead one call per layer for the whole batch to the C++ kernel of
:mod:`sglang.srt.layers.cpu_extend_attention`, which reads each request's K/V in place through
``req_to_token`` (no gather, no mask) with flash-style tiling: per layer 1.3-2.2x faster than
the SDPA loop in float32 and 2-3.6x in bfloat16 (docs/performance.md).

On CPU, decode runs instead in the C++ paged kernel of
:mod:`sglang.srt.layers.cpu_decode_attention` once the model runner has called
:meth:`TorchNativeAttnBackend.enable_cpu_decode_kernel`: one call per layer for the whole batch,
reading each request's keys straight from the pool through its ``req_to_token`` row (no mirror,
no gather, no padding). The mirror and the gathers above remain the SDPA path
(``--disable-cpu-attention-kernel``, CUDA, operands the kernel does not take).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglang.srt.layers import cpu_extend_attention
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.decode_kv_mirror import DecodeKVMirror, MirrorPlan
from sglang.srt.layers.cpu_decode_attention import decode_attention, kernel_supports, load_kernel

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


# A request shorter than half its group's longest is split off into a new group when that
# saves at least this many padded key slots (about the cost of one more gather + SDPA call).
_MIN_SAVED_SLOTS = 4096


@dataclass
class DecodeGroup:
    rows: torch.Tensor | None  # [b] batch rows in this group; None = the whole batch, in order
    slot_ids: torch.Tensor  # [b * max_len] int64: KV slots row-major, padding -> dummy slot 0
    mask: torch.Tensor | None  # [b, 1, 1, max_len] bool, True = real key; None if no padding
    max_len: int  # longest sequence of the group
    # First slot when the group is one request whose slots are consecutive (the usual batch-1
    # decode): its K/V are then read as a view of the pool instead of gathered (a copy).
    contiguous_start: int | None = None


@dataclass
class PagedDecodeMetadata:
    """Decode by the CPU paged kernel: it reads the batch's own pool rows and lengths."""

    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, on the host


@dataclass
class DecodeMetadata:
    groups: list[DecodeGroup]  # one SDPA call each; together they cover every batch row once


def group_by_length(seq_lens: list[int]) -> list[list[int]]:
    """Partition batch rows into groups that are padded to their own longest sequence.

    Rows are taken longest first; a new group starts at a row shorter than half of the current
    group's longest when padding the remaining rows to that length would waste at least
    ``_MIN_SAVED_SLOTS`` key slots. So a batch of similar lengths stays one group, and a long
    tail costs at most 2x padding. Returns row lists in descending length order.
    """
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    group_max = 0
    for pos, row in enumerate(order):
        length = seq_lens[row]
        remaining = len(order) - pos
        if not groups or (
            2 * length <= group_max and (group_max - length) * remaining >= _MIN_SAVED_SLOTS
        ):
            groups.append([])
            group_max = length
        groups[-1].append(row)
    return groups


def _contiguous_start(slots: torch.Tensor) -> int | None:
    """The first slot if the single row of ``slots`` [1, n] is a run of consecutive slots."""
    first, last = int(slots[0, 0]), int(slots[0, -1])
    if last - first != slots.shape[1] - 1 or not bool((slots[0, 1:] - slots[0, :-1] == 1).all()):
        return None
    return first


@dataclass
class ExtendSegment:
    q_start: int  # first row of this request in the flattened new tokens
    q_end: int  # one past its last row
    slot_ids: torch.Tensor | None  # [seq_len] its KV slots; None when it has no cached prefix
    mask: torch.Tensor | None  # [new_len, seq_len] bool causal mask; None without prefix


@dataclass
class ExtendMetadata:
    """Per-batch EXTEND state. The operands of each path are built on first use and kept for
    the batch's other layers: the SDPA loop's per-request segments (slots and masks), or the
    CPU kernel's length tensors; a batch normally takes only one path."""

    table: torch.Tensor  # req_to_token
    pool_rows: torch.Tensor  # [B] int64 req_pool_indices
    prefix_lens: list[int]  # [B] tokens cached before this step
    extend_lens: list[int]  # [B] new tokens
    _segments: list[ExtendSegment] | None = None
    _kernel_lens: tuple[torch.Tensor, torch.Tensor] | None = None

    def segments(self) -> list[ExtendSegment]:
        """One segment per request, in batch order (the SDPA loop's operands)."""
        if self._segments is None:
            self._segments = []
            q_start = 0
            for row, new_len, prefix_len in zip(
                self.pool_rows.tolist(), self.extend_lens, self.prefix_lens
            ):
                q_end = q_start + new_len
                if prefix_len == 0:
                    self._segments.append(ExtendSegment(q_start, q_end, None, None))
                else:
                    seq_len = prefix_len + new_len
                    # New token j (position prefix_len + j) sees keys 0 .. prefix_len + j.
                    key_pos = torch.arange(seq_len, device=self.table.device)
                    query_pos = torch.arange(prefix_len, seq_len, device=self.table.device)
                    mask = key_pos[None, :] <= query_pos[:, None]
                    slots = self.table[row, :seq_len]
                    self._segments.append(ExtendSegment(q_start, q_end, slots, mask))
                q_start = q_end
        return self._segments

    def kernel_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prefix_lens, extend_lens)`` as [B] int64 CPU tensors (the CPU kernel's)."""
        if self._kernel_lens is None:
            self._kernel_lens = (
                torch.tensor(self.prefix_lens, dtype=torch.int64),
                torch.tensor(self.extend_lens, dtype=torch.int64),
            )
        return self._kernel_lens


class TorchNativeAttnBackend(AttentionBackend):
    """SDPA-based backend. Its only state across batches is the CPU decode mirror, a copy of
    pool data that it revalidates against ``ReqToTokenPool.row_epochs`` every step."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = device
        self._mirror: DecodeKVMirror | None = None
        # Decode attention by the C++ kernel where it applies (see enable_cpu_decode_kernel).
        self.uses_cpu_kernel = False

    def enable_cpu_decode_kernel(self) -> bool:
        """Build (once per process) and use the CPU decode-attention kernel for decode batches
        on CPU; returns False, with SDPA kept, where it cannot be built. The prefill-attention
        kernel is built and used with it (where it cannot be built, EXTEND keeps SDPA)."""
        self.uses_cpu_kernel = load_kernel()
        if self.uses_cpu_kernel:
            cpu_extend_attention.load_kernel()
        return self.uses_cpu_kernel

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Set ``forward_batch.attn_metadata`` to a PagedDecodeMetadata, MirrorPlan,
        DecodeMetadata or ExtendMetadata."""
        if not forward_batch.is_decode:
            forward_batch.attn_metadata = self._extend_metadata(forward_batch)
            return
        pool = forward_batch.kv_pool
        if self._paged_decode_applies(pool):
            forward_batch.attn_metadata = PagedDecodeMetadata(
                forward_batch.req_pool_indices, forward_batch.seq_lens
            )
            return
        plan = None
        if torch.device(pool.device).type == "cpu" and not self._lone_contiguous(forward_batch):
            if self._mirror is None or self._mirror.pool is not pool:
                # Budget: the mirror may at most double the memory of the KV pool.
                self._mirror = DecodeKVMirror(pool, budget_tokens=pool.size)
            plan = self._mirror.plan(forward_batch)
        forward_batch.attn_metadata = plan or self._decode_metadata(forward_batch)

    def _paged_decode_applies(self, pool: MHATokenToKVPool) -> bool:
        """Whether decode runs in the CPU paged kernel: enabled, and it takes the pool's
        buffers (the query has the pool's dtype)."""
        if not self.uses_cpu_kernel:
            return False
        k_cache, v_cache = pool.get_kv_buffer(0)
        return kernel_supports(k_cache.new_empty((1, k_cache.shape[-1])), k_cache, v_cache)

    def release_memory(self) -> None:
        """Free the decode mirror (rebuilt from the pool by the next decode batch)."""
        self._mirror = None

    @staticmethod
    def _lone_contiguous(forward_batch: ForwardBatch) -> bool:
        """One request whose KV slots are consecutive (read as a view of the pool)."""
        if forward_batch.batch_size != 1:
            return False
        row, seq_len = forward_batch.req_pool_indices[0], forward_batch.seq_lens_cpu[0]
        slots = forward_batch.req_to_token_pool.req_to_token[row, :seq_len]
        return _contiguous_start(slots[None, :]) is not None

    @staticmethod
    def _decode_metadata(forward_batch: ForwardBatch) -> DecodeMetadata:
        table = forward_batch.req_to_token_pool.req_to_token
        seq_lens_cpu = forward_batch.seq_lens_cpu
        row_groups = group_by_length(seq_lens_cpu)
        groups = []
        for rows in row_groups:
            max_len = seq_lens_cpu[rows[0]]
            rows_t = None
            pool_rows, seq_lens = forward_batch.req_pool_indices, forward_batch.seq_lens
            if len(row_groups) > 1:  # with one group keep batch order: no gather/scatter of q
                rows_t = torch.tensor(rows, dtype=torch.int64, device=table.device)
                pool_rows = pool_rows.index_select(0, rows_t)
                seq_lens = seq_lens.index_select(0, rows_t)
            slots = table.index_select(0, pool_rows)[:, :max_len]
            mask = None
            if min(seq_lens_cpu[r] for r in rows) != max_len:
                mask = torch.arange(max_len, device=table.device)[None, :] < seq_lens[:, None]
                slots = slots.masked_fill(~mask, 0)
                mask = mask[:, None, None, :]
            start = _contiguous_start(slots) if slots.shape[0] == 1 else None
            groups.append(DecodeGroup(rows_t, slots.reshape(-1), mask, max_len, start))
        return DecodeMetadata(groups)

    @staticmethod
    def _extend_metadata(forward_batch: ForwardBatch) -> ExtendMetadata:
        return ExtendMetadata(
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.extend_prefix_lens_cpu,
            forward_batch.extend_seq_lens_cpu,
        )

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        self.store_kv(k, v, layer, forward_batch)
        meta = forward_batch.attn_metadata
        if isinstance(meta, PagedDecodeMetadata):
            k_cache, v_cache = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
            table = forward_batch.req_to_token_pool.req_to_token
            if q.dim() != 2:
                q = q.reshape(q.shape[0], -1)
            return decode_attention(
                q, k_cache, v_cache, table, meta.req_pool_indices, meta.seq_lens, layer.scaling
            )
        if isinstance(meta, MirrorPlan):
            return self._decode_mirror(q, forward_batch.attn_metadata, layer)
        groups = forward_batch.attn_metadata.groups
        if groups[0].rows is None:
            return self._decode_group(q, groups[0], layer, forward_batch)
        out = torch.empty_like(q)
        for group in groups:
            group_q = q.index_select(0, group.rows)
            out.index_copy_(0, group.rows, self._decode_group(group_q, group, layer, forward_batch))
        return out

    def _decode_mirror(
        self, q: torch.Tensor, plan: MirrorPlan, layer: RadixAttention
    ) -> torch.Tensor:
        """One attention call per mirror bucket; ``q`` and the result are in batch order."""
        mirror = self._mirror
        assert mirror is not None, "a MirrorPlan is only built with its mirror"
        mirror.fill(layer.layer_id, plan)
        out = None
        for step in plan.steps:
            keys, values = mirror.keys_values(layer.layer_id, step)
            step_q = q if step.batch_rows is None else q.index_select(0, step.batch_rows)
            step_out = _sdpa_decode(step_q, keys, values, step.mask, layer)
            if step.batch_rows is None:  # the whole batch, in batch order
                return step_out
            if out is None:
                out = torch.empty_like(q)
            out.index_copy_(0, step.batch_rows, step_out)
        assert out is not None, "a plan's steps cover every batch row"
        return out

    def _decode_group(
        self,
        q: torch.Tensor,
        group: DecodeGroup,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        """One attention call for the rows of ``group``; ``q`` is ``[b, H*D]`` in group order."""
        batch_size = q.shape[0]
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        k_cache, v_cache = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        kv_shape = (batch_size, group.max_len, num_kv_heads, head_dim)
        if group.contiguous_start is not None:
            window = slice(group.contiguous_start, group.contiguous_start + group.max_len)
            keys = k_cache[window].view(kv_shape).transpose(1, 2)
            values = v_cache[window].view(kv_shape).transpose(1, 2)
        else:
            keys = k_cache.index_select(0, group.slot_ids).view(kv_shape).transpose(1, 2)
            values = v_cache.index_select(0, group.slot_ids).view(kv_shape).transpose(1, 2)
        return _sdpa_decode(q, keys, values, group.mask, layer)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        k, v = self.store_and_read_kv(k, v, layer, forward_batch)
        meta: ExtendMetadata = forward_batch.attn_metadata
        k_cache, v_cache = forward_batch.kv_pool.get_kv_buffer(layer.layer_id)
        q_rows = q.reshape(-1, layer.num_heads * layer.head_dim)
        if self.uses_cpu_kernel and cpu_extend_attention.kernel_supports(q_rows, k_cache, v_cache):
            # One call for the batch, reading K/V in place (the new tokens' are stored above).
            prefix_lens, extend_lens = meta.kernel_lens()
            return cpu_extend_attention.extend_attention(
                q_rows,
                k_cache,
                v_cache,
                meta.table,
                meta.pool_rows,
                prefix_lens,
                extend_lens,
                layer.scaling,
            )
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        for seg in meta.segments():
            if seg.slot_ids is None:
                keys, values = k[seg.q_start : seg.q_end], v[seg.q_start : seg.q_end]
            else:
                keys = k_cache.index_select(0, seg.slot_ids).to(q.dtype)
                values = v_cache.index_select(0, seg.slot_ids).to(q.dtype)
            # [1, heads, len, D] views of the token-major tensors.
            seg_out = F.scaled_dot_product_attention(
                q[seg.q_start : seg.q_end].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=seg.mask,
                is_causal=seg.mask is None,
                scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            out[seg.q_start : seg.q_end] = seg_out.squeeze(0).transpose(0, 1)
        return out.view(-1, layer.num_heads * layer.head_dim)


def _sdpa_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    layer: RadixAttention,
) -> torch.Tensor:
    """One decode SDPA call: ``q`` [b, H*D] with its G query heads per KV head folded into the
    query axis, ``keys``/``values`` [b, KVH, len, D]; returns [b, H*D]."""
    batch_size = q.shape[0]
    out = F.scaled_dot_product_attention(
        q.reshape(batch_size, layer.num_kv_heads, -1, layer.head_dim),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=mask,
        scale=layer.scaling,
    )
    return out.reshape(batch_size, -1)
