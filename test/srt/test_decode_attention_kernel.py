"""The split-KV decode attention kernel (sgl_kernel.decode_attention; CUDA, here in Triton's
interpreter on CPU): it matches float64 attention, a token's bits do not depend on the other
tokens of its step, and it agrees with the per-query kernel that prefill and deterministic mode
use. Lengths cover one key, a partial chunk, exact chunk edges and more chunks than programs
(each program then folds several)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_test_utils import TEST_DEVICE

import sgl_kernel.decode_attention as da
from sgl_kernel.batch_invariant import paged_attention_per_query
from sgl_kernel.decode_attention import NUM_SPLITS, paged_decode_attention, split_pays_off

# 16 programs x 32 keys = 512 keys before a program takes a second chunk; 1100 needs three.
LENGTHS = [1, 5, 32, 33, 300, 512, 513, 1100]


def _decode_case(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """One decode token per request of LENGTHS keys, the keys in shuffled pool slots (slot 0,
    the pool's dummy, unused); the requests sit in rows 1, 3, 5, ... of the table."""
    gen = torch.Generator().manual_seed(3)
    total = sum(LENGTHS)
    k_cache = torch.randn(total + 1, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(total + 1, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(total, generator=gen) + 1
    table = torch.zeros(2 * len(LENGTHS), max(LENGTHS) + 7, dtype=torch.int64)
    start = 0
    for i, length in enumerate(LENGTHS):
        table[2 * i + 1, :length] = slots[start : start + length]
        start += length
    pool_rows = torch.arange(len(LENGTHS)) * 2 + 1
    positions = torch.tensor(LENGTHS) - 1
    q = torch.randn(len(LENGTHS), num_heads, head_dim, generator=gen).to(dtype)
    tensors = (q, k_cache, v_cache, table, pool_rows, positions)
    return tuple(t.to(TEST_DEVICE) for t in tensors)


def _reference(q, k_cache, v_cache, table, pool_rows, positions, scale) -> torch.Tensor:
    out = []
    for i in range(q.shape[0]):
        keys = table[pool_rows[i], : positions[i] + 1]
        k = k_cache[keys].double().transpose(0, 1)
        v = v_cache[keys].double().transpose(0, 1)
        out.append(
            F.scaled_dot_product_attention(
                q[i : i + 1].double().transpose(0, 1), k, v, scale=scale, enable_gqa=True
            ).transpose(0, 1)
        )
    return torch.cat(out)


@pytest.mark.parametrize(
    "heads, head_dim, dtype",
    [((9, 3), 64, torch.float32), ((4, 4), 32, torch.float32), ((9, 3), 64, torch.bfloat16),
     ((8, 1), 128, torch.bfloat16)],
)  # fmt: skip
def test_matches_float64_attention(heads: tuple[int, int], head_dim: int, dtype) -> None:
    case = _decode_case(*heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(*case, scale)
    assert out.shape == case[0].shape and out.dtype == dtype
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.double(), _reference(*case, scale), **tol)
    per_query = paged_attention_per_query(*case, scale)
    torch.testing.assert_close(out.float(), per_query.float(), **tol)


def test_a_tokens_bits_do_not_depend_on_its_step() -> None:
    """Each token alone, in a sub-batch, or among padding-like repeats: the same bits (what
    lets CUDA graphs pad a batch without changing a token)."""
    q, k_cache, v_cache, table, pool_rows, positions = _decode_case(9, 3, 64, torch.float32)
    full = paged_decode_attention(q, k_cache, v_cache, table, pool_rows, positions, 0.125)
    for i in [0, 7]:
        alone = paged_decode_attention(
            q[i : i + 1], k_cache, v_cache, table, pool_rows[i : i + 1], positions[i : i + 1], 0.125
        )
        assert torch.equal(alone, full[i : i + 1])
    rows = torch.tensor([7, 2, 7, 0], device=TEST_DEVICE)
    mixed = paged_decode_attention(
        q[rows], k_cache, v_cache, table, pool_rows[rows], positions[rows], 0.125
    )
    assert torch.equal(mixed, full[rows])


def test_edge_cases() -> None:
    q, k_cache, v_cache, table, pool_rows, positions = _decode_case(4, 2, 16, torch.float32)
    assert paged_decode_attention(q[:0], k_cache, v_cache, table, pool_rows[:0], positions[:0],
                                  1.0).shape == (0, 4, 16)  # fmt: skip
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, table, pool_rows, positions, 1.0)
    assert NUM_SPLITS & (NUM_SPLITS - 1) == 0  # tl.arange over the splits needs a power of two


def test_split_only_while_per_query_programs_leave_multiprocessors_idle(monkeypatch) -> None:
    """On a GPU of 132 multiprocessors with 3 KV heads: split up to 43 tokens (129 per-query
    programs), the per-query kernel from 44; always split in the interpreter."""
    monkeypatch.setattr(da, "_multiprocessors", lambda device: 132)
    gpu = torch.device("cuda")
    assert split_pays_off(1, 3, gpu) and split_pays_off(43, 3, gpu)
    assert not split_pays_off(44, 3, gpu) and not split_pays_off(256, 3, gpu)
    assert split_pays_off(256, 3, torch.device("cpu"))
