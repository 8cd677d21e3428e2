"""The brgemm linear kernel (layers/cpu_brgemm.py) against a float64 product, its column
blocks, and its use by the packed linear layers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang.srt.layers import cpu_brgemm, cpu_gemv
from sglang.srt.layers.cpu_prepack import (
    PackedLinear,
    packed_linear_op,
    prepack_supported,
)

pytestmark = pytest.mark.skipif(
    not (cpu_brgemm.host_supported() and prepack_supported()),
    reason="torch's brgemm is oneDNN's on x86-64 hosts with AVX2 only",
)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert cpu_brgemm.load_kernel()


def _expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not cpu_brgemm.bf16_supported(), reason="bfloat16 blocks need AVX512-BF16, no AMX"
        ),
    ),
]


# Rows: none, the small-batch sizes, a decode batch, and both sides of a row chunk. In
# features: under, at and over the k chunk of AVX2 hosts (K_CHUNK_AVX2), 200 with a short last
# chunk there.
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 64, 255, 256, 257, 600])
@pytest.mark.parametrize("shape", [(96, 40), (576, 576), (48, 1536), (1040, 64), (80, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_product(
    rows: int, shape: tuple[int, int], with_bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(rows + shape[0])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features).to(dtype)
    nb = cpu_brgemm.blockable(weight, torch.get_num_threads())
    assert nb is not None
    got = cpu_brgemm.blocked_linear(x, cpu_brgemm.block_weight(weight, nb), bias)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    expected = _expected(x, weight, bias)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    else:  # a float32 sum (bias included) rounded once to bfloat16
        torch.testing.assert_close(got, expected.bfloat16(), atol=2e-2, rtol=8e-3)


def test_inputs_of_any_rank_and_layout() -> None:
    weight = torch.randn(64, 32)
    blocked = cpu_brgemm.block_weight(weight, 32)
    x = torch.randn(3, 5, 32)
    got = cpu_brgemm.blocked_linear(x, blocked, None)
    assert got.shape == (3, 5, 64)
    torch.testing.assert_close(got.double(), _expected(x, weight, None), atol=1e-4, rtol=1e-5)
    strided = torch.randn(40, 7)[:32].T  # [7, 32] with a column stride: copied first
    torch.testing.assert_close(
        cpu_brgemm.blocked_linear(strided, blocked, None).double(),
        _expected(strided, weight, None),
        atol=1e-4,
        rtol=1e-5,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_independent_of_batch_and_threads(dtype: torch.dtype) -> None:
    """Each output is a sum over k in a fixed order: a row gets the same bits alone, in any
    batch and with any number of threads."""
    weight = torch.randn(576, 1536).to(dtype)
    blocked = cpu_brgemm.block_weight(weight, 48)
    x = torch.randn(300, 1536).to(dtype)
    full = cpu_brgemm.blocked_linear(x, blocked, None)
    for rows in (1, 3, 64, 257):
        assert torch.equal(cpu_brgemm.blocked_linear(x[:rows], blocked, None), full[:rows])
        last = cpu_brgemm.blocked_linear(x[rows - 1 : rows], blocked, None)
        assert torch.equal(last[0], full[rows - 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_brgemm.blocked_linear(x, blocked, None), full)
    finally:
        torch.set_num_threads(threads)


def test_block_layout() -> None:
    weight = torch.arange(96 * 8, dtype=torch.float32).reshape(96, 8)
    blocked = cpu_brgemm.block_weight(weight, 32)
    assert blocked.shape == (3, 8, 32) and blocked.is_contiguous()
    for b in range(3):
        assert torch.equal(blocked[b], weight[32 * b : 32 * (b + 1)].T)
    pairs = cpu_brgemm.block_weight(weight.bfloat16(), 32)  # pairs of k side by side
    assert pairs.shape == (3, 4, 32, 2) and pairs.is_contiguous()
    for b in range(3):
        block = weight[32 * b : 32 * (b + 1)].bfloat16()  # [j, k]
        assert torch.equal(pairs[b], block.reshape(32, 4, 2).permute(1, 0, 2))
    assert cpu_brgemm.out_features(blocked) == cpu_brgemm.out_features(pairs) == 96


def test_blockable() -> None:
    threads = torch.get_num_threads()
    assert cpu_brgemm.blockable(torch.randn(96, 40), threads) is not None
    assert cpu_brgemm.blockable(torch.randn(40, 96), threads) is None  # no width divides 40
    assert cpu_brgemm.blockable(torch.randn(96, 40).half(), threads) is None
    bf16 = cpu_brgemm.blockable(torch.randn(96, 40).bfloat16(), threads)
    assert (bf16 is not None) == cpu_brgemm.bf16_supported()
    assert cpu_brgemm.blockable(torch.randn(96, 41).bfloat16(), threads) is None  # K odd


@pytest.mark.parametrize(
    ("out_features", "threads", "expected"),
    [
        (576, 2, 48),  # 9 blocks of 64 would not split evenly over 2 threads
        (960, 2, 48),
        (3072, 2, 64),
        (49152, 2, 64),
        (576, 1, 64),
        (80, 2, 16),  # no even split: the widest width that divides
        (96, 4, 48),
        (40, 2, None),  # no multiple of 16 divides it: oneDNN's layout instead
        (8, 1, None),
    ],
)
def test_column_block(out_features: int, threads: int, expected: int | None) -> None:
    assert cpu_brgemm.column_block(out_features, threads) == expected


def test_operands_out_of_contract() -> None:
    blocked = cpu_brgemm.block_weight(torch.randn(32, 16), 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        cpu_brgemm.blocked_linear(torch.randn(2, 16).half(), blocked.half(), None)
    pairs = cpu_brgemm.block_weight(torch.randn(32, 16).bfloat16(), 32)
    with pytest.raises(RuntimeError, match="x's dtype"):
        cpu_brgemm.blocked_linear(torch.randn(2, 16), pairs, None)
    with pytest.raises(RuntimeError, match="must be"):
        cpu_brgemm.blocked_linear(torch.randn(2, 8), blocked, None)  # K mismatch
    with pytest.raises(RuntimeError, match="bias"):
        cpu_brgemm.blocked_linear(torch.randn(2, 16), blocked, torch.randn(31))


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_takes_the_blocked_copy(
    dtype: torch.dtype, spy_rows: Callable[[Any, str], list[int]]
) -> None:
    """With the kernel loaded, a weight of a suitable width is packed into column blocks
    (repacked when the weight changes) and every row count goes through the kernel but those
    the small-batch kernel takes (layers/cpu_gemv.py, where built); other widths keep oneDNN's
    layout."""
    import sglang.srt.layers.cpu_prepack as cpu_prepack

    calls = spy_rows(cpu_prepack, "blocked_linear")
    weight = torch.randn(96, 64).to(dtype)
    bias = torch.randn(96).to(dtype)
    packer = PackedLinear()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    blocked_rows = []
    small = cpu_gemv.max_rows()
    for rows in (1, 2, small, small + 1, 70):
        x = torch.randn(rows, 64).to(dtype)
        expected = _expected(x, weight, bias).to(dtype)
        torch.testing.assert_close(packer(x, weight, bias), expected, atol=tol, rtol=tol)
        if not cpu_gemv.kernel_supports(x, weight, bias):
            blocked_rows.append(rows)
    assert calls == blocked_rows and small + 1 in calls and 70 in calls
    packed = packer.packed_weight(weight)
    nb = cpu_brgemm.column_block(96, torch.get_num_threads())
    assert nb is not None and packed is not None and packed.dim() > 2 and packer.blocked
    assert cpu_brgemm.out_features(packed) == 96 and packed.shape[2] == nb
    assert packer.nbytes == weight.element_size() * weight.numel()
    weight.mul_(-1)
    x = torch.randn(5, 64).to(dtype)
    expected = _expected(x, weight, bias).to(dtype)
    torch.testing.assert_close(packer(x, weight, bias), expected, atol=tol, rtol=tol)
    odd = PackedLinear()
    odd_weight = torch.randn(40, 64).to(dtype)
    torch.testing.assert_close(odd(x, odd_weight), x @ odd_weight.T, atol=tol, rtol=tol)
    odd_packed = odd.packed_weight(odd_weight)
    assert odd_packed is not None and odd_packed.dim() == 2 and not odd.blocked


def test_bf16_model_through_float32_blocks() -> None:
    """A bfloat16 model on a host without native bfloat16 (``upcast_bf16``) computes in
    float32 on the blocked float32 copy, rounding the output to bfloat16."""
    weight = torch.randn(64, 48).bfloat16()
    bias = torch.randn(64).bfloat16()
    x = torch.randn(33, 48).bfloat16()
    packer = PackedLinear(upcast_bf16=True)
    got = packer(x, weight, bias)
    packed = packer.packed_weight(weight)
    assert packed is not None and packed.dim() == 3 and packed.dtype == torch.float32
    assert got.dtype == torch.bfloat16
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    widened = cpu_brgemm.blocked_linear(x.float(), packed, bias.float()).bfloat16()
    assert torch.equal(got, widened)  # the kernel's own rounding: the same bits


@pytest.mark.parametrize("rows", [0, 1, 5, 64, 257])
@pytest.mark.parametrize("shape", [(576, 576), (48, 1536), (80, 200)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_input_on_float32_blocks_rounds_the_float32_product(
    rows: int, shape: tuple[int, int], with_bias: bool
) -> None:
    """A bfloat16 x on float32 blocks gives the bits of the float32 product of the widened x
    (and bias) rounded to bfloat16, in a row chunk and across chunks; a NaN in x stays a NaN
    in its row only."""
    torch.manual_seed(rows * 7 + shape[1])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    x = torch.randn(rows, in_features).bfloat16()
    if rows > 1:
        x[1, 3] = float("nan")
    nb = cpu_brgemm.column_block(out_features, torch.get_num_threads())
    assert nb is not None
    blocked = cpu_brgemm.block_weight(weight, nb)
    got = cpu_brgemm.blocked_linear(x, blocked, bias)
    widened = cpu_brgemm.blocked_linear(x.float(), blocked, None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    rounded = widened.bfloat16()
    # NaN's bits differ between torch's own conversions (0x7fc0 scalar, 0xffff vectorised).
    assert torch.equal(got.isnan(), rounded.isnan())
    assert torch.equal(got.nan_to_num(0.0), rounded.nan_to_num(0.0))
    if rows > 1:
        assert bool(got[1].isnan().all()) and not bool(got[0].isnan().any())


def test_compiled_op_on_blocked_copy() -> None:
    """The opaque op that compiled graphs call (--enable-torch-compile) takes the blocked copy:
    its fake implementation gives the real output's shape."""
    weight = torch.randn(96, 64)
    blocked = cpu_brgemm.block_weight(weight, 48)
    x = torch.randn(5, 64)
    torch.library.opcheck(packed_linear_op, (x, blocked, None))
    torch.testing.assert_close(packed_linear_op(x, blocked, None), x @ weight.T)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_runner_blocks_weights(tiny_model_dir, dtype: str) -> None:
    """At start-up the model runner loads the kernel and packs the weights of suitable width
    in column blocks: float32 ones, bfloat16 ones where the kernel takes them, and the float32
    copies of bfloat16 weights (--cpu-bf16-linear fp32)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    if dtype == "bfloat16" and not cpu_brgemm.bf16_supported():
        pytest.skip("bfloat16 blocks need AVX512-BF16, no AMX")
    path = str(tiny_model_dir())
    for mode in ("auto", "fp32") if dtype == "bfloat16" else ("auto",):
        args = ServerArgs(
            model_path=path, device="cpu", dtype=dtype, max_total_tokens=64, cpu_bf16_linear=mode
        )
        runner = ModelRunner(args, ModelConfig(path, dtype=dtype, device="cpu"))
        expected = torch.float32 if mode == "fp32" else runner.dtype
        packers = _packers_and_modules(runner.model)
        assert packers and all(p.packed_dtype == expected for p, _ in packers)
        assert all(p.nbytes > 0 for p, _ in packers)
        _assert_blocked(packers)


def _assert_blocked(packers: list[tuple[PackedLinear, torch.nn.Module]]) -> None:
    for packer, module in packers:
        dtype = torch.float32 if packer.upcast_bf16 else module.weight.dtype
        packed = packer.packed_weight(module.weight)
        assert packer.blocked and packed is not None
        assert packed.dim() == (4 if dtype == torch.bfloat16 else 3)


def _packers_and_modules(model: torch.nn.Module) -> list[tuple[PackedLinear, torch.nn.Module]]:
    return [
        (m.linear_fn, m)
        for m in model.modules()
        if isinstance(getattr(m, "linear_fn", None), PackedLinear)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.shape[0] % 16 == 0
    ]


def test_float32_with_onednn_capped_at_avx2() -> None:
    """An AVX2 host's path, on this one: with oneDNN capped at AVX2 (in a fresh process, as the
    cap is read once) the float32 products are oneDNN's AVX2 kernels and still agree with a
    float64 product; bfloat16 weights are not taken."""
    code = """
import torch
from sglang.srt.layers import cpu_brgemm
assert cpu_brgemm.load_kernel() and not cpu_brgemm.bf16_supported()
torch.manual_seed(0)
for n, k in ((96, 40), (576, 576)):
    w, b = torch.randn(n, k), torch.randn(n)
    blocked = cpu_brgemm.block_weight(w, cpu_brgemm.column_block(n, torch.get_num_threads()))
    for rows in (1, 3, 64, 300):
        x = torch.randn(rows, k)
        got = cpu_brgemm.blocked_linear(x, blocked, b).double()
        expected = x.double() @ w.double().T + b.double()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
print("ok")
"""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
