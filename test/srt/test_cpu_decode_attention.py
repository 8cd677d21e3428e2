"""The CPU paged decode-attention kernel (layers/cpu_decode_attention.py) against SDPA: random
operands in a pool layout (scattered slots, garbage in every slot no row reads), and the
engine's greedy tokens and logprobs with the kernel vs ``--disable-cpu-attention-kernel``."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.cpu_decode_attention import decode_attention, kernel_supports, load_kernel
from sglang.srt.layers.cpu_extension import avx2_host

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or not avx2_host(),
    reason="the kernel is built on Linux hosts with AVX2 or AVX-512 only",
)

# Per row: 1, non-multiples of 16, and lengths over one (512 keys) and several work chunks.
LENS = [1, 17, 95, 64, 600, 3, 1300]


def _pool(
    lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, req_to_token, req_pool_indices) for requests of ``lens`` keys: each
    request's slots are a random scatter over a pool with twice as many slots (unread slots
    hold 1e4, which would dominate any softmax they leaked into), its table row one of more
    rows than requests, in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * sum(lens) + 1
    shape = (num_slots, kv_heads, head_dim)
    k_cache = torch.full(shape, 1e4).to(dtype)
    v_cache = torch.full(shape, 1e4).to(dtype)
    table = torch.zeros(len(lens) + 3, max(lens) + 9, dtype=torch.int64)
    rows = torch.randperm(table.shape[0], generator=gen)[: len(lens)]
    slots = torch.randperm(num_slots - 1, generator=gen) + 1
    used = 0
    for row, n in zip(rows.tolist(), lens):
        table[row, :n] = slots[used : used + n]
        used += n
        k_cache[table[row, :n]] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[table[row, :n]] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, table, rows


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    lens: list[int],
    scale: float,
) -> torch.Tensor:
    """SDPA in float64 over each row's gathered keys."""
    out = []
    kv_heads, head_dim = k_cache.shape[1:]
    for i, (row, n) in enumerate(zip(rows.tolist(), lens)):
        keys = k_cache[table[row, :n]].double().transpose(0, 1)  # [KVH, n, D]
        values = v_cache[table[row, :n]].double().transpose(0, 1)
        query = q[i].double().reshape(kv_heads, -1, head_dim)  # [KVH, G, D]
        out.append(F.scaled_dot_product_attention(query, keys, values, scale=scale).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize(
    ("dtype", "native_bf16"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["float32", "bfloat16", "bfloat16-portable"],
)
def test_matches_sdpa(group: int, head_dim: int, dtype: torch.dtype, native_bf16: bool) -> None:
    """Every row attends to exactly its own keys, for each query-head group size, head dim
    (48: the runtime-size loops) and dtype, with bfloat16 by the CPU's own dot-product
    instruction where it has one and by the portable code; nothing of the slots a row does not
    own leaks in."""
    assert load_kernel()
    torch.manual_seed(head_dim + group)
    kv_heads = 2
    k_cache, v_cache, table, rows = _pool(LENS, kv_heads, head_dim, dtype)
    # q as a slice of a wider projection output (row stride > H*D), as the model hands it over
    width = kv_heads * group * head_dim
    q = torch.randn(len(LENS), width + 3 * head_dim).to(dtype)[:, :width]
    assert kernel_supports(q, k_cache, v_cache)
    scale = head_dim**-0.5
    lens = torch.tensor(LENS)
    got = decode_attention(q, k_cache, v_cache, table, rows, lens, scale, native_bf16)
    expected = _reference(q, k_cache, v_cache, table, rows, LENS, scale)
    assert got.dtype == dtype and got.shape == (len(LENS), width)
    if dtype == torch.float32:
        # values are ~N(0, 1): 1e-5 relative to their scale
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    else:  # the reference sees the same bfloat16 inputs; the output is rounded to bfloat16
        # (and the native path rounds the softmax weights to bfloat16, as SDPA does)
        torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_result_independent_of_threads_and_batch(dtype: torch.dtype) -> None:
    """A row's result is the same bits with 1 or 2 threads, alone or in a batch: the keys are
    split into chunks by length only, and the batch's 10 chunks are work items of all KV heads
    (at least 2 per thread) where a row alone is computed by items of one KV head each."""
    assert load_kernel()
    k_cache, v_cache, table, rows = _pool(LENS, 3, 64, dtype)
    q = torch.randn(len(LENS), 9 * 64).to(dtype)
    lens = torch.tensor(LENS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, k_cache, v_cache, table, rows, lens, 0.125)
        torch.set_num_threads(2)
        two = decode_attention(q, k_cache, v_cache, table, rows, lens, 0.125)
        alone = [
            decode_attention(q[i, None], k_cache, v_cache, table, rows[i, None], n[None], 0.125)
            for i, n in enumerate(lens)
        ]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(torch.cat(alone), two)


def test_rejects_operands_out_of_contract() -> None:
    assert load_kernel()
    k_cache, v_cache, table, rows = _pool([3, 5], 1, 64, torch.float32)
    q = torch.randn(2, 64)
    for lens in ([0, 3], [3, table.shape[1] + 1]):
        with pytest.raises(RuntimeError, match="seq_lens must be in"):
            decode_attention(q, k_cache, v_cache, table, rows, torch.tensor(lens), 0.125)
    lens = torch.tensor([3, 5])
    with pytest.raises(RuntimeError, match="req_pool_indices out of range"):
        decode_attention(q, k_cache, v_cache, table, torch.tensor([0, 99]), lens, 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        decode_attention(q.bfloat16(), k_cache, v_cache, table, rows, lens, 0.125)


def test_unsupported_operands_fall_back() -> None:
    k_cache, v_cache, _, _ = _pool([3], 1, 64, torch.float32)
    q = torch.randn(1, 64)
    assert kernel_supports(q, k_cache, v_cache)
    assert not kernel_supports(q.half(), k_cache.half(), v_cache.half())
    assert not kernel_supports(q.bfloat16(), k_cache, v_cache)  # mixed dtypes
    assert not kernel_supports(q, k_cache[:, :, :32], v_cache[:, :, :32])  # not contiguous
    k_cache, v_cache, _, _ = _pool([3], 1, 40, torch.float32)  # head dim not a multiple of 16
    assert not kernel_supports(torch.randn(1, 40), k_cache, v_cache)


def test_model_runner_enables_the_kernel(tiny_model_dir) -> None:
    """On by default on CPU, off with --disable-cpu-attention-kernel and in deterministic
    mode (which has its own backend)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = str(tiny_model_dir())
    config = ModelConfig(path, dtype="float32", device="cpu")
    for kwargs, expected in [
        ({}, True),
        ({"disable_cpu_attention_kernel": True}, False),
        ({"enable_deterministic_inference": True}, False),
    ]:
        args = ServerArgs(model_path=path, device="cpu", max_total_tokens=64, **kwargs)
        backend = ModelRunner(args, config).attn_backend
        assert getattr(backend, "uses_cpu_kernel", False) is expected, kwargs


def test_engine_tokens_and_logprobs_match_sdpa(tiny_model_dir) -> None:
    """Greedy tokens and their logprobs with the kernel == with SDPA (float32, to the HF parity
    tests' 1e-4), on a model with head dim 64 and 3 query heads per KV head: a lone request
    and a batch of mixed lengths (SDPA: the zero-copy path and the mirror's buckets). In
    bfloat16 the tiny random model's greedy run is chaotic (SDPA's own tokens leave the float32
    ones within a few steps), so there the kernel is held to SDPA by test_matches_sdpa."""
    import random

    import sglang as sgl

    model_dir = tiny_model_dir("llama", hidden_size=384, num_attention_heads=6)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 460) for _ in range(n)] for n in (5, 40, 77, 150, 9, 66)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    results = []
    for disable in (False, True):
        with sgl.Engine(
            model_path=str(model_dir), random_seed=0, disable_cpu_attention_kernel=disable
        ) as engine:
            alone = engine.generate(
                input_ids=[prompts[0]], sampling_params=params, return_logprob=True
            )
            batch = engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True
            )
        results.append(alone + batch)
    for with_kernel, with_sdpa in zip(*results):
        assert with_kernel["output_ids"] == with_sdpa["output_ids"]
        got = [lp for lp, _, _ in with_kernel["meta_info"]["output_token_logprobs"]]
        ref = [lp for lp, _, _ in with_sdpa["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(ref, abs=1e-4)
