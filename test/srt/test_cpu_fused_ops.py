"""The CPU fused elementwise kernels (layers/cpu_fused_ops.py) against the torch ops they
replace, and a model running on them against transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_test_utils import BatchBuilder, hf_logits, load_from_hf
from test_models import ARCHS, PROMPTS, make_hf_model

from sglang.srt.layers import cpu_fused_ops
from sglang.srt.layers.cpu_extension import platform_supported
from sglang.srt.layers.layernorm import rms_norm
from sglang.srt.layers.moe import has_sparse_moe
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, _inv_freq_for
from sglang.srt.models.registry import get_model_class

pytestmark = pytest.mark.skipif(
    not platform_supported(),
    reason="the kernels are built on Linux (x86-64 or aarch64) only",
)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert cpu_fused_ops.load_kernel()


def assert_within_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bfloat16: equal up to a unit in the last place (float32 statistics summed in another
    order, or an exp polynomial, may move a value across a rounding boundary). float32: to a
    few units (a last-bit change of the statistics goes through two more products)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    units = 2 if expected.dtype == torch.bfloat16 else 16
    diff = (got.double() - expected.double()).abs()
    bound = units * torch.finfo(expected.dtype).eps * expected.double().abs() + 1e-30
    assert bool((diff <= bound).all()), f"max diff {diff.max().item():.3g}"


def wide_rows(rows: int, cols: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """A [rows, cols] view whose row stride is larger than cols, as a slice hands it over."""
    return (torch.randn(rows, cols + 24) * scale).to(dtype)[:, 3 : cols + 3]


@DTYPES
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("width", [576, 100])  # 100: not a multiple of the 16 accumulators
def test_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    torch.manual_seed(rows + width)
    x, residual = wide_rows(rows, width, dtype), wide_rows(rows, width, dtype, 3.0)
    weight = torch.randn(width).to(dtype)
    summed = x + residual
    out, got_summed = cpu_fused_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got_summed, summed)  # one rounding of the sum, as torch's add
    assert_within_rounding(out, rms_norm(summed, weight, 1e-5))
    alone, same = cpu_fused_ops.add_rms_norm(x, None, weight, 1e-5)
    assert same is x
    assert_within_rounding(alone, rms_norm(x, weight, 1e-5))


def test_add_rms_norm_against_float64() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 576) * 40
    weight = torch.randn(576)
    out, _ = cpu_fused_ops.add_rms_norm(x, None, weight, 1e-6)
    xd = x.double()
    expected = weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=1e-6)


def test_add_rms_norm_any_leading_shape() -> None:
    """Qwen3's q/k norms normalise [tokens, heads, head_dim]."""
    x = torch.randn(7, 9, 32).bfloat16()
    weight = torch.randn(32).bfloat16()
    out, _ = cpu_fused_ops.add_rms_norm(x, None, weight, 1e-6)
    assert out.shape == x.shape
    assert_within_rounding(out, rms_norm(x, weight, 1e-6))


@DTYPES
@pytest.mark.parametrize("rows", [1, 64, 700])
@pytest.mark.parametrize("d", [768, 45])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, d: int) -> None:
    """d = 45: on AVX-512 hosts the first 32 columns take the 16-lane path, on AVX2 hosts the
    first 40 the 8-lane one, the rest the scalar one."""
    torch.manual_seed(rows)
    x = wide_rows(rows, 2 * d, dtype, 4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped range, and zero
    x[0, 40:44] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # the same in the scalar tail
    got = cpu_fused_ops.silu_and_mul(x)
    expected = F.silu(x[:, :d]) * x[:, d:]
    assert got.shape == (rows, d)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-30)
    else:
        assert_within_rounding(got, expected)


def bf16_bits(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int16).view(torch.bfloat16)


