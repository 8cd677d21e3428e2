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
def _rope_kernel(
    x_ptr, out_ptr, positions_ptr, table_ptr,
    stride_x, stride_out, stride_table, num_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
):  # fmt: skip
    """Token ``t``, all heads: the first ``2 * HALF`` dims of each head rotated by the cos/sin
    row of its position (``table[p] = [cos | sin]``), the other ``PASS`` dims copied."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    i = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    i_mask = i < HALF
    mask = (h[:, None] < num_heads) & i_mask[None, :]
    cos = tl.load(table_ptr + pos * stride_table + i, mask=i_mask, other=0.0)[None, :]
    sin = tl.load(table_ptr + pos * stride_table + HALF + i, mask=i_mask, other=0.0)[None, :]
    src = x_ptr + t * stride_x + h[:, None] * HEAD_DIM + i[None, :]
    dst = out_ptr + t * stride_out + h[:, None] * HEAD_DIM + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)
    if PASS > 0:
        j = tl.arange(0, BLOCK_PASS)
        rest = (h[:, None] < num_heads) & (j[None, :] < PASS)
        offs = h[:, None] * HEAD_DIM + 2 * HALF + j[None, :]
        kept = tl.load(x_ptr + t * stride_x + offs, mask=rest, other=0.0)
        tl.store(out_ptr + t * stride_out + offs, kept, mask=rest)


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
