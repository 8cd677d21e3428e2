"""The C++ kernels of the CPU sampler (layers/cpu_sampling.py) against the torch ops of
``sgl_kernel.sampling_torch`` they replace: the Gumbel-max's noise and tokens bit for bit, the
softmax statistics within float32 rounding (against float64), and the engine's seeded
sampling unchanged by them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl_kernel import sampling_torch
from sglang.srt.layers import cpu_sampling
from sglang.srt.layers.cpu_extension import avx2_host, platform_supported
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

pytestmark = pytest.mark.skipif(
    not (platform_supported() and avx2_host() and torch.backends.mkl.is_available()),
    reason="built on x86-64 Linux with AVX2, against a torch that carries MKL's vmsLn",
)

VOCABS = [1, 7, 16, 1000, 3 * 1024 + 37, 49152]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert cpu_sampling.load_kernel()


@pytest.fixture
def torch_path() -> Iterator[None]:
    """The torch ops for the test's duration, then the registration as it was."""
    saved = sampling_torch.cpu_kernels()
    sampling_torch.use_cpu_kernels(None)
    yield
    sampling_torch.use_cpu_kernels(saved)


def keys_for(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2**32, (rows,), generator=gen, dtype=torch.int64)
    keys[0] = 2**32 - 1  # the top of the key range
    return keys


def rows_of(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits / T of one shape: ``wide`` N(0, 9); ``flat`` N(0, 1e-4) (nearly every column is a
    candidate: the exact pass); ``peaked`` a few large values over a low floor, as a trained
    model's logits; ``ties`` small integers (equal logits everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "wide":
        return torch.randn(rows, vocab, generator=gen) * 3
    if kind == "flat":
        return torch.randn(rows, vocab, generator=gen) * 1e-2
    if kind == "ties":
        return torch.randint(0, 3, (rows, vocab), generator=gen).float()
    x = torch.randn(rows, vocab, generator=gen) * 2 - 8
    top = torch.randint(0, vocab, (rows, 5), generator=gen)
    return x.scatter(1, top, torch.randn(rows, 5, generator=gen) * 2 + 12)


def torch_argmax(x: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    saved = sampling_torch.cpu_kernels()
    sampling_torch.use_cpu_kernels(None)
    try:
        return sampling_torch._gumbel_argmax_full(x, thr, keys)
    finally:
        sampling_torch.use_cpu_kernels(saved)


@pytest.mark.parametrize("vocab", VOCABS)
def test_noise_is_bitwise_torch(vocab: int) -> None:
    keys = keys_for(5, vocab)
    expected = sampling_torch._neg_gumbel_from_keys(keys, torch.arange(vocab))
    got = cpu_sampling.neg_gumbel(keys, vocab)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("kind", ["wide", "flat", "peaked", "ties"])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("truncated", [False, True], ids=["whole", "thr"])
def test_tokens_are_the_torch_paths(kind: str, vocab: int, truncated: bool) -> None:
    rows = 33
    x = rows_of(kind, rows, vocab, seed=vocab)
    keys = keys_for(rows, vocab + 1)
    thr = None
    if truncated:  # per row: a value of the row (some rows keep one column, some all)
        cols = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(3))
        thr = x.gather(1, cols[:, None]).squeeze(1).contiguous()
    expected = torch_argmax(x, thr, keys)
    assert torch.equal(cpu_sampling.gumbel_argmax(x, thr, keys), expected)
    assert torch.equal(cpu_sampling.gumbel_argmax_exact(x, thr, keys), expected)


def test_special_values_as_torch() -> None:
    """NaN (its first one wins), +inf, -inf columns, a row of -inf, a row that its threshold
    leaves empty: the torch path's choice in each."""
    vocab = 2 * 1024 + 5
    x = rows_of("peaked", 8, vocab, seed=1)
    x[0, [700, 40]] = float("nan")
    x[1, 1500] = float("inf")
    x[1, 9] = float("inf")
    x[2, ::2] = float("-inf")
    x[3] = float("-inf")
    x[4, 2047:] = float("nan")  # NaN in the vector tail only
    x[5, 100] = float("nan")  # NaN below the threshold: scored NaN, as torch scores it
    thr = torch.full((8,), float("-inf"))
    thr[5] = 50.0
    thr[6] = float("inf")  # nothing allowed: every score -inf
    thr[7] = x[7].max()  # one column allowed
    keys = keys_for(8, 9)
    for t in (None, thr):
        expected = torch_argmax(x, t, keys)
        assert torch.equal(cpu_sampling.gumbel_argmax(x, t, keys), expected)
    assert cpu_sampling.gumbel_argmax(x, None, keys)[0].item() == 40
    assert cpu_sampling.gumbel_argmax(x, thr, keys)[7].item() == int(x[7].argmax())


def test_row_independent_of_batch_and_threads() -> None:
    x = rows_of("wide", 16, 5000, seed=4)
    keys = keys_for(16, 5)
    whole = cpu_sampling.gumbel_argmax(x, None, keys)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = cpu_sampling.gumbel_argmax(x, None, keys)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, one_thread)
    for r in (0, 7, 15):
        assert cpu_sampling.gumbel_argmax(x[r : r + 1], None, keys[r : r + 1]).item() == whole[r]


