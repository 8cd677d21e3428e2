"""Sampler (the torch backend) vs the plain contract oracle, the seeded-noise contract,
SamplingBatchInfo penalties and masks."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from sgl_kernel import sampling_torch
from sgl_kernel.sampling_contract import sample_contract
from sglang.srt.layers.sampler import (
    HASH_MUL1,
    HASH_MUL2,
    POSITION_SALT,
    SampleOutput,
    Sampler,
    derive_seed,
    gumbel_noise,
    hash32,
    noise_row_keys,
    row_logsumexp,
)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    sampling_seed: int = 0
    origin_input_ids: Sequence[int] = field(default_factory=lambda: [1, 2, 3])
    output_ids: list[int] = field(default_factory=list)
    eos_token_ids: set[int] = field(default_factory=lambda: {0})
    grammar: None = None


def make_info(reqs: list[FakeReq], vocab_size: int) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_reqs(reqs, vocab_size, "cpu")


def sample(
    logits: torch.Tensor,
    reqs: list[FakeReq],
    return_logprob: bool = False,
    tops: list[int] | None = None,
) -> SampleOutput:
    info = make_info(reqs, logits.shape[1])
    return Sampler().forward(logits.clone(), info, return_logprob, tops)


def req(seed: int = 0, position: int = 3, **params) -> FakeReq:
    # Only the prompt's length matters to sampling; a range keeps long positions cheap.
    return FakeReq(SamplingParams(**params), seed, origin_input_ids=range(position))


# Probabilities in a scrambled vocab order, so index bugs cannot hide behind sorted logits.
HAND_PROBS = {4: 0.40, 1: 0.25, 6: 0.15, 0: 0.10, 7: 0.05, 2: 0.03, 3: 0.015, 5: 0.005}
HAND_LOGITS = torch.tensor([math.log(HAND_PROBS[v]) for v in range(8)], dtype=torch.float32)


def sampled_set(params: dict, num_samples: int = 3000, oracle: bool = False) -> set[int]:
    """Tokens drawn over many seeds by the Sampler, or by the contract oracle."""
    logits = HAND_LOGITS.repeat(num_samples, 1)
    reqs = [req(seed=i, position=i % 17, **params) for i in range(num_samples)]
    if oracle:
        out = sample_contract(logits, make_info(reqs, logits.shape[1]), False, None)
        return set(out.next_token_ids.tolist())
    return set(sample(logits, reqs).next_token_ids.tolist())


# ---- the counter-based noise contract -------------------------------------------------------


def test_hash32_known_answers():
    # Frozen outputs: if these change, every seeded output of the engine changes.
    assert (HASH_MUL1, HASH_MUL2, POSITION_SALT) == (0x21F0AAAD, 0x735A2D97, 0x9E3779B9)
    expected = {
        0: 0x0,
        1: 0x86D2FA73,
        2: 0x0DA7F4E7,
        12345: 0x869DAE96,
        0xFFFFFFFF: 0x99B5E683,
        0x80000000: 0xE0BD5472,
    }
    for x, h in expected.items():
        assert hash32(x) == h
        assert hash32(torch.tensor([x], dtype=torch.int64)).item() == h


def test_row_keys_known_answers_and_seed_reduction():
    seeds = torch.tensor([0, 42, 2**32 + 42, -1], dtype=torch.int64)
    positions = torch.tensor([0, 7, 7, 100], dtype=torch.int64)
    keys = noise_row_keys(seeds, positions).tolist()
    assert keys == [0x144A87A9, 0xA9F445AD, 0xA9F445AD, 0x07D1585C]
    # -1 reduces to 2**32 - 1, as Python's modulo does in SamplingBatchInfo.
    assert keys[3] == hash32((2**32 - 1) ^ hash32(100 ^ POSITION_SALT))


def test_gumbel_noise_known_answers():
    noise = gumbel_noise(torch.tensor([42]), torch.tensor([7]), 5)[0].tolist()
    expected = [
        -1.0413607358932495,
        0.03730414807796478,
        0.08868958055973053,
        1.31755530834198,
        4.779132843017578,
    ]
    assert noise == pytest.approx(expected, abs=1e-6)


def test_fast_noise_matches_contract_bit_for_bit():
    rng = random.Random(0)
    seeds = [rng.getrandbits(64) - 2**63 for _ in range(6)] + [0, 2**32 - 1]
    positions = [rng.randrange(0, 2**31) for _ in range(6)] + [0, 5]
    seeds_t, positions_t = torch.tensor(seeds), torch.tensor(positions)
    fast = sampling_torch.gumbel_noise(seeds_t, positions_t, 4099)
    assert torch.equal(fast, gumbel_noise(seeds_t, positions_t, 4099))
    # The contract's noise is the documented recipe, row by row with Python-int keys.
    for i, (s, p) in enumerate(zip(seeds, positions)):
        row_key = hash32((s % 2**32) ^ hash32((p % 2**32) ^ POSITION_SALT))
        bits = hash32(row_key ^ torch.arange(4099, dtype=torch.int64))
        u = ((bits >> 9).to(torch.float32) + 0.5) / 2**23
        assert torch.equal(fast[i], -torch.log(-torch.log(u)))


def test_uniform_never_reaches_zero_or_one():
    # bits >> 9 spans [0, 2**23): u in [2**-24, 1 - 2**-24], so g is always finite.
    ends = torch.tensor([0, 2**23 - 1], dtype=torch.float32)
    u = (ends + 0.5) / 2**23
    assert u[0].item() == 2.0**-24 and u[1].item() == 1 - 2.0**-24
    noise = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 1 << 14)
    assert torch.isfinite(noise).all()


def test_noise_depends_on_position_and_seed():
    base = gumbel_noise(torch.tensor([7]), torch.tensor([100]), 1000)[0]
    other_pos = gumbel_noise(torch.tensor([7]), torch.tensor([101]), 1000)[0]
    other_seed = gumbel_noise(torch.tensor([8]), torch.tensor([100]), 1000)[0]
    for other in (other_pos, other_seed):
        assert (base != other).float().mean() > 0.99
        assert abs(torch.corrcoef(torch.stack([base, other]))[0, 1].item()) < 0.15


def test_derive_seed_stable_and_distinct():
    assert derive_seed(0, "req-1") == 6619153686110415579
    assert derive_seed(1234, "abc") == 3897235786081953
    assert derive_seed(0, "req-2") != derive_seed(0, "req-1")
    assert derive_seed(1, "req-1") != derive_seed(0, "req-1")


# ---- greedy and truncation --------------------------------------------------------------------


def test_greedy_is_argmax_and_top_k_one_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    expected = logits.argmax(dim=-1)
    greedy = sample(logits, [req(seed=i, temperature=0.0) for i in range(6)])
    top_k_one = sample(logits, [req(seed=i, temperature=1.5, top_k=1) for i in range(6)])
    assert torch.equal(greedy.next_token_ids, expected)
    assert torch.equal(top_k_one.next_token_ids, expected)
    mixed = sample(logits, [req(seed=i, temperature=float(i % 2)) for i in range(6)])
    assert torch.equal(mixed.next_token_ids[0::2], expected[0::2])
    ties = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    assert sample(ties, [req(temperature=0.0)] * 2).next_token_ids.tolist() == [1, 0]


@pytest.mark.parametrize("vocab", [2047, 2048, 5000, 49152, 49155])
def test_greedy_argmax_chunked_on_wide_rows(vocab: int):
    """Wide rows take the chunked argmax (chunk maxima first): the first index on ties, also
    across chunks and in a short last chunk; a row with NaN gives its first NaN (as max(dim))."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    logits[1, [3, vocab // 2, vocab - 1]] = 50.0  # ties in the first, a middle and the last chunk
    logits[2, [vocab - 2, vocab - 1]] = 50.0  # ties inside the short last chunk
    logits[3] = 0.0  # the whole row ties
    logits[4, [vocab - 3, 7]] = float("nan")
    expected = logits.max(dim=-1).indices
    assert expected[:4].tolist() == [int(logits[0].argmax()), 3, vocab - 2, 0]
    assert expected[4].item() == 7
    greedy = sample(logits, [req(seed=i, temperature=0.0) for i in range(5)])
    assert torch.equal(greedy.next_token_ids, expected)

