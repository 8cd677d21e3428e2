"""Torch sampler ("pytorch" backend) and the counter-based seeded-noise contract.

Seeded sampling is Gumbel-max with noise that is a pure function of (seed, absolute position,
vocab index), so a request's token never depends on its batch. The exact recipe (constants,
bit layout, float steps) is specified in docs/sampling.md; the future Triton kernel must
reproduce :func:`hash32` and :func:`gumbel_noise` exactly. Changing anything below changes
every seeded output: the known-answer tests in test/srt/test_sampler.py exist to catch that.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

MASK32 = 0xFFFFFFFF
# Multipliers of the two-round xorshift-multiply hash (odd, < 2**31: x * M < 2**63 for any
# 32-bit x, so int64 torch arithmetic never overflows). Shift amounts are 16, 15, 15.
HASH_MUL1 = 0x21F0AAAD
HASH_MUL2 = 0x735A2D97
# XORed into the position before hashing so that position p and seed p do not collide.
POSITION_SALT = 0x9E3779B9
# u = ((bits >> 9) + 0.5) * 2**-23: 23 bits keep every step exact in float32 (u in (0, 1)).
_UNIFORM_SHIFT = 9
_UNIFORM_BITS_MASK = 0x7FFFFF
_UNIFORM_SCALE = 2.0**-23
# CPU: the noise is generated in row chunks of about this many elements to stay in L2 cache.
_CPU_CHUNK_ELEMS = 1 << 19
# Top-p rows without top-k first look for their nucleus among this many largest logits and
# fall back to a full sort only when the nucleus is larger (same result, much cheaper).
_TOP_P_PREFIX_LEN = 256
# row_logsumexp sums chunks of this many columns: below ATen's parallel grain (32768), so
# each chunk is always reduced by a single thread in a fixed order.
_LSE_CHUNK = 4096

_IntLike = TypeVar("_IntLike", int, torch.Tensor)


def hash32(x: _IntLike) -> _IntLike:
    """The contract hash: a 32-bit mixer, ``x`` in [0, 2**32) -> [0, 2**32).

    Works on Python ints and on int64 tensors (elementwise, returns a new tensor). This is the
    reference definition; :func:`gumbel_noise` uses a faster int32 form with identical bits.
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


def _to_int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same 32-bit pattern."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _neg_gumbel_from_keys(row_keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """-g = log(-log(u)) for ``bits = hash32(row_key ^ v)``, float32 (callers subtract it:
    ``x - (-g)`` is bitwise ``x + g`` and saves a pass).

    ``row_keys``: [b] int64 from :func:`noise_row_keys`; ``vocab_ids``: [V] or [b, K] int64.
    Returns [b, V] or [b, K]. Computes :func:`hash32` on int32 bit patterns, whose
    multiplication wraps mod 2**32 (half the memory traffic of int64, about 1.3x faster on
    CPU); ``>>`` on int32 is arithmetic, so shifted values are masked into logical shifts.
    """
    # The first xorshift is linear over xor: (k ^ v) ^ ((k ^ v) >> 16) equals
    # (k ^ (k >> 16)) ^ (v ^ (v >> 16)), so it is applied to the [b] keys and the ids.
    keys = _to_int32_bits(row_keys ^ (row_keys >> 16))[:, None]
    ids = _to_int32_bits(vocab_ids ^ (vocab_ids >> 16))
    bits = keys ^ (ids[None, :] if ids.dim() == 1 else ids)
    shifted = torch.empty_like(bits)
    bits.mul_(HASH_MUL1)
    bits.bitwise_xor_(torch.bitwise_right_shift(bits, 15, out=shifted).bitwise_and_(0x1FFFF))
    bits.mul_(HASH_MUL2)
    bits.bitwise_xor_(torch.bitwise_right_shift(bits, 15, out=shifted).bitwise_and_(0x1FFFF))
    bits.bitwise_right_shift_(_UNIFORM_SHIFT).bitwise_and_(_UNIFORM_BITS_MASK)
    u = bits.to(torch.float32)
    u.add_(0.5).mul_(_UNIFORM_SCALE)
    return u.log_().neg_().log_()


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The seeded noise of the contract: [B, vocab_size] float32, row i from (seeds[i],
    positions[i]) only. ``seeds``/``positions``: [B] int64 on the target device."""
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    return _neg_gumbel_from_keys(noise_row_keys(seeds, positions), vocab_ids).neg_()


