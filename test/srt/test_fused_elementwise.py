"""The fused Triton elementwise kernels (sgl_kernel.fused_elementwise; CUDA, here in Triton's
interpreter on CPU) against the torch ops they replace, and a model run with them on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_test_utils import TEST_DEVICE, make_runner

from sgl_kernel import fused_elementwise as fe
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm, rms_norm
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, get_rope

DTYPES = [torch.float32, torch.bfloat16]
INTERPRETED = TEST_DEVICE == "cpu"  # Triton's interpreter (conftest sets it without CUDA)


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 2).to(dtype).to(TEST_DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor, exact_fp32: bool = False) -> None:
    """float32: bit for bit where the kernel rounds as torch does (``exact_fp32``), else within
    the last bit of a sum of squares or an ``exp`` taken another way (~1e-6 relative).
    bfloat16 on a GPU: nearly always bit for bit, within a rounding. Triton's CPU interpreter
    rounds float32 to bfloat16 toward zero (not to nearest), so there only the values are
    checked, within a few roundings."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        if exact_fp32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    elif INTERPRETED:
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2)
        assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 576])
def test_add_rms_norm_equals_the_torch_ops(dtype: torch.dtype, hidden: int) -> None:
    x, res = _rand(7, hidden, dtype=dtype), _rand(7, hidden, dtype=dtype, seed=1)
    weight = _rand(hidden, dtype=dtype, seed=2)
    out, summed = fe.add_rms_norm(x, res, weight, 1e-5)
    _close(summed, x + res, exact_fp32=True)  # the add rounds in the input dtype, as torch's
    _close(out, rms_norm(x + res, weight, 1e-5))
    alone, _ = fe.add_rms_norm(x, None, weight, 1e-5)
    _close(alone, rms_norm(x, weight, 1e-5))
    # Heads as rows (q/k norms), from a non-contiguous slice.
    qk = _rand(5, 3 * hidden, dtype=dtype, seed=3)[:, :hidden].reshape(5, 2, hidden // 2)
    head_weight = weight[: hidden // 2].contiguous()
    _close(fe.add_rms_norm(qk, None, head_weight, 1e-6)[0], rms_norm(qk, head_weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "heads"), [(64, 64, 12), (128, 64, 3), (32, 32, 1)]
)
def test_rope_equals_the_torch_ops(
    dtype: torch.dtype, head_dim: int, rotary_dim: int, heads: int
) -> None:
    rope = get_rope(head_dim, 10000.0, 512, None, rotary_dim / head_dim)
    assert isinstance(rope, RotaryEmbedding) and rope.rotary_dim == rotary_dim
    x = _rand(9, heads * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 511, 3, 3, 42], device=TEST_DEVICE)
    want = rope.rotate(positions, x)
    got = fe.rope(x, positions, rope.cos_sin_table(x.device), head_dim, rotary_dim)
    _close(got, want, exact_fp32=True)  # no fused multiply-adds: the torch ops' roundings


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 1536, 3000])
def test_silu_and_mul_equals_the_torch_ops(dtype: torch.dtype, d: int) -> None:
    x = _rand(4, 2 * d, dtype=dtype)
    _close(fe.silu_and_mul(x), F.silu(x[:, :d]) * x[:, d:])
    assert fe.silu_and_mul(x[:0]).shape == (0, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_equals_index_copy(dtype: torch.dtype) -> None:
    """K and V of 5 tokens (views into a fused qkv row, as the attention layer passes them) to
    scattered slots: the same pool as two ``index_copy_`` calls; other slots untouched."""
    qkv = _rand(5, 3 * 2 * 16, dtype=dtype)
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    loc = torch.tensor([7, 2, 30, 11, 5], device=TEST_DEVICE)
    k_buf, v_buf = _rand(40, 2, 16, dtype=dtype, seed=1), _rand(40, 2, 16, dtype=dtype, seed=2)
    want_k, want_v = k_buf.clone().index_copy_(0, loc, k), v_buf.clone().index_copy_(0, loc, v)
    fe.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)
    fe.store_kv(k_buf, v_buf, loc[:0], k[:0], v[:0])  # no token: nothing written
    assert torch.equal(k_buf, want_k)


DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("model_dtype", "pool_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (32, 16)])
def test_rope_store_kv_equals_rope_then_store(
    model_dtype: torch.dtype, pool_dtype: torch.dtype, head_dim: int, rotary_dim: int
) -> None:
    """The fused kernel gives the bits of ``rope`` on q and on k followed by ``store_kv`` of
    the rotated k and v: q, k and v as views into one qkv row (GQA: 6 query heads, 2 KV heads),
    scattered slots, a pool of another dtype; the other slots untouched."""
    heads, kv_heads, num_tokens = 6, 2, 5
    rope = get_rope(head_dim, 10000.0, 512, None, rotary_dim / head_dim)
    table = rope.cos_sin_table(torch.device(TEST_DEVICE))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _rand(num_tokens, q_size + 2 * kv_size, dtype=model_dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.tensor([0, 7, 3, 511, 100], device=TEST_DEVICE)
    loc = torch.tensor([7, 2, 30, 11, 5], device=TEST_DEVICE)
    pool = [_rand(40, kv_heads, head_dim, dtype=pool_dtype, seed=s) for s in (1, 2)]
    want_k, want_v = (b.clone() for b in pool)
    want_q = fe.rope(q, positions, table, head_dim, rotary_dim)
    k_rot = fe.rope(k, positions, table, head_dim, rotary_dim)
    fe.store_kv(
        want_k, want_v, loc, k_rot.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
    )
    got_q = fe.rope_store_kv(q, k, v, positions, table, head_dim, rotary_dim, *pool, loc)
    assert torch.equal(got_q, want_q)
    assert torch.equal(pool[0], want_k) and torch.equal(pool[1], want_v)
    _close(got_q, rope.rotate(positions, q), exact_fp32=True)  # and the torch ops' rotation
    empty = fe.rope_store_kv(q[:0], k[:0], v[:0], positions[:0], table, head_dim, rotary_dim,
                             *pool, loc[:0])  # fmt: skip
    assert empty.shape == (0, q_size) and torch.equal(pool[0], want_k)


@pytest.mark.skipif(not INTERPRETED, reason="CPU model runners; on a GPU the engine tests run it")
def test_model_with_fused_ops_matches_the_torch_ops(
    tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill and decode logits of the tiny model (qwen3: q/k norms, and partial rotary on
    llama) with the kernels (and the K/V store) switched on equal those of the torch ops.
    With both switched on, each layer rotates q/k and stores k/v in one kernel
    (``RotaryEmbedding.rotate_and_store``), and the CPU backend reads the new K/V back from
    the pool."""
    from model_test_utils import RUNNER_SLOTS, BatchBuilder

    fused_stores = []
    real_rope_store_kv = fe.rope_store_kv

    def counted(*args: torch.Tensor | int) -> torch.Tensor:
        fused_stores.append(args)
        return real_rope_store_kv(*args)

    monkeypatch.setattr(fe, "rope_store_kv", counted)
    for path in (tiny_model_dir("qwen3"), tiny_model_dir(partial_rotary_factor=0.5)):
        outs = []
        for fused in (False, True):
            runner = make_runner(path, disable_cpu_fused_ops=True)
            modules = [
                m
                for m in runner.model.modules()
                if isinstance(m, (RMSNorm, SiluAndMul, RotaryEmbedding))
            ]
            for m in modules:
                m.use_triton_fused_ops = fused
            runner.token_to_kv_pool.use_triton_store = fused
            builder = BatchBuilder(runner.model.config, num_slots=RUNNER_SLOTS - 1, max_reqs=4)
            first = runner.forward(builder.extend([("a", [3, 9, 27, 81]), ("b", [5, 7])]))
            second = runner.forward(builder.decode([("a", 11), ("b", 13)]))
            outs.append((first.next_token_logits, second.next_token_logits))
            # Every layer of both passes stored its K/V in the fused kernel, and only then.
            assert len(fused_stores) == (2 * runner.model.config.num_hidden_layers if fused else 0)
            fused_stores.clear()
        for want, got in zip(outs[0], outs[1]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
