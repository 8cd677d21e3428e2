"""The segment-grouped LoRA kernels (sglang.srt.lora.triton_ops) against a plain torch
reference. On CPU they run in Triton's interpreter: conftest sets TRITON_INTERPRET=1 before
anything imports triton, so these tests run (slowly, small shapes) in CPU CI. The ``gpu`` test
repeats the comparison at a real model's shapes on CUDA."""

from __future__ import annotations

import pytest
import torch
from model_test_utils import TEST_DEVICE

from sglang.srt.lora.triton_ops import (
    LoRASegments,
    build_lora_segments,
    lora_expand,
    lora_shrink,
    triton_lora_available,
)

DTYPES = [torch.float32, torch.bfloat16]
Request = tuple[int, int, int]  # (row_start, row_len, slot or -1)


def lora_delta_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    widths: list[int],
    requests: list[Request],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Y, delta) computed row group by row group in float32: ``Y[rows, :w] = x[rows] @
    A[slot, :w].T`` rounded to x's dtype (the kernels' intermediate), ``delta[rows] =
    Y[rows, :w] @ B[slot, :, :w].T`` in float32; zero for base rows and past each width."""
    y = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in requests:
        if slot < 0:
            continue
        w, rows = widths[slot], slice(start, start + length)
        y[rows, :w] = (x[rows].float() @ a[slot, :w].float().T).to(x.dtype)
        delta[rows] = y[rows, :w].float() @ b[slot, :, :w].float().T
    return y, delta


def _tol(dtype: torch.dtype) -> dict:
    # bf16: Y is rounded to 8 mantissa bits and the kernel's float32 sums differ in order from
    # torch's, so one bf16 ulp of Y can flip; out is compared after its own bf16 rounding.
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}


def _slots(
    num_slots: int,
    widths: list[int],
    k: int,
    num_out: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    shard_starts: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked A [S, W_max, K] and B [S, O, W_max]. Without ``shard_starts`` every entry is
    random, also past each slot's width (the kernels must not read it); with them B is laid
    out as layers.py writes a fused layer: shard s's columns only in its output rows."""
    w_max = max(widths)
    a = torch.randn(num_slots, w_max, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, num_out, w_max, generator=gen) / 4
    if shard_starts is not None:
        n = len(shard_starts)
        bounds = [*shard_starts, num_out]
        b_fused = torch.zeros_like(b)
        for slot, w in enumerate(widths):
            r = w // n
            for s in range(n):
                rows, cols = slice(bounds[s], bounds[s + 1]), slice(s * r, (s + 1) * r)
                b_fused[slot, rows, cols] = b[slot, rows, cols]
        b = b_fused
    return a.to(TEST_DEVICE, dtype), b.to(TEST_DEVICE, dtype)


def _check_against_reference(
    requests: list[Request],
    widths: list[int],
    dtype: torch.dtype,
    k: int = 80,
    num_out: int = 96,
    shard_starts: list[int] | None = None,
    seed: int = 0,
) -> LoRASegments:
    gen = torch.Generator().manual_seed(seed)
    num_rows = max((start + length for start, length, _ in requests), default=0)
    a, b = _slots(len(widths), widths, k, num_out, dtype, gen, shard_starts)
    # x is a column slice (row stride k + 8), as a reshaped hook input may be.
    x = torch.randn(num_rows, k + 8, generator=gen).to(TEST_DEVICE, dtype)[:, :k]
    out = torch.randn(num_rows, num_out, generator=gen).to(TEST_DEVICE, dtype)
    widths_t = torch.tensor(widths, dtype=torch.int32, device=TEST_DEVICE)
    segments = build_lora_segments(requests, TEST_DEVICE)

    y = lora_shrink(x, a, widths_t, segments)
    y_ref, delta = lora_delta_reference(x, a, b, widths, requests)
    assert y.dtype == dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y.float(), y_ref.float(), **_tol(dtype))
    expected = (out.float() + delta).to(dtype)
    base = [torch.arange(s, s + n) for s, n, slot in requests if slot < 0]
    for layout in [(0,)] + ([shard_starts] if shard_starts else []):
        result = out.clone()
        lora_expand(y, b, widths_t, segments, result, layout)
        torch.testing.assert_close(result.float(), expected.float(), **_tol(dtype))
        for rows in base:  # untouched, bit for bit
            assert torch.equal(result[rows.to(TEST_DEVICE)], out[rows.to(TEST_DEVICE)])
    return segments


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_one_row_segments(dtype: torch.dtype) -> None:
    """16 one-row requests over 3 slots of different widths, base rows between them; no two
    neighbours share a slot, so there are as many segments as adapted rows."""
    slots = [0, 1, 2, -1, 0, 2, 1, -1, 2, 0, 1, 0, -1, 1, 2, 0]
    segments = _check_against_reference([(i, 1, s) for i, s in enumerate(slots)], [8, 5, 3], dtype)
    assert segments.starts.numel() == 13 and segments.max_len == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_long_segments(dtype: torch.dtype) -> None:
    """Segments of 37 and 70 rows (several row blocks each, the last one partial) around a
    base-model request; K and W_max are not multiples of the tiles."""
    requests = [(0, 37, 1), (37, 5, -1), (42, 70, 0)]
    segments = _check_against_reference(requests, [6, 7], dtype, k=72)
    assert segments.lens.tolist() == [37, 70] and segments.max_len == 70


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("widths", [[12, 24, 0], [12, 72, 0]])
def test_fused_shards_and_ranks_per_slot(dtype: torch.dtype, widths: list[int]) -> None:
    """q, k, v shards (48 + 24 + 24 output rows: both column blocks of 64 straddle a shard
    boundary), adapters of rank 4 and 8 (or 24) and an empty slot, decode and prefill rows in
    one step: the shard-restricted expand equals the full product. With rank 24, W_max = 72
    spans two column blocks of shrink (the rank-4 slot skips the second) and a straddling
    expand block reduces over 48 columns in two steps."""
    requests = [(0, 1, 1), (1, 1, 0), (2, 1, 2), (3, 20, 1), (23, 1, -1), (24, 3, 0)]
    _check_against_reference(requests, widths, dtype, shard_starts=[0, 48, 72])


