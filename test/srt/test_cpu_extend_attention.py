"""The CPU prefill-attention kernel (layers/cpu_extend_attention.py) against a float64 SDPA
reference: random operands in a real pool layout (scattered slots, cached prefixes), and the
engine's greedy tokens and logprobs with the kernels vs ``--disable-cpu-attention-kernel`` on
prompts that hit the radix cache."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.cpu_extend_attention import (
    extend_attention,
    kernel_supports,
    load_kernel,
    tiles_supported,
)
from sglang.srt.layers.cpu_extension import cpu_flags

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"),
    reason="the kernel is built on Linux x86-64/aarch64 only",
)

# (cached prefix, new tokens) per request: no prefix and a prefix, a lone new token, lengths
# that are not multiples of the kernel's blocks (32 keys, items of 32-128 new tokens; on the
# brgemm path 128 keys / 64 rows), requests of many blocks (three key blocks on the brgemm
# path: 290 keys), split into the fewest items of a short request (4 x 75 rows) and into items
# of up to 128 rows (5 x 120).
REQUESTS = [
    (0, 45), (37, 70), (5, 1), (0, 1), (130, 33), (0, 97), (64, 64), (200, 90), (40, 300),
    (0, 600),
]


def _pool_batch(
    requests: list[tuple[int, int]], kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """A layer's K/V pool [S, KVH, D] with every request's tokens in scattered slots (slot 0
    and the unused slots hold 1e4: reading one breaks the result), a request-to-token table
    with more rows and columns than used, the requests in shuffled rows; returns (k_cache,
    v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens)."""
    seq_lens = [p + e for p, e in requests]
    size = sum(seq_lens) + 20
    k_cache = torch.randn(size, kv_heads, head_dim)
    v_cache = torch.randn(size, kv_heads, head_dim)
    slots = torch.randperm(size - 1)[: sum(seq_lens)] + 1
    unused = torch.ones(size, dtype=torch.bool)
    unused[slots] = False
    k_cache[unused] = 1e4
    v_cache[unused] = 1e4
    table = torch.zeros(len(requests) + 3, max(seq_lens) + 9, dtype=torch.int64)
    pool_rows = torch.randperm(len(requests) + 3)[: len(requests)]
    start = 0
    for row, seq_len in zip(pool_rows.tolist(), seq_lens):
        table[row, :seq_len] = slots[start : start + seq_len]
        start += seq_len
    prefix_lens = torch.tensor([p for p, _ in requests])
    extend_lens = torch.tensor([e for _, e in requests])
    return k_cache.to(dtype), v_cache.to(dtype), table, pool_rows, prefix_lens, extend_lens


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    pool_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per request, float64 SDPA over the operands' values with the bottom-right causal mask."""
    head_dim, kv_heads = k_cache.shape[2], k_cache.shape[1]
    num_heads = q.shape[1] // head_dim
    outs, start = [], 0
    for row, prefix, new in zip(pool_rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()):
        slots = table[row, : prefix + new]
        keys = k_cache[slots].double().transpose(0, 1)
        values = v_cache[slots].double().transpose(0, 1)
        query = q[start : start + new].double().view(new, num_heads, head_dim).transpose(0, 1)
        mask = torch.arange(prefix + new)[None, :] <= torch.arange(prefix, prefix + new)[:, None]
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=kv_heads != num_heads
        )
        outs.append(out.transpose(0, 1).reshape(new, -1))
        start += new
    return torch.cat(outs)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "tiles"),
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.bfloat16, torch.bfloat16, True),
        (torch.float32, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, False),
    ],
)
def test_matches_sdpa(
    group: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, tiles: bool
) -> None:
    """Every new token attends to exactly the keys up to its own position, for each query-head
    group size, head dim (48: the runtime-size loops and the key packing's scalar path),
    dtype pairing and, in bfloat16, both the vdpbf16ps path and the brgemm (AMX) path."""
    assert load_kernel()
    if tiles and " avx512_bf16" not in cpu_flags():
        pytest.skip("the brgemm path is built on AVX512-BF16 hosts only (see test below)")
    torch.manual_seed(head_dim + group)
    kv_heads = 2
    operands = _pool_batch(REQUESTS, kv_heads, head_dim, kv_dtype)
    total = int(operands[-1].sum())
    # q as a slice of a wider projection output (row stride > H*D), as the model hands it over
    width = kv_heads * group * head_dim
    q = torch.randn(total, width + 3 * head_dim).to(q_dtype)[:, :width]
    assert kernel_supports(q, operands[0], operands[1])
    scale = head_dim**-0.5
    got = extend_attention(q, *operands, scale, tiles=tiles)
    expected = _reference(q, *operands, scale)
    assert got.dtype == q_dtype and got.shape == (total, width)
    if q_dtype == torch.float32:
        # values are ~N(0, 1): 1e-5 relative to their scale
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    else:
        # the reference is computed from the same bfloat16 values; the output is rounded once
        torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1.6e-2)


def test_brgemm_path_availability() -> None:
    """The brgemm path is chosen by default exactly on AMX hosts; a build without AVX512-BF16
    refuses it with a clear error instead of computing something else."""
    assert load_kernel()
    flags = cpu_flags()
    assert tiles_supported() == (
        " amx_bf16" in flags and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )
    operands = _pool_batch([(0, 3)], 1, 64, torch.bfloat16)
    q = torch.randn(3, 64).to(torch.bfloat16)
    if " avx512_bf16" in flags:
        torch.testing.assert_close(
            extend_attention(q, *operands, 0.125, tiles=True).double(),
            _reference(q, *operands, 0.125), atol=1e-2, rtol=1.6e-2,
        )
    else:
        with pytest.raises(RuntimeError, match="no AMX path"):
            extend_attention(q, *operands, 0.125, tiles=True)
    # float32 operands ignore the flag
    q32, k32, v32 = q.float(), operands[0].float(), operands[1].float()
    torch.testing.assert_close(
        extend_attention(q32, k32, v32, *operands[2:], 0.125, tiles=True),
        extend_attention(q32, k32, v32, *operands[2:], 0.125, tiles=False),
    )