def test_silu_and_mul_bf16_rounds_nan_and_denormals_as_the_scalar_path() -> None:
    """Lanes whose rounding a CPU's own bfloat16 conversion (AVX512-BF16) would get wrong: it
    flushes denormals to zero and keeps a NaN's sign and payload, where the kernels' rounding
    (from_f32) keeps the denormal and gives 0x7fc0. Each sits among ordinary lanes of the
    16-lane path (columns < 32 of d = 45), whose rounding must then fall back for the vector,
    and again in the scalar tail (columns 32-44): the two give the same bits, and the exact
    denormal results are torch's."""
    torch.manual_seed(0)
    d = 45
    x = (torch.randn(3, 2 * d) * 2).bfloat16()
    g, u = x[:, :d], x[:, d:]
    cases = [(0, 5, 35), (1, 17, 38), (2, 30, 41)]  # (row, vector column, tail column)
    for col in (5, 35):
        g[0, col] = bf16_bits([-63])[0]  # 0xffc1: a NaN with the sign bit set
    for col in (17, 38):
        g[1, col], u[1, col] = 20.0, bf16_bits([1])[0]  # 20 x 2^-133: a denormal product
    for col in (30, 41):
        g[2, col], u[2, col] = bf16_bits([3])[0], 1.0  # silu of a denormal: a denormal (g / 2)
    got = cpu_fused_ops.silu_and_mul(x)
    bits = got.view(torch.int16)
    expected = F.silu(g) * u
    for row, vec_col, tail_col in cases:
        assert bits[row, vec_col] == bits[row, tail_col]
    assert bits[0, 5].item() == 0x7FC0
    assert bits[1, 17].item() == 20
    for row, col in ((1, 17), (2, 30)):
        assert bits[row, col] == expected[row, col].view(torch.int16)
    keep = torch.ones_like(got, dtype=torch.bool)
    for row, vec_col, tail_col in cases:
        keep[row, vec_col] = keep[row, tail_col] = False
    assert_within_rounding(got[keep], expected[keep])


def rotary(rotary_dim: int, scaling: dict | None = None) -> RotaryEmbedding:
    inv_freq, factor = _inv_freq_for(10000.0, rotary_dim, 4096, scaling)
    return RotaryEmbedding(64, rotary_dim, 4096, inv_freq, factor)


@DTYPES
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize(
    ("rotary_dim", "scaling"),
    [(64, None), (32, None), (64, {"rope_type": "yarn", "factor": 4.0})],
    ids=["full", "partial", "yarn"],
)
def test_rope_bitwise_equal_to_torch(
    dtype: torch.dtype, rows: int, rotary_dim: int, scaling: dict | None
) -> None:
    torch.manual_seed(rows)
    rope = rotary(rotary_dim, scaling)
    qk = wide_rows(rows, 12 * 64, dtype, 2.0)  # q and k side by side, a slice of qkv
    positions = torch.randint(0, 4096, (rows,))
    expected = rope.rotate(positions, qk)
    rope.use_cpu_fused_ops = True
    got = rope.rotate(positions, qk)
    assert got.is_contiguous() and torch.equal(got, expected)


def test_rope_rejects_positions_out_of_range() -> None:
    rope = rotary(64)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_fused_ops.rope(torch.randn(2, 128), torch.tensor([0, 4096]), rope._cos_sin, 64, 64)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_fused_ops.rope(torch.randn(2, 128), torch.tensor([0, 1], dtype=torch.int32),
                           rope._cos_sin, 64, 64)  # fmt: skip


