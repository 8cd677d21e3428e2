"""The sampling contract, written plainly: the oracle every sampling backend is tested against.

One row at a time, full sorts, no tuning. It defines what a backend must return for a batch of
logits: the token (greedy argmax, or Gumbel-max over the truncated set with counter-based
seeded noise), the chosen token's logprob, the top logprobs and the per-token entropy. The
backends are :mod:`sgl_kernel.sampling_torch` (``pytorch``, the CPU default) and
:mod:`sgl_kernel.sampling` (``triton``); both must pick the same tokens as
:func:`sample_contract` and agree with its logprobs and entropies within float32 rounding.
The recipe (constants, bit layout, float steps) is specified in docs/sampling.md, the entropy
definitions in docs/entropy.md. Changing anything here changes every seeded output: the
known-answer tests in test/srt/test_sampler.py exist to catch that.

This module also holds what the backends share: the noise constants, the result and plan
types, and the :class:`SamplingRows` protocol they read a batch through.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, TypeVar

import torch

MASK32 = 0xFFFFFFFF
# Multipliers of the two-round xorshift-multiply hash (odd, < 2**31: x * M < 2**63 for any
# 32-bit x, so int64 torch arithmetic never overflows). Shift amounts are 16, 15, 15.
HASH_MUL1 = 0x21F0AAAD
HASH_MUL2 = 0x735A2D97
# XORed into the position before hashing so that position p and seed p do not collide.
POSITION_SALT = 0x9E3779B9
# u = ((bits >> 9) + 0.5) * 2**-23: 23 bits keep every step exact in float32 (u in (0, 1)).
UNIFORM_SHIFT = 9
UNIFORM_SCALE = 2.0**-23
# Entropy modes (docs/entropy.md) and their codes in the per-row tensor the kernel reads.
ENTROPY_MODES = ("raw", "scaled", "sampled")
ENTROPY_MODE_CODES = {"raw": 1, "scaled": 2, "sampled": 3}  # 0: the row wants no entropy
_MODE_OF_CODE = {code: mode for mode, code in ENTROPY_MODE_CODES.items()}

_IntLike = TypeVar("_IntLike", int, torch.Tensor)


class SampleOutput(NamedTuple):
    """What every sampling backend returns for a batch of B rows."""

    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log_softmax(logits / T)[chosen]
    top_logprobs_val: torch.Tensor | None  # [B, K] float32, descending
    top_logprobs_idx: torch.Tensor | None  # [B, K] int64
    entropies: torch.Tensor | None = None  # [B] float32; 0 in rows that asked for none


class EntropyGroup(NamedTuple):
    """Rows sharing one entropy definition: ``mode`` in ENTROPY_MODES, ``top_k`` 0 for the
    full vocabulary (else < V), ``rows`` [E] int64 batch rows, None for the whole batch."""

    mode: str
    top_k: int
    rows: torch.Tensor | None


class EntropyPlan(NamedTuple):
    """Which rows of a batch want entropy, and under which definition (docs/entropy.md)."""

    modes: torch.Tensor  # [B] int32 ENTROPY_MODE_CODES; 0: the row wants no entropy
    top_ks: torch.Tensor  # [B] int64: 0 = full vocabulary, else the K of the top-k variant
    groups: tuple[EntropyGroup, ...]  # the same, grouped on the host (no device sync)


class SamplingRows(Protocol):
    """What the samplers read per batch (``SamplingBatchInfo`` provides it); [B] tensors."""

    vocab_size: int
    temperatures: torch.Tensor  # float32; temperature-0 rows hold 1.0
    top_ks: torch.Tensor  # int64; disabled stored as vocab_size
    top_ps: torch.Tensor  # float32
    min_ps: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    positions: torch.Tensor  # int64: absolute position of the token sampled next
    is_greedy: torch.Tensor  # bool
    sampled_rows: torch.Tensor | None  # non-greedy rows; None when all rows sample
    is_all_greedy: bool
    unit_temperature: bool  # every row's (stored) temperature is 1.0
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    top_p_without_top_k: bool
    max_top_k: int


# ---- the noise --------------------------------------------------------------------------------


def hash32(x: _IntLike) -> _IntLike:
    """The contract hash: a 32-bit mixer, ``x`` in [0, 2**32) -> [0, 2**32).

    Works on Python ints and on int64 tensors (elementwise, returns a new tensor).
    """
    x = x ^ (x >> 16)
    x = (x * HASH_MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL2) & MASK32
    return x ^ (x >> 15)


def noise_row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``hash32((seed mod 2**32) ^ hash32((position mod 2**32) ^ POSITION_SALT))``.

    ``seeds``, ``positions``: [B] int64 (any value; reduced mod 2**32, two's complement).
    Returns [B] int64 in [0, 2**32).
    """
    pos_hash = hash32((positions & MASK32) ^ POSITION_SALT)
    return hash32((seeds & MASK32) ^ pos_hash)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The seeded noise g: [B, vocab_size] float32, row i from (seeds[i], positions[i]) only.

    ``bits = hash32(row_key ^ v)``, ``u = ((bits >> 9) + 0.5) * 2**-23`` (exact in float32,
    never 0 or 1), ``g = -log(-log(u))``. ``seeds``/``positions``: [B] int64.
    """
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = hash32(noise_row_keys(seeds, positions)[:, None] ^ vocab_ids[None, :])
    u = ((bits >> UNIFORM_SHIFT).to(torch.float32) + 0.5) * UNIFORM_SCALE
    return -torch.log(-torch.log(u))


# ---- truncation and entropy of one row ----------------------------------------------------------


def truncation_threshold(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The threshold t of one row: its allowed set is ``{v : x[v] >= t}`` (x = logits / T).

    ``x``: [V] float32; ``top_k`` (int64, disabled as >= V), ``top_p``, ``min_p`` (float32):
    0-dim tensors. ``t = max(t_k, t_p, t_min)``, a disabled criterion giving -inf:
    t_k the k-th largest x; t_p the x of the top-p crossing token (the first whose inclusive
    cumulative probability, float32 ``exp(x - logsumexp(x))`` in descending order, reaches
    top_p); t_min = max x + log(min_p). Returns a 0-dim float32 tensor.
    """
    vocab_size = x.shape[0]
    sorted_x = x.sort(descending=True).values
    t = torch.tensor(float("-inf"))
    if top_k < vocab_size:
        t = torch.maximum(t, sorted_x[int(top_k) - 1])
    if top_p < 1.0:
        cum_probs = torch.exp(sorted_x - torch.logsumexp(x, dim=0)).cumsum(dim=0)
        num_kept = min(int((cum_probs < top_p).sum()) + 1, vocab_size)
        t = torch.maximum(t, sorted_x[num_kept - 1])
    if min_p > 0.0:
        t = torch.maximum(t, sorted_x[0] + torch.log(min_p))
    return t