def test_strided_rows() -> None:
    """Rows of a wider tensor (row stride > V), as a slice hands them over."""
    base = rows_of("wide", 6, 1100, seed=6)
    x = base[:, 50:1074]
    keys = keys_for(6, 7)
    assert torch.equal(cpu_sampling.gumbel_argmax(x, None, keys), torch_argmax(x, None, keys))


def test_strided_thresholds() -> None:
    """A threshold column sliced out of a wider tensor is taken as it is."""
    x = rows_of("peaked", 5, 700, seed=12)
    keys = keys_for(5, 13)
    thr = torch.stack([x.amax(1) - 3, x.amin(1)], 1)[:, 0]
    assert not thr.is_contiguous()
    assert torch.equal(cpu_sampling.gumbel_argmax(x, thr, keys), torch_argmax(x, thr, keys))


def test_rejects_bad_operands() -> None:
    keys = keys_for(2, 0)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_sampling.gumbel_argmax(torch.zeros(2, 8, dtype=torch.float64), None, keys)
    with pytest.raises(RuntimeError, match="row_keys"):
        cpu_sampling.gumbel_argmax(torch.zeros(2, 8), None, keys.int())
    with pytest.raises(RuntimeError, match="B = row_keys"):
        cpu_sampling.gumbel_argmax(torch.zeros(3, 8), None, keys)
    with pytest.raises(RuntimeError, match="thr"):
        cpu_sampling.gumbel_argmax(torch.zeros(2, 8), torch.zeros(3), keys)


