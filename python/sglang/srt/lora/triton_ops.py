"""Segment-grouped LoRA matmul with Triton: the CUDA path of the batched LoRA delta.

The torch path (:mod:`sglang.srt.lora.layers`) gathers each adapter's rows, does two matmuls
and scatters back with ``index_add_``. Here the step's rows are described once as segments
(runs of consecutive rows using one slot) and two kernels read x and write out in place, with
no gather, no scatter and no per-adapter launch::

    Y   = lora_shrink(x, A, widths, segments)               # [N, W_max], x's dtype
    lora_expand(Y, B, widths, segments, out, shard_starts)  # out[rows] += Y[rows] @ B[slot].T

How a caller (a :class:`~sglang.srt.lora.layers.LoRATarget`'s hook) uses them:

1. Once per step, from each request's rows of the flattened tokens (in row order) and its
   slot (-1: base model): ``segments = build_lora_segments([(row_start, row_len, slot), ...],
   device)``. One host-to-device copy; adjacent requests of one slot become one segment; base
   rows are in no segment, so their delta is 0 and ``out`` keeps its value there.
2. Per target, keep ``widths`` as an int32 tensor [num_slots] on the weights' device, equal to
   ``LoRATarget.width`` (n * rank; 0 for an empty slot), updated when a slot is written.
3. In the hook: ``x = inputs[0].reshape(-1, in)``, ``out = output.view(-1, out_features)``,
   then ``lora_expand(lora_shrink(x, A, widths, segments), B, widths, segments, out,
   target.offsets)``. ``A`` [S, W_max, in] and ``B`` [S, out, W_max] are the target's stacked
   slots, unchanged (their layout is the one layers.py writes).

Contract of both wrappers: x, A, B, Y and out share one device and one dtype (float32,
bfloat16 or float16); each has a contiguous last dimension (other strides are free); widths
and the segment tensors are int32 on that device. Segments must not overlap and must lie in
[0, N); ``widths[s] <= W_max``; neither is checked (it would cost a device sync). Products
accumulate in float32; Y is rounded to x's dtype (as the torch path's intermediate is), and
each element of out is rounded once, after the delta is added. Nothing synchronizes the host;
the launch shape depends on the number of segments and ``max_len``, so a CUDA graph capture
must fix both (pad with zero-length segments; ``segments._replace(max_len=captured)``).
Importing this module does not import triton (the first launch does): check
:func:`triton_lora_available` before choosing this path.

Cost of the fused-shard layout: B of a fused layer (q, k, v or gate, up) holds shard s's
columns s*r .. (s+1)*r only in its output rows, zeros elsewhere, so the full product over
[:width] would be correct but do n times the expand work. Given ``shard_starts`` (the
target's ``offsets``), each output column block reduces only over the columns of the shards
it touches: r columns, 2r for a block straddling a shard boundary. Shrink reads all of A's
n*r rows: they are all dense.

Rows are not batch invariant: the row tile (16 or 64) is chosen from the longest segment of
the step, so deterministic mode keeps the torch path (``LoRATarget.batch_invariant``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from sglang.srt import environ

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_SHARDS = 3  # q, k, v: the most shards a fused projection has
# Row tile: 16 (tl.dot's minimum) when every segment is short (decode), else 64 (prefill).
_SHORT_SEGMENT = 16
_LONG_BLOCK_M = 64


class LoRASegments(NamedTuple):
    """Which rows of a step use which slot: segment g is rows ``starts[g] .. starts[g] +
    lens[g] - 1``, all with slot ``slots[g]``. Tensors are int32 [G] on the compute device."""

    starts: torch.Tensor
    lens: torch.Tensor
    slots: torch.Tensor
    max_len: int  # the longest segment (0 if none), on the host: it sizes the grid, no sync


def build_lora_segments(
    requests: Iterable[tuple[int, int, int]], device: torch.device | str
) -> LoRASegments:
    """Segments of a step from each request's ``(row_start, row_len, slot)`` in row order
    (``slot`` -1: the base model, in no segment). Requests of one slot whose rows follow each
    other merge into one segment (fewer, fuller row tiles). ValueError if rows go backwards
    or overlap."""
    starts: list[int] = []
    lens: list[int] = []
    slots: list[int] = []
    end = 0
    for row_start, row_len, slot in requests:
        if row_start < end or row_len < 0:
            raise ValueError(f"request rows [{row_start}, +{row_len}) overlap or precede row {end}")
        end = row_start + row_len
        if slot < 0 or row_len == 0:
            continue
        if slots and slots[-1] == slot and starts[-1] + lens[-1] == row_start:
            lens[-1] += row_len
        else:
            starts.append(row_start)
            lens.append(row_len)
            slots.append(slot)
    table = torch.tensor([starts, lens, slots], dtype=torch.int32).to(device)
    return LoRASegments(table[0], table[1], table[2], max(lens, default=0))


def triton_lora_available(device: torch.device | str) -> bool:
    """Whether the kernels can run on ``device``: triton is installed and the device is CUDA,
    or CPU with Triton's interpreter on (``TRITON_INTERPRET=1``, slow: for tests)."""
    kind = torch.device(device).type
    if importlib.util.find_spec("triton") is None:
        return False
    return kind == "cuda" or (kind == "cpu" and environ.triton_interpret_enabled())