@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, {4, 1, 6}),
        # cumulative 0.40, 0.65, 0.80: the token crossing 0.7 (id 6) is kept.
        ({"top_p": 0.7}, {4, 1, 6}),
        ({"top_p": 0.5}, {4, 1}),
        ({"min_p": 0.3}, {4, 1, 6}),  # keeps p >= 0.12
        ({"min_p": 0.2}, {4, 1, 6, 0}),  # keeps p >= 0.08
        ({"top_k": 2, "top_p": 0.9}, {4, 1}),
        ({"top_k": 5, "top_p": 0.7, "min_p": 0.01}, {4, 1, 6}),
        ({}, set(range(8))),
    ],
)
def test_allowed_sets(params: dict, allowed: set[int]):
    assert sampled_set(params) == allowed
    assert sampled_set(params, num_samples=1500, oracle=True) == allowed


@pytest.mark.parametrize("top_k", [-1, 7])
def test_exact_score_ties_pick_smallest_vocab_id(top_k: int):
    # logits = -g makes logits + g exactly 0 for every token: the smallest allowed id wins.
    seeds, positions = torch.tensor([5, 6]), torch.tensor([11, 12])
    logits = -gumbel_noise(seeds, positions, 400)
    reqs = [req(seed=5, position=11, top_k=top_k), req(seed=6, position=12, top_k=top_k)]
    got = sample(logits, reqs).next_token_ids.tolist()
    if top_k == -1:
        assert got == [0, 0]
    else:
        assert got == [int(row.topk(top_k).indices.min()) for row in logits]


