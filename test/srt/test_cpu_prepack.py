"""oneDNN-prepacked linear weights on CPU (layers/cpu_prepack.py): same products as F.linear,
repacked whenever the weight changes by any path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.cpu_prepack import (
    PackedLinear,
    enable_cpu_weight_prepack,
    pack_now,
    prepack_supported,
)
from sglang.srt.layers.linear import QKVLinear, ReplicatedLinear
from sglang.srt.layers.logits_processor import LogitsProcessor

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    packed = PackedLinear()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in (None, bias):
        got = packed(x, weight, b)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=tol, atol=tol)


def test_repacks_after_in_place_update_and_storage_swap() -> None:
    layer = ReplicatedLinear(16, 8)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 16))
    (packer,) = enable_cpu_weight_prepack(layer)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        first = layer(x)
    torch.testing.assert_close(first, x @ layer.weight.T)
    with torch.no_grad():  # an in-place update, as every weight loader does
        layer.weight.mul_(-2.0)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), -2.0 * first, rtol=1e-5, atol=1e-5)
    layer.weight.data = torch.randn(8, 16)  # a new storage, as resume after release does
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    assert packer.nbytes > 0
    packer.clear()
    assert packer.nbytes == 0


def test_inference_tensor_weight_falls_back_to_plain_linear() -> None:
    with torch.inference_mode():
        weight = torch.randn(8, 16)  # an inference tensor has no version counter
        x = torch.randn(2, 16)
        packer = PackedLinear()
        torch.testing.assert_close(packer(x, weight), F.linear(x, weight))
    assert packer.nbytes == 0


def test_mixed_dtypes_fall_back() -> None:
    packer = PackedLinear()
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError):  # what F.linear itself says of mixed dtypes
        packer(x, weight)
    assert packer.nbytes == 0


def test_pack_now_covers_layers_and_lm_head() -> None:
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = QKVLinear(32, 8, 4, 2)
            self.lm_head = ReplicatedLinear(32, 100)
            self.logits_processor = LogitsProcessor(object())

    model = Tiny()
    for p in model.parameters():
        with torch.no_grad():
            p.normal_()
    packers = enable_cpu_weight_prepack(model)
    assert len(packers) == 3  # qkv, lm_head, the logits processor
    nbytes = pack_now(model)
    assert nbytes >= 4 * (64 * 32 + 2 * 100 * 32)
    assert all(p.nbytes > 0 for p in packers)