def test_empty_batch() -> None:
    """No segment (all rows base model, or no rows): Y is zero and out is left as it was."""
    gen = torch.Generator().manual_seed(0)
    a, b = _slots(2, [4, 4], 16, 32, torch.float32, gen)
    widths = torch.tensor([4, 4], dtype=torch.int32, device=TEST_DEVICE)
    for num_rows in (0, 3):
        segments = build_lora_segments([(0, num_rows, -1)], TEST_DEVICE)
        assert segments.starts.numel() == 0 and segments.max_len == 0
        x = torch.randn(num_rows, 16, generator=gen).to(TEST_DEVICE)
        out = torch.randn(num_rows, 32, generator=gen).to(TEST_DEVICE)
        y = lora_shrink(x, a, widths, segments)
        assert y.shape == (num_rows, 4) and not y.any()
        result = out.clone()
        lora_expand(y, b, widths, segments, result)
        assert torch.equal(result, out)


def test_build_segments_merges_and_skips() -> None:
    segments = build_lora_segments(
        [(0, 2, 1), (2, 3, 1), (5, 1, -1), (6, 0, 0), (6, 4, 0), (10, 1, 1), (12, 2, 1)], "cpu"
    )
    assert segments.starts.tolist() == [0, 6, 10, 12]
    assert segments.lens.tolist() == [5, 4, 1, 2]
    assert segments.slots.tolist() == [1, 0, 1, 1]
    assert segments.max_len == 5 and segments.starts.dtype == torch.int32
    with pytest.raises(ValueError, match="overlap"):
        build_lora_segments([(0, 3, 0), (2, 1, 1)], "cpu")


def test_availability_and_argument_checks() -> None:
    assert triton_lora_available(TEST_DEVICE)  # CUDA, or CPU under the interpreter (conftest)
    x = torch.randn(4, 16, device=TEST_DEVICE)
    a = torch.randn(2, 8, 16, device=TEST_DEVICE)
    widths = torch.tensor([8, 8], dtype=torch.int32, device=TEST_DEVICE)
    segments = build_lora_segments([(0, 4, 0)], TEST_DEVICE)
    with pytest.raises(ValueError, match="a:"):
        lora_shrink(x, a.bfloat16(), widths, segments)
    with pytest.raises(ValueError, match="widths"):
        lora_shrink(x, a, widths.long(), segments)
    with pytest.raises(ValueError, match="x:"):
        lora_shrink(x.T, a[:, :, :4], widths, segments)
    y = lora_shrink(x, a, widths, segments)
    with pytest.raises(ValueError, match="shard_starts"):
        lora_expand(y, torch.zeros(2, 8, 8, device=TEST_DEVICE), widths, segments,
                    torch.zeros(4, 8, device=TEST_DEVICE), (0, 2, 4, 6))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_realistic_shapes(dtype: torch.dtype) -> None:
    """SmolLM2-like fused qkv (K 576, O 1728 in 3 shards), ranks 16 and 64 and an empty slot
    in a pool sized for rank 64, 256 rows: 128 decode rows then prefills of 57 and 71."""
    slots = [i % 4 - 1 for i in range(128)]  # -1 (base), 0, 1, 2 in turn
    requests = [(i, 1, s) for i, s in enumerate(slots)] + [(128, 57, 1), (185, 71, 0)]
    _check_against_reference(
        requests, [48, 192, 0], dtype, k=576, num_out=1728, shard_starts=[0, 576, 1152]
    )
