"""The small ops between a decoder layer's products as one Triton kernel each (CUDA; on CPU
only under ``TRITON_INTERPRET=1``, for tests).

Eager torch runs the add + RMSNorm of a layer as ~6 kernels, RoPE as ~11 and SiLU-and-mul as
2. At batch 1 on a GPU each is a few microseconds, and together they were two thirds of a
SmolLM2 decode step's ~900 kernels. Each kernel here does one op in one pass over its rows.

Each computes what the torch ops of ``sglang.srt.layers`` compute, in the same dtypes and
order of roundings: the residual add in the input dtype, norm statistics and rotations in
float32, a rounding to the input dtype before the norm's weight multiply. Without fused
multiply-adds (``enable_fp_fusion=False``), the rotation's products round as torch's do. The
norm's sum of squares may add in another order than torch's reduction, and SiLU's ``exp`` is
the GPU's own, so those two can differ from torch in the last bit of a float32; after a
rounding to bfloat16 they seldom do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LAUNCH = {"enable_fp_fusion": False}


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    stride_x, stride_res, stride_out, stride_sum, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row ``r``: ``s = x + res`` (rounded to x's dtype; stored), ``out = round(s * rsqrt(
    mean(s^2) + eps)) * w``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last dim]`` with a dense last dim (a view where the layout allows)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s) * weight, s)`` with ``s = x + residual`` (``s = x`` without a residual),
    over the last dim; new tensors of ``x``'s shape and dtype. Precondition: ``x``,
    ``residual`` and ``weight`` share a dtype."""
    rows = _rows(x)
    n_rows, n_cols = rows.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    summed = rows
    res = rows
    if residual is not None:
        res = _rows(residual)
        summed = torch.empty_like(out)
    if n_rows:
        _add_rms_norm_kernel[(n_rows,)](
            rows, res, weight, out, summed,
            rows.stride(0), res.stride(0), out.stride(0), summed.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
        )  # fmt: skip
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _rotate_heads(
    src, dst, num_heads, cos, sin,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    """One token's ``num_heads`` heads from the row at ``src`` to the row at ``dst`` (heads
    dense, ``HEAD_DIM`` apart): the first ``2 * HALF`` dims rotated by ``cos``/``sin``
    ``[1, BLOCK_HALF]``, the other ``PASS`` dims copied. Each value is rounded to the source's
    dtype, then to the destination's (a K/V pool may hold another dtype)."""
    i = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    mask = (h[:, None] < num_heads) & (i < HALF)[None, :]
    offs = h[:, None] * HEAD_DIM + i[None, :]
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    src_dtype = src.dtype.element_ty
    dst_dtype = dst.dtype.element_ty
    tl.store(dst + offs, (x1 * cos - x2 * sin).to(src_dtype).to(dst_dtype), mask=mask)
    tl.store(dst + offs + HALF, (x2 * cos + x1 * sin).to(src_dtype).to(dst_dtype), mask=mask)
    if PASS > 0:
        j = tl.arange(0, BLOCK_PASS)
        rest = (h[:, None] < num_heads) & (j[None, :] < PASS)
        kept_offs = h[:, None] * HEAD_DIM + 2 * HALF + j[None, :]
        kept = tl.load(src + kept_offs, mask=rest, other=0.0)
        tl.store(dst + kept_offs, kept.to(dst_dtype), mask=rest)


@triton.jit
def _cos_sin(table_ptr, pos, stride_table, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The ``[1, BLOCK_HALF]`` cos and sin rows of position ``pos`` (``table[p] = [cos|sin]``)."""
    i = tl.arange(0, BLOCK_HALF)
    row = table_ptr + pos * stride_table + i
    cos = tl.load(row, mask=i < HALF, other=0.0)[None, :]
    sin = tl.load(row + HALF, mask=i < HALF, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _rope_kernel(
    x_ptr, out_ptr, positions_ptr, table_ptr,
    stride_x, stride_out, stride_table, num_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    """Token ``t``, all heads: the first ``2 * HALF`` dims of each head rotated by the cos/sin
    row of its position, the other ``PASS`` dims copied."""
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(table_ptr, tl.load(positions_ptr + t), stride_table, HALF, BLOCK_HALF)
    _rotate_heads(x_ptr + t * stride_x, out_ptr + t * stride_out, num_heads, cos, sin,
                  HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, PASS, BLOCK_PASS)  # fmt: skip


def rope(
    x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, head_dim: int, rotary_dim: int
) -> torch.Tensor:
    """``x`` ``[T, n * head_dim]`` (any number of heads, e.g. q and k side by side) rotated at
    ``positions`` ``[T]`` int64: NeoX-style halves of the first ``rotary_dim`` dims of each
    head, with ``table`` ``[max_position, rotary_dim]`` float32 rows ``[cos | sin]``; the last
    ``head_dim - rotary_dim`` dims are copied. A new tensor of ``x``'s shape and dtype."""
    num_tokens, width = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_tokens, width), dtype=x.dtype, device=x.device)
    num_heads, half = width // head_dim, rotary_dim // 2
    pass_dims = head_dim - rotary_dim
    if num_tokens:
        _rope_kernel[(num_tokens,)](
            x, out, positions, table, x.stride(0), out.stride(0), table.stride(0), num_heads,
            HEAD_DIM=head_dim, HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(half), PASS=pass_dims,
            BLOCK_PASS=triton.next_power_of_2(max(pass_dims, 1)), **_LAUNCH,
        )  # fmt: skip
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr
):  # fmt: skip
    """Row ``r``, columns block ``b``: ``round(silu(gate)) * up``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(dtype),
             mask=mask)  # fmt: skip


_SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]``, ``d = x.shape[-1] // 2``; a new tensor."""
    rows = _rows(x)
    n_rows, width = rows.shape
    d = width // 2
    out = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
    if n_rows:
        block = min(_SILU_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(n_rows, triton.cdiv(d, block))](
            rows, out, rows.stride(0), out.stride(0), d, BLOCK=block, **_LAUNCH
        )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _store_kv_kernel(
    k_buf_ptr, v_buf_ptr, loc_ptr, k_ptr, v_ptr, stride_kbuf, stride_vbuf, stride_k, stride_v,
    width, BLOCK: tl.constexpr,
):  # fmt: skip
    """Token ``t``: its ``width`` K and V values (all heads) to slot ``loc[t]`` of the pool."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    k = tl.load(k_ptr + t * stride_k + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_v + cols, mask=mask)
    tl.store(k_buf_ptr + slot * stride_kbuf + cols, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_buf_ptr + slot * stride_vbuf + cols, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """``k_buf[loc] = k`` and ``v_buf[loc] = v`` in one kernel (two ``index_copy_`` calls
    otherwise). ``k_buf``/``v_buf`` [slots, KVH, D] with dense slots; ``k``/``v`` [T, KVH, D]
    with dense heads (values cast to the pool's dtype); ``loc`` [T] distinct slots."""
    num_tokens = loc.shape[0]
    width = k_buf.shape[1] * k_buf.shape[2]
    k_rows, v_rows = k.reshape(num_tokens, width), v.reshape(num_tokens, width)
    if k_rows.stride(-1) != 1 or v_rows.stride(-1) != 1:
        k_rows, v_rows = k_rows.contiguous(), v_rows.contiguous()
    if num_tokens:
        _store_kv_kernel[(num_tokens,)](
            k_buf, v_buf, loc, k_rows, v_rows, k_buf.stride(0), v_buf.stride(0),
            k_rows.stride(0), v_rows.stride(0), width, BLOCK=triton.next_power_of_2(width),
        )  # fmt: skip


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_buf_ptr, v_buf_ptr, loc_ptr, positions_ptr, table_ptr,
    stride_q, stride_k, stride_v, stride_q_out, stride_kbuf, stride_vbuf, stride_table,
    num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Token ``t``: its q heads rotated to row ``t`` of the output, its k heads rotated and its
    v heads copied to slot ``loc[t]`` of the pool."""
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(table_ptr, tl.load(positions_ptr + t), stride_table, HALF, BLOCK_HALF)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    _rotate_heads(q_ptr + t * stride_q, q_out_ptr + t * stride_q_out, num_heads, cos, sin,
                  HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, PASS, BLOCK_PASS)  # fmt: skip
    _rotate_heads(k_ptr + t * stride_k, k_buf_ptr + slot * stride_kbuf, num_kv_heads, cos, sin,
                  HEAD_DIM, HALF, BLOCK_KVH, BLOCK_HALF, PASS, BLOCK_PASS)  # fmt: skip
    cols = tl.arange(0, BLOCK_V)
    mask = cols < num_kv_heads * HEAD_DIM
    v = tl.load(v_ptr + t * stride_v + cols, mask=mask)
    tl.store(v_buf_ptr + slot * stride_vbuf + cols, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """:func:`rope` of ``q`` and of ``k`` and :func:`store_kv` of the rotated k and ``v``, in
    one kernel: returns the rotated ``q`` (a new ``[T, H * head_dim]`` tensor) and writes
    ``k_buf[loc]`` and ``v_buf[loc]``, the same bits as those two calls.

    ``q`` ``[T, H * head_dim]``, ``k``/``v`` ``[T, KVH * head_dim]`` (views into a fused qkv
    row are fine: only the last dim must be dense); ``k_buf``/``v_buf`` ``[slots, KVH,
    head_dim]`` with dense slots; ``loc`` ``[T]`` distinct slots; ``positions``/``table`` as
    for :func:`rope`."""
    num_tokens = q.shape[0]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty((num_tokens, q.shape[1]), dtype=q.dtype, device=q.device)
    num_kv_heads = k_buf.shape[1]
    if k_buf[0].stride() != (head_dim, 1) or v_buf[0].stride() != (head_dim, 1):
        raise ValueError("rope_store_kv needs pools whose slots are dense [KVH, head_dim] rows")
    half, pass_dims = rotary_dim // 2, head_dim - rotary_dim
    if num_tokens:
        _rope_store_kv_kernel[(num_tokens,)](
            q, k, v, out, k_buf, v_buf, loc, positions, table,
            q.stride(0), k.stride(0), v.stride(0), out.stride(0), k_buf.stride(0),
            v_buf.stride(0), table.stride(0), q.shape[1] // head_dim, num_kv_heads,
            HEAD_DIM=head_dim, HALF=half, BLOCK_H=triton.next_power_of_2(q.shape[1] // head_dim),
            BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), PASS=pass_dims,
            BLOCK_PASS=triton.next_power_of_2(max(pass_dims, 1)),
            BLOCK_V=triton.next_power_of_2(num_kv_heads * head_dim), **_LAUNCH,
        )  # fmt: skip
    return out