def entropy(values: torch.Tensor) -> float:
    """H(softmax(values)) in nats, in float64; ``values`` [n], -inf entries have probability 0."""
    log_p = torch.log_softmax(values.double(), dim=0)
    p = log_p.exp()
    return float(-torch.where(p > 0, p * log_p, 0.0).sum())


def row_entropy(
    logits: torch.Tensor, x: torch.Tensor, t: torch.Tensor, is_greedy: bool, mode: str, top_k: int
) -> float:
    """Entropy of one row under ``mode`` (docs/entropy.md), ``top_k`` > 0 for the top-k variant.

    ``logits`` [V] (after the logits processors), ``x`` = logits / T, ``t`` the row's
    :func:`truncation_threshold`. raw: softmax(logits); scaled: softmax(x); sampled: softmax of
    the allowed x, 0 for a greedy row (a point mass). The top-k variant keeps the K largest
    values as ``torch.topk`` returns them (all of them when there are fewer).
    """
    if mode == "raw":
        values = logits
    elif mode == "scaled":
        values = x
    elif is_greedy:
        return 0.0
    else:
        values = x[x >= t]
    if top_k > 0:
        values = values.topk(min(top_k, values.shape[0])).values
    return entropy(values)


# ---- the sampler ------------------------------------------------------------------------------


def sample_contract(
    logits: torch.Tensor,
    info: SamplingRows,
    return_logprob: bool,
    top_logprobs_nums: list[int] | None,
    entropy_plan: EntropyPlan | None = None,
) -> SampleOutput:
    """What a sampling backend must return for ``logits`` [B, V] (upcast to float32 on CPU).

    Per row, with x = logits / T: greedy rows take the first argmax of the logits, the others
    the first argmax of ``x + gumbel_noise`` over ``{x >= t}``. Logprobs are
    ``log_softmax(x)`` before truncation; top logprobs the K = max(top_logprobs_nums) largest
    of it. Entropy for the rows ``entropy_plan`` names (others hold 0). Mutates nothing.
    """
    logits = logits.detach().float().cpu()
    num_rows, vocab_size = logits.shape
    if vocab_size != info.vocab_size:
        raise ValueError(f"logits have {vocab_size} columns, expected {info.vocab_size}")
    temperatures, top_ks, top_ps, min_ps, greedy_rows = (
        p.detach().cpu()
        for p in (info.temperatures, info.top_ks, info.top_ps, info.min_ps, info.is_greedy)
    )
    noise = gumbel_noise(info.seeds.cpu(), info.positions.cpu(), vocab_size)
    x = logits / temperatures[:, None]
    next_ids = torch.empty(num_rows, dtype=torch.int64)
    entropies = torch.zeros(num_rows, dtype=torch.float32)
    for row in range(num_rows):
        t = truncation_threshold(x[row], top_ks[row], top_ps[row], min_ps[row])
        is_greedy = bool(greedy_rows[row])
        if is_greedy:
            next_ids[row] = logits[row].argmax()
        else:
            scores = x[row] + noise[row]
            next_ids[row] = torch.where(x[row] >= t, scores, float("-inf")).argmax()
        if entropy_plan is not None and int(entropy_plan.modes[row]) != 0:
            mode = _MODE_OF_CODE[int(entropy_plan.modes[row])]
            top_k = int(entropy_plan.top_ks[row])
            entropies[row] = row_entropy(logits[row], x[row], t, is_greedy, mode, top_k)
    device = info.temperatures.device
    out_entropies = None if entropy_plan is None else entropies.to(device)
    if not return_logprob:
        return SampleOutput(next_ids.to(device), None, None, None, out_entropies)
    log_probs = torch.log_softmax(x, dim=-1)
    chosen = log_probs.gather(1, next_ids[:, None]).squeeze(1)
    num_top = min(max(top_logprobs_nums or [0]), vocab_size)
    top_val, top_idx = None, None
    if num_top > 0:
        top = log_probs.topk(num_top, dim=-1)
        top_val, top_idx = top.values.to(device), top.indices.to(device)
    return SampleOutput(next_ids.to(device), chosen.to(device), top_val, top_idx, out_entropies)
