"""Split-KV paged decode attention (Triton; CUDA, or CPU under ``TRITON_INTERPRET=1``).

The per-query kernel of ``sgl_kernel.batch_invariant`` runs one program per (token, KV head)
and walks the keys in order. At batch 1 that is 3 programs for SmolLM2 on a GPU of 132
multiprocessors, each a chain of dependent loads (table row, then keys and values) per 32
keys: ~15 us a layer, a third of an H100 decode step. Here a token's keys are split over
``NUM_SPLITS`` programs and a second kernel merges their partial softmaxes:

    key chunk c = keys [c * CHUNK, (c + 1) * CHUNK)      (CHUNK = the tile's BLOCK_N)
    program (t, h, s) folds chunks s, s + NUM_SPLITS, s + 2 * NUM_SPLITS, ... of token t
    merge (t, head):  out = sum_s w_s o_s / sum_s w_s,  w_s = exp(lse_s - max lse)

The partition is a function of the token's position alone, never of the batch: a token's
result is the same whatever else shares its step, padding rows of a CUDA graph included. It
is not the per-query kernel's reduction order, so deterministic mode (prefill/decode
consistency) keeps that kernel; this one serves decode otherwise, while the per-query kernel's
programs do not fill the GPU (:func:`split_pays_off`).

Measured on an H100 (bfloat16, SmolLM2's 9 query and 3 KV heads, 300 keys per token, GPU time
per call): 1 token 7.2 us here against 37.5 us per query; 32 tokens 24 vs 38 us; 512 tokens
376 vs 307 us (each program then holds at most a chunk or two, and the merge is extra work).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sgl_kernel.batch_invariant import check_paged_operands, fold_key_block, query_tile

# Programs per (token, KV head). 16 x 32 keys: a token's first 512 keys take one chunk per
# program; SmolLM2 at batch 1 gets 48 programs.
NUM_SPLITS = 16


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, part_out_ptr, part_lse_ptr, table_ptr, pool_rows_ptr, positions_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Token t, KV head h, split s: the normalized partial output [GROUP, D] and log-sum-exp
    [GROUP] over the split's chunks (lse -inf, output 0 for a split with no key)."""
    t = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(positions_ptr + t)
    table_row = table_ptr + tl.load(pool_rows_ptr + t).to(tl.int64) * stride_table
    q, heads, q_mask = query_tile(q_ptr, t, kv_head, stride_qt, stride_qh,
                                   GROUP, HEAD_DIM, BLOCK_G, BLOCK_D)  # fmt: skip
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(split * BLOCK_N, pos + 1, NUM_SPLITS * BLOCK_N):
        m, denom, acc = fold_key_block(
            q, m, denom, acc, start, pos, table_row, k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh, stride_kt, stride_vt, scale, HEAD_DIM, BLOCK_D, BLOCK_N,
        )  # fmt: skip
    has_keys = denom > 0.0
    out = acc / tl.where(has_keys, denom, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, denom, 1.0)), float("-inf"))
    # Partials laid out [T, H, NUM_SPLITS, D] and [T, H, NUM_SPLITS].
    d = tl.arange(0, BLOCK_D)
    row = (t * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
    tl.store(part_lse_ptr + row, lse, mask=tl.arange(0, BLOCK_G) < GROUP)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, positions_ptr, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Token t, query head h: the softmax-weighted mean of its splits' outputs (splits past the
    token's last chunk hold no key and are not read)."""
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    used = tl.minimum(tl.load(positions_ptr + t) // BLOCK_N + 1, NUM_SPLITS)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    row = (t * num_heads + head) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s < used, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # split 0 always holds key 0: the max is finite
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                    mask=(s[:, None] < used) & (d[None, :] < HEAD_DIM), other=0.0)  # fmt: skip
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)  # fmt: skip


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_pays_off(num_tokens: int, num_kv_heads: int, device: torch.device) -> bool:
    """Whether a decode step of ``num_tokens`` tokens should split its keys: while the
    per-query kernel's ``num_tokens * num_kv_heads`` programs are fewer than the GPU's
    multiprocessors (one wave leaves some idle). A function of the batch size alone, so one
    captured CUDA graph always runs one kernel. Always on CPU (Triton's interpreter: tests)."""
    if device.type != "cuda":
        return True
    return num_tokens * num_kv_heads < _multiprocessors(device)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    pool_rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each query token over its own request's cached keys ``0..positions[t]``,
    the keys split over :data:`NUM_SPLITS` programs.

    Same contract and reference as ``sgl_kernel.batch_invariant.paged_attention_per_query``
    (``q`` [T, H, D]; ``k_cache``/``v_cache`` [slots, KVH, D]; keys 0..p already in the pool;
    returns [T, H, D] in q's dtype), with float32 partials of ``T * H * NUM_SPLITS * (D + 1)``
    floats as scratch. Reads lengths on the device only: safe to capture in a CUDA graph.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group, (block_g, block_d, block_n) = check_paged_operands(q, k_cache, v_cache)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    part_lse = torch.empty(
        (num_tokens, num_heads, NUM_SPLITS), dtype=torch.float32, device=q.device
    )
    part_out = part_lse.new_empty((num_tokens, num_heads, NUM_SPLITS, head_dim))
    _split_kernel[(num_tokens, num_kv_heads, NUM_SPLITS)](
        q, k_cache, v_cache, part_out, part_lse, req_to_token, pool_rows, positions,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        NUM_SPLITS=NUM_SPLITS, num_warps=4,
    )  # fmt: skip
    _merge_kernel[(num_tokens, num_heads)](
        part_out, part_lse, out, positions, num_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=NUM_SPLITS, num_warps=1,
    )  # fmt: skip
    return out
