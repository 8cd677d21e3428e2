"""Batch-invariant Triton kernels for ``--enable-deterministic-inference`` on CUDA (DESIGN §7).

A row's result must not depend on how many other rows share the call, nor on how a prompt was
chunked, nor on whether a token's keys were written by a prefill or by decode steps. Each
kernel gets there the same way: its launch configuration (tile shapes, warps, stages) is a
constant, never chosen from the problem size, and no reduction is ever split across programs
(no split-K, no split-KV). The order of every floating-point addition is then a function of
the reduced length alone.

    kernel                         one program computes                 reduction order
    matmul_batch_invariant         a [BLOCK_M, BLOCK_N] output tile      K in fixed BLOCK_K steps
    rms_norm_batch_invariant       one row                               the whole row, one tile
    paged_attention_per_query      one query token x one KV head        keys 0..pos, fixed
                                   (its GROUP query heads)               BLOCK_N (<= 32) steps,
                                                                         online softmax

The attention kernel treats every query alone (its keys are read from the paged KV pool
through ``req_to_token``), so a prefill of n tokens computes each of them exactly as n decode
steps would: prefill/decode consistency by construction. The torch reference for each kernel is
the plain torch expression in its docstring; the tests compare against it and check the
invariances under ``TRITON_INTERPRET=1`` on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fixed tile shapes per input dtype (never per problem size: that is what makes rows
# invariant). float32 uses IEEE products (no TF32), as torch's default matmul does.
_MATMUL_CONFIG = {
    torch.float32: {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
    torch.bfloat16: {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    torch.float16: {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
}
_GROUP_M = 8  # tiles of 8 row-blocks are swept column-wise (L2 reuse of the weight tiles)
# Keys per step of the attention kernel: 32, fewer when the [BLOCK_G, BLOCK_N, BLOCK_D] float32
# products of a step would exceed this many elements (registers). A function of the model only.
_ATTN_TILE_ELEMENTS = 8192


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """C = A @ B.T (+ bias) for A [M, K] and B [N, K]; one output tile per program."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < k_left), other=0.0)
        if INTERPRETED:
            # The interpreter's tl.dot is a BLAS call whose rounding depends on where a row
            # sits in the tile (and its 16-bit dot is wrong): an explicit float32 product and
            # sum give every row the same reduction order, as the compiled kernel does.
            a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def matmul_batch_invariant(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose rows are bitwise independent of the other rows.

    ``x`` [..., K] and ``weight`` [N, K] of the same dtype (float32, bfloat16 or float16);
    accumulation is float32, the bias is added before the final rounding. Returns [..., N].
    """
    if x.dtype != weight.dtype or x.dtype not in _MATMUL_CONFIG:
        raise ValueError(f"unsupported dtypes {x.dtype} x {weight.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    a = x.reshape(-1, k)
    m, n = a.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    config = _MATMUL_CONFIG[x.dtype]
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _matmul_kernel[grid](
        a, weight, out, bias if bias is not None else out, m, n, k,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        INTERPRETED=x.device.type == "cpu", GROUP_M=_GROUP_M, **config,
    )  # fmt: skip
    return out.reshape(*lead, n)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    """One row per program: w * (x * rsqrt(mean(x^2) + eps)), statistics in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0)
    x_f = x.to(tl.float32)
    variance = tl.sum(x_f * x_f, axis=0) / n_cols
    normed = (x_f * tl.math.rsqrt(variance + eps)).to(x.dtype).to(tl.float32)
    # The product of two 16-bit floats is exact in float32: rounding it once gives what a
    # 16-bit multiply gives (and the interpreter has no 16-bit arithmetic).
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    out = (w * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=valid)


def rms_norm_batch_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(x.dtype)`` over the
    last dim (the HF Llama/Qwen RMSNorm), one program per row. Returns a new tensor shaped
    like ``x``, in x's dtype."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), hidden, eps,
            BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return out.reshape(x.shape)


@triton.jit
def query_tile(
    q_ptr, t, kv_head, stride_qt, stride_qh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Token t's GROUP query heads of KV head ``kv_head`` as float32 [BLOCK_G, BLOCK_D], with
    their head indices and the mask of the real (head, dim) entries."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q_ptrs = q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :]
    return tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32), heads, q_mask


