"""Both sampling backends (the fused Triton kernel, on the GPU when there is one, else under
TRITON_INTERPRET=1 on CPU, and the tuned torch sampler) vs the plain contract oracle, entropy
definitions and bounds, the sampling-backend registry and the entropy flags of ServerArgs."""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch
from model_test_utils import TEST_DEVICE

from sgl_kernel.sampling_contract import SampleOutput, gumbel_noise, sample_contract
from sgl_kernel.sampling_torch import sample_torch
from sglang.srt.layers.sampler import SAMPLING_BACKENDS, Sampler, get_sampling_backend
from sglang.srt.sampling.sampling_batch_info import EntropyRequest, SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def kernel() -> Iterator[ModuleType]:
    """sgl_kernel.sampling: its kernels compiled for the GPU when there is one, else built for
    Triton's CPU interpreter.

    Triton decides at decoration time whether a kernel is interpreted, so on CPU the module is
    (re)imported with TRITON_INTERPRET=1 set; the variable is restored afterwards.
    """
    name = "sgl_kernel.sampling"
    if TEST_DEVICE == "cuda":
        yield importlib.import_module(name)
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.reload(sys.modules[name]) if name in sys.modules else None
        yield module or importlib.import_module(name)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    sampling_seed: int
    origin_input_ids: range
    output_ids: list[int] = field(default_factory=list)
    eos_token_ids: set[int] = field(default_factory=set)
    grammar: None = None


def make_info(
    params: list[dict], vocab: int, entropy: list[EntropyRequest | None] | None = None
) -> SamplingBatchInfo:
    reqs = [
        FakeReq(SamplingParams(**p), sampling_seed=7919 * i + 5, origin_input_ids=range(3 + i))
        for i, p in enumerate(params)
    ]
    return SamplingBatchInfo.from_reqs(reqs, vocab, TEST_DEVICE, entropy)


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (built on CPU, where torch.Generator draws reproducibly) on TEST_DEVICE."""
    return tensor.to(TEST_DEVICE)


def run_backends(
    kernel: ModuleType, logits: torch.Tensor, info: SamplingBatchInfo, return_logprob: bool = True
) -> tuple[list[SampleOutput], SampleOutput]:
    """(outputs of the kernel and of the torch backend, the contract oracle's output)."""
    plan = info.entropy_plan("raw", 0)
    got = [
        sample(logits, info, return_logprob, None, plan)
        for sample in (kernel.sample_triton, sample_torch)
    ]
    return got, sample_contract(logits, info, return_logprob, None, plan)


def assert_same(got: SampleOutput, want: SampleOutput) -> None:
    assert got.next_token_ids.tolist() == want.next_token_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    if want.entropies is None:
        assert got.entropies is None
    else:
        torch.testing.assert_close(got.entropies, want.entropies, rtol=1e-5, atol=1e-6)


# Every truncation combination, greedy (temperature 0 and top_k 1), several temperatures.
TRUNCATIONS = [
    {"temperature": 0.0},
    {"temperature": 0.7, "top_k": 1},
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.3, "top_k": 20},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 1.1, "top_k": 40, "top_p": 0.95},
    {"temperature": 0.8, "top_k": 7, "min_p": 0.02},
    {"temperature": 1.2, "top_p": 0.5, "min_p": 0.1},
    {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.01},
]
ENTROPY_SPECS: list[EntropyRequest | None] = [
    ("raw", 0), ("scaled", 0), ("sampled", 0), ("raw", 10), ("scaled", 3), ("sampled", 25), None,
]  # fmt: skip


