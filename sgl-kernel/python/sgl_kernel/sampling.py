"""Fused sampling kernel (Triton): next token, chosen logprob and entropy of each row.

One program per row of the logits [B, V] (float32, bfloat16 or float16, any row stride;
columns contiguous). It reproduces :func:`sgl_kernel.sampling_contract.sample_contract`:
the same noise bits (docs/sampling.md), the same allowed set {x >= t} per row, the same token,
and the entropy definitions of docs/entropy.md. Nothing of size [B, V] is written: each pass
below streams the row in tiles and keeps a few scalars per row.

    pass         runs for                          computes (x = logits / T)
    1 stats      every row                         online max, sum exp(x - m) (-> log Z and the
                                                   chosen logprob) and sum exp * (x - m)
                                                   (-> scaled entropy); the same of the raw
                                                   logits for raw-entropy rows with T != 1;
                                                   argmax (greedy rows); Gumbel-max of sampled
                                                   rows that do not truncate
    2 search     rows with top-k / top-p or the    thresholds by a 16-pivot search on the
                 top-k entropy variant             order-preserving int32 key of the values:
                                                   each pass narrows the key interval 17-fold
                                                   (<= 8 passes): k-th largest by counts,
                                                   top-p crossing by probability mass
    3 final      truncating rows, and rows whose   Gumbel-max over {x >= t}; softmax
                 entropy is over a subset          statistics of the subset

Entropy is ``H = log S - A / S`` with ``S = sum exp(v - m)`` and ``A = sum exp(v - m)(v - m)``
(one online pass; no cancellation between large logZ and E[v]). The top-k entropy variant is
over the multiset of the K largest logits: values above the K-th largest t, plus
``K - count(> t)`` copies of t, exactly what ``torch.topk`` returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel.sampling_contract import (
    HASH_MUL1,
    HASH_MUL2,
    POSITION_SALT,
    UNIFORM_SCALE,
    UNIFORM_SHIFT,
    EntropyPlan,
    SampleOutput,
    SamplingRows,
)

_MUL1 = tl.constexpr(HASH_MUL1)
_MUL2 = tl.constexpr(HASH_MUL2)
_SALT = tl.constexpr(POSITION_SALT)
_U_SHIFT = tl.constexpr(UNIFORM_SHIFT)
_U_SCALE = tl.constexpr(UNIFORM_SCALE)
_RAW = tl.constexpr(1)
_SAMPLED = tl.constexpr(3)
_NUM_PIVOTS = 16  # pivots per search pass (a power of two: tl.arange)
# Warps per row program. Fixed: the shape of tl.sum's reduction tree, and so the bits of log Z,
# depend on it, and row_logsumexp_triton must reproduce the sampler's log Z exactly.
_NUM_WARPS = 8


@triton.jit
def _hash32(x):
    """The contract hash on uint32 (multiplication wraps mod 2**32; shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * _MUL1
    x = x ^ (x >> 15)
    x = x * _MUL2
    return x ^ (x >> 15)


@triton.jit
def _neg_log_gumbel(row_key, cols):
    """log(-log(u)) = -g of the contract noise at columns ``cols`` (int32) of a row."""
    bits = _hash32(row_key ^ cols.to(tl.uint32))
    u = ((bits >> _U_SHIFT).to(tl.float32) + 0.5) * _U_SCALE
    return tl.log(-tl.log(u))


@triton.jit
def _merge_stats(m, s, a, v, WITH_DEV: tl.constexpr):
    """Fold the tile ``v`` into the online (max m, sum exp(v - m) s, sum exp(v - m)(v - m) a);
    -inf entries have probability 0 and add nothing (no NaN from 0 * -inf)."""
    new_m = tl.maximum(m, tl.max(v, axis=0))
    base = tl.where(new_m == float("-inf"), 0.0, new_m)
    shift = tl.where(m == float("-inf"), 0.0, m - base)  # <= 0; rescales the old sums
    alpha = tl.exp(shift)
    # -inf -> -FLT_MAX: exp is still 0, and 0 * -FLT_MAX is 0 where 0 * -inf would be NaN.
    dev = tl.maximum(v - base, -3.4028234663852886e38)
    e = tl.exp(dev)
    if WITH_DEV:
        a = alpha * (a + s * shift) + tl.sum(e * dev, axis=0)
    s = alpha * s + tl.sum(e, axis=0)
    return new_m, s, a


@triton.jit
def _entropy(s, a):
    """log S - A / S; 0 for the empty sums of statistics a row did not collect."""
    s = tl.where(s > 0.0, s, 1.0)
    return tl.log(s) - a / s


@triton.jit
def _argmax_update(best, best_idx, v, cols):
    """Running (max, first index of the max) over tiles visited in column order."""
    tile_max = tl.max(v, axis=0)
    tile_idx = tl.min(tl.where(v == tile_max, cols, 2147483647), axis=0)
    better = tile_max > best
    return tl.where(better, tile_max, best), tl.where(better, tile_idx, best_idx)


@triton.jit
def _sort_key(v):
    """float32 -> int32 with the same order (-0.0 folded into +0.0: they compare equal)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(key):
    """Inverse of :func:`_sort_key` (``key`` int64 holding an int32 key)."""
    k = key.to(tl.int32)
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _narrow(lo, hi, pivots, holds):
    """New [lo, hi] of a search for the largest key with a property that holds up to the
    answer and not above it: the largest pivot where it holds, below the smallest where not."""
    new_lo = tl.max(tl.where(holds, pivots, lo), axis=0)
    new_hi = tl.min(tl.where(holds, hi, pivots - 1), axis=0)
    return new_lo, new_hi


@triton.jit
def _pivots(lo, hi, NUM: tl.constexpr):
    """NUM int64 pivots in (lo, hi], evenly spread (ceil), for a non-empty interval."""
    j = tl.arange(0, NUM).to(tl.int64) + 1
    return lo + ((hi - lo) * j + NUM) // (NUM + 1)


@triton.jit
def _search_pass(
    row_ptr, vocab_size, temp, log_z, top_k, top_p, ent_k,
    k_lo, k_hi, p_lo, p_hi, e_lo, e_hi,
    BLOCK: tl.constexpr, NUM: tl.constexpr,
    SEARCH_K: tl.constexpr, SEARCH_P: tl.constexpr, SEARCH_E: tl.constexpr,
):  # fmt: skip
    """One read of the row narrowing the three key intervals: k-th largest logit (top-k),
    top-p crossing value of x, K-th largest logit (entropy top-k). Finished searches
    (lo == hi) skip their work."""
    k_piv = _pivots(k_lo, k_hi, NUM)
    p_piv = _pivots(p_lo, p_hi, NUM)
    e_piv = _pivots(e_lo, e_hi, NUM)
    k_piv32, p_piv32, e_piv32 = k_piv.to(tl.int32), p_piv.to(tl.int32), e_piv.to(tl.int32)
    k_count = tl.zeros([NUM], dtype=tl.int32)
    e_count = tl.zeros([NUM], dtype=tl.int32)
    p_mass = tl.zeros([NUM], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logit = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        l_key = _sort_key(logit)[:, None]
        if SEARCH_K:  # noqa: SIM102 (constexpr guard: compiled out)
            if k_lo < k_hi:
                k_count += tl.sum((l_key >= k_piv32[None, :]).to(tl.int32), axis=0)
        if SEARCH_E:  # noqa: SIM102 (constexpr guard: compiled out)
            if e_lo < e_hi:
                e_count += tl.sum((l_key >= e_piv32[None, :]).to(tl.int32), axis=0)
        if SEARCH_P:  # noqa: SIM102 (constexpr guard: compiled out)
            if p_lo < p_hi:
                x = tl.math.div_rn(logit, temp)
                prob = tl.exp(x - log_z)[:, None]
                above = _sort_key(x)[:, None] >= p_piv32[None, :]
                p_mass += tl.sum(tl.where(above, prob, 0.0), axis=0)
    if SEARCH_K:  # noqa: SIM102 (constexpr guard: compiled out)
        if k_lo < k_hi:
            k_lo, k_hi = _narrow(k_lo, k_hi, k_piv, k_count >= top_k)
    if SEARCH_E:  # noqa: SIM102 (constexpr guard: compiled out)
        if e_lo < e_hi:
            e_lo, e_hi = _narrow(e_lo, e_hi, e_piv, e_count >= ent_k)
    if SEARCH_P:  # noqa: SIM102 (constexpr guard: compiled out)
        if p_lo < p_hi:
            p_lo, p_hi = _narrow(p_lo, p_hi, p_piv, p_mass >= top_p)
    return k_lo, k_hi, p_lo, p_hi, e_lo, e_hi


@triton.jit
def _first_pass(
    row_ptr, vocab_size, temp, row_key, gumbel_now, needs_raw,
    BLOCK: tl.constexpr, WITH_DEV: tl.constexpr, HAS_RAW: tl.constexpr,
    NEED_MIN: tl.constexpr,
):  # fmt: skip
    """Pass 1: online statistics of x = logits / T (and of the raw logits for ``needs_raw``),
    argmax of the logits, row minima (search bounds, when NEED_MIN), and the Gumbel-max
    (score, index) when ``gumbel_now`` (a sampled row that does not truncate)."""
    neg_inf = tl.full([], float("-inf"), tl.float32)
    zero = tl.zeros([], dtype=tl.float32)
    m_x, s_x, a_x = neg_inf, zero, zero
    m_l, s_l, a_l = neg_inf, zero, zero
    min_l = tl.full([], float("inf"), tl.float32)
    min_x = min_l
    best_l, best_l_idx = neg_inf, tl.zeros([], dtype=tl.int32)
    best_s, best_s_idx = neg_inf, tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab_size
        logit = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(logit, temp)
        m_x, s_x, a_x = _merge_stats(m_x, s_x, a_x, x, WITH_DEV)
        if HAS_RAW:  # noqa: SIM102 (constexpr guard: compiled out)
            if needs_raw:
                m_l, s_l, a_l = _merge_stats(m_l, s_l, a_l, logit, True)
        best_l, best_l_idx = _argmax_update(best_l, best_l_idx, logit, cols)
        if NEED_MIN:
            min_l = tl.minimum(min_l, tl.min(tl.where(valid, logit, float("inf")), axis=0))
            min_x = tl.minimum(min_x, tl.min(tl.where(valid, x, float("inf")), axis=0))
        if gumbel_now:
            score = x - _neg_log_gumbel(row_key, cols)
            best_s, best_s_idx = _argmax_update(best_s, best_s_idx, score, cols)
    return (m_x, s_x, a_x, m_l, s_l, a_l, min_l, min_x, best_l, best_l_idx, best_s,
            best_s_idx)  # fmt: skip


@triton.jit
def _final_pass(
    row_ptr, vocab_size, temp, row_key, final_len, truncates, thr, subset, ent_mode, thr_e,
    t_e, v_max, best_s, best_s_idx,
    BLOCK: tl.constexpr, HAS_SUBSET: tl.constexpr,
):  # fmt: skip
    """Pass 3 over the first ``final_len`` columns (0: skipped): the Gumbel-max over
    {x >= thr} of a truncating row, and the statistics (relative to ``v_max``) of the entropy
    subset {x >= thr_e, logit > t_e}, with the count of logits above ``t_e``."""
    s_f = tl.zeros([], dtype=tl.float32)
    a_f = tl.zeros([], dtype=tl.float32)
    num_above = tl.zeros([], dtype=tl.int64)
    for start in range(0, final_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logit = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(logit, temp)
        if truncates:
            score = tl.where(x >= thr, x - _neg_log_gumbel(row_key, cols), float("-inf"))
            best_s, best_s_idx = _argmax_update(best_s, best_s_idx, score, cols)
        if HAS_SUBSET:  # noqa: SIM102 (constexpr guard: compiled out)
            if subset:
                member = (x >= thr_e) & (logit > t_e)
                dev = tl.where(member, tl.where(ent_mode == _RAW, logit, x) - v_max, 0.0)
                e = tl.where(member, tl.exp(dev), 0.0)
                s_f += tl.sum(e, axis=0)
                a_f += tl.sum(e * dev, axis=0)
                num_above += tl.sum((logit > t_e).to(tl.int64), axis=0)
    return best_s, best_s_idx, s_f, a_f, num_above


@triton.jit
def _fused_sample_kernel(
    logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
    seeds_ptr, positions_ptr, greedy_ptr, ent_modes_ptr, ent_top_ks_ptr,
    next_ids_ptr, logprobs_ptr, entropies_ptr, vocab_size,
    BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_RAW: tl.constexpr, HAS_SUBSET: tl.constexpr,
    HAS_ENT_TOP_K: tl.constexpr,
):  # fmt: skip
    """One row per program; HAS_* say whether any row of the batch uses a feature (the code of
    the others is compiled out). Writes next_ids, logprobs and (HAS_ENTROPY) entropies."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    temp = tl.load(temperatures_ptr + row)
    sampled = tl.load(greedy_ptr + row) == 0
    top_k = tl.load(top_ks_ptr + row)
    top_p = tl.load(top_ps_ptr + row)
    min_p = tl.load(min_ps_ptr + row)
    uses_k, uses_p = sampled & (top_k < vocab_size), sampled & (top_p < 1.0)
    uses_min_p = sampled & (min_p > 0.0)
    truncates = uses_k | uses_p | uses_min_p
    seed_key = _hash32(tl.load(positions_ptr + row).to(tl.uint32) ^ _SALT)
    row_key = _hash32(tl.load(seeds_ptr + row).to(tl.uint32) ^ seed_key)
    ent_mode = tl.zeros([], dtype=tl.int32)
    ent_k = tl.zeros([], dtype=tl.int64)
    if HAS_ENTROPY:
        ent_mode = tl.load(ent_modes_ptr + row)
        ent_k = tl.load(ent_top_ks_ptr + row)
    needs_raw = (ent_mode == _RAW) & (ent_k == 0) & (temp != 1.0)
    uses_ent_k = (ent_k > 0) & ~((ent_mode == _SAMPLED) & ~sampled)
    HAS_SEARCH: tl.constexpr = HAS_TOP_K or HAS_TOP_P or HAS_ENT_TOP_K

    m_x, s_x, a_x, m_l, s_l, a_l, min_l, min_x, best_l, best_l_idx, best_s, best_s_idx = (
        _first_pass(row_ptr, vocab_size, temp, row_key, sampled & ~truncates, needs_raw,
                    BLOCK, HAS_ENTROPY, HAS_RAW, HAS_SEARCH)
    )  # fmt: skip
    log_z = m_x + tl.log(s_x)
    # Pass 2: thresholds, as int64 key intervals (lo == hi: nothing to search).
    k_lo = tl.where(uses_k, _sort_key(min_l), 0).to(tl.int64)
    k_hi = tl.where(uses_k, _sort_key(best_l), 0).to(tl.int64)
    p_lo = tl.where(uses_p, _sort_key(min_x), 0).to(tl.int64)
    p_hi = tl.where(uses_p, _sort_key(m_x), 0).to(tl.int64)
    e_lo = tl.where(uses_ent_k, _sort_key(min_l), 0).to(tl.int64)
    e_hi = tl.where(uses_ent_k, _sort_key(best_l), 0).to(tl.int64)
    if HAS_SEARCH:
        while (k_lo < k_hi) | (p_lo < p_hi) | (e_lo < e_hi):
            k_lo, k_hi, p_lo, p_hi, e_lo, e_hi = _search_pass(
                row_ptr, vocab_size, temp, log_z, top_k, top_p, ent_k,
                k_lo, k_hi, p_lo, p_hi, e_lo, e_hi,
                SEARCH_BLOCK, NUM_PIVOTS, HAS_TOP_K, HAS_TOP_P, HAS_ENT_TOP_K,
            )  # fmt: skip
    thr = tl.full([], float("-inf"), tl.float32)
    if HAS_MIN_P:
        thr = tl.where(uses_min_p, m_x + tl.log(tl.where(uses_min_p, min_p, 1.0)), thr)
    if HAS_TOP_K:
        thr = tl.maximum(thr, tl.where(uses_k, tl.math.div_rn(_key_value(k_lo), temp), thr))
    if HAS_TOP_P:
        thr = tl.maximum(thr, tl.where(uses_p, _key_value(p_lo), thr))

    subset = uses_ent_k | ((ent_mode == _SAMPLED) & truncates)
    t_e = tl.where(uses_ent_k, _key_value(e_lo), float("-inf"))
    v_max = tl.where(ent_mode == _RAW, best_l, m_x)
    best_s, best_s_idx, s_f, a_f, num_above = _final_pass(
        row_ptr, vocab_size, temp, row_key, tl.where(truncates | subset, vocab_size, 0),
        truncates, thr, subset, ent_mode, tl.where(ent_mode == _SAMPLED, thr, float("-inf")),
        t_e, v_max, best_s, best_s_idx, BLOCK, HAS_SUBSET,
    )  # fmt: skip
    next_id = tl.where(sampled, best_s_idx, best_l_idx)
    chosen = tl.math.div_rn(tl.load(row_ptr + next_id).to(tl.float32), temp)
    tl.store(next_ids_ptr + row, next_id.to(tl.int64))
    tl.store(logprobs_ptr + row, chosen - log_z)
    if HAS_ENTROPY:
        ent = _entropy(s_x, a_x)
        if HAS_RAW:
            ent = tl.where(needs_raw, _entropy(s_l, a_l), ent)
        if HAS_ENT_TOP_K:
            # The K-th largest value, repeated K - count(> t) times (ties at the boundary).
            s_f, a_f = _add_boundary_copies(s_f, a_f, uses_ent_k, ent_mode, ent_k, num_above,
                                            t_e, temp, thr, v_max)  # fmt: skip
        if HAS_SUBSET:
            ent = tl.where(subset, _entropy(s_f, a_f), ent)
        ent = tl.where(((ent_mode == _SAMPLED) & ~sampled) | (ent_mode == 0), 0.0, ent)
        tl.store(entropies_ptr + row, ent)


@triton.jit
def _add_boundary_copies(s_f, a_f, uses_ent_k, ent_mode, ent_k, num_above, t_e, temp, thr,
                         v_max):  # fmt: skip
    """Add ``K - count(logit > t)`` copies of the K-th largest logit ``t`` to the subset's
    statistics (the sampled mode keeps them only when they are allowed)."""
    x_t = tl.math.div_rn(t_e, temp)
    kept = uses_ent_k & ((ent_mode != _SAMPLED) | (x_t >= thr))
    dev_t = tl.where(kept, tl.where(ent_mode == _RAW, t_e, x_t) - v_max, 0.0)
    dev_t = tl.maximum(dev_t, -3.4028234663852886e38)  # t = -inf: K > the finite values
    e_t = tl.where(kept, (ent_k - num_above).to(tl.float32) * tl.exp(dev_t), 0.0)
    return s_f + e_t, a_f + e_t * dev_t


def _tile_sizes(device: torch.device, vocab_size: int) -> tuple[int, int]:
    """(BLOCK, SEARCH_BLOCK): constants of the device and the vocabulary, never of the batch.

    The interpreter runs each tile op as one numpy call: large tiles (but no larger than the
    row) keep it fast. On GPUs, search tiles are [SEARCH_BLOCK, 16]: small, for registers.
    """
    if device.type == "cpu":
        block = min(8192, triton.next_power_of_2(vocab_size))
        return block, block
    return 2048, 256


@triton.jit
def _log_z_kernel(logits_ptr, row_stride, out_ptr, vocab_size, BLOCK: tl.constexpr):
    """log Z of one row per program, through the sampler's own online pass (same tiles)."""
    row = tl.program_id(0).to(tl.int64)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logit = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab_size,
                        other=float("-inf")).to(tl.float32)  # fmt: skip
        m, s, _ = _merge_stats(m, s, s, logit, False)
    tl.store(out_ptr + row, m + tl.log(s))