def stats_float64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum exp(x - max), sum exp(x - max) * (x - max)) per row, in float64."""
    xd = x.double()
    m = xd.amax(dim=1, keepdim=True)
    d = (xd - m).clamp(min=torch.finfo(torch.float32).min)
    e = d.exp()
    return m.squeeze(1), e.sum(1), (e * d).sum(1)


@pytest.mark.parametrize("kind", ["wide", "flat", "peaked", "ties"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_softmax_stats_against_float64(kind: str, vocab: int) -> None:
    x = rows_of(kind, 9, vocab, seed=vocab + 2)
    x[1, : vocab // 2] = float("-inf")  # masked columns add 0
    row_max, sum_exp, sum_dev = cpu_sampling.softmax_stats(x, True)
    want_max, want_sum, want_dev = stats_float64(x)
    assert torch.equal(row_max.double(), want_max)  # the max is exact
    torch.testing.assert_close(sum_exp.double(), want_sum, rtol=1e-6, atol=0)
    assert sum_dev is not None
    torch.testing.assert_close(sum_dev.double(), want_dev, rtol=1e-5, atol=1e-6)
    no_dev = cpu_sampling.softmax_stats(x, False)
    assert no_dev[2] is None and torch.equal(no_dev[1], sum_exp)


def test_softmax_stats_special_rows_as_torch(torch_path: None) -> None:
    """A row holding NaN, +inf, or only -inf gives NaN sums (and the torch ops' max), as the
    torch ops do."""
    x = rows_of("wide", 4, 100, seed=3)
    x[0, 7] = float("nan")
    x[1, 50] = float("inf")
    x[2] = float("-inf")
    want = sampling_torch.row_softmax_stats(x, True)
    got = cpu_sampling.softmax_stats(x, True)
    for g, w in zip(got, want):
        assert g is not None and w is not None
        assert torch.equal(g[:3].isnan(), w[:3].isnan())
        assert torch.equal(g[:3].nan_to_num(), w[:3].nan_to_num())
        assert torch.isfinite(g[3])


def test_softmax_stats_row_independent_of_batch() -> None:
    x = rows_of("peaked", 12, 49152, seed=11)
    whole = cpu_sampling.softmax_stats(x, True)
    for r in (0, 5, 11):
        alone = cpu_sampling.softmax_stats(x[r : r + 1], True)
        for a, w in zip(alone, whole):
            assert a is not None and w is not None
            assert torch.equal(a, w[r : r + 1])


def nucleus_of(x: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's candidates for every row at ``top_p`` (with the sampler's log_z)."""
    log_z = sampling_torch.row_logsumexp(x)
    return cpu_sampling.nucleus_candidates(x, log_z, torch.full((x.shape[0],), top_p))


@pytest.mark.parametrize("kind", ["wide", "flat", "peaked", "ties"])
@pytest.mark.parametrize("vocab", [7, 1000, 3 * 1024 + 37, 49152])
@pytest.mark.parametrize("top_p", [0.0, 0.5, 0.95, 0.999])
def test_nucleus_candidates_are_the_sorted_prefix(kind: str, vocab: int, top_p: float) -> None:
    """Each served row gets its own largest values in descending order (the full sort's
    prefix), holding at least top_p of its softmax (float64) unless they are every column
    within 32 of the max; -inf after them; at most half the row."""
    x = rows_of(kind, 9, vocab, seed=vocab + 5)
    vals, lengths = nucleus_of(x, top_p)
    assert vals.shape[1] == max(1, int(lengths.max()))
    probs = torch.softmax(x.double(), dim=-1)
    for r in range(x.shape[0]):
        n = int(lengths[r])
        assert n <= vocab // 2
        assert torch.all(vals[r, n:] == float("-inf"))
        if n == 0:
            continue
        assert torch.equal(vals[r, :n], x[r].sort(descending=True).values[:n])
        within = x[r] > x[r].max() - 32
        assert probs[r][x[r] >= vals[r, n - 1]].sum() >= top_p or n == int(within.sum())
    if kind == "peaked" and vocab > 1000:  # a trained model's rows: a handful of candidates
        assert int(lengths.max()) <= 16
    if kind == "wide" and vocab == 49152 and top_p == 0.95:  # thousands, not the whole row
        assert int(lengths.min()) > 1000 and int(lengths.max()) < 8192


def test_nucleus_candidates_special_rows() -> None:
    """NaN, +inf, only -inf and a non-finite log_z get no candidates (the sampler's old path
    takes them); -inf columns never are candidates; more than half a row is none."""
    x = rows_of("peaked", 6, 2000, seed=14)
    x[0, 3] = float("nan")
    x[1, 1999] = float("inf")
    x[2] = float("-inf")
    x[3, 1000:] = float("-inf")
    x[5] = 1.0  # ties everywhere: the cut is the whole row
    log_z = sampling_torch.row_logsumexp(x)
    log_z[4] = float("nan")
    vals, lengths = cpu_sampling.nucleus_candidates(x, log_z, torch.full((6,), 0.999))
    assert lengths.tolist()[:3] == [0, 0, 0] and lengths[4] == 0 and lengths[5] == 0
    n = int(lengths[3])
    assert 0 < n <= 1000 and torch.isfinite(vals[3, :n]).all()
    assert torch.equal(vals[3, :n], x[3].sort(descending=True).values[:n])


def test_nucleus_candidates_row_independent_of_batch_and_threads() -> None:
    x = rows_of("wide", 8, 6000, seed=15)
    whole, lengths = nucleus_of(x, 0.9)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(nucleus_of(x, 0.9)[0], whole)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 7):
        alone, n = nucleus_of(x[r : r + 1], 0.9)
        assert int(n) == int(lengths[r]) and torch.equal(alone[0, : int(n)], whole[r, : int(n)])