def special_rows(num_rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows, then: masked (-inf) entries, very peaked, uniform, ties at the top,
    almost everything masked."""
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    specials = [
        lambda r: r.index_fill_(0, torch.arange(0, vocab, 3), NEG_INF),
        lambda r: r.index_fill_(0, torch.tensor([vocab // 2]), 40.0),
        lambda r: r.zero_(),
        lambda r: r.index_fill_(0, torch.arange(5, vocab, vocab // 8), 9.0),
        lambda r: r.index_fill_(0, torch.arange(3, vocab), NEG_INF),
    ]
    for i, fill in enumerate(specials[: num_rows - 1]):
        fill(logits[num_rows - 1 - i])
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, num_rows", [(1000, 16), (49152, 3), (151936, 2)])
def test_backends_match_contract(kernel, dtype: torch.dtype, vocab: int, num_rows: int):
    gen = torch.Generator().manual_seed(vocab + num_rows)
    params = [TRUNCATIONS[(i * 7 + 4) % len(TRUNCATIONS)] for i in range(num_rows)]
    specs = [ENTROPY_SPECS[(i * 3 + vocab) % len(ENTROPY_SPECS)] for i in range(num_rows)]
    logits = on_device(special_rows(num_rows, vocab, gen).to(dtype))
    outs, want = run_backends(kernel, logits, make_info(params, vocab, specs))
    for got in outs:
        assert_same(got, want)
        assert got.entropies is not None and bool(torch.isfinite(got.entropies).all())


@pytest.mark.parametrize("num_pivots", [8, 16, 32])
def test_rows_cut_into_many_tiles_match_contract(kernel, monkeypatch, num_pivots: int):
    """The GPU's layout at a small scale: rows of 1,000 logits in 8 tiles of 128 columns, so the
    tiles' partials, their merge and the atomic search counts all run (by default the
    interpreter puts such a row in one tile). The special rows put ties of the maximum in
    different tiles and mask whole tiles; the "wide" row spans almost every int32 key, so the
    search needs all of its launches. The descending rows put the largest logits in the first
    tiles, whole tiles above the top-k / top-p threshold: those are counted without compares."""
    vocab, block = 1000, 128
    tiling = kernel._Tiling(block, 32, 8, 8, num_pivots, kernel._search_launches(num_pivots))
    monkeypatch.setattr(kernel, "_tiling", lambda device, vocab_size, num_rows: tiling)
    logits = special_rows(5, vocab, torch.Generator().manual_seed(num_pivots))
    wide = torch.linspace(-1e30, 1e30, vocab)[torch.randperm(vocab, generator=torch.Generator())]
    ramp = torch.linspace(6.0, -6.0, vocab)
    logits = on_device(torch.cat([logits, wide[None], ramp[None], ramp[None], ramp[None]]))
    params = [TRUNCATIONS[(i * 5 + 1) % len(TRUNCATIONS)] for i in range(5)]
    params.append({"temperature": 1.0, "top_k": 20})
    params.append({"temperature": 1.0, "top_k": 400})
    params.append({"temperature": 0.5, "top_p": 0.999})
    params.append({"temperature": 1.0, "top_k": 300, "top_p": 0.995})
    specs = [ENTROPY_SPECS[i % len(ENTROPY_SPECS)] for i in range(6)]
    specs += [("sampled", 0), ("sampled", 0), ("raw", 300)]  # entropy of the kept set; top-k
    info = make_info(params, vocab, specs)
    plan = info.entropy_plan("raw", 0)
    got = kernel.sample_triton(logits, info, True, None, plan)
    want = sample_contract(logits, info, True, None, plan)
    assert_same(got, want)
    # A temperature-1 row's logprob normaliser is row_logsumexp_triton's, bit for bit.
    unit = [i for i, p in enumerate(params) if p["temperature"] == 1.0]
    chosen = logits[unit].gather(1, got.next_token_ids[unit, None]).squeeze(1)
    assert torch.equal(got.logprobs[unit], chosen - kernel.row_logsumexp_triton(logits[unit]))


@pytest.mark.parametrize("tiles", [1, 4])
def test_verification_settles_rows_without_changing_a_result(kernel, monkeypatch, tiles: int):
    """A truncating row's whole-row Gumbel-max is its token when it lies in the allowed set;
    verification settles such rows without a search. Results with and without it are the same
    bits, and the contract's. The rows: peaked and flat, every truncation, ties at the top-k
    boundary (top_k = the number of tied maxima: one more than the count above a tied winner),
    masked columns, a NaN (never settled; no contract for it), entropy modes that need the
    allowed set (never settled). With
    ``tiles`` 4, the verify pass skips tiles whose maximum is not above the winner's."""
    vocab = 1000
    if tiles > 1:
        searches = kernel._search_launches(16)
        tiling = kernel._Tiling(256, 32, tiles, tiles, 16, searches)  # 4 x 256 >= 1000 columns
        monkeypatch.setattr(kernel, "_tiling", lambda device, vocab_size, num_rows: tiling)
    gen = torch.Generator().manual_seed(tiles)
    truncating = [p for p in TRUNCATIONS if set(p) != {"temperature"} and p.get("top_k") != 1]
    rows, params, specs = [], [], []
    num_random = len(truncating) * (2 if tiles == 1 else 1)  # the interpreter runs tiles slowly
    for i in range(num_random):
        rows.append(torch.randn(vocab, generator=gen) * (1.0, 9.0)[i % 2])
        params.append(truncating[i % len(truncating)])
        specs.append([None, ("raw", 0), ("scaled", 0)][i % 3])
    ties = torch.randint(0, 4, (vocab,), generator=gen).float()
    top_count = int((ties == 3).sum())
    for top_k, top_p in ((top_count, 1.0), (top_count + 1, 1.0), (vocab, 0.3), (3 * vocab, 0.99)):
        rows.append(ties)
        params.append({"temperature": 1.0, "top_k": min(top_k, vocab), "top_p": top_p})
        specs.append(None)
    masked = torch.randn(vocab, generator=gen).index_fill_(0, torch.arange(0, vocab, 2), NEG_INF)
    nan_row = torch.randn(vocab, generator=gen)
    nan_row[7] = float("nan")
    rows += [masked, nan_row, rows[0], rows[1]]
    params += [{"temperature": 0.8, "top_p": 0.9}] * 2 + [params[0], params[1]]
    specs += [None, None, ("sampled", 0), ("raw", 5)]  # the last two need the allowed set
    params.append({"temperature": 0.0})
    rows.append(rows[2])
    specs.append(None)
    logits = on_device(torch.stack(rows))
    info = make_info(params, vocab, specs)
    plan = info.entropy_plan("raw", 0)
    fast = kernel.sample_triton(logits, info, True, None, plan, verify=True)
    slow = kernel.sample_triton(logits, info, True, None, plan, verify=False)
    assert torch.equal(fast.next_token_ids, slow.next_token_ids)
    for got, ref in ((fast.logprobs, slow.logprobs), (fast.entropies, slow.entropies)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    # The contract's tokens (its logprobs of these large logits differ in float32 rounding).
    want = sample_contract(logits, info, False, None).next_token_ids
    clean = [i for i, row in enumerate(rows) if not bool(row.isnan().any())]
    assert fast.next_token_ids[clean].tolist() == want[clean].tolist()

    settled = kernel.settled_rows(logits, info, plan).tolist()
    assert not any(settled[-4:])  # a NaN, the allowed set's entropy, top-k entropy, greedy
    assert settled[-5]  # the masked row: -inf columns are no obstacle
    assert 0 < sum(settled[:num_random]) < num_random  # both paths ran
    # Peaked rows (scale 9) keep almost all of their mass in the allowed set: most settle.
    assert sum(settled[1:num_random:2]) >= num_random // 2 - 2
    # The tied rows settle exactly when fewer than top_k logits lie above the whole-row winner:
    # with top_k = the number of maxima (3), a winner among them; with one more, a 2 too.
    noise = gumbel_noise(info.seeds.cpu(), info.positions.cpu(), vocab)
    scores = logits.cpu().float() / info.temperatures.cpu()[:, None] + noise
    winners = scores.nan_to_num(NEG_INF).argmax(dim=-1)
    assert settled[num_random] == bool(ties[winners[num_random]] == 3)
    assert settled[num_random + 1] == bool(ties[winners[num_random + 1]] >= 2)
    assert settled[num_random + 3]  # top_p 0.99 with every value kept by top_k


def test_kernel_reads_any_row_stride_and_skips_entropy_when_unasked(kernel):
    gen = torch.Generator().manual_seed(3)
    wide = on_device(torch.randn(6, 700, generator=gen) * 2)
    logits = wide[:, :613]  # row stride 700, not contiguous
    info = make_info(TRUNCATIONS[2:8], 613)
    outs, want = run_backends(kernel, logits, info)
    assert want.entropies is None
    for got in outs:
        assert got.entropies is None
        assert_same(got, want)
    contiguous = kernel.sample_triton(logits.contiguous(), info, False, None, None)
    assert contiguous.next_token_ids.tolist() == want.next_token_ids.tolist()
    assert contiguous.logprobs is None


def test_all_greedy_without_logprobs_launches_no_kernel(kernel, monkeypatch):
    # Ties (first index wins), a NaN row (its first NaN, as max(dim)), -inf and bfloat16.
    vocab = 3000
    rows = torch.randn(5, vocab, generator=torch.Generator().manual_seed(11))
    rows[1, [17, 2900]] = 50.0
    rows[2, [40, 700]] = float("nan")
    rows[3, :] = NEG_INF
    rows[3, 1234] = 0.0
    params = [{"temperature": 0.0}] * 4 + [{"top_k": 1}]
    info = make_info(params, vocab)
    for dtype in (torch.float32, torch.bfloat16):
        logits = on_device(rows.to(dtype))
        want = sample_contract(logits.float(), info, False, None)
        with monkeypatch.context() as patched:
            patched.setattr(kernel, "_launch", lambda *a: pytest.fail("a kernel was launched"))
            got = kernel.sample_triton(logits, info, False, None, None)
        assert got.next_token_ids.tolist() == want.next_token_ids.tolist()
        assert got.next_token_ids.tolist()[1:4] == [17, 40, 1234]
        assert got.logprobs is None and got.entropies is None
        # Asking for logprobs takes the kernel, with the same tokens (but in the NaN row: the
        # kernel's maximum skips NaN).
        full = kernel.sample_triton(logits, info, True, None, None).next_token_ids.tolist()
        expected = want.next_token_ids.tolist()
        assert full[:2] + full[3:] == expected[:2] + expected[3:]


def test_uniform_rows_follow_the_noise_alone(kernel):
    # Equal logits: the token is the argmax of the contract noise, so any bit of the hash
    # that differs between a backend and the contract shows up here.
    vocab, num_rows = 3000, 24
    info = make_info([{"temperature": 1.0}] * num_rows, vocab)
    noise = gumbel_noise(info.seeds, info.positions, vocab)
    for sample in (kernel.sample_triton, sample_torch):
        got = sample(on_device(torch.zeros(num_rows, vocab)), info, False, None, None)
        assert got.next_token_ids.tolist() == noise.argmax(dim=-1).tolist()


def test_chi_square_of_kernel_samples(kernel):
    # 8 tokens in a scrambled order; min_p 0.3 keeps p >= 0.12: tokens 4, 1 and 6.
    probs = {4: 0.40, 1: 0.25, 6: 0.15, 0: 0.10, 7: 0.05, 2: 0.03, 3: 0.015, 5: 0.005}
    row = torch.tensor([math.log(probs[v]) for v in range(8)])
    num_samples = 300
    info = make_info([{"temperature": 1.0, "min_p": 0.3}] * num_samples, 8)
    logits = on_device(row.repeat(num_samples, 1))
    tokens = kernel.sample_triton(logits, info, False, None, None).next_token_ids
    counts = torch.bincount(tokens.cpu(), minlength=8)
    assert set(counts.nonzero().squeeze(1).tolist()) == {1, 4, 6}
    kept = torch.tensor([probs[v] if v in (1, 4, 6) else 0.0 for v in range(8)])
    chi2_truncated = _chi_square(counts, kept / kept.sum())
    chi2_untruncated = _chi_square(counts[[1, 4, 6]], torch.tensor([0.25, 0.40, 0.15]) / 0.8)
    assert chi2_truncated < 13.8  # 2 degrees of freedom, p = 0.001
    assert chi2_untruncated < 13.8
    wrong = torch.tensor([probs[v] for v in range(8)])
    assert _chi_square(counts, wrong) > 50  # the untruncated distribution is rejected


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    used = expected > 0
    return float(((counts[used] - expected[used]) ** 2 / expected[used]).sum())


# ---- entropy definitions ------------------------------------------------------------------


def _float64_entropy(values: torch.Tensor) -> float:
    logp = torch.log_softmax(values.double(), dim=-1)
    p = logp.exp()
    return float(-(torch.where(p > 0, p * logp, 0.0)).sum())


@pytest.mark.parametrize("backend", ["contract", "torch", "kernel"])
def test_entropy_definitions(kernel, backend: str):
    gen = torch.Generator().manual_seed(11)
    vocab = 300
    logits = torch.randn(1, vocab, generator=gen).repeat(6, 1) * 2.5
    logits[:, 7] = NEG_INF  # masked entries have probability 0
    params = [{"temperature": 0.7, "top_k": 30, "top_p": 0.9, "min_p": 0.01}] * 6
    specs = [("raw", 0), ("scaled", 0), ("sampled", 0), ("raw", 12), ("scaled", 12), ("sampled", 9)]
    info = make_info(params, vocab, specs)
    sample = {"contract": sample_contract, "torch": sample_torch}.get(backend, kernel.sample_triton)
    got = sample(on_device(logits), info, False, None, info.entropy_plan("raw", 0)).entropies
    x = logits[0].double()
    scaled = (logits[0] / 0.7).double()
    sorted_scaled = scaled.sort(descending=True).values
    probs = torch.softmax(sorted_scaled, dim=-1)
    cum_before = probs.cumsum(0) - probs
    keep = (cum_before < 0.9) & (torch.arange(vocab) < 30) & (probs >= 0.01 * probs[0])
    allowed = sorted_scaled[keep]
    want = [
        _float64_entropy(x),
        _float64_entropy(scaled),
        _float64_entropy(allowed),
        _float64_entropy(x.topk(12).values),
        _float64_entropy(scaled.topk(12).values),
        _float64_entropy(allowed[:9]),
    ]
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert want[2] < want[1] and want[4] <= math.log(12)  # the definitions do differ


def test_entropy_bounds_and_special_rows(kernel):
    vocab = 1000
    gen = torch.Generator().manual_seed(5)
    logits = on_device(torch.cat([special_rows(6, vocab, gen)] * 3))
    specs = [("raw", 0)] * 6 + [("scaled", 16)] * 6 + [("sampled", 0)] * 6
    params = ([{"temperature": 1.5}] * 6) + ([{"temperature": 0.5, "top_p": 0.9}] * 12)
    info = make_info(params, vocab, specs)
    outs, want = run_backends(kernel, logits, info, return_logprob=False)
    for got in outs:
        assert_same_tokens_and_entropy(got, want)
    ent = outs[0].entropies
    assert bool((ent >= -1e-6).all())
    assert bool((ent[:6] <= math.log(vocab) + 1e-5).all())
    assert bool((ent[6:12] <= math.log(16) + 1e-5).all())
    uniform, peaked, few = 3, 4, 1  # rows of special_rows(6, ...): zeros, +40, 3 finite
    assert ent[uniform].item() == pytest.approx(math.log(vocab), rel=1e-5)
    assert ent[6 + uniform].item() == pytest.approx(math.log(16), rel=1e-5)
    assert ent[peaked].item() == pytest.approx(0.0, abs=1e-5)
    assert ent[few].item() <= math.log(3) + 1e-6


def assert_same_tokens_and_entropy(got: SampleOutput, want: SampleOutput) -> None:
    assert got.next_token_ids.tolist() == want.next_token_ids.tolist()
    torch.testing.assert_close(got.entropies, want.entropies, rtol=1e-5, atol=1e-6)


def test_top_k_entropy_counts_boundary_ties_as_topk_does(kernel):
    # K = 2 over 3, 2, 2, 2, 1: the multiset {3, 2}, as torch.topk returns it.
    logits = on_device(torch.tensor([[2.0, 3.0, 2.0, 1.0, 2.0]] * 2))
    info = make_info([{"temperature": 1.0}, {"temperature": 0.0}], 5, [("raw", 2), ("sampled", 2)])
    outs, want = run_backends(kernel, logits, info)
    for got in outs:
        assert_same(got, want)
        assert got.entropies[0].item() == pytest.approx(_float64_entropy(torch.tensor([3.0, 2.0])))
        assert got.entropies[1].item() == 0.0  # a greedy row samples a point mass


def test_entropy_does_not_change_tokens_or_logprobs(kernel):
    gen = torch.Generator().manual_seed(8)
    logits = on_device(torch.randn(len(TRUNCATIONS), 500, generator=gen) * 2)
    plain = make_info(TRUNCATIONS, 500)
    with_entropy = make_info(TRUNCATIONS, 500, [("sampled", 0)] * len(TRUNCATIONS))
    for sample in (kernel.sample_triton, sample_torch, sample_contract):
        a = sample(logits, plain, True, None, plain.entropy_plan("raw", 0))
        b = sample(logits, with_entropy, True, None, with_entropy.entropy_plan("raw", 0))
        assert a.entropies is None and b.entropies is not None
        assert a.next_token_ids.tolist() == b.next_token_ids.tolist()
        assert a.logprobs.tolist() == b.logprobs.tolist()


# ---- plan, registry, server arguments -----------------------------------------------------


def test_entropy_plan_groups_rows_and_applies_defaults():
    requests = [None, (None, None), ("sampled", None), (None, 7), ("raw", 500)]
    info = make_info([{}] * 5, 100, requests)
    assert make_info([{}] * 2, 100).entropy_plan("raw", 0) is None
    plan = info.entropy_plan("scaled", 0)
    assert plan.modes.tolist() == [0, 2, 3, 2, 1]
    assert plan.top_ks.tolist() == [0, 0, 0, 7, 0]  # K >= V means the full vocabulary
    assert {(g.mode, g.top_k, tuple(g.rows.tolist())) for g in plan.groups} == {
        ("scaled", 0, (1,)), ("sampled", 0, (2,)), ("scaled", 7, (3,)), ("raw", 0, (4,)),
    }  # fmt: skip
    assert info.entropy_plan("scaled", 0) is plan  # built once per batch composition
    assert info.entropy_plan("raw", 3).top_ks.tolist() == [0, 3, 3, 7, 0]


def test_backend_registry(kernel):
    assert SAMPLING_BACKENDS == ("pytorch", "triton")
    with pytest.raises(ValueError, match="supported: pytorch, triton"):
        get_sampling_backend("cuda_graph")
    with pytest.raises(ValueError, match="entropy mode"):
        Sampler("pytorch", entropy_mode="exact")
    info = make_info(TRUNCATIONS, 64, [(None, None)] * len(TRUNCATIONS))
    gen = torch.Generator().manual_seed(1)
    logits = on_device(torch.randn(len(TRUNCATIONS), 64, generator=gen))
    plan = info.entropy_plan("scaled", 0)
    want = sample_contract(logits, info, True, [2] * 11, plan)
    outs = [
        Sampler("pytorch", "scaled").forward(logits, info, True, [2] * 11),
        SampleOutput(*kernel.sample_triton(logits, info, True, [2] * 11, plan)),
    ]
    for got in outs:
        assert_same(got, want)
        torch.testing.assert_close(got.top_logprobs_val, want.top_logprobs_val)
        assert got.top_logprobs_idx.tolist() == want.top_logprobs_idx.tolist()


def test_server_args_sampling_backend_and_entropy_flags(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = ServerArgs(model_path="m", device="cpu")
    assert args.sampling_backend == "pytorch"
    assert (args.entropy_mode, args.entropy_top_k) == ("raw", 0)
    assert not args.enable_entropy_with_logprobs
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ServerArgs(model_path="m", device="cpu", sampling_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ServerArgs(model_path="m", device="cpu", sampling_backend="triton").device == "cpu"
    with pytest.raises(ValueError, match="--entropy-mode"):
        ServerArgs(model_path="m", device="cpu", entropy_mode="exact")
    with pytest.raises(ValueError, match="--entropy-top-k"):
        ServerArgs(model_path="m", device="cpu", entropy_top_k=-1)


def test_request_overrides_are_validated_and_split_per_prompt():
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.request_validation import _check_entropy_args
    from sglang.srt.managers.schedule_batch import Req

    _check_entropy_args(None, None)
    _check_entropy_args("sampled", 0)
    with pytest.raises(ValueError, match="entropy_mode"):
        _check_entropy_args("exact", None)
    for bad_k in (-1, True, 2.5):
        with pytest.raises(ValueError, match="entropy_top_k"):
            _check_entropy_args(None, bad_k)
    obj = GenerateReqInput(
        input_ids=[[1], [2]], return_entropy=True, entropy_mode=["raw", "sampled"], entropy_top_k=5
    )
    obj.normalize_batch_and_arguments()
    assert [(obj[i].entropy_mode, obj[i].entropy_top_k) for i in range(2)] == [
        ("raw", 5), ("sampled", 5),
    ]  # fmt: skip
    req = Req("r", [1, 2], SamplingParams(), 0, set(), return_entropy=True, entropy_mode="scaled")
    assert req.entropy_request == ("scaled", None)
    assert Req("s", [1], SamplingParams(), 0, set(), entropy_mode="raw").entropy_request is None