@DTYPES
def test_store_kv_equals_index_copy(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    k_cache, v_cache = torch.zeros(50, 3, 64, dtype=dtype), torch.zeros(50, 3, 64, dtype=dtype)
    qkv = torch.randn(9, 576 + 2 * 192).to(dtype)
    k, v = qkv[:, 576:768].view(-1, 3, 64), qkv[:, 768:].view(-1, 3, 64)  # strided rows
    loc = torch.randperm(49)[:9] + 1
    cpu_fused_ops.store_kv(k_cache, v_cache, loc, k, v)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    expected_k.index_copy_(0, loc, k)
    expected_v.index_copy_(0, loc, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_store_kv_rejects_bad_operands() -> None:
    cache = torch.zeros(10, 2, 16)
    k = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_fused_ops.store_kv(cache, cache.clone(), torch.tensor([3, 10]), k, k)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_fused_ops.store_kv(cache, cache.clone(), torch.tensor([3, 4]), k.bfloat16(), k)
    with pytest.raises(RuntimeError, match="shape"):
        cpu_fused_ops.store_kv(cache, cache.clone(), torch.tensor([3, 4]), k[:, :1], k)


def test_results_independent_of_threads() -> None:
    """Each row is computed by one thread in a fixed order."""
    torch.manual_seed(0)
    x = torch.randn(512, 576).bfloat16()
    weight = torch.randn(576).bfloat16()
    gate_up = torch.randn(512, 3072)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, summed = cpu_fused_ops.add_rms_norm(x, x.flip(0), weight, 1e-5)
            results.append((out, summed, cpu_fused_ops.silu_and_mul(gate_up)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_row_independent_of_batch() -> None:
    torch.manual_seed(0)
    x = torch.randn(300, 576)
    weight = torch.randn(576)
    whole, _ = cpu_fused_ops.add_rms_norm(x, None, weight, 1e-5)
    alone, _ = cpu_fused_ops.add_rms_norm(x[17:18].clone(), None, weight, 1e-5)
    assert torch.equal(whole[17:18], alone)


def test_supports() -> None:
    assert cpu_fused_ops.supports(torch.randn(2, 4))
    assert cpu_fused_ops.supports(torch.randn(2, 4).bfloat16())
    assert not cpu_fused_ops.supports(torch.randn(2, 4).half())
    assert not cpu_fused_ops.supports(torch.randn(4, 2).T)  # last dim not dense


def enable_fused(model: torch.nn.Module, builder: BatchBuilder) -> int:
    """What the model runner does: switch every module that has the switch, and the pool."""
    modules = [m for m in model.modules() if hasattr(m, "use_cpu_fused_ops")]
    for module in modules:
        module.use_cpu_fused_ops = True
    builder.kv_pool.use_cpu_fused_ops = True
    return len(modules)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_model_on_fused_ops_matches_hf(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill and decode steps of every architecture (Qwen3: q/k norms; Qwen2: biases; the
    MoE models: their experts) with the fused kernels on, against transformers at the model
    tests' tolerance."""
    hf_model = make_hf_model(arch)
    model = load_from_hf(get_model_class([ARCHS[arch][1]]), hf_model)
    builder = BatchBuilder(model.config)
    assert enable_fused(model, builder) > 0
    calls: dict[str, int] = {}
    for name in ("add_rms_norm", "silu_and_mul", "rope", "store_kv"):
        real = getattr(cpu_fused_ops, name)

        def counted(*args: object, _real: Callable = real, _name: str = name) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args)

        monkeypatch.setattr(cpu_fused_ops, name, counted)
    seqs = {rid: list(p) for rid, p in zip("abc", PROMPTS)}

    def check(out) -> None:
        for rid, row in zip(seqs, out.next_token_logits):
            torch.testing.assert_close(
                row, hf_logits(hf_model, seqs[rid])[-1], atol=1e-4, rtol=1e-4
            )
            seqs[rid].append(int(row.argmax()))

    check(builder.run(model, builder.extend(list(seqs.items()))))
    for _ in range(3):
        check(builder.run(model, builder.decode([(rid, s[-1]) for rid, s in seqs.items()])))
    layers = model.config.num_hidden_layers
    assert calls["store_kv"] == 4 * layers and calls["rope"] == 4 * layers
    assert calls["add_rms_norm"] >= 4 * (2 * layers + 1)
    if has_sparse_moe(model):  # one call per expert run (and shared expert) in a step
        assert calls["silu_and_mul"] > 4 * layers
    else:
        assert calls["silu_and_mul"] == 4 * layers


def test_model_runner_switches_the_kernels(tiny_model_dir: Callable[..., Path]) -> None:
    """On by default on CPU (deterministic mode too: every row is computed alone), off with
    --disable-cpu-fused-ops."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = str(tiny_model_dir("qwen3"))
    config = ModelConfig(path, dtype="float32", device="cpu")
    for kwargs, expected in [
        ({}, True),
        ({"disable_cpu_fused_ops": True}, False),
        ({"enable_deterministic_inference": True}, True),
    ]:
        args = ServerArgs(model_path=path, device="cpu", max_total_tokens=64, **kwargs)
        runner = ModelRunner(args, config)
        switches = [m.use_cpu_fused_ops for m in runner.model.modules()
                    if hasattr(m, "use_cpu_fused_ops")]  # fmt: skip
        # per layer: two norms, q/k norms, the activation; the final norm; the rotary module
        assert len(switches) >= 4 * config.num_hidden_layers + 2
        assert set(switches) == {expected}, kwargs
        assert runner.token_to_kv_pool.use_cpu_fused_ops is expected


def test_engine_tokens_and_logprobs_match_torch_ops(tiny_model_dir: Callable[..., Path]) -> None:
    """Greedy tokens and their logprobs with the kernels == with the torch ops (float32, to
    the HF parity tests' 1e-4), a lone request and a batch of mixed lengths."""
    import sglang as sgl

    prompts = [[5, 17, 3, 99, 250, 8, 41], list(range(30, 90)), [7] * 3]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    results = []
    for disabled in (False, True):
        with sgl.Engine(
            model_path=str(tiny_model_dir("qwen3")), random_seed=0, disable_cpu_fused_ops=disabled
        ) as engine:
            alone = engine.generate(
                input_ids=[prompts[0]], sampling_params=params, return_logprob=True
            )
            batch = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        results.append(alone + batch)
    for fused, torch_ops in zip(*results):
        assert fused["output_ids"] == torch_ops["output_ids"]
        got = [lp for lp, _, _ in fused["meta_info"]["output_token_logprobs"]]
        ref = [lp for lp, _, _ in torch_ops["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(ref, abs=1e-4)