def test_nucleus_candidates_rejects_bad_operands() -> None:
    x = torch.zeros(2, 8)
    ok = torch.zeros(2)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_sampling.nucleus_candidates(x.double(), ok, ok)
    with pytest.raises(RuntimeError, match="log_z and mass"):
        cpu_sampling.nucleus_candidates(x, torch.zeros(3), ok)
    with pytest.raises(RuntimeError, match="log_z and mass"):
        cpu_sampling.nucleus_candidates(x, ok, ok.double())


TRUNCATIONS = [
    {"top_p": 0.95},
    {"top_p": 0.5},
    {"top_p": 0.999},
    {"top_p": 0.9, "min_p": 0.01},
    {"top_p": 0.95, "top_k": 3000},
    {"top_k": 3000},
    {"top_p": 0.9, "top_k": 20, "min_p": 0.1},
]


@pytest.mark.parametrize("kind", ["wide", "flat", "peaked", "ties"])
@pytest.mark.parametrize("params", TRUNCATIONS, ids=lambda p: "-".join(map(str, p.values())))
def test_truncation_on_candidates_is_the_full_sorts(
    kind: str, params: dict[str, float], torch_path: None
) -> None:
    """Thresholds (exactly) and tokens with the candidates equal the torch path's (a topk
    prefix, full sorts past it), rows mixed with top-p-only ones at temperature 1 and a NaN
    row among them."""
    from test_sampler import req

    from sglang.srt.layers.sampler import Sampler

    vocab, rows = 49152, 16
    reqs = [req(seed=i, position=i, **(params if i % 4 else {"top_p": 0.95})) for i in range(rows)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab, "cpu", [("raw", None)] * rows)
    x = rows_of(kind, rows, vocab, seed=21)
    x[5, 9] = float("nan")  # the old path's row, inside a batch the candidates serve
    log_z = sampling_torch.row_logsumexp(x)
    trunc = (info.top_ks, info.top_ps, info.min_ps)
    want = sampling_torch._truncation_thresholds(x, log_z, trunc, info)[0]
    want_ids = Sampler("pytorch").forward(x, info, False, None).next_token_ids
    sampling_torch.use_cpu_kernels(cpu_sampling.KERNELS)
    got = sampling_torch._truncation_thresholds(x, log_z, trunc, info)[0]
    got_ids = Sampler("pytorch").forward(x, info, False, None).next_token_ids
    # Equal values (a NaN's sign may differ), which the threshold compares only as values.
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got_ids, want_ids)
    assert got_ids[5] == 9  # the NaN row's first NaN, as the contract's argmax takes it


