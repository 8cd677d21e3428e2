"""The CPU decode-attention kernel (layers/cpu_decode_attention.py) against SDPA: random
operands laid out like the decode mirror, and the engine's greedy tokens and logprobs with the
kernel vs ``--disable-cpu-attention-kernel``."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.cpu_decode_attention import decode_attention, kernel_supports, load_kernel

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"),
    reason="the kernel is built on Linux x86-64/aarch64 only",
)

LENS = [1, 17, 95, 64, 130, 3]  # per row: 1 and non-multiples of 16 included


def _mirror_views(
    batch: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V as the mirror hands them out: [b, KVH, max_len, D] transposed windows of
    [rows_cap, len_cap, KVH, D] buffers with more rows and positions than used."""
    shape = (batch + 2, max_len + 14, kv_heads, head_dim)
    k, v = (torch.randn(shape).to(dtype) for _ in range(2))
    window = (slice(0, batch), slice(0, max_len))
    return k[window].transpose(1, 2), v[window].transpose(1, 2)


def _reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA in float64 over the operands' values, with the key mask."""
    batch, kv_heads, max_len, head_dim = keys.shape
    mask = (torch.arange(max_len)[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.double().reshape(batch, kv_heads, -1, head_dim),
        keys.double(),
        values.double(),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(batch, -1)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_matches_sdpa(
    group: int, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """Every row attends to exactly its first lens[i] keys, for each query-head group size,
    head dim (48: the runtime-size loops) and dtype pairing; the padding behind a row's length
    holds garbage that must not leak in."""
    assert load_kernel()
    torch.manual_seed(head_dim + group)
    kv_heads, batch = 2, len(LENS)
    lens = torch.tensor(LENS)
    keys, values = _mirror_views(batch, kv_heads, head_dim, max(LENS) + 5, kv_dtype)
    keys.select(2, -1).fill_(1e4)  # a key past every row's length: masked out or the test fails
    # q as a slice of a wider projection output (row stride > H*D), as the model hands it over
    width = kv_heads * group * head_dim
    q = torch.randn(batch, width + 3 * head_dim).to(q_dtype)[:, :width]
    assert kernel_supports(q, keys, values)
    scale = head_dim**-0.5
    got = decode_attention(q, keys, values, lens, scale)
    expected = _reference(q, keys, values, lens, scale)
    assert got.dtype == q_dtype and got.shape == (batch, width)
    if q_dtype == torch.float32:
        # values are ~N(0, 1): 1e-5 relative to their scale
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1.6e-2)


def test_threads_give_identical_results() -> None:
    """(row, KV head) pairs are independent: 1 and 2 threads give the same bits."""
    assert load_kernel()
    keys, values = _mirror_views(len(LENS), 3, 64, 140, torch.float32)
    q = torch.randn(len(LENS), 9 * 64)
    lens = torch.tensor(LENS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, keys, values, lens, 0.125)
        torch.set_num_threads(2)
        two = decode_attention(q, keys, values, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_rejects_lengths_out_of_range() -> None:
    assert load_kernel()
    keys, values = _mirror_views(2, 1, 64, 8, torch.float32)
    q = torch.randn(2, 64)
    for lens in ([0, 3], [3, 9]):
        with pytest.raises(RuntimeError, match="lens must be in"):
            decode_attention(q, keys, values, torch.tensor(lens), 0.125)


def test_unsupported_operands_fall_back() -> None:
    q = torch.randn(2, 64)
    keys, values = _mirror_views(2, 1, 64, 8, torch.float32)
    assert not kernel_supports(q.half(), keys, values)
    assert not kernel_supports(q, keys.half(), values.half())
    assert not kernel_supports(q, keys, values.to(torch.bfloat16))
    keys, values = _mirror_views(2, 1, 40, 8, torch.float32)  # head dim not a multiple of 16
    assert not kernel_supports(torch.randn(2, 40), keys, values)


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
    (the zero-copy path) and a batch of mixed lengths (the mirror, several buckets). In
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