def row_logsumexp_triton(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits, -1)`` [B] float32, bit for bit the log Z from which the fused sampling
    kernel derives a temperature-1 row's chosen logprob: prompt logprobs computed with it equal
    the decode logprobs of the same tokens (prefill/decode consistency)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        block, _ = _tile_sizes(logits.device, vocab_size)
        _log_z_kernel[(num_rows,)](
            logits, logits.stride(0), out, vocab_size, BLOCK=block, num_warps=_NUM_WARPS
        )
    return out


def sample_triton(
    logits: torch.Tensor,
    info: SamplingRows,
    return_logprob: bool,
    top_logprobs_nums: list[int] | None,
    entropy: EntropyPlan | None = None,
) -> SampleOutput:
    """The ``triton`` sampling backend: same contract and results as ``sample_contract``.

    ``logits`` [B, V] float32/bfloat16/float16 on CUDA (or on CPU under TRITON_INTERPRET=1),
    any row stride. Reads ``logits`` once per pass and mutates nothing; writes [B] outputs.
    """
    if logits.shape[-1] != info.vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, expected {info.vocab_size}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    device = logits.device
    next_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    entropies = None if entropy is None else torch.empty_like(logprobs)
    groups = () if entropy is None else entropy.groups
    has_trunc = info.need_top_k or info.need_top_p or info.need_min_p
    block, search_block = _tile_sizes(device, vocab_size)
    _fused_sample_kernel[(num_rows,)](
        logits, logits.stride(0), info.temperatures, info.top_ks, info.top_ps, info.min_ps,
        info.seeds, info.positions, info.is_greedy,
        info.top_ks if entropy is None else entropy.modes,
        info.top_ks if entropy is None else entropy.top_ks,
        next_ids, logprobs, logprobs if entropies is None else entropies, vocab_size,
        BLOCK=block,
        SEARCH_BLOCK=search_block,
        NUM_PIVOTS=_NUM_PIVOTS,
        HAS_TOP_K=info.need_top_k, HAS_TOP_P=info.need_top_p, HAS_MIN_P=info.need_min_p,
        HAS_ENTROPY=entropy is not None,
        HAS_RAW=any(g.mode == "raw" and g.top_k == 0 for g in groups)
        and not info.unit_temperature,
        HAS_SUBSET=any(g.top_k > 0 or (g.mode == "sampled" and has_trunc) for g in groups),
        HAS_ENT_TOP_K=any(g.top_k > 0 for g in groups),
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    if not return_logprob:
        return SampleOutput(next_ids, None, None, None, entropies)
    num_top = max(top_logprobs_nums) if top_logprobs_nums else 0
    if num_top <= 0:
        return SampleOutput(next_ids, logprobs, None, None, entropies)
    # Rare path (top_logprobs_num > 0): log Z = x[chosen] - logprob; a top-k on x gives the rest.
    scaled = logits.float() / info.temperatures[:, None]
    log_z = scaled.gather(1, next_ids[:, None]).squeeze(1) - logprobs
    top = scaled.topk(min(num_top, vocab_size), dim=-1)
    return SampleOutput(next_ids, logprobs, top.values - log_z[:, None], top.indices, entropies)