def test_top_k_keeps_boundary_ties():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]]).repeat(2000, 1)
    reqs = [req(seed=i, top_k=2) for i in range(2000)]
    assert set(sample(logits, reqs).next_token_ids.tolist()) == {0, 2, 3}


# ---- seeded determinism ---------------------------------------------------------------------


def test_token_independent_of_batch_composition():
    torch.manual_seed(1)
    logits = torch.randn(12, 300) * 2
    params = [
        {"temperature": 0.7},
        {"temperature": 1.0, "top_p": 0.8},
        {"temperature": 1.3, "top_k": 20},
        {"temperature": 0.9, "min_p": 0.05},
        {"temperature": 0.0},
        {"temperature": 1.1, "top_k": 40, "top_p": 0.95},
    ] * 2
    reqs = [req(seed=100 + i, position=10 + 3 * i, **params[i]) for i in range(12)]
    full = sample(logits, reqs).next_token_ids
    for i in range(12):
        assert sample(logits[i : i + 1], [reqs[i]]).next_token_ids.item() == full[i].item()
    order = list(range(12))
    random.Random(3).shuffle(order)
    shuffled = sample(logits[order], [reqs[i] for i in order]).next_token_ids
    assert shuffled.tolist() == full[order].tolist()
    assert sample(logits[:5], reqs[:5]).next_token_ids.tolist() == full[:5].tolist()


@pytest.mark.parametrize("vocab", [37, 3000])
def test_matches_contract(vocab: int):
    # vocab 3000 with flat logits forces nuclei beyond the top-p prefix (full-sort fallback).
    rng = random.Random(vocab)
    torch.manual_seed(vocab)
    logits = torch.randn(40, vocab) * torch.tensor([0.2, 3.0]).repeat(20)[:, None]
    rows = [
        {
            "temperature": rng.choice([0.0, 0.5, 1.0, 1.7]),
            "top_k": rng.choice([-1, 1, 2, 10, 50]),
            "top_p": rng.choice([1.0, 0.3, 0.9, 0.99]),
            "min_p": rng.choice([0.0, 0.0, 0.02, 0.3]),
        }
        for _ in range(40)
    ]
    seeds = [rng.getrandbits(40) for _ in range(40)]
    positions = [rng.randrange(1, 5000) for _ in range(40)]
    reqs = [req(seed=s, position=p, **r) for r, s, p in zip(rows, seeds, positions)]
    info = make_info(reqs, vocab)
    want = sample_contract(logits, info, True, [3] * 40)
    got = Sampler().forward(logits.clone(), info, True, [3] * 40)
    assert got.next_token_ids.tolist() == want.next_token_ids.tolist()
    assert len(set(got.next_token_ids.tolist())) > 10  # not vacuous: the rows do sample
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.top_logprobs_val, want.top_logprobs_val)


