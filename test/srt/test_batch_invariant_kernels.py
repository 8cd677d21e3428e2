"""The Triton kernels of deterministic mode on CUDA (sgl_kernel.batch_invariant), run on CPU
under TRITON_INTERPRET=1 (conftest): each matches its torch reference, and each row's bits do
not depend on the other rows of the call; the per-query attention kernel gives the same bits
for a token whether it is computed in a prefill or alone (decode). Then the whole Triton path
(attention, matmul, norm, fused sampler, its logsumexp for prompt logprobs) through a model and
through ``sglang.Engine``."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_test_utils import CUDA_POOL, ids_and_logprobs
from model_test_utils import TEST_DEVICE, BatchBuilder, hf_greedy, load_from_hf
from test_determinism import assert_prefill_logprobs_equal_decode
from test_entropy_kernel import make_info
from test_models import PROMPTS, make_hf_model

import sglang as sgl
from sgl_kernel.batch_invariant import (
    matmul_batch_invariant,
    paged_attention_per_query,
    rms_norm_batch_invariant,
)
from sgl_kernel.sampling import row_logsumexp_triton, sample_triton
from sglang.srt.layers.batch_invariant import enable_batch_invariant_mode
from sglang.srt.layers.layernorm import rms_norm
from sglang.srt.models.registry import get_model_class

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_matches_linear_and_rows_are_invariant(dtype, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    # K and N not multiples of the tiles: the masked edges are exercised.
    weight = torch.randn(150, 90, generator=gen).to(TEST_DEVICE, dtype)
    bias = torch.randn(150, generator=gen).to(TEST_DEVICE, dtype) if with_bias else None
    x = torch.randn(70, 90, generator=gen).to(TEST_DEVICE, dtype)
    full = matmul_batch_invariant(x, weight, bias)
    assert full.dtype == dtype and full.shape == (70, 150)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(full.float(), expected, **_tol(dtype))
    for start, stop in [(0, 1), (5, 8), (31, 64), (69, 70)]:
        assert torch.equal(matmul_batch_invariant(x[start:stop], weight, bias), full[start:stop])
    # Leading dims are flattened, and an empty batch is an empty result.
    batched = matmul_batch_invariant(x[:6].view(2, 3, 90), weight, bias)
    assert torch.equal(batched, full[:6].view(2, 3, 150))
    assert matmul_batch_invariant(x[:0], weight, bias).shape == (0, 150)


def test_matmul_refuses_mixed_dtypes() -> None:
    with pytest.raises(ValueError, match="unsupported dtypes"):
        matmul_batch_invariant(
            torch.randn(2, 4, device=TEST_DEVICE),
            torch.randn(3, 4, dtype=torch.bfloat16, device=TEST_DEVICE),
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_and_rows_are_invariant(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 3, 48, generator=gen) * 3).to(TEST_DEVICE, dtype)
    weight = (1 + torch.randn(48, generator=gen) * 0.1).to(TEST_DEVICE, dtype)
    out = rms_norm_batch_invariant(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), rms_norm(x, weight, 1e-6).float(), **_tol(dtype))
    assert torch.equal(rms_norm_batch_invariant(x[4:5], weight, 1e-6), out[4:5])


def _paged_case(num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 2):
    """Two requests of 21 and 40 tokens with KV in shuffled slots of a 100-slot pool (40 > 32:
    the second spans two key blocks)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 16
    k_cache = torch.randn(100, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(100, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(99, generator=gen) + 1  # slot 0 is the pool's dummy
    table = torch.zeros(4, 50, dtype=torch.int64)
    lens = {1: 21, 3: 40}
    table[1, :21], table[3, :40] = slots[:21], slots[21:61]
    pool_rows = torch.tensor([1] * 21 + [3] * 40)
    positions = torch.cat([torch.arange(21), torch.arange(40)])
    q = torch.randn(61, num_heads, head_dim, generator=gen).to(dtype)
    tensors = (q, k_cache, v_cache, table, pool_rows, positions)
    return *(t.to(TEST_DEVICE) for t in tensors), lens


@pytest.mark.parametrize(
    "heads, dtype",
    [((6, 2), torch.float32), ((4, 4), torch.float32), ((9, 3), torch.bfloat16)],
)
def test_paged_attention_matches_sdpa(heads: tuple[int, int], dtype) -> None:
    q, k_cache, v_cache, table, pool_rows, positions, lens = _paged_case(*heads, dtype)
    scale = 16**-0.5
    out = paged_attention_per_query(q, k_cache, v_cache, table, pool_rows, positions, scale)
    assert out.shape == q.shape and out.dtype == dtype
    start = 0
    for row, length in lens.items():
        keys = k_cache[table[row, :length]].float().transpose(0, 1)
        values = v_cache[table[row, :length]].float().transpose(0, 1)
        expected = F.scaled_dot_product_attention(
            q[start : start + length].float().transpose(0, 1), keys, values,
            is_causal=True, scale=scale, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(out[start : start + length].float(), expected, **_tol(dtype))
        start += length


def test_paged_attention_prefill_equals_decode_bitwise() -> None:
    """A token computed inside a whole prefill, in a chunk, or alone (a decode step): the same
    bits."""
    q, k_cache, v_cache, table, pool_rows, positions, _ = _paged_case(6, 2, torch.float32)
    args = (k_cache, v_cache, table)
    full = paged_attention_per_query(q, *args, pool_rows, positions, 0.25)
    for i in [0, 20, 21, 52, 53, 60]:
        alone = paged_attention_per_query(q[i : i + 1], *args, pool_rows[i : i + 1],
                                          positions[i : i + 1], 0.25)  # fmt: skip
        assert torch.equal(alone, full[i : i + 1])
    chunk = slice(30, 57)
    part = paged_attention_per_query(q[chunk], *args, pool_rows[chunk], positions[chunk], 0.25)
    assert torch.equal(part, full[chunk])


def test_paged_attention_refuses_bad_grouping() -> None:
    q, k_cache, v_cache, table, pool_rows, positions, _ = _paged_case(4, 4, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention_per_query(q[:, :3], k_cache, v_cache, table, pool_rows, positions, 1.0)


def test_triton_logsumexp_is_the_samplers_log_z() -> None:
    """Greedy rows at temperature 1: the fused sampler's chosen logprob is exactly
    logit - row_logsumexp_triton, whatever the batch (prefill/decode logprob consistency)."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 1000, generator=gen) * 4).to(TEST_DEVICE)
    log_z = row_logsumexp_triton(logits)
    torch.testing.assert_close(log_z, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    assert torch.equal(row_logsumexp_triton(logits[2:3]), log_z[2:3])
    info = make_info([{"temperature": 0}] * 5, 1000)
    out = sample_triton(logits, info, True, None)
    chosen = logits.gather(1, out.next_token_ids[:, None]).squeeze(1)
    assert torch.equal(out.logprobs, chosen - log_z)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_on_the_triton_path_matches_hf(arch: str) -> None:
    """Triton attention + batch-invariant Triton matmul and RMSNorm through a whole model."""
    hf_model = make_hf_model(arch)
    model = load_from_hf(get_model_class(hf_model.config.architectures), hf_model)
    model.to(TEST_DEVICE)
    assert enable_batch_invariant_mode(model, "triton") > 0
    builder = BatchBuilder(model.config, backend_name="triton", device=TEST_DEVICE)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    out = builder.run(model, builder.extend(list(zip(rids, PROMPTS))))
    tokens = [[int(t)] for t in out.next_token_logits.argmax(-1)]
    for _ in range(3):
        out = builder.run(model, builder.decode([(rid, t[-1]) for rid, t in zip(rids, tokens)]))
        for i, row in enumerate(out.next_token_logits):
            tokens[i].append(int(row.argmax()))
    for i, prompt in enumerate(PROMPTS):
        assert tokens[i] == hf_greedy(hf_model, prompt, 4)[0]


def test_enable_batch_invariant_mode_rejects_unknown_kernels() -> None:
    with pytest.raises(ValueError, match="kernels"):
        enable_batch_invariant_mode(torch.nn.Linear(2, 2), "cuda")


@pytest.fixture(scope="module")
def triton_engine(tiny_model_dir):
    with sgl.Engine(
        model_path=str(tiny_model_dir("llama")),
        enable_deterministic_inference=True,
        attention_backend="triton",
        sampling_backend="triton",
        device=TEST_DEVICE,
        random_seed=0,
        log_level="warning",
        **CUDA_POOL,  # a pool sized from free memory fails beside other tests' engines
    ) as engine:
        yield engine


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0}, {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "sampling_seed": 7}],
)
def test_engine_triton_path_is_batch_invariant(triton_engine, params: dict) -> None:
    rng = random.Random(0)
    target = [rng.randrange(3, 450) for _ in range(12)]
    others = [[rng.randrange(3, 450) for _ in range(n)] for n in (3, 17, 9)]
    params = {**params, "max_new_tokens": 5, "ignore_eos": True}
    alone = triton_engine.generate(input_ids=[target], sampling_params=params, return_logprob=True)
    batch = triton_engine.generate(
        input_ids=others[:2] + [target] + others[2:], sampling_params=params, return_logprob=True
    )
    assert ids_and_logprobs(batch[2]) == ids_and_logprobs(alone[0])


def test_engine_triton_path_prefill_logprobs_equal_decode(triton_engine) -> None:
    prompt = [random.Random(1).randrange(3, 450) for _ in range(10)]
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    assert_prefill_logprobs_equal_decode(triton_engine, prompt, params)


CAPABILITIES = (80, 90)


@pytest.fixture(scope="module")
def cuda_compiles(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[int, str, str]]:
    """cuda_compile_check.py run for each capability, the runs side by side (each is one
    single-threaded compiler process); capability -> (exit code, stdout, stderr). Triton is not
    in interpreter mode there, so a kernel that only the real compiler rejects fails CI."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's current default, stated (silences a warning)
    script = Path(__file__).with_name("cuda_compile_check.py")
    logs = tmp_path_factory.mktemp("cuda-compile")
    procs = {}
    with contextlib.ExitStack() as files:
        for capability in CAPABILITIES:
            out, err = (files.enter_context(open(logs / f"{capability}.{kind}", "w"))
                        for kind in ("out", "err"))  # fmt: skip
            procs[capability] = subprocess.Popen(
                [sys.executable, str(script), str(capability)], env=env, stdout=out, stderr=err
            )
        codes = {capability: proc.wait() for capability, proc in procs.items()}
    results = {}
    for capability, code in codes.items():
        out, err = ((logs / f"{capability}.{kind}").read_text() for kind in ("out", "err"))
        results[capability] = (code, out, err)
    return results


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_triton_kernel_compiles_for_cuda(cuda_compiles, capability: int) -> None:
    """No GPU here: every kernel compiles to a cubin for sm_80/sm_90 (A100, H100)."""
    code, stdout, stderr = cuda_compiles[capability]
    assert code == 0, stderr[-3000:]
    compiled = [line.split()[1] for line in stdout.splitlines() if line.startswith("ok ")]
    assert compiled.count("_paged_attention_kernel") == 10
    assert compiled.count("_split_kernel") == compiled.count("_merge_kernel") == 10
    assert compiled.count("_store_kv_kernel") == 2
    assert compiled.count("_rope_store_kv_kernel") == 4
    # The sampler's launches as its host code makes them: top-k/top-p over 5 rows (8 pivots),
    # all greedy, plain sampling, min-p alone, every feature over 2 rows (32 pivots).
    sampler = {"_stats_kernel": 5, "_verify_kernel": 2, "_search_kernel": 2, "_final_kernel": 3,
               "_finish_kernel": 5, "_log_z_tile_kernel": 1, "_log_z_kernel": 1}  # fmt: skip
    assert {name: compiled.count(name) for name in sampler} == sampler
    assert {"_matmul_kernel", "_rms_norm_kernel"} <= set(compiled)
    assert compiled.count("lora_shrink_kernel") == compiled.count("lora_expand_kernel") == 2