def _next_pow2_in(n: int, low: int, high: int) -> int:
    """The smallest power of two >= n, clamped to [low, high] (tile sizes are powers of two;
    tl.dot needs at least 16)."""
    return min(high, max(low, 1 << max(n - 1, 0).bit_length()))


def _check(name: str, t: torch.Tensor, dim: int, ref: torch.Tensor) -> None:
    if t.dim() != dim or t.dtype != ref.dtype or t.device != ref.device or t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a {dim}-d {ref.dtype} tensor on {ref.device} with a contiguous "
            f"last dimension; got {tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}"
        )


def _check_widths(widths: torch.Tensor, num_slots: int, ref: torch.Tensor) -> None:
    if widths.dtype != torch.int32 or widths.shape != (num_slots,) or widths.device != ref.device:
        raise ValueError(
            f"widths: expected int32 [{num_slots}] on {ref.device}; got {widths.dtype} "
            f"{tuple(widths.shape)} on {widths.device}"
        )


def _row_block(segments: LoRASegments) -> int:
    return _SHORT_SEGMENT if segments.max_len <= _SHORT_SEGMENT else _LONG_BLOCK_M


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, widths: torch.Tensor, segments: LoRASegments
) -> torch.Tensor:
    """Y [N, W_max] with ``Y[rows, :w] = x[rows] @ A[slot, :w].T`` for every segment (w =
    ``widths[slot]``), zero elsewhere: in columns >= w and in rows of no segment.

    ``x`` [N, K], ``a`` [S, W_max, K], ``widths`` int32 [S]; Y has x's dtype (float32
    accumulation). A new tensor: callers may keep it across layers of one step.
    """
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: unsupported dtype {x.dtype}")
    _check("x", x, 2, x)
    _check("a", a, 3, x)
    num_slots, w_max, k = a.shape
    if k != x.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} does not match x {tuple(x.shape)}")
    _check_widths(widths, num_slots, x)
    y = torch.zeros(x.shape[0], w_max, dtype=x.dtype, device=x.device)
    num_segments = segments.starts.numel()
    if num_segments == 0 or segments.max_len == 0 or w_max == 0:
        return y
    from sglang.srt.lora import triton_kernels  # imports triton: only on this path

    block_m = _row_block(segments)
    block_n = _next_pow2_in(w_max, 16, 64)
    grid = (num_segments, -(-segments.max_len // block_m), -(-w_max // block_n))
    triton_kernels.lora_shrink_kernel[grid](
        x, a, y, segments.starts, segments.lens, segments.slots, widths,
        k, w_max, x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
        IEEE=x.dtype == torch.float32, INTERPRETED=x.device.type == "cpu",
    )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    widths: torch.Tensor,
    segments: LoRASegments,
    out: torch.Tensor,
    shard_starts: Sequence[int] = (0,),
) -> None:
    """``out[rows] += Y[rows, :w] @ B[slot, :, :w].T`` in place for every segment (w =
    ``widths[slot]``); rows of no segment and slots of width 0 leave out unchanged.

    ``y`` [N, W_max] (from :func:`lora_shrink`), ``b`` [S, O, W_max], ``out`` [N, O].
    ``shard_starts``: first output row of each shard of a fused layer (``LoRATarget.offsets``,
    at most 3, starting at 0); B must then be zero outside each shard's block of columns
    (layers.py's layout) and ``widths`` multiples of the number of shards.
    """
    _check("y", y, 2, y)
    _check("b", b, 3, y)
    _check("out", out, 2, y)
    num_slots, num_out, w_max = b.shape
    if y.shape[1] != w_max or out.shape != (y.shape[0], num_out):
        raise ValueError(
            f"y {tuple(y.shape)}, b {tuple(b.shape)} and out {tuple(out.shape)} do not match"
        )
    num_shards = len(shard_starts)
    if not 1 <= num_shards <= _MAX_SHARDS or shard_starts[0] != 0:
        raise ValueError(f"shard_starts must be 1 to {_MAX_SHARDS} rows from 0: {shard_starts}")
    _check_widths(widths, num_slots, y)
    num_segments = segments.starts.numel()
    if num_segments == 0 or segments.max_len == 0 or num_out == 0:
        return
    from sglang.srt.lora import triton_kernels  # imports triton: only on this path

    # Missing shards start at O: no column reaches them.
    starts = [*shard_starts[1:], num_out, num_out][:2]
    block_m = _row_block(segments)
    block_n = 64
    grid = (num_segments, -(-segments.max_len // block_m), -(-num_out // block_n))
    triton_kernels.lora_expand_kernel[grid](
        y, b, out, segments.starts, segments.lens, segments.slots, widths,
        num_out, y.stride(0), b.stride(0), b.stride(1), out.stride(0), starts[0], starts[1],
        NUM_SHARDS=num_shards, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=_next_pow2_in(w_max // num_shards, 16, 64),
        IEEE=y.dtype == torch.float32, INTERPRETED=y.device.type == "cpu",
    )  # fmt: skip