@triton.jit
def fold_key_block(
    q, m, denom, acc, start, pos, table_row, k_head_ptr, v_head_ptr, stride_kt, stride_vt, scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Fold keys ``start .. start + BLOCK_N - 1`` (those ``<= pos``; the first one must be) of a
    request's table row into the online softmax (max m, sum denom, weighted values acc)."""
    d = tl.arange(0, BLOCK_D)
    n = start + tl.arange(0, BLOCK_N)
    visible = n <= pos
    slots = tl.load(table_row + n, mask=visible, other=0).to(tl.int64)
    kv_mask = visible[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_head_ptr + slots[:, None] * stride_kt + d[None, :], mask=kv_mask,
                other=0.0).to(tl.float32)  # fmt: skip
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
    scores = tl.where(visible[None, :], scores, float("-inf"))
    new_m = tl.maximum(m, tl.max(scores, axis=1))  # finite: key `start` is visible
    alpha = tl.exp(m - new_m)
    p = tl.exp(scores - new_m[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    v = tl.load(v_head_ptr + slots[:, None] * stride_vt + d[None, :], mask=kv_mask,
                other=0.0).to(tl.float32)  # fmt: skip
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return new_m, denom, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, pool_rows_ptr, positions_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_table, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query token t (program 0) attends, for KV head h (program 1) and its GROUP query heads,
    over keys 0..positions[t] of its request (row pool_rows[t] of the req_to_token table)."""
    t = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(positions_ptr + t)
    table_row = table_ptr + tl.load(pool_rows_ptr + t).to(tl.int64) * stride_table
    q, heads, q_mask = query_tile(q_ptr, t, kv_head, stride_qt, stride_qh,
                                   GROUP, HEAD_DIM, BLOCK_G, BLOCK_D)  # fmt: skip
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, pos + 1, BLOCK_N):
        m, denom, acc = fold_key_block(
            q, m, denom, acc, start, pos, table_row, k_ptr + kv_head * stride_kh,
            v_ptr + kv_head * stride_vh, stride_kt, stride_vt, scale, HEAD_DIM, BLOCK_D, BLOCK_N,
        )  # fmt: skip
    out = acc / denom[:, None]
    d = tl.arange(0, BLOCK_D)
    out_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def attention_tile_shape(group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_G, BLOCK_D, BLOCK_N) of the attention kernel for ``group`` query heads per KV
    head: constants of the model, never of the batch."""
    block_g, block_d = max(2, triton.next_power_of_2(group)), triton.next_power_of_2(head_dim)
    return block_g, block_d, max(8, min(32, _ATTN_TILE_ELEMENTS // (block_g * block_d)))


def check_paged_operands(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, tuple[int, int, int]]:
    """The query heads per KV head and :func:`attention_tile_shape` of paged attention
    operands (``q`` [T, H, D], ``k_cache``/``v_cache`` [slots, KVH, D]); ValueError when H is
    not a multiple of KVH or a head dimension is not contiguous."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous")
    group = num_heads // num_kv_heads
    return group, attention_tile_shape(group, head_dim)


def paged_attention_per_query(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    pool_rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each query token over its own request's cached keys.

    ``q`` [T, H, D]; ``k_cache``/``v_cache`` [slots, KVH, D] (H a multiple of KVH: query head
    ``h`` reads KV head ``h // (H // KVH)``); ``req_to_token`` [rows, max_len] maps a request's
    positions to KV slots; ``pool_rows`` [T] and ``positions`` [T] give each query token its
    request row and absolute position p. Keys 0..p must already be in the pool (the caller
    writes the new K/V first). Reference: ``softmax(q . K[:p+1]^T * scale) @ V[:p+1]`` per
    token and head, in float32. Returns [T, H, D] in q's dtype.
    """
    num_tokens, _, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group, (block_g, block_d, block_n) = check_paged_operands(q, k_cache, v_cache)
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    _paged_attention_kernel[(num_tokens, num_kv_heads)](
        q, k_cache, v_cache, out, req_to_token, pool_rows, positions,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=4,
    )  # fmt: skip
    return out
