"""Per-request contiguous copies of the running requests' K/V, for batched decode on CPU.

Decode attention needs the keys of the batch as dense ``[b, KVH, max_len, D]`` tensors, but the
pool keeps them scattered over slots (decode steps interleave the requests' new tokens).
Gathering them anew in every layer of every step copies the whole KV of the batch each step,
which on CPU costs as much as the attention itself. The mirror keeps that dense layout across
steps instead, one row per running request, in buckets by length class::

    bucket with len_cap C, per layer:  k[layer], v[layer]   [rows_cap, C, KVH, D]
    row w holds the pool's K/V of pool row owner[w], positions [0, valid_len[w])
    a request of length n lives in the bucket C = length_class(n)  (n <= C, C <= 1.25 n + 64)

Each step copies only what a row lacks from the pool (the new token; the whole sequence when
a request first decodes or grows into the next bucket), so the per-step copy is ``B`` rows
instead of every key. SDPA runs once per bucket, padded to that bucket's longest row: the
buckets bound the padding that one padded call over the whole batch would read (on a mixed
batch that is most of the attention's memory traffic).

Validity: the pool's KV of a request can change only when its ReqToTokenPool row is handed out
again or rewritten, and every such change bumps ``ReqToTokenPool.row_epochs[row]``; a mirror row
is reused only while its ``(pool row, epoch)`` is unchanged, else it is refilled from the pool.
All buckets together never exceed ``budget_tokens`` (sum of rows_cap * len_cap); a batch that
would need more gets ``None`` from :meth:`DecodeKVMirror.plan` and the caller gathers instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# Bucket rows grow in steps of this many (with 25% headroom), and a bucket shrinks once it has
# more than twice the rows it needs plus one step.
_ROW_STEP = 8
# Length classes: multiples of _MIN_LEN_STEP, two classes per octave above 2 * that (64, 128,
# 192, 256, 384, 512, 768, ...). On the benchmark's mixed batches SDPA then reads ~1.13x the
# real keys instead of ~1.7x for one padded call, in ~5 calls per layer; finer classes (~1.08x,
# ~6 calls) gained nothing, as more requests change bucket (a refill) per step.
_MIN_LEN_STEP = 64


def length_class(seq_len: int) -> int:
    """The ``len_cap`` of the bucket for a sequence of ``seq_len`` tokens: ``seq_len`` rounded
    up to a multiple of ``max(64, 2 ** (floor(log2(seq_len)) - 1))``."""
    step = max(_MIN_LEN_STEP, 1 << max(seq_len.bit_length() - 2, 0))
    return -(-seq_len // step) * step


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass
class BucketStep:
    """One SDPA call of a decode step: the rows of one bucket."""

    bucket: _Bucket
    num_rows: int  # rows [0, num_rows) of the bucket are this step's requests of its class
    max_len: int  # longest of them (keys per row, padded)
    fill_range: tuple[int, int]  # this bucket's part of MirrorPlan.fill_src
    fill_dst: torch.Tensor  # [F_b] int64 flat index row * len_cap + position in the bucket
    mask: torch.Tensor | None  # [num_rows, 1, 1, max_len] bool, True = real key; None: no padding
    batch_rows: torch.Tensor | None  # [num_rows] batch row of each bucket row; None: identity


@dataclass
class MirrorPlan:
    """What every layer of one decode step does with the mirror (built once per step)."""

    fill_src: torch.Tensor  # [F] int64 pool slots to copy in (new tokens included), by bucket
    steps: list[BucketStep]  # together they cover every batch row once


class _Bucket:
    """The mirror rows of one length class (see the module docstring)."""

    def __init__(self, pool: MHATokenToKVPool, len_cap: int) -> None:
        self.pool = pool
        self.len_cap = len_cap
        self.rows_cap = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.owner: list[tuple[int, int]] = []  # per row: (pool row, its epoch)
        self.valid_len: list[int] = []  # per row: positions copied from the pool

    def rows_cap_for(self, num_rows: int) -> int:
        """The row capacity :meth:`fit` gives for ``num_rows`` rows."""
        if self.rows_cap >= num_rows and self.rows_cap <= 2 * num_rows + _ROW_STEP:
            return self.rows_cap
        return _round_up(num_rows + num_rows // 4, _ROW_STEP)

    def fit(self, num_rows: int) -> None:
        """Reallocate to ``rows_cap_for(num_rows)`` rows if that differs, keeping the rows
        (precondition: at most ``num_rows`` of them)."""
        rows_cap = self.rows_cap_for(num_rows)
        if rows_cap == self.rows_cap:
            return
        shape = (rows_cap, self.len_cap, self.pool.head_num, self.pool.head_dim)
        kept = len(self.owner)
        for bufs in (self.k, self.v):
            # One layer at a time, so the peak is one layer over the old and new sizes. Rows not
            # copied are zeroed: SDPA reads the padding behind a row's length (masked, but
            # NaN * 0 is NaN), so every value in the buffers must stay finite.
            for layer_id in range(self.pool.layer_num):
                new = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
                new[kept:].zero_()
                if layer_id < len(bufs):
                    new[:kept] = bufs[layer_id][:kept]
                    bufs[layer_id] = new
                else:
                    bufs.append(new)
        self.rows_cap = rows_cap

    def keep_only(self, wanted: set[tuple[int, int]]) -> None:
        """Keep the rows whose owner is in ``wanted``, moved down to ``[0, kept)``: each kept
        row above that range moves into a hole below it (one row copy per layer)."""
        keep = [w for w, owner in enumerate(self.owner) if owner in wanted]
        num_kept = len(keep)
        holes = [w for w in range(num_kept) if self.owner[w] not in wanted]
        movers = [w for w in keep if w >= num_kept]
        if movers:
            src = torch.tensor(movers, device=self.pool.device)
            dst = torch.tensor(holes, device=self.pool.device)
            for buf in self.k + self.v:
                buf.index_copy_(0, dst, buf.index_select(0, src))
            for h, m in zip(holes, movers):
                self.owner[h], self.valid_len[h] = self.owner[m], self.valid_len[m]
        del self.owner[num_kept:], self.valid_len[num_kept:]


class DecodeKVMirror:
    """Owner of the mirror buckets of one KV pool; used by one attention backend."""

    def __init__(self, pool: MHATokenToKVPool, budget_tokens: int) -> None:
        self.pool = pool
        self.budget_tokens = budget_tokens
        self.buckets: dict[int, _Bucket] = {}  # len_cap -> bucket

    def plan(self, forward_batch: ForwardBatch) -> MirrorPlan | None:
        """Rearrange the mirror for this decode batch and say what each layer must copy.

        Mutates the mirror (drops rows of requests not in the batch or grown out of their
        bucket, moves rows, resizes buckets) and marks every row valid up to its new sequence
        length, which the per-layer :meth:`fill` of this step makes true. Returns None, after
        emptying the mirror, when the batch needs more than ``budget_tokens``.
        """
        pool_rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens_cpu
        epochs = forward_batch.req_to_token_pool.row_epochs
        owners = [(row, epochs[row]) for row in pool_rows]
        by_class: dict[int, list[int]] = {}  # len_cap -> batch rows
        for i, n in enumerate(seq_lens):
            by_class.setdefault(length_class(n), []).append(i)
        for len_cap in list(self.buckets):
            if len_cap not in by_class:
                del self.buckets[len_cap]
        for len_cap, rows in by_class.items():
            bucket = self.buckets.setdefault(len_cap, _Bucket(self.pool, len_cap))
            bucket.keep_only({owners[i] for i in rows})
        needed = sum(self.buckets[c].rows_cap_for(len(r)) * c for c, r in by_class.items())
        if needed > self.budget_tokens:
            self.reset()
            return None
        fill_src: list[torch.Tensor] = []
        steps = []
        num_filled = 0
        for len_cap, rows in sorted(by_class.items()):
            bucket = self.buckets[len_cap]
            bucket.fit(len(rows))
            step, src = self._bucket_step(forward_batch, bucket, rows, owners, num_filled)
            fill_src.append(src)
            num_filled += src.numel()
            steps.append(step)
        return MirrorPlan(torch.cat(fill_src), steps)

    def fill(self, layer_id: int, plan: MirrorPlan) -> None:
        """Copy this step's missing K/V of ``layer_id`` from the pool into the buckets (after
        the pool got the new tokens)."""
        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        new_k = k_cache.index_select(0, plan.fill_src)
        new_v = v_cache.index_select(0, plan.fill_src)
        flat_shape = (-1, self.pool.head_num, self.pool.head_dim)
        for step in plan.steps:
            start, end = step.fill_range
            k, v = step.bucket.k[layer_id], step.bucket.v[layer_id]
            k.view(flat_shape).index_copy_(0, step.fill_dst, new_k[start:end])
            v.view(flat_shape).index_copy_(0, step.fill_dst, new_v[start:end])

    @staticmethod
    def keys_values(layer_id: int, step: BucketStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``step``'s rows as ``[num_rows, KVH, max_len, D]`` views."""
        window = (slice(0, step.num_rows), slice(0, step.max_len))
        k, v = step.bucket.k[layer_id], step.bucket.v[layer_id]
        return k[window].transpose(1, 2), v[window].transpose(1, 2)

    def reset(self) -> None:
        """Forget every row and free the tensors."""
        self.buckets = {}

    def _bucket_step(
        self,
        forward_batch: ForwardBatch,
        bucket: _Bucket,
        rows: list[int],
        owners: list[tuple[int, int]],
        fill_offset: int,
    ) -> tuple[BucketStep, torch.Tensor]:
        """Give the batch ``rows`` (all of this bucket's class) bucket rows; returns the step
        and the pool slots of every position they lack, the new token (position n - 1, always
        rewritten) included."""
        device = self.pool.device
        seq_lens = forward_batch.seq_lens_cpu
        row_of = {owner: w for w, owner in enumerate(bucket.owner)}
        for i in rows:
            if owners[i] not in row_of:
                row_of[owners[i]] = len(bucket.owner)
                bucket.owner.append(owners[i])
                bucket.valid_len.append(0)
        bucket_rows = [row_of[owners[i]] for i in rows]
        starts = [min(bucket.valid_len[w], seq_lens[i] - 1) for w, i in zip(bucket_rows, rows)]
        lens = [seq_lens[i] for i in rows]
        for w, n in zip(bucket_rows, lens):
            bucket.valid_len[w] = n
        bases = torch.tensor(bucket_rows, device=device) * bucket.len_cap
        rows_t = torch.tensor(rows, device=device)
        if all(s == n - 1 for s, n in zip(starts, lens)):  # steady state: new tokens only
            src = forward_batch.out_cache_loc.index_select(0, rows_t)
            dst = bases + torch.tensor(starts, device=device)
        else:
            table = forward_batch.req_to_token_pool.req_to_token
            pool_rows = [owners[i][0] for i in rows]
            src = torch.cat([table[r, s:n] for r, s, n in zip(pool_rows, starts, lens)])
            dst = torch.cat(
                [torch.arange(s, n, device=device) + b for s, n, b in zip(starts, lens, bases)]
            )
        max_len = max(lens)
        mask = None
        num_rows = len(rows)
        if min(lens) != max_len:
            bucket_lens = [0] * num_rows
            for w, n in zip(bucket_rows, lens):
                bucket_lens[w] = n
            lens_t = torch.tensor(bucket_lens, device=device)
            mask = torch.arange(max_len, device=device)[None, :] < lens_t[:, None]
            mask = mask[:, None, None, :]
        batch_of = [0] * num_rows
        for w, i in zip(bucket_rows, rows):
            batch_of[w] = i
        identity = num_rows == forward_batch.batch_size and batch_of == list(range(num_rows))
        batch_rows = None if identity else torch.tensor(batch_of, device=device)
        fill_range = (fill_offset, fill_offset + src.numel())
        step = BucketStep(bucket, num_rows, max_len, fill_range, dst, mask, batch_rows)
        return step, src