def test_resubmission_continues_identically():
    torch.manual_seed(2)
    vocab, prompt = 64, [7, 8, 9, 10]
    table = torch.randn(40, vocab)  # a stand-in model: logits depend on the position only

    def run(reqs: list[FakeReq], steps: int) -> list[int]:
        info = make_info(reqs, vocab)
        out = []
        for _ in range(steps):
            logits = table[info.positions.clone()]
            ids = Sampler().forward(logits, info, False, None).next_token_ids
            info.cumulate_output_tokens(ids)
            out.append(ids[0].item())
        return out

    params = SamplingParams(temperature=0.9, top_p=0.95)
    whole = run([FakeReq(params, 77, list(prompt))], 12)
    # Retract: same request with its outputs so far. Abort + resubmit: prompt grows.
    retracted = run([FakeReq(params, 77, list(prompt), whole[:5])], 7)
    resubmitted = run([FakeReq(params, 77, prompt + whole[:5])], 7)
    assert retracted == whole[5:] and resubmitted == whole[5:]
    assert len(set(whole)) > 3  # the test would be vacuous if sampling were constant


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("two_threads")
def test_logprobs_bitwise_batch_invariant_on_long_rows():
    # Rows longer than ATen's parallel grain (32768) are reduced differently for 1 row than
    # for many by torch.logsumexp; row_logsumexp and therefore logprobs and top-p must not be.
    torch.manual_seed(5)
    vocab = 40000
    logits = torch.randn(6, vocab) * 8  # peaked: small nuclei, no full-sort fallback
    reqs = [req(seed=i, position=9, temperature=0.9, top_p=0.95) for i in range(6)]
    batch = sample(logits, reqs, return_logprob=True, tops=[2] * 6)
    for i in range(6):
        alone = sample(logits[i : i + 1], [reqs[i]], return_logprob=True, tops=[2])
        assert alone.next_token_ids.item() == batch.next_token_ids[i].item()
        assert alone.logprobs.item() == batch.logprobs[i].item()
        assert alone.top_logprobs_val[0].tolist() == batch.top_logprobs_val[i].tolist()
    lse = row_logsumexp(logits)
    assert torch.allclose(lse, torch.logsumexp(logits, dim=-1), rtol=0, atol=1e-5)
    assert all(row_logsumexp(logits[i : i + 1]).item() == lse[i].item() for i in range(6))