def test_sampler_on_the_kernels(torch_path: None) -> None:
    """The whole sampler (temperature 1 and 0.7, mixed with greedy rows, top-p, entropy)
    returns the torch ops' tokens with the kernels registered, logprobs and entropies within
    float32 rounding, and calls them."""
    from test_sampler import req

    from sglang.srt.layers.sampler import Sampler

    logits = rows_of("peaked", 12, 3000, seed=8)
    sampler = Sampler("pytorch")
    calls: list[str] = []

    def gumbel(x: torch.Tensor, thr: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        calls.append("gumbel")
        return cpu_sampling.gumbel_argmax(x, thr, keys)

    def stats(x: torch.Tensor, with_entropy: bool) -> Any:
        calls.append("stats")
        return cpu_sampling.softmax_stats(x, with_entropy)

    def nucleus(x: torch.Tensor, log_z: torch.Tensor, mass: torch.Tensor) -> Any:
        calls.append("nucleus")
        return cpu_sampling.nucleus_candidates(x, log_z, mass)

    counted = sampling_torch.CpuSamplingKernels(gumbel, stats, nucleus)
    cases = [{"temperature": 1.0}, {"temperature": 0.7}, {"temperature": 0.0},
             {"temperature": 1.0, "top_p": 0.9}]  # fmt: skip
    for params in ([cases[0]] * 12, cases * 3):
        reqs = [req(seed=i, position=5 + i, **p) for i, p in enumerate(params)]
        info = SamplingBatchInfo.from_reqs(reqs, 3000, "cpu", [("raw", None)] * 12)
        plan = info.entropy_plan("raw", 0)
        expected = sampler.forward(logits, info, True, None)
        sampling_torch.use_cpu_kernels(counted)
        got = sampler.forward(logits, info, True, None)
        sampling_torch.use_cpu_kernels(None)
        assert plan is not None and got.entropies is not None and expected.entropies is not None
        assert torch.equal(got.next_token_ids, expected.next_token_ids)
        assert got.logprobs is not None and expected.logprobs is not None
        torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.entropies, expected.entropies, rtol=1e-5, atol=1e-6)
    assert {"gumbel", "stats", "nucleus"} <= set(calls)


def test_model_runner_switches_it(tiny_model_dir: Callable[..., Path], torch_path: None) -> None:
    """A CPU runner turns it on, or off with --disable-cpu-fused-ops."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    path = str(tiny_model_dir("llama"))
    config = ModelConfig(path, dtype="float32", device="cpu")
    cases = [({}, cpu_sampling.KERNELS), ({"disable_cpu_fused_ops": True}, None)]
    for kwargs, expected in cases:
        args = ServerArgs(model_path=path, device="cpu", max_total_tokens=64, **kwargs)
        ModelRunner(args, config)
        assert sampling_torch.cpu_kernels() is expected


def test_engine_seeded_sampling_unchanged(
    tiny_model_dir: Callable[..., Path], torch_path: None
) -> None:
    """A scheduler in process, seeded requests at temperature 1 with logprobs: the kernels and
    the torch ops give the same tokens, and logprobs within float32 rounding (the same logits
    go in)."""
    from scheduler_test_utils import OutputSink

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler_process import build_scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(tiny_model_dir("llama")), device="cpu", random_seed=0)
    sink = OutputSink()
    core = build_scheduler(args, sink.on_output, sink.on_reply)
    assert sampling_torch.cpu_kernels() is cpu_sampling.KERNELS
    prompts = [[5, 17, 3, 99, 250, 8, 41], list(range(30, 90)), [7] * 3]
    runs = []
    for native in (cpu_sampling.KERNELS, None):
        sampling_torch.use_cpu_kernels(native)
        reqs = []
        for i, ids in enumerate(prompts):
            params = SamplingParams(
                temperature=1.0, max_new_tokens=16, ignore_eos=True, sampling_seed=100 + i
            )
            params.normalize()
            reqs.append(TokenizedGenerateReqInput(f"{native is None}-{i}", "", ids, params,
                                                  return_logprob=True))  # fmt: skip
        core.process_input_requests(reqs)
        while core.has_runnable_work():
            core.run_step()
        runs.append([sink.by_rid[r.rid] for r in reqs])
        assert core.flush_cache().success
    for with_kernel, with_torch in zip(*runs):
        assert len(with_kernel.output_ids) == 16
        assert with_kernel.output_ids == with_torch.output_ids
        assert with_kernel.logprobs == pytest.approx(with_torch.logprobs, abs=1e-5)