def derive_seed(random_seed: int, rid: str) -> int:
    """Seed of a request that gave no ``sampling_seed``: stable across processes and runs
    (blake2b of the engine seed and the rid), in [0, 2**63)."""
    digest = hashlib.blake2b(f"{random_seed}\x00{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log_softmax(logits / T)[chosen]
    top_logprobs_val: torch.Tensor | None  # [B, K] float32, descending
    top_logprobs_idx: torch.Tensor | None  # [B, K] int64


class Sampler:
    """Torch sampler: greedy argmax, or truncated Gumbel-max with counter-based noise."""

    name = "pytorch"

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> SampleOutput:
        """Pick one token per row of ``logits`` [B, V] (float32; bfloat16 is upcast).

        Precondition: ``info.apply_logits_processors(logits)`` has already run (penalties are
        part of the logits). Does not mutate ``logits`` or ``info``; the caller advances
        positions with ``info.cumulate_output_tokens`` afterwards.
        """
        if logits.shape[-1] != info.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns, expected {info.vocab_size}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        log_z = None
        if info.is_all_greedy:
            next_ids = _argmax(logits)
            scaled = logits  # temperature-0 rows: logprobs are log_softmax(logits)
        else:
            scaled = logits / info.temperatures[:, None]
            if return_logprob or info.need_top_p:
                log_z = row_logsumexp(scaled)
            next_ids = _sample(logits, scaled, log_z, info)
        if not return_logprob:
            return SampleOutput(next_ids, None, None, None)
        if log_z is None:
            log_z = row_logsumexp(scaled)
        # log_softmax(scaled) = scaled - logsumexp(scaled), evaluated only where it is read.
        chosen = scaled.gather(1, next_ids[:, None]).squeeze(1) - log_z
        num_top = max(top_logprobs_nums) if top_logprobs_nums else 0
        if num_top <= 0:
            return SampleOutput(next_ids, chosen, None, None)
        top = scaled.topk(min(num_top, logits.shape[1]), dim=-1)
        return SampleOutput(next_ids, chosen, top.values - log_z[:, None], top.indices)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of ``x`` [b, V], bitwise independent of b.

    ``torch.logsumexp`` splits a row longer than ATen's parallel grain (32768) across threads
    only when there are few rows, so a row's result changed with the batch size. Summing
    fixed chunks of 4096 (each always reduced by one thread) and then the chunk sums keeps
    the order of additions a function of V alone. Returns [b] float32.
    """
    num_rows, vocab_size = x.shape
    row_max = x.amax(dim=-1, keepdim=True)
    exps = torch.exp(x - row_max)
    main_len = vocab_size - vocab_size % _LSE_CHUNK
    chunk_sums = exps[:, :main_len].reshape(num_rows, -1, _LSE_CHUNK).sum(dim=-1)
    if main_len < vocab_size:
        chunk_sums = torch.cat([chunk_sums, exps[:, main_len:].sum(dim=-1, keepdim=True)], 1)
    return (row_max + torch.log(chunk_sums.sum(dim=-1, keepdim=True))).squeeze(1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise index of the maximum, the first one on ties (as argmax). ``max(dim)`` is about
    3x faster than ``argmax`` on CPU (torch 2.x); the tie rule is pinned by the tests."""
    return x.max(dim=-1).indices


def _sample(
    logits: torch.Tensor,
    scaled: torch.Tensor,
    log_z: torch.Tensor | None,
    info: SamplingBatchInfo,
) -> torch.Tensor:
    """Greedy rows: argmax of the raw logits; the others: :func:`_sample_rows` on ``scaled``.

    ``log_z`` [B]: :func:`row_logsumexp` of ``scaled``, required when ``info.need_top_p``.
    """
    rows = info.sampled_rows
    if rows is None:
        return _sample_rows(scaled, log_z, info, slice(None))
    next_ids = _argmax(logits)
    rows_log_z = None if log_z is None else log_z[rows]
    next_ids[rows] = _sample_rows(scaled[rows], rows_log_z, info, rows)
    return next_ids


def _sample_rows(
    x: torch.Tensor,
    log_z: torch.Tensor | None,
    info: SamplingBatchInfo,
    rows: torch.Tensor | slice,
) -> torch.Tensor:
    """Seeded truncated Gumbel-max for the non-greedy rows ``rows`` of the batch.

    ``x``: [b, V] float32 logits / temperature, already restricted to ``rows``; ``log_z``: [b]
    its row_logsumexp (None unless top-p is used). Returns [b] int64 token ids.
    """
    row_keys = noise_row_keys(info.seeds[rows], info.positions[rows])
    if not (info.need_top_k or info.need_top_p or info.need_min_p):
        return _gumbel_argmax_full(x, None, row_keys)
    params = (info.top_ks[rows], info.top_ps[rows], info.min_ps[rows])
    thr, prefix = _truncation_thresholds(x, log_z, params, info)
    if prefix is not None:
        vals, idx = prefix
        # The allowed set {x >= thr} lies inside the prefix when thr beats its last value.
        if idx.shape[1] == x.shape[1] or bool((thr > vals[:, -1]).all()):
            return _gumbel_argmax_prefix(vals, idx, thr, row_keys, x.shape[1])
    return _gumbel_argmax_full(x, thr, row_keys)


def _gumbel_argmax_full(
    x: torch.Tensor, thr: torch.Tensor | None, row_keys: torch.Tensor
) -> torch.Tensor:
    """argmax over v with x[v] >= thr of x[v] + g[v] (first index on ties), whole vocab."""
    num_rows, vocab_size = x.shape
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=x.device)
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    step = _CPU_CHUNK_ELEMS // vocab_size if x.device.type == "cpu" else num_rows
    step = max(step, 1)
    for start in range(0, num_rows, step):
        end = start + step
        scores = _neg_gumbel_from_keys(row_keys[start:end], vocab_ids)
        torch.sub(x[start:end], scores, out=scores)
        if thr is not None:
            _mask_below_(scores, x[start:end], thr[start:end, None])
        out[start:end] = _argmax(scores)
    return out


