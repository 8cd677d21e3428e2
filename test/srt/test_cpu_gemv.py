"""The CPU small-batch linear kernel (layers/cpu_gemv.py) against a float64 product, and its
use by the packed linear layers for small batches (1-4 rows; 5-16 too on AVX2 hosts, its tile
path)."""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang.srt.layers import cpu_gemv
from sglang.srt.layers.cpu_extension import avx2_host
from sglang.srt.layers.cpu_prepack import (
    PackedLinear,
    native_bf16_supported,
    prepack_supported,
)

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or not avx2_host(),
    reason="the kernel is built on Linux hosts with AVX2 or AVX-512 only",
)


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert cpu_gemv.load_kernel()


# 5-16 rows: the tile path on AVX2 hosts (6-row groups and the rest), refused elsewhere.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 12, 16])
@pytest.mark.parametrize("shape", [(50, 64), (960, 576), (7, 96)])  # N not a multiple of 16
@pytest.mark.parametrize(
    ("dtype", "native_bf16"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["float32", "bfloat16", "bfloat16-portable"],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_product(
    rows: int, shape: tuple[int, int], dtype: torch.dtype, native_bf16: bool, with_bias: bool
) -> None:
    torch.manual_seed(rows + shape[0])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features).to(dtype)
    # x as rows of a wider tensor (row stride > in_features), as a slice would hand it over
    x = torch.randn(rows, in_features + 8).to(dtype)[:, :in_features]
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    if rows > cpu_gemv.max_rows():  # a host without the tile path
        assert cpu_gemv.max_rows() == cpu_gemv.MAX_ROWS
        assert not cpu_gemv.kernel_supports(x, weight, bias)
        with pytest.raises(RuntimeError, match=f"1 to {cpu_gemv.MAX_ROWS} rows"):
            cpu_gemv.small_linear(x, weight, bias, native_bf16)
        return
    assert cpu_gemv.kernel_supports(x, weight, bias)
    got = cpu_gemv.small_linear(x, weight, bias, native_bf16)
    expected = x.double() @ weight.double().T
    if bias is not None:
        expected += bias.double()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    else:  # one rounding of the float32 sum to bfloat16
        torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=8e-3)


@pytest.mark.parametrize("rows", [2, 11])
def test_result_independent_of_threads(rows: int) -> None:
    rows = min(rows, cpu_gemv.max_rows())
    weight = torch.randn(3001, 576).bfloat16()
    x = torch.randn(rows, 576).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemv.small_linear(x, weight, None)
        torch.set_num_threads(2)
        two = cpu_gemv.small_linear(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_independent_of_batch(dtype: torch.dtype) -> None:
    """A row's result is the same bits whatever rows come with it, within each path: 1-4 rows
    (lane partials) and 5 to max_rows() (tiles of 6 rows and a rest)."""
    weight = torch.randn(101, 576).to(dtype)
    x = torch.randn(cpu_gemv.max_rows(), 576).to(dtype)
    paths = [range(1, cpu_gemv.MAX_ROWS + 1), range(cpu_gemv.MAX_ROWS + 1, len(x) + 1)]
    for sizes in paths:
        if not sizes:
            continue
        full = cpu_gemv.small_linear(x[: sizes[-1]], weight, None)
        for m in sizes:
            assert torch.equal(cpu_gemv.small_linear(x[:m], weight, None), full[:m]), m
        for start in range(1, len(sizes)):  # the same rows later in the batch
            part = cpu_gemv.small_linear(x[start : sizes[-1]], weight, None)
            assert torch.equal(part, full[start:]), start


def test_operands_out_of_contract() -> None:
    weight = torch.randn(16, 64)
    too_many = torch.randn(cpu_gemv.max_rows() + 1, 64)
    assert not cpu_gemv.kernel_supports(too_many, weight, None)
    assert not cpu_gemv.kernel_supports(torch.randn(1, 64).bfloat16(), weight, None)  # dtypes
    assert not cpu_gemv.kernel_supports(torch.randn(1, 48), torch.randn(16, 48), None)  # K % 32
    assert not cpu_gemv.kernel_supports(torch.randn(1, 64).half(), weight.half(), None)
    assert not cpu_gemv.kernel_supports(torch.randn(1, 64), weight.T.contiguous().T, None)
    with pytest.raises(RuntimeError, match=f"1 to {cpu_gemv.max_rows()} rows"):
        cpu_gemv.small_linear(too_many, weight, None)


@pytest.mark.skipif(not prepack_supported(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_uses_it_for_small_batches(
    dtype: torch.dtype, spy_rows: Callable[[Any, str], list[int]]
) -> None:
    """Up to max_rows() rows go through the kernel (on the live weight: an in-place update is
    seen at once), more rows through the packed copy; both agree."""
    import sglang.srt.layers.cpu_prepack as cpu_prepack

    calls = spy_rows(cpu_prepack, "small_linear")
    weight = torch.randn(100, 64).to(dtype)
    packer = PackedLinear(upcast_bf16=not native_bf16_supported())  # as the model runner packs
    most = cpu_gemv.max_rows()
    x = torch.randn(most + 1, 64).to(dtype)
    full = packer(x, weight)
    small = packer(x[:most], weight)
    assert calls == [most]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(small, full[:most], atol=tol, rtol=tol)
    weight.mul_(2)
    torch.testing.assert_close(packer(x[:1], weight), 2 * small[:1], atol=tol, rtol=tol)


def test_kept_off_without_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without AVX2 (or AVX-512) the kernel is not built and the packed product serves
    every batch."""
    import sglang.srt.layers.cpu_prepack as cpu_prepack
    from sglang.srt.layers import cpu_extension

    monkeypatch.setattr(cpu_extension, "avx2_host", lambda: False)
    monkeypatch.setattr(cpu_gemv._KERNEL, "module", None)
    assert not cpu_gemv.load_kernel()
    x, weight = torch.randn(1, 64), torch.randn(16, 64)
    assert not cpu_prepack.kernel_supports(x, weight, None)
    torch.testing.assert_close(PackedLinear()(x, weight), x @ weight.T)
