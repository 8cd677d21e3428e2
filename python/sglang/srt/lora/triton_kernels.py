"""The two segment-grouped Triton kernels of the batched LoRA matmul (wrappers, contracts and
launch shapes: :mod:`sglang.srt.lora.triton_ops`, the only module that imports this one).

A segment is a run of consecutive rows of the step's tokens that all use one adapter slot.
Both kernels share one grid, ``(segment, row block within the segment, column block)``::

    program (g, m, n)   rows  seg_starts[g] + m*BLOCK_M ... + BLOCK_M - 1   (< seg_lens[g])
                        cols  n*BLOCK_N ... n*BLOCK_N + BLOCK_N - 1
    shrink   Y[rows, cols]    = x[rows] @ A[slot, cols].T            cols >= widths[slot] -> 0
    expand   out[rows, cols] += Y[rows, k_lo:k_hi] @ B[slot, cols, k_lo:k_hi].T

Row blocks past a segment's end exit at once, so the grid is sized by the longest segment of
the step. Every reduction accumulates in float32 in one program (no split-K), so each output
element is written by exactly one program and the in-place ``+=`` of expand needs no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mma(acc, a, b, IEEE: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` in float32. float32 inputs use IEEE products (no TF32), as torch's
    default matmul does. The interpreter's 16-bit ``tl.dot`` is wrong, so on CPU the tiles are
    widened to float32 first."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _segment_rows(seg_starts_ptr, seg_lens_ptr, seg, m_block, BLOCK_M: tl.constexpr):
    """Rows (int64, for the pointer arithmetic of large tensors) of this program's row block
    of segment ``seg``, their mask, and whether the block holds any row at all."""
    seg_len = tl.load(seg_lens_ptr + seg)
    in_seg = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = (tl.load(seg_starts_ptr + seg) + in_seg).to(tl.int64)
    return rows, in_seg < seg_len, m_block * BLOCK_M < seg_len


@triton.jit
def _shard_of(col, shard_start1, shard_start2):
    """Index (0, 1 or 2) of the shard whose output rows of B hold row ``col``."""
    return (col >= shard_start1).to(tl.int32) + (col >= shard_start2).to(tl.int32)


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, y_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, widths_ptr,
    K, w_max, stride_xm, stride_as, stride_aw, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """Y[rows, cols] = x[rows] @ A[slot, cols].T, zero in columns at or past the slot's width
    (so a reader may take all w_max columns). x [N, K], A [S, w_max, K], Y [N, w_max]; the
    last dimension of each is contiguous."""
    seg, m_block, n_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, row_mask, any_rows = _segment_rows(seg_starts_ptr, seg_lens_ptr, seg, m_block, BLOCK_M)
    if any_rows:
        slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
        width = tl.load(widths_ptr + slot)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # A column block wholly past the adapter's width only writes zeros: skip its K loop
        # (a rank-16 adapter in a pool sized for rank 64 reads a quarter of A's rows).
        if n_block * BLOCK_N < width:
            a_base = a_ptr + slot * stride_as + cols[None, :] * stride_aw
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(
                    x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & (ks[None, :] < K),
                    other=0.0,
                )
                a = tl.load(
                    a_base + ks[:, None],
                    mask=(cols[None, :] < width) & (ks[:, None] < K),
                    other=0.0,
                )
                acc = _mma(acc, x, a, IEEE, INTERPRETED)
        tl.store(
            y_ptr + rows[:, None] * stride_ym + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=row_mask[:, None] & (cols[None, :] < w_max),
        )


@triton.jit
def lora_expand_kernel(
    y_ptr, b_ptr, out_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr, widths_ptr,
    num_out, stride_ym, stride_bs, stride_bo, stride_om, shard_start1, shard_start2,
    NUM_SHARDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """out[rows, cols] += Y[rows, k_lo:k_hi] @ B[slot, cols, k_lo:k_hi].T, the sum rounded once
    to out's dtype. Y [N, W], B [S, num_out, W], out [N, num_out]; last dimensions contiguous.

    With NUM_SHARDS n > 1, output rows [shard_start_s, shard_start_{s+1}) of B are shard s and
    only its columns s*r .. (s+1)*r (r = width / n) can be non-zero, so [k_lo, k_hi) is the
    union of those column ranges over the shards this column block touches; with n == 1 it is
    [0, width). Starts of shards that do not exist are num_out."""
    seg, m_block, n_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, row_mask, any_rows = _segment_rows(seg_starts_ptr, seg_lens_ptr, seg, m_block, BLOCK_M)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    width = tl.load(widths_ptr + slot)
    if any_rows and width > 0:  # an empty slot adds nothing: leave out untouched
        rank = width // NUM_SHARDS
        first_col = n_block * BLOCK_N
        last_col = tl.minimum(first_col + BLOCK_N, num_out) - 1
        k_lo = _shard_of(first_col, shard_start1, shard_start2) * rank
        k_hi = (_shard_of(last_col, shard_start1, shard_start2) + 1) * rank
        cols = first_col + tl.arange(0, BLOCK_N)
        b_base = b_ptr + slot * stride_bs + cols[None, :].to(tl.int64) * stride_bo
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            y = tl.load(
                y_ptr + rows[:, None] * stride_ym + ks[None, :],
                mask=row_mask[:, None] & (ks[None, :] < k_hi),
                other=0.0,
            )
            b = tl.load(
                b_base + ks[:, None],
                mask=(cols[None, :] < num_out) & (ks[:, None] < k_hi),
                other=0.0,
            )
            acc = _mma(acc, y, b, IEEE, INTERPRETED)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        mask = row_mask[:, None] & (cols[None, :] < num_out)
        total = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