@pytest.mark.parametrize(
    ("dtype", "tiles"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_threads_give_identical_results(dtype: torch.dtype, tiles: bool) -> None:
    """Work items are independent: 1 and 2 threads give the same bits (SmolLM2's heads, a
    batch of many requests)."""
    assert load_kernel()
    if tiles and " avx512_bf16" not in cpu_flags():
        pytest.skip("the brgemm path is built on AVX512-BF16 hosts only")
    torch.manual_seed(1)
    requests = [(int(p), int(e)) for p, e in torch.randint(1, 90, (16, 2))]
    requests[0] = (0, 150)
    operands = _pool_batch(requests, 3, 64, dtype)
    q = torch.randn(int(operands[-1].sum()), 9 * 64).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = extend_attention(q, *operands, 0.125, tiles=tiles)
        torch.set_num_threads(2)
        two = extend_attention(q, *operands, 0.125, tiles=tiles)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    expected = _reference(q, *operands, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(one.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_request_result_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """A request's work items depend on its own lengths only: alone or in a batch (of shorter
    and longer requests) it gets the same bits."""
    assert load_kernel()
    torch.manual_seed(2)
    requests = [(0, 600), (16, 9), (40, 300), (3, 130)]
    k_cache, v_cache, table, rows, prefix_lens, extend_lens = _pool_batch(requests, 3, 64, dtype)
    q = torch.randn(int(extend_lens.sum()), 9 * 64).to(dtype)
    batch = extend_attention(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, 0.125)
    start = 0
    for i, new in enumerate(extend_lens.tolist()):
        alone = extend_attention(
            q[start : start + new], k_cache, v_cache, table, rows[i : i + 1],
            prefix_lens[i : i + 1], extend_lens[i : i + 1], 0.125,
        )
        assert torch.equal(alone, batch[start : start + new]), requests[i]
        start += new


def test_rejects_inconsistent_operands() -> None:
    assert load_kernel()
    k_cache, v_cache, table, rows, prefix_lens, extend_lens = _pool_batch(
        [(3, 4), (0, 5)], 1, 64, torch.float32
    )
    q = torch.randn(9, 64)
    with pytest.raises(RuntimeError, match="extend_lens sum to"):
        extend_attention(q[:8], k_cache, v_cache, table, rows, prefix_lens, extend_lens, 0.125)
    bad_table = table.clone()
    bad_table[rows[0], 2] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        extend_attention(q, k_cache, v_cache, bad_table, rows, prefix_lens, extend_lens, 0.125)
    too_long = torch.tensor([table.shape[1], 5])
    with pytest.raises(RuntimeError, match="out of range"):
        extend_attention(q, k_cache, v_cache, table, rows, too_long, extend_lens, 0.125)


def test_unsupported_operands_fall_back() -> None:
    assert load_kernel()
    q = torch.randn(2, 64)
    k_cache, v_cache = torch.randn(8, 1, 64), torch.randn(8, 1, 64)
    assert kernel_supports(q, k_cache, v_cache)
    assert not kernel_supports(q.half(), k_cache, v_cache)
    assert not kernel_supports(q, k_cache.half(), v_cache.half())
    assert not kernel_supports(q, k_cache, v_cache.to(torch.bfloat16))
    # head dim not a multiple of 16
    assert not kernel_supports(torch.randn(2, 40), torch.randn(8, 1, 40), torch.randn(8, 1, 40))


def test_engine_tokens_and_logprobs_match_sdpa(tiny_model_dir) -> None:
    """Greedy tokens and their logprobs with the CPU kernels == with SDPA (float32, to the HF
    parity tests' 1e-4), head dim 64 and 3 query heads per KV head: prompts that share a long
    prefix, so the second batch's prefills start from radix-cache hits (a cached prefix),
    next to fresh prompts of mixed lengths."""
    import random

    import sglang as sgl

    model_dir = tiny_model_dir("llama", hidden_size=384, num_attention_heads=6)
    rng = random.Random(0)
    shared = [rng.randrange(3, 460) for _ in range(70)]
    fresh = [[rng.randrange(3, 460) for _ in range(n)] for n in (5, 40, 77)]
    suffixes = [[rng.randrange(3, 460) for _ in range(n)] for n in (1, 9, 33)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    results = []
    for disable in (False, True):
        with sgl.Engine(
            model_path=str(model_dir), random_seed=0, disable_cpu_attention_kernel=disable
        ) as engine:
            first = engine.generate(
                input_ids=[shared] + fresh, sampling_params=params, return_logprob=True
            )
            second = engine.generate(
                input_ids=[shared + s for s in suffixes], sampling_params=params,
                return_logprob=True,
            )
        assert all(out["meta_info"]["cached_tokens"] >= len(shared) for out in second)
        results.append(first + second)
    for with_kernel, with_sdpa in zip(*results):
        assert with_kernel["output_ids"] == with_sdpa["output_ids"]
        got = [lp for lp, _, _ in with_kernel["meta_info"]["output_token_logprobs"]]
        ref = [lp for lp, _, _ in with_sdpa["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(ref, abs=1e-4)
