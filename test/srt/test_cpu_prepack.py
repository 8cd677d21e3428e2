"""oneDNN-prepacked linear weights on CPU (layers/cpu_prepack.py): same products as F.linear,
repacked whenever the weight changes by any path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.cpu_prepack import (
    PackedLinear,
    enable_cpu_weight_prepack,
    native_bf16_supported,
    pack_now,
    prepack_supported,
)
from sglang.srt.layers.linear import QKVParallelLinear, ReplicatedLinear
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
            self.qkv = QKVParallelLinear(32, 8, 4, 2)
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


@pytest.mark.parametrize("rows", [1, 33])
def test_bf16_through_float32_copies(rows: int) -> None:
    """The path for CPUs without native bfloat16: float32 packed copy, bfloat16 output that
    agrees with the native bfloat16 product up to summation order."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(64, 48, generator=gen).bfloat16()
    bias = torch.randn(64, generator=gen).bfloat16()
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    packer = PackedLinear(upcast_bf16=True)
    got = packer(x, weight, bias)
    assert got.dtype == torch.bfloat16
    assert packer.nbytes == 4 * weight.numel()  # a float32 copy
    expected = (F.linear(x.float(), weight.float(), bias.float())).bfloat16()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, PackedLinear()(x, weight, bias), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("dtype", "mode", "packed_dtype"),
    [
        ("float32", "auto", torch.float32),
        ("bfloat16", "bf16", torch.bfloat16),
        ("bfloat16", "fp32", torch.float32),
    ],
)
def test_model_runner_packs_every_linear(
    tiny_model_dir, dtype: str, mode: str, packed_dtype: torch.dtype
) -> None:
    """The model runner packs every linear layer at start-up (so the first request pays
    nothing), in the dtype --cpu-bf16-linear asks for; none when prepack is disabled."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = str(tiny_model_dir())
    args = ServerArgs(
        model_path=path, device="cpu", dtype=dtype, max_total_tokens=64, cpu_bf16_linear=mode
    )
    runner = ModelRunner(args, ModelConfig(path, dtype=dtype, device="cpu"))
    assert runner.weight_packers
    if packed_dtype == torch.bfloat16 and not native_bf16_supported():
        # oneDNN packs bfloat16 only on CPUs with native bfloat16: torch's product serves.
        assert all(p.nbytes == 0 for p in runner.weight_packers)
    else:
        assert all(p.nbytes > 0 for p in runner.weight_packers)
        assert all(p.packed_dtype == packed_dtype for p in runner.weight_packers)
    runner.release_weights()
    assert all(p.nbytes == 0 for p in runner.weight_packers)

    args = ServerArgs(
        model_path=path,
        device="cpu",
        dtype=dtype,
        max_total_tokens=64,
        disable_cpu_weight_prepack=True,
    )
    assert ModelRunner(args, ModelConfig(path, dtype=dtype, device="cpu")).weight_packers == []