def _mask_below_(scores: torch.Tensor, x: torch.Tensor, thr: torch.Tensor) -> None:
    """scores[x < thr] = -inf in place, without a bool mask (``masked_fill_`` and
    ``torch.where`` are ~8x slower on CPU): 1/[x >= thr] - 1 is 0 (kept) or +inf."""
    blocked = torch.ge(x, thr, out=torch.empty_like(scores))
    scores.sub_(blocked.reciprocal_().sub_(1.0))


def _gumbel_argmax_prefix(
    vals: torch.Tensor,
    idx: torch.Tensor,
    thr: torch.Tensor,
    row_keys: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """Same choice as :func:`_gumbel_argmax_full` when every allowed token is in the
    descending prefix (``vals``, ``idx``) [b, K]: noise only for those K tokens."""
    scores = _neg_gumbel_from_keys(row_keys, idx)
    torch.sub(vals, scores, out=scores)
    _mask_below_(scores, vals, thr[:, None])
    best = scores.max(dim=-1, keepdim=True).values
    # Tie-break on the smallest vocab id, as argmax over the whole vocab does.
    return torch.where(scores == best, idx, vocab_size).min(dim=-1).values


def _truncation_thresholds(
    x: torch.Tensor,
    log_z: torch.Tensor | None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    info: SamplingBatchInfo,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Per-row threshold t: the allowed set is {v : x[v] >= t} (x = logits / T).

    t = max(k-th largest x, x of the token whose cumulative prob first reaches top_p,
    max x + log(min_p)); a disabled criterion contributes -inf. ``params``: the rows'
    (top_ks, top_ps, min_ps). Returns (t [b], the descending prefix (values, indices) it was
    read from, or None when no sort was needed).
    """
    if not (info.need_top_k or info.need_top_p):
        row_max = x.max(dim=-1, keepdim=True).values
        return _thresholds_from_sorted(row_max, None, params, info)[0], None
    prefix_len = min(x.shape[1], info.max_top_k + 1)
    if info.top_p_without_top_k:
        prefix_len = min(x.shape[1], max(prefix_len, _TOP_P_PREFIX_LEN))
    vals, idx = x.topk(prefix_len, dim=-1)
    thr, unresolved = _thresholds_from_sorted(vals, log_z, params, info)
    if unresolved is not None and bool(unresolved.any()):
        # Some nucleus is larger than the prefix: redo those rows on a full sort. The prefix
        # of the sort has the same values, so cumulative sums and thresholds agree.
        rows = unresolved.nonzero().squeeze(1)
        assert log_z is not None
        full = _sorted_descending(x[rows])
        row_params = (params[0][rows], params[1][rows], params[2][rows])
        thr[rows] = _thresholds_from_sorted(full, log_z[rows], row_params, info)[0]
    return thr, (vals, idx)


def _sorted_descending(x: torch.Tensor) -> torch.Tensor:
    """Values of each row of ``x`` [b, V] in descending order. On CPU numpy's value-only sort
    is about 20x faster than ``torch.sort`` (which also builds indices); same values."""
    if x.device.type != "cpu":
        return x.sort(dim=-1, descending=True).values
    return torch.from_numpy(-np.sort(-x.detach().numpy(), axis=-1))


def _thresholds_from_sorted(
    vals: torch.Tensor,
    log_z: torch.Tensor | None,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    info: SamplingBatchInfo,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Thresholds from the K largest values ``vals`` [b, K] (descending; K = V is a full sort).

    ``log_z`` [b]: row_logsumexp of the whole row (needed for top-p). Returns (thr [b],
    rows whose top-p crossing lies beyond the prefix and is not dominated, or None).
    """
    top_ks, top_ps, min_ps = params
    num_rows, prefix_len = vals.shape
    neg_inf = torch.full((num_rows,), float("-inf"), device=vals.device)
    thr = neg_inf
    if info.need_min_p:
        thr = torch.where(min_ps > 0, vals[:, 0] + torch.log(min_ps), neg_inf)
    if info.need_top_k:
        kth = vals.gather(1, (top_ks.clamp(max=prefix_len) - 1)[:, None]).squeeze(1)
        thr = torch.maximum(thr, torch.where(top_ks < info.vocab_size, kth, neg_inf))
    if not info.need_top_p:
        return thr, None
    assert log_z is not None, "top-p needs the row log-normaliser"
    cum_probs = torch.exp(vals - log_z[:, None]).cumsum(dim=-1)
    # Tokens before the crossing one have cumulative prob < top_p; the crossing one is kept.
    num_before = (cum_probs < top_ps[:, None]).sum(dim=-1)
    crossing = vals.gather(1, num_before.clamp(max=prefix_len - 1)[:, None]).squeeze(1)
    uses_top_p = top_ps < 1.0
    unresolved = uses_top_p & (num_before >= prefix_len) & (thr < vals[:, -1])
    if prefix_len == info.vocab_size:
        unresolved = None
    thr = torch.maximum(thr, torch.where(uses_top_p, crossing, neg_inf))
    return thr, unresolved