def truncated_probs(logits: torch.Tensor, temperature: float, allowed: list[int]) -> torch.Tensor:
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[allowed] = True
    probs = torch.where(mask, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"temperature": 0.7}, list(range(6))),
        ({"temperature": 1.3, "top_k": 4}, [0, 1, 2, 3]),
        ({"temperature": 1.0, "top_p": 0.8}, None),
    ],
)
@pytest.mark.parametrize("one_seed", [False, True])
def test_chi_square_goodness_of_fit(params: dict, allowed: list[int] | None, one_seed: bool):
    # Many seeds at a few positions, or one seed along many positions (one long sequence).
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    temperature = params["temperature"]
    if allowed is None:  # top-p: the smallest prefix reaching 0.8, crossing token included
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        allowed = list(range(int((torch.cumsum(probs, 0) - probs < params["top_p"]).sum())))
    num_samples = 24000
    if one_seed:
        reqs = [req(seed=7, position=i + 1, **params) for i in range(num_samples)]
    else:
        reqs = [req(seed=1000 + i // 3, position=i % 3 + 50, **params) for i in range(num_samples)]
    ids = sample(logits.repeat(num_samples, 1), reqs).next_token_ids
    observed = torch.bincount(ids, minlength=6).double()
    expected = truncated_probs(logits, temperature, allowed) * num_samples
    assert observed[[v for v in range(6) if v not in allowed]].sum() == 0
    chi2 = float(((observed[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum())
    dof = len(allowed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (chi2, p_value)


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_scaled_log_softmax_before_truncation():
    torch.manual_seed(3)
    logits = torch.randn(4, 30) * 2
    temps = [0.0, 0.5, 1.0, 2.0]
    reqs = [req(seed=i, temperature=t, top_k=3, top_p=0.5) for i, t in enumerate(temps)]
    out = sample(logits, reqs, return_logprob=True, tops=[0, 5, 2, 1])
    assert out.top_logprobs_val.shape == (4, 5)
    for i, t in enumerate(temps):
        expected = torch.log_softmax(logits[i] / (t or 1.0), dim=-1)
        chosen = out.next_token_ids[i]
        assert out.logprobs[i].item() == pytest.approx(expected[chosen].item(), abs=1e-5)
        top = torch.sort(expected, descending=True)
        assert torch.allclose(out.top_logprobs_val[i], top.values[:5], atol=1e-5)
        assert out.top_logprobs_idx[i].tolist() == top.indices[:5].tolist()
        assert (out.top_logprobs_val[i].diff() <= 0).all()


def test_no_logprobs_unless_asked():
    logits = torch.randn(2, 10)
    out = sample(logits, [req(), req(seed=1)], return_logprob=False)
    assert out.logprobs is None and out.top_logprobs_val is None
    out = sample(logits, [req(), req(seed=1)], return_logprob=True, tops=[0, 0])
    assert out.logprobs is not None and out.top_logprobs_val is None


def test_bfloat16_origin_logits():
    torch.manual_seed(4)
    logits_bf16 = (torch.randn(8, 500) * 3).to(torch.bfloat16)
    reqs = [req(seed=i, temperature=0.8, top_p=0.9) for i in range(8)]
    from_f32 = sample(logits_bf16.float(), reqs, return_logprob=True, tops=[3] * 8)
    from_bf16 = sample(logits_bf16, reqs, return_logprob=True, tops=[3] * 8)
    assert torch.equal(from_f32.next_token_ids, from_bf16.next_token_ids)
    assert torch.equal(from_f32.logprobs, from_bf16.logprobs)
    assert from_f32.logprobs.dtype == torch.float32


def test_vocab_mismatch_is_an_error():
    info = make_info([req()], 10)
    with pytest.raises(ValueError, match="columns"):
        Sampler().forward(torch.zeros(1, 12), info, False, None)


# ---- penalties and min_new_tokens -----------------------------------------------------------


def processed(logits: torch.Tensor, reqs: list[FakeReq]) -> torch.Tensor:
    out = logits.clone()
    make_info(reqs, logits.shape[1]).apply_logits_processors(out)
    return out


def test_frequency_and_presence_penalties():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    r = req(frequency_penalty=0.5, presence_penalty=0.25)
    r.output_ids = [1, 1, 3, 1]
    got = processed(logits, [r])[0].tolist()
    assert got == pytest.approx([1.0, 2.0 - 1.5 - 0.25, -1.0, 0.5 - 0.5 - 0.25, 3.0])


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0]])
    r = req(repetition_penalty=2.0)
    r.output_ids = [0, 1, 1]
    assert processed(logits, [r])[0].tolist() == [1.0, -4.0, 4.0, -1.0]


def test_repetition_penalty_below_one_in_a_mixed_batch():
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0], [2.0, -2.0, 4.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
    favour, punish, plain = req(repetition_penalty=0.5), req(repetition_penalty=2.0), req()
    for r in (favour, punish, plain):
        r.output_ids = [0, 1]
    assert processed(logits, [favour, punish, plain]).tolist() == [
        [4.0, -1.0, 4.0, -1.0],
        [1.0, -4.0, 4.0, -1.0],
        [1.0, 1.0, 1.0, 1.0],
    ]


def test_masked_tokens_never_sampled_with_truncation():
    # -inf logits (EOS under min_new_tokens) next to rows with and without truncation.
    logits = torch.zeros(300, 6)
    logits[:, 2] = float("-inf")
    params = [{"top_p": 0.9}, {"min_p": 0.5}, {}]
    reqs = [req(seed=i, **params[i % 3]) for i in range(300)]
    ids = sample(logits, reqs).next_token_ids
    assert set(ids.tolist()) == {0, 1, 3, 4, 5}


def test_penalties_only_touch_their_rows_and_cumulate():
    plain, penalized = req(), req(frequency_penalty=1.0)
    info = make_info([plain, penalized], 4)
    info.cumulate_output_tokens(torch.tensor([2, 2]))
    info.cumulate_output_tokens(torch.tensor([2, 3]))
    out = torch.zeros(2, 4)
    info.apply_logits_processors(out)
    assert out.tolist() == [[0, 0, 0, 0], [0, 0, -1, -1]]
    assert info.positions.tolist() == [5, 5]


def test_rebuilt_penalty_state_is_bit_identical_to_cumulated():
    # A retracted request is rebuilt from its output_ids: penalised logits must not change.
    params = {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": 0.3}
    steps = [[3, 1], [3, 4], [5, 1], [3, 1]]
    live = make_info([req(**params), req(temperature=0.5, **params)], 8)
    for ids in steps:
        live.cumulate_output_tokens(torch.tensor(ids))
    rebuilt_reqs = [req(**params), req(temperature=0.5, **params)]
    for row, r in enumerate(rebuilt_reqs):
        r.output_ids = [ids[row] for ids in steps]
    rebuilt = make_info(rebuilt_reqs, 8)
    logits = torch.randn(2, 8) * 3
    a, b = logits.clone(), logits.clone()
    live.apply_logits_processors(a)
    rebuilt.apply_logits_processors(b)
    assert torch.equal(a, b) and not torch.equal(a, logits)
    assert torch.equal(live.positions, rebuilt.positions)


def test_penalties_on_bfloat16_logits():
    r = req(repetition_penalty=2.0, frequency_penalty=0.5)
    r.output_ids = [0, 1]
    logits = torch.tensor([[2.0, -2.0, 4.0]])
    out = logits.to(torch.bfloat16)
    make_info([r], 3).apply_logits_processors(out)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[0.5, -4.5, 4.0]]


def test_no_processors_is_a_no_op():
    info = make_info([req(), req(temperature=0.0)], 6)
    assert info.penalties is None and info.min_new_tokens is None
    logits = torch.randn(2, 6)
    out = logits.clone()
    info.apply_logits_processors(out)
    assert torch.equal(out, logits)


def test_min_new_tokens_masks_eos_until_reached():
    r = req(temperature=0.0, min_new_tokens=3, stop_token_ids=[4])
    r.eos_token_ids = {0, 4}
    r.output_ids = [5]
    other = req(temperature=0.0)  # same EOS, no minimum: never masked
    info = make_info([r, other], 6)
    logits = torch.tensor([[9.0, 0, 0, 0, 8.0, 1.0]] * 2)
    tokens = []
    for _ in range(3):
        step = logits.clone()
        info.apply_logits_processors(step)
        ids = Sampler().forward(step, info, False, None).next_token_ids
        info.cumulate_output_tokens(ids)
        tokens.append(ids.tolist())
    # Row 0 has 1 output token: two more steps with EOS (ids 0 and 4) masked, then free.
    assert [t[0] for t in tokens] == [5, 5, 0]
    assert [t[1] for t in tokens] == [0, 0, 0]


def test_positions_and_seeds_from_requests():
    r = FakeReq(SamplingParams(), -1, origin_input_ids=[1] * 10, output_ids=[2] * 4)
    info = make_info([r, req(seed=2**40 + 3, position=3)], 8)
    assert info.positions.tolist() == [14, 3]
    assert info.seeds.tolist() == [2**32 - 1, 3]
