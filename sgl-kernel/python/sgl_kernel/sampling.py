"""Fused sampling kernels (Triton): next token, chosen logprob and entropy of each row.

Logits [B, V] (float32, bfloat16 or float16, any row stride; columns contiguous). The result
reproduces :func:`sgl_kernel.sampling_contract.sample_contract`: the same noise bits
(docs/sampling.md), the same allowed set {x >= t} per row, the same token, and the entropy
definitions of docs/entropy.md. Nothing of size [B, V] is written.

Each row is cut into tiles of BLOCK columns (:mod:`sgl_kernel.sampling_tiles`), and the
passes below run one program per (tile, row), so a batch of one row still fills the GPU. Per-tile
partials go to small [B, tiles, fields] buffers; the next kernel combines them.

    kernel       runs for                          computes (x = logits / T)
    stats        every row                         per tile: max, sum exp(x - m) (-> log Z and
                                                   the chosen logprob) and sum exp * (x - m)
                                                   (-> scaled entropy); the same of the raw
                                                   logits for raw-entropy rows with T != 1;
                                                   argmax (greedy rows); Gumbel-max of sampled
                                                   rows over the whole row (that of truncating
                                                   rows only when they verify)
    verify       top-k / top-p rows                per row, the count of logits above the
                                                   whole-row Gumbel-max w's and the mass of x
                                                   above x_w: the row is settled (w is its
                                                   token) when w is provably allowed; reads
                                                   only the tiles whose max is above w's
    search x P   unsettled rows with top-k /       thresholds by an N-pivot search on the
                 top-p, rows with the top-k        order-preserving int32 key of the values:
                 entropy variant                   each launch narrows the key interval
                                                   (N + 1)-fold (on GPUs N = 8: P = 11
                                                   launches settle any int32 interval; N =
                                                   32, P = 7 for up to 4 rows): k-th
                                                   largest by counts, top-p crossing by
                                                   fixed-point probability mass; tiles add
                                                   their counts atomically (integers: the
                                                   order does not matter); a tile whose key
                                                   range misses an interval is not read
    final        unsettled truncating rows, and    per tile: Gumbel-max over {x >= t}; softmax
                 rows whose entropy is over a      statistics of the subset (other rows'
                 subset                            tiles are not read)
    finish       every row (one program a row)     combines the partials; writes the outputs

Entropy is ``H = log S - A / S`` with ``S = sum exp(v - m)`` and ``A = sum exp(v - m)(v - m)``
(no cancellation between large logZ and E[v]). The top-k entropy variant is over the multiset
of the K largest logits: values above the K-th largest t, plus ``K - count(> t)`` copies of t,
exactly what ``torch.topk`` returns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sgl_kernel import sampling_tiles as st
from sgl_kernel.sampling_contract import EntropyPlan, SampleOutput, SamplingRows

# Warps per program. Fixed: the shape of tl.sum's reduction trees, and so the bits of log Z,
# depend on it, and row_logsumexp_triton must reproduce the sampler's log Z exactly.
_NUM_WARPS = 8
_NUM_INTERVALS = tl.constexpr(6)  # (lo, hi) of the three searches: top-k, top-p, entropy top-k


def _search_launches(num_pivots: int) -> int:
    """Search launches that settle any int32 key interval: each one leaves at most
    ``width // (num_pivots + 1)`` of a width (docs/sampling.md)."""
    width, launches = 2**32 - 1, 0
    while width > 0:
        width //= num_pivots + 1
        launches += 1
    return launches


@triton.jit
def _row_params(row, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, greedy_ptr,
                ent_modes_ptr, ent_top_ks_ptr, vocab_size, HAS_ENTROPY: tl.constexpr):  # fmt: skip
    """A row's sampling parameters and what it uses: (temp, sampled, top_k, top_p, min_p,
    uses_k, uses_p, uses_min_p, ent_mode, ent_k, uses_ent_k)."""
    temp = tl.load(temperatures_ptr + row)
    sampled = tl.load(greedy_ptr + row) == 0
    top_k = tl.load(top_ks_ptr + row)
    top_p = tl.load(top_ps_ptr + row)
    min_p = tl.load(min_ps_ptr + row)
    ent_mode = tl.zeros([], dtype=tl.int32)
    ent_k = tl.zeros([], dtype=tl.int64)
    if HAS_ENTROPY:
        ent_mode = tl.load(ent_modes_ptr + row)
        ent_k = tl.load(ent_top_ks_ptr + row)
    uses_ent_k = (ent_k > 0) & ~((ent_mode == st.SAMPLED) & ~sampled)
    uses_k, uses_p = sampled & (top_k < vocab_size), sampled & (top_p < 1.0)
    uses_min_p = sampled & (min_p > 0.0)
    return (temp, sampled, top_k, top_p, min_p, uses_k, uses_p, uses_min_p, ent_mode, ent_k,
            uses_ent_k)  # fmt: skip


@triton.jit
def _row_stats(part_ptr, part_idx_ptr, row, num_tiles, TILES: tl.constexpr,
               WITH_RAW: tl.constexpr, WITH_BOUNDS: tl.constexpr,
               WITH_SAMPLED: tl.constexpr):  # fmt: skip
    """The row's statistics, combined from its tiles' partials: (m_x, s_x, a_x, m_l, s_l, a_l,
    min_l, min_x, best_l, best_l_idx, best_s_idx). The raw-logit statistics (WITH_RAW), minima
    (WITH_BOUNDS) and the Gumbel-max (WITH_SAMPLED) are read only when asked for (else 0)."""
    tiles = tl.arange(0, TILES)
    ok = tiles < num_tiles
    part = part_ptr + (row * num_tiles + tiles) * st.STATS
    idx = part_idx_ptr + (row * num_tiles + tiles) * 2
    m_x, s_x, a_x = st.merged_softmax(part + st.X, ok)
    zero = tl.zeros([], dtype=tl.float32)
    m_l, s_l, a_l, min_l, min_x = zero, zero, zero, zero, zero
    if WITH_RAW:
        m_l, s_l, a_l = st.merged_softmax(part + st.L, ok)
    if WITH_BOUNDS:
        min_l = tl.min(tl.load(part + st.MIN_L, mask=ok, other=float("inf")), axis=0)
        min_x = tl.min(tl.load(part + st.MIN_X, mask=ok, other=float("inf")), axis=0)
    best_l, best_l_idx = st.merged_argmax(
        tl.load(part + st.BEST_L, mask=ok, other=float("-inf")),
        tl.load(idx, mask=ok, other=2147483647),
    )
    best_s_idx = tl.zeros([], dtype=tl.int32)
    if WITH_SAMPLED:
        _, best_s_idx = st.merged_argmax(
            tl.load(part + st.BEST_S, mask=ok, other=float("-inf")),
            tl.load(idx + 1, mask=ok, other=2147483647),
        )
    return m_x, s_x, a_x, m_l, s_l, a_l, min_l, min_x, best_l, best_l_idx, best_s_idx


@triton.jit
def _stats_kernel(
    logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr,
    positions_ptr, greedy_ptr, ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr,
    verify_ptr, vocab_size, num_tiles,
    BLOCK: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_RAW: tl.constexpr,
    NEED_MIN: tl.constexpr, VERIFY: tl.constexpr,
):  # fmt: skip
    """One tile of one row (grid: tiles x rows): softmax statistics of x (and of the raw
    logits for raw-entropy rows), argmax, minima (search bounds, when NEED_MIN), and the
    Gumbel-max of a sampled row over the whole row (VERIFY: truncating rows too, and a tile
    holding a NaN counts itself in verify[row, 2]; else only rows that do not truncate)."""
    tile = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    temp, sampled, _, _, _, uses_k, uses_p, uses_min_p, ent_mode, ent_k, _ = _row_params(
        row, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, greedy_ptr, ent_modes_ptr,
        ent_top_ks_ptr, vocab_size, HAS_ENTROPY,
    )  # fmt: skip
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab_size
    logit = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=float("-inf"))
    logit = logit.to(tl.float32)
    x = tl.math.div_rn(logit, temp)
    out = part_ptr + (row * num_tiles + tile) * st.STATS
    m, s, a = st.softmax_stats(x, HAS_ENTROPY)
    tl.store(out + st.X, m)
    tl.store(out + st.X + 1, s)
    tl.store(out + st.X + 2, a)
    if HAS_RAW:
        needs_raw = (ent_mode == st.RAW) & (ent_k == 0) & (temp != 1.0)
        m, s, a = st.softmax_stats(tl.where(needs_raw, logit, x), True)
        tl.store(out + st.L, m)
        tl.store(out + st.L + 1, s)
        tl.store(out + st.L + 2, a)
    if NEED_MIN:
        tl.store(out + st.MIN_L, tl.min(tl.where(valid, logit, float("inf")), axis=0))
        tl.store(out + st.MIN_X, tl.min(tl.where(valid, x, float("inf")), axis=0))
    best_l, best_l_idx = st.tile_argmax(logit, cols)
    if VERIFY:  # noqa: SIM102 (constexpr guard: compiled out)
        # The statistics pass over NaN (tl.max and tl.maximum drop it), the searches count its
        # key as the largest; a row holding one is left to the search, never settled.
        if tl.sum((logit != logit).to(tl.int32), axis=0) > 0:
            tl.atomic_add(verify_ptr + row * 3 + 2, 1, sem="relaxed")
    gumbel_now = sampled & (VERIFY | ~(uses_k | uses_p | uses_min_p))
    score = tl.full([BLOCK], float("-inf"), tl.float32)
    if gumbel_now:
        score = x - st.neg_log_gumbel(st.row_noise_key(seeds_ptr, positions_ptr, row), cols)
    best_s, best_s_idx = st.tile_argmax(score, cols)
    tl.store(out + st.BEST_L, best_l)
    tl.store(out + st.BEST_S, best_s)
    idx = part_idx_ptr + (row * num_tiles + tile) * 2
    tl.store(idx, best_l_idx)
    tl.store(idx + 1, best_s_idx)


@triton.jit
def _winner(row, logits_ptr, row_stride, part_ptr, part_idx_ptr, num_tiles, temp,
            TILES: tl.constexpr):  # fmt: skip
    """The row's Gumbel-max over the whole vocabulary (the stats pass's, VERIFY): (its column,
    its logit, its x, the row's max of x, log Z)."""
    m_x, s_x, _, _, _, _, _, _, _, _, winner = _row_stats(
        part_ptr, part_idx_ptr, row, num_tiles, TILES, False, False, True
    )
    logit = tl.load(logits_ptr + row * row_stride + winner).to(tl.float32)
    return winner, logit, tl.math.div_rn(logit, temp), m_x, m_x + tl.log(s_x)


@triton.jit
def _may_verify(sampled, uses_k, uses_p, uses_min_p, uses_ent_k, ent_mode, log_z, nan_tiles):
    """Whether a row's token may be settled by verification: a sampled, truncating row whose
    entropy needs no subset (which needs the threshold itself), with no NaN logit (``nan_tiles``
    0) and a finite log Z (no +inf logit, not all -inf)."""
    truncates = uses_k | uses_p | uses_min_p
    subset = uses_ent_k | ((ent_mode == st.SAMPLED) & truncates)
    finite = (nan_tiles == 0) & (tl.abs(log_z) < float("inf"))
    return sampled & truncates & ~subset & finite


@triton.jit
def _verdict(row, logits_ptr, row_stride, part_ptr, part_idx_ptr, verify_ptr, num_tiles,
             temp, sampled, top_k, top_p, min_p, uses_k, uses_p, uses_min_p, uses_ent_k,
             ent_mode, TILES: tl.constexpr):  # fmt: skip
    """Whether the row's whole-row Gumbel-max w lies in its allowed set {x >= t}, so that it is
    the row's token (the Gumbel-max over a set holding the overall one is that one). Sufficient
    conditions, each implying x_w >= that criterion's threshold as the search would find it:
    fewer than top_k logits above w's (the k-th largest is then <= w's), less fixed-point mass
    than top_p's above x_w (no pivot above x_w holds), x_w >= the min-p threshold. The counts
    come from the verify pass; every kernel that asks gets the same answer."""
    _, _, x_w, m_x, log_z = _winner(row, logits_ptr, row_stride, part_ptr, part_idx_ptr,
                                    num_tiles, temp, TILES)  # fmt: skip
    counts = verify_ptr + row * 3
    ok_k = ~uses_k | (tl.load(counts) < top_k)
    ok_p = ~uses_p | (tl.load(counts + 1) < (top_p * st.MASS_SCALE).to(tl.int64))
    ok_min_p = ~uses_min_p | (x_w >= m_x + tl.log(tl.where(uses_min_p, min_p, 1.0)))
    may = _may_verify(sampled, uses_k, uses_p, uses_min_p, uses_ent_k, ent_mode, log_z,
                      tl.load(counts + 2))  # fmt: skip
    return may & ok_k & ok_p & ok_min_p


@triton.jit
def _settled_row_params(
    row, logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
    greedy_ptr, ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr, verify_ptr, vocab_size,
    num_tiles, HAS_ENTROPY: tl.constexpr, TILES: tl.constexpr, VERIFY: tl.constexpr,
):  # fmt: skip
    """:func:`_row_params`, then whether verification settled the row (:func:`_verdict` when
    the batch verifies, else False): a settled row's token is its whole-row Gumbel-max, and
    the searches and the final pass skip it."""
    temp, sampled, top_k, top_p, min_p, uses_k, uses_p, uses_min_p, ent_mode, ent_k, uses_ent_k = (
        _row_params(row, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, greedy_ptr,
                    ent_modes_ptr, ent_top_ks_ptr, vocab_size, HAS_ENTROPY)
    )  # fmt: skip
    settled = row < 0
    if VERIFY:
        settled = _verdict(row, logits_ptr, row_stride, part_ptr, part_idx_ptr, verify_ptr,
                           num_tiles, temp, sampled, top_k, top_p, min_p, uses_k, uses_p,
                           uses_min_p, uses_ent_k, ent_mode, TILES)  # fmt: skip
    return (temp, sampled, top_k, top_p, min_p, uses_k, uses_p, uses_min_p, ent_mode, ent_k,
            uses_ent_k, settled)  # fmt: skip


@triton.jit
def _verify_kernel(
    logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, greedy_ptr,
    ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr, verify_ptr, vocab_size, num_tiles,
    BLOCK: tl.constexpr, TILES: tl.constexpr, HAS_ENTROPY: tl.constexpr,
):  # fmt: skip
    """One tile of one row (grid: tiles x rows): add to verify[row, 0] the count of logits
    above the winner's (top-k rows) and to verify[row, 1] the fixed-point mass of x above x_w
    (top-p rows), each
    column's mass truncated as the search truncates it. A tile whose maximum is not above the
    winner's adds nothing and is not read: with a peaked row only the top few tiles are."""
    tile = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    temp, sampled, _, _, _, uses_k, uses_p, uses_min_p, ent_mode, _, uses_ent_k = _row_params(
        row, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, greedy_ptr, ent_modes_ptr,
        ent_top_ks_ptr, vocab_size, HAS_ENTROPY,
    )  # fmt: skip
    _, l_w, x_w, _, log_z = _winner(row, logits_ptr, row_stride, part_ptr, part_idx_ptr,
                                    num_tiles, temp, TILES)  # fmt: skip
    counts = verify_ptr + row * 3
    may = _may_verify(sampled, uses_k, uses_p, uses_min_p, uses_ent_k, ent_mode, log_z,
                      tl.load(counts + 2))  # fmt: skip
    _, max_l, _, max_x = st.tile_keys(part_ptr + (row * num_tiles + tile) * st.STATS)
    key_l = st.sort_key(l_w)
    key_x = st.sort_key(x_w)
    k_read = may & uses_k & (max_l > key_l)
    p_read = may & uses_p & (max_x > key_x)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    end = tl.where(k_read | p_read, vocab_size, 0)  # 0: nothing of the tile is read
    logit = tl.load(logits_ptr + row * row_stride + cols, mask=cols < end,
                    other=float("-inf")).to(tl.float32)  # fmt: skip
    if k_read:
        tl.atomic_add(counts, tl.sum((st.sort_key(logit) > key_l).to(tl.int64), axis=0),
                      sem="relaxed")  # fmt: skip
    if p_read:
        x = tl.math.div_rn(logit, temp)
        mass = (tl.exp(x - log_z) * st.MASS_SCALE).to(tl.int64)
        tl.atomic_add(counts + 1, tl.sum(tl.where(st.sort_key(x) > key_x, mass, 0), axis=0),
                      sem="relaxed")  # fmt: skip


@triton.jit
def _intervals(
    launch, row, num_rows, part_ptr, part_idx_ptr, intervals_ptr, totals_ptr, num_tiles,
    top_k, top_p, ent_k, uses_k, uses_p, uses_ent_k,
    TILES: tl.constexpr, NUM: tl.constexpr,
    SEARCH_K: tl.constexpr, SEARCH_P: tl.constexpr, SEARCH_E: tl.constexpr,
):  # fmt: skip
    """The row's three key intervals after ``launch`` search launches (0: the row's bounds),
    then its max of x, its log Z and its largest logit. Launch j left its intervals in slot
    j % 2 and its counts in totals[j]."""
    m_x, s_x, _, _, _, _, min_l, min_x, best_l, _, _ = _row_stats(
        part_ptr, part_idx_ptr, row, num_tiles, TILES, False, True, False
    )
    log_z = m_x + tl.log(s_x)
    k_lo = tl.where(uses_k, st.sort_key(min_l), 0).to(tl.int64)
    k_hi = tl.where(uses_k, st.sort_key(best_l), 0).to(tl.int64)
    p_lo = tl.where(uses_p, st.sort_key(min_x), 0).to(tl.int64)
    p_hi = tl.where(uses_p, st.sort_key(m_x), 0).to(tl.int64)
    e_lo = tl.where(uses_ent_k, st.sort_key(min_l), 0).to(tl.int64)
    e_hi = tl.where(uses_ent_k, st.sort_key(best_l), 0).to(tl.int64)
    if launch > 0:
        slot = intervals_ptr + (((launch - 1) % 2) * num_rows + row) * _NUM_INTERVALS
        k_lo, k_hi = tl.load(slot), tl.load(slot + 1)
        p_lo, p_hi = tl.load(slot + 2), tl.load(slot + 3)
        e_lo, e_hi = tl.load(slot + 4), tl.load(slot + 5)
        totals = totals_ptr + ((launch - 1) * num_rows + row) * 3 * NUM + tl.arange(0, NUM)
        if SEARCH_K:  # noqa: SIM102 (constexpr guard: compiled out)
            if k_lo < k_hi:
                k_lo, k_hi = st.narrow(k_lo, k_hi, st.pivots_of(k_lo, k_hi, NUM),
                                       tl.load(totals) >= top_k)  # fmt: skip
        if SEARCH_E:  # noqa: SIM102 (constexpr guard: compiled out)
            if e_lo < e_hi:
                e_lo, e_hi = st.narrow(e_lo, e_hi, st.pivots_of(e_lo, e_hi, NUM),
                                       tl.load(totals + NUM) >= ent_k)  # fmt: skip
        if SEARCH_P:  # noqa: SIM102 (constexpr guard: compiled out)
            if p_lo < p_hi:
                needed = (top_p * st.MASS_SCALE).to(tl.int64)
                p_lo, p_hi = st.narrow(p_lo, p_hi, st.pivots_of(p_lo, p_hi, NUM),
                                       tl.load(totals + 2 * NUM) >= needed)  # fmt: skip
    return k_lo, k_hi, p_lo, p_hi, e_lo, e_hi, m_x, log_z, best_l


@triton.jit(do_not_specialize=["launch", "num_rows"])
def _search_kernel(
    logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, greedy_ptr,
    ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr, verify_ptr, intervals_ptr,
    totals_ptr, vocab_size, num_tiles, num_rows, launch,
    BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, TILES: tl.constexpr, NUM: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, VERIFY: tl.constexpr,
    SEARCH_K: tl.constexpr, SEARCH_P: tl.constexpr, SEARCH_E: tl.constexpr,
):  # fmt: skip
    """Search launch ``launch`` (grid: tiles x rows): narrow the intervals with the previous
    launch's totals, then add this tile's counts at the new pivots to totals[launch]. A row
    settled by verification searches nothing."""
    tile = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    (temp, sampled, top_k, top_p, min_p, uses_k, uses_p, uses_min_p, ent_mode, ent_k, uses_ent_k,
     settled) = _settled_row_params(
        row, logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
        greedy_ptr, ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr, verify_ptr,
        vocab_size, num_tiles, HAS_ENTROPY, TILES, VERIFY,
    )  # fmt: skip
    uses_k, uses_p = uses_k & ~settled, uses_p & ~settled
    k_lo, k_hi, p_lo, p_hi, e_lo, e_hi, _, log_z, _ = _intervals(
        launch, row, num_rows, part_ptr, part_idx_ptr, intervals_ptr, totals_ptr, num_tiles,
        top_k, top_p, ent_k, uses_k, uses_p, uses_ent_k,
        TILES, NUM, SEARCH_K, SEARCH_P, SEARCH_E,
    )  # fmt: skip
    first = tile == 0  # one program per row records the intervals (all compute the same)
    slot = intervals_ptr + ((launch % 2) * num_rows + row) * _NUM_INTERVALS
    tl.store(slot, k_lo, mask=first)
    tl.store(slot + 1, k_hi, mask=first)
    tl.store(slot + 2, p_lo, mask=first)
    tl.store(slot + 3, p_hi, mask=first)
    tl.store(slot + 4, e_lo, mask=first)
    tl.store(slot + 5, e_hi, mask=first)
    # This tile's key range decides, per search, whether it is compared, counted whole or
    # skipped: after the first launches most tiles lie below the intervals and are not read.
    min_l, max_l, min_x, max_x = st.tile_keys(part_ptr + (row * num_tiles + tile) * st.STATS)
    k_on, p_on, e_on = k_lo < k_hi, p_lo < p_hi, e_lo < e_hi
    begin = tile * BLOCK
    k_count, e_count, p_mass = st.count_tile(
        logits_ptr + row * row_stride, begin, tl.minimum(begin + BLOCK, vocab_size), temp,
        log_z, st.pivots_of(k_lo, k_hi, NUM), st.pivots_of(p_lo, p_hi, NUM),
        st.pivots_of(e_lo, e_hi, NUM),
        k_on & (max_l > k_lo) & (min_l <= k_hi), p_on & (max_x > p_lo) & (min_x <= p_hi),
        e_on & (max_l > e_lo) & (min_l <= e_hi),
        k_on & (min_l > k_hi), p_on & (min_x > p_hi), e_on & (min_l > e_hi),
        SEARCH_BLOCK, NUM, SEARCH_K, SEARCH_P, SEARCH_E,
    )  # fmt: skip
    totals = totals_ptr + (launch * num_rows + row) * 3 * NUM + tl.arange(0, NUM)
    if SEARCH_K:  # noqa: SIM102 (constexpr guard: compiled out)
        if k_on:
            tl.atomic_add(totals, k_count, sem="relaxed")
    if SEARCH_E:  # noqa: SIM102 (constexpr guard: compiled out)
        if e_on:
            tl.atomic_add(totals + NUM, e_count, sem="relaxed")
    if SEARCH_P:  # noqa: SIM102 (constexpr guard: compiled out)
        if p_on:
            tl.atomic_add(totals + 2 * NUM, p_mass, sem="relaxed")


@triton.jit(do_not_specialize=["num_rows", "launches"])
def _final_kernel(
    logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, seeds_ptr,
    positions_ptr, greedy_ptr, ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr,
    verify_ptr, intervals_ptr, totals_ptr, fin_ptr, fin_idx_ptr, thresholds_ptr,
    vocab_size, num_tiles, num_rows, launches,
    BLOCK: tl.constexpr, TILES: tl.constexpr, NUM: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    HAS_ENT_TOP_K: tl.constexpr, HAS_SUBSET: tl.constexpr, VERIFY: tl.constexpr,
):  # fmt: skip
    """One tile of one row after ``launches`` searches (grid: tiles x rows): the Gumbel-max
    over {x >= t} of a truncating row not settled by verification, and the statistics
    (relative to the row's max) of the entropy subset {x >= t_e', logit > t_e} with the count
    of logits above t_e. Rows that need neither are not read. Tile 0 also records the row's
    (t, t_e) for the finish."""
    tile = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    (temp, sampled, top_k, top_p, min_p, uses_k, uses_p, uses_min_p, ent_mode, ent_k, uses_ent_k,
     settled) = _settled_row_params(
        row, logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
        greedy_ptr, ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr, verify_ptr,
        vocab_size, num_tiles, HAS_ENTROPY, TILES, VERIFY,
    )  # fmt: skip
    truncates = uses_k | uses_p | uses_min_p
    subset = uses_ent_k | ((ent_mode == st.SAMPLED) & truncates)
    samples_here = truncates & ~settled
    uses_k, uses_p = uses_k & ~settled, uses_p & ~settled
    k_lo, _, p_lo, _, e_lo, _, m_x, _, best_l = _intervals(
        launches, row, num_rows, part_ptr, part_idx_ptr, intervals_ptr, totals_ptr, num_tiles,
        top_k, top_p, ent_k, uses_k, uses_p, uses_ent_k,
        TILES, NUM, HAS_TOP_K, HAS_TOP_P, HAS_ENT_TOP_K,
    )  # fmt: skip
    thr = tl.full([], float("-inf"), tl.float32)
    if HAS_MIN_P:
        thr = tl.where(uses_min_p, m_x + tl.log(tl.where(uses_min_p, min_p, 1.0)), thr)
    if HAS_TOP_K:
        thr = tl.maximum(thr, tl.where(uses_k, tl.math.div_rn(st.key_value(k_lo), temp), thr))
    if HAS_TOP_P:
        thr = tl.maximum(thr, tl.where(uses_p, st.key_value(p_lo), thr))
    t_e = tl.where(uses_ent_k, st.key_value(e_lo), float("-inf"))
    v_max = tl.where(ent_mode == st.RAW, best_l, m_x)

    cols = tile * BLOCK + tl.arange(0, BLOCK)
    end = tl.where(samples_here | subset, vocab_size, 0)  # 0: nothing of the tile is read
    logit = tl.load(logits_ptr + row * row_stride + cols, mask=cols < end,
                    other=float("-inf")).to(tl.float32)  # fmt: skip
    x = tl.math.div_rn(logit, temp)
    score = tl.full([BLOCK], float("-inf"), tl.float32)
    if samples_here:
        noise = st.neg_log_gumbel(st.row_noise_key(seeds_ptr, positions_ptr, row), cols)
        score = tl.where(x >= thr, x - noise, float("-inf"))
    best_s, best_s_idx = st.tile_argmax(score, cols)
    s_f = tl.zeros([], dtype=tl.float32)
    a_f = tl.zeros([], dtype=tl.float32)
    num_above = tl.zeros([], dtype=tl.int32)
    if HAS_SUBSET:  # noqa: SIM102 (constexpr guard: compiled out)
        if subset:
            thr_e = tl.where(ent_mode == st.SAMPLED, thr, float("-inf"))
            member = (x >= thr_e) & (logit > t_e)
            dev = tl.where(member, tl.where(ent_mode == st.RAW, logit, x) - v_max, 0.0)
            e = tl.where(member, tl.exp(dev), 0.0)
            s_f = tl.sum(e, axis=0)
            a_f = tl.sum(e * dev, axis=0)
            num_above = tl.sum((logit > t_e).to(tl.int32), axis=0)
    out = fin_ptr + (row * num_tiles + tile) * 3
    tl.store(out + st.FIN_BEST, best_s)
    tl.store(out + st.FIN_S, s_f)
    tl.store(out + st.FIN_A, a_f)
    idx = fin_idx_ptr + (row * num_tiles + tile) * 2
    tl.store(idx, best_s_idx)
    tl.store(idx + 1, num_above)
    tl.store(thresholds_ptr + row * 2, thr, mask=tile == 0)
    tl.store(thresholds_ptr + row * 2 + 1, t_e, mask=tile == 0)


@triton.jit
def _finish_kernel(
    logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr, greedy_ptr,
    ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr, verify_ptr, fin_ptr, fin_idx_ptr,
    thresholds_ptr, next_ids_ptr, logprobs_ptr, entropies_ptr, settled_ptr, vocab_size,
    num_tiles,
    TILES: tl.constexpr, HAS_SAMPLED: tl.constexpr, HAS_FINAL: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, HAS_RAW: tl.constexpr, HAS_SUBSET: tl.constexpr,
    HAS_ENT_TOP_K: tl.constexpr, VERIFY: tl.constexpr, RECORD_SETTLED: tl.constexpr,
):  # fmt: skip
    """One program per row: combine the tiles' partials; write next_ids, logprobs,
    (HAS_ENTROPY) entropies and (RECORD_SETTLED) whether verification settled the row."""
    row = tl.program_id(0).to(tl.int64)
    (temp, sampled, top_k, top_p, min_p, uses_k, uses_p, uses_min_p, ent_mode, ent_k, uses_ent_k,
     settled) = _settled_row_params(
        row, logits_ptr, row_stride, temperatures_ptr, top_ks_ptr, top_ps_ptr, min_ps_ptr,
        greedy_ptr, ent_modes_ptr, ent_top_ks_ptr, part_ptr, part_idx_ptr, verify_ptr,
        vocab_size, num_tiles, HAS_ENTROPY, TILES, VERIFY,
    )  # fmt: skip
    if RECORD_SETTLED:
        tl.store(settled_ptr + row, settled.to(tl.int8))
    m_x, s_x, a_x, _, s_l, a_l, _, _, best_l, best_l_idx, best_s_idx = _row_stats(
        part_ptr, part_idx_ptr, row, num_tiles, TILES, HAS_RAW, False, HAS_SAMPLED
    )
    log_z = m_x + tl.log(s_x)
    truncates = uses_k | uses_p | uses_min_p
    subset = uses_ent_k | ((ent_mode == st.SAMPLED) & truncates)
    s_f = tl.zeros([], dtype=tl.float32)
    a_f = tl.zeros([], dtype=tl.float32)
    if HAS_FINAL:
        tiles = tl.arange(0, TILES)
        ok = tiles < num_tiles
        fin = fin_ptr + (row * num_tiles + tiles) * 3
        fin_idx = fin_idx_ptr + (row * num_tiles + tiles) * 2
        _, trunc_idx = st.merged_argmax(
            tl.load(fin + st.FIN_BEST, mask=ok, other=float("-inf")),
            tl.load(fin_idx, mask=ok, other=2147483647),
        )
        best_s_idx = tl.where(truncates & ~settled, trunc_idx, best_s_idx)
        s_f = tl.sum(tl.load(fin + st.FIN_S, mask=ok, other=0.0), axis=0)
        a_f = tl.sum(tl.load(fin + st.FIN_A, mask=ok, other=0.0), axis=0)
        if HAS_ENT_TOP_K:
            # The K-th largest value, repeated K - count(> t) times (ties at the boundary).
            num_above = tl.sum(tl.load(fin_idx + 1, mask=ok, other=0), axis=0)
            s_f, a_f = _add_boundary_copies(
                s_f, a_f, uses_ent_k, ent_mode, ent_k, num_above,
                tl.load(thresholds_ptr + row * 2 + 1), temp, tl.load(thresholds_ptr + row * 2),
                tl.where(ent_mode == st.RAW, best_l, m_x),
            )  # fmt: skip
    next_id = tl.where(sampled, best_s_idx, best_l_idx)
    chosen = tl.load(logits_ptr + row * row_stride + next_id).to(tl.float32)
    tl.store(next_ids_ptr + row, next_id.to(tl.int64))
    tl.store(logprobs_ptr + row, tl.math.div_rn(chosen, temp) - log_z)
    if HAS_ENTROPY:
        ent = st.entropy_of(s_x, a_x)
        if HAS_RAW:
            needs_raw = (ent_mode == st.RAW) & (ent_k == 0) & (temp != 1.0)
            ent = tl.where(needs_raw, st.entropy_of(s_l, a_l), ent)
        if HAS_SUBSET:
            ent = tl.where(subset, st.entropy_of(s_f, a_f), ent)
        ent = tl.where(((ent_mode == st.SAMPLED) & ~sampled) | (ent_mode == 0), 0.0, ent)
        tl.store(entropies_ptr + row, ent)


@triton.jit
def _add_boundary_copies(s_f, a_f, uses_ent_k, ent_mode, ent_k, num_above, t_e, temp, thr,
                         v_max):  # fmt: skip
    """Add ``K - count(logit > t)`` copies of the K-th largest logit ``t`` to the subset's
    statistics (the sampled mode keeps them only when they are allowed)."""
    x_t = tl.math.div_rn(t_e, temp)
    kept = uses_ent_k & ((ent_mode != st.SAMPLED) | (x_t >= thr))
    dev_t = tl.where(kept, tl.where(ent_mode == st.RAW, t_e, x_t) - v_max, 0.0)
    dev_t = tl.maximum(dev_t, -3.4028234663852886e38)  # t = -inf: K > the finite values
    e_t = tl.where(kept, (ent_k - num_above).to(tl.float32) * tl.exp(dev_t), 0.0)
    return s_f + e_t, a_f + e_t * dev_t


@triton.jit
def _log_z_tile_kernel(logits_ptr, row_stride, part_ptr, vocab_size, num_tiles,
                       BLOCK: tl.constexpr):  # fmt: skip
    """Softmax statistics of one tile of one row, as the stats kernel computes them at T = 1."""
    tile = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    logit = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab_size,
                    other=float("-inf")).to(tl.float32)  # fmt: skip
    m, s, _ = st.softmax_stats(tl.math.div_rn(logit, 1.0), False)
    out = part_ptr + (row * num_tiles + tile) * st.STATS
    tl.store(out + st.X, m)
    tl.store(out + st.X + 1, s)
    tl.store(out + st.X + 2, 0.0)


@triton.jit
def _log_z_kernel(part_ptr, out_ptr, num_tiles, TILES: tl.constexpr):
    """log Z of one row per program, combined from its tiles as the finish kernel does."""
    row = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, TILES)
    part = part_ptr + (row * num_tiles + tiles) * st.STATS
    m, s, _ = st.merged_softmax(part + st.X, tiles < num_tiles)
    tl.store(out_ptr + row, m + tl.log(s))


class _Tiling(NamedTuple):
    """How rows are cut: constants of the device and the vocabulary, never of the batch (the
    pivot count may depend on it: it changes the number of search launches, not the result)."""

    block: int  # columns per tile (one program)
    search_block: int  # columns per step of a search tile ([search_block, pivots] compares)
    num_tiles: int
    tiles_pow2: int  # the combining reductions' width (their tree shape fixes log Z's bits)
    num_pivots: int  # pivots per search launch (a power of two: tl.arange)
    searches: int  # search launches that settle any interval with that many pivots


# Batches of at most this many rows search with 32 pivots on GPUs (7 launches, not 11).
_FEW_ROWS = 4


def _tiling(device: torch.device, vocab_size: int, num_rows: int) -> _Tiling:
    """On GPUs, 2048-column tiles (a row of 151,936 logits becomes 75 programs) and 8 pivots:
    11 search launches. A launch costs ~pivots compares per column it reads, and tiles outside
    a search's interval are not read, so few pivots and more, cheaper launches win (256 pivots
    in 4 launches ran a 64-row top-k/top-p batch 8x slower than torch's sort on an H200). A
    batch of up to :data:`_FEW_ROWS` rows is bound by its launches instead: 32 pivots in 7
    launches (one top-k/top-p row on an H100: 0.62 ms against 0.83 with 8 pivots). The
    interpreter (CPU) runs each tile op as one numpy call: larger tiles, and 16 pivots. The
    search's result does not depend on the pivots (docs/sampling.md)."""
    if device.type == "cpu":
        block = min(32768, triton.next_power_of_2(vocab_size))
        search_block, num_pivots = block, 16
    else:
        block, search_block = 2048, 256
        num_pivots = 32 if num_rows <= _FEW_ROWS else 8
    num_tiles = triton.cdiv(vocab_size, block)
    return _Tiling(block, search_block, num_tiles, triton.next_power_of_2(num_tiles), num_pivots,
                   _search_launches(num_pivots))  # fmt: skip


def row_logsumexp_triton(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits, -1)`` [B] float32, bit for bit the log Z from which the fused sampling
    kernels derive a temperature-1 row's chosen logprob: prompt logprobs computed with it equal
    the decode logprobs of the same tokens (prefill/decode consistency)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows:
        tiling = _tiling(logits.device, vocab_size, num_rows)
        part = torch.empty(num_rows, tiling.num_tiles, st.STATS.value, dtype=torch.float32,
                           device=logits.device)  # fmt: skip
        _log_z_tile_kernel[(tiling.num_tiles, num_rows)](
            logits, logits.stride(0), part, vocab_size, tiling.num_tiles, BLOCK=tiling.block,
            num_warps=_NUM_WARPS,
        )  # fmt: skip
        _log_z_kernel[(num_rows,)](
            part, out, tiling.num_tiles, TILES=tiling.tiles_pow2, num_warps=_NUM_WARPS
        )
    return out


def sample_triton(
    logits: torch.Tensor,
    info: SamplingRows,
    return_logprob: bool,
    top_logprobs_nums: list[int] | None,
    entropy: EntropyPlan | None = None,
    *,
    verify: bool | None = None,
) -> SampleOutput:
    """The ``triton`` sampling backend: same contract and results as ``sample_contract``.

    ``logits`` [B, V] float32/bfloat16/float16 on CUDA (or on CPU under TRITON_INTERPRET=1),
    any row stride. Mutates nothing; writes [B] outputs. Launches: 2 for plain sampling, 3 with
    min-p or an entropy subset, 15 on GPUs with top-k / top-p (11 for up to 4 rows; one fewer
    for top-k entropy alone); none for an all-greedy batch that asks for no logprob and no
    entropy (one torch ``max``: the first maximum, the first NaN of a row holding one, as the
    contract). ``verify``: whether truncating rows' whole-row Gumbel-max is verified first
    (module docstring); the results are the same either way. ``None`` (default): on GPUs only
    for batches of more than :data:`_FEW_ROWS` rows, since a settled row still pays every
    launch and a smaller batch is bound by its launches (one row on an H200: 0.57 ms verified,
    0.49 not); always in the interpreter.
    """
    if logits.shape[-1] != info.vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, expected {info.vocab_size}")
    if info.is_all_greedy and entropy is None and not return_logprob:
        # The argmax alone: two Triton launches cost a batch-1 decode step ~0.25 ms of host
        # time on an H100 host, a torch reduction ~0.02 ms.
        return SampleOutput(logits.max(dim=-1).indices, None, None, None, None)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    device = logits.device
    next_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
    entropies = None if entropy is None else torch.empty_like(logprobs)
    if num_rows:
        if verify is None:
            verify = device.type == "cpu" or num_rows > _FEW_ROWS
        _launch(logits, info, entropy, next_ids, logprobs, entropies, verify, None)
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


def _launch(
    logits: torch.Tensor,
    info: SamplingRows,
    entropy: EntropyPlan | None,
    next_ids: torch.Tensor,
    logprobs: torch.Tensor,
    entropies: torch.Tensor | None,
    verify: bool,
    settled: torch.Tensor | None,
) -> None:
    """Run the kernels of the module docstring on a non-empty batch, writing the outputs (and
    into ``settled``, int8 [B] when given, 1 where verification settled the row)."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    tiling = _tiling(device, vocab_size, num_rows)
    groups = () if entropy is None else entropy.groups
    has_trunc = info.need_top_k or info.need_top_p or info.need_min_p
    verify = verify and has_trunc and not info.is_all_greedy
    has_ent_top_k = any(g.top_k > 0 for g in groups)
    has_search = info.need_top_k or info.need_top_p or has_ent_top_k
    has_subset = any(g.top_k > 0 or (g.mode == "sampled" and has_trunc) for g in groups)
    has_raw = any(g.mode == "raw" and g.top_k == 0 for g in groups) and not info.unit_temperature
    rows = (logits, logits.stride(0), info.temperatures, info.top_ks, info.top_ps, info.min_ps)
    ent = (info.top_ks, info.top_ks) if entropy is None else (entropy.modes, entropy.top_ks)
    part = torch.empty(num_rows, tiling.num_tiles, st.STATS.value, dtype=torch.float32,
                       device=device)  # fmt: skip
    part_idx = torch.empty(num_rows, tiling.num_tiles, 2, dtype=torch.int32, device=device)
    grid = (tiling.num_tiles, num_rows)
    warps = {"num_warps": _NUM_WARPS}
    # Placeholders of the verify pass's and the searches' int64 buffers (same type: compiled,
    # never read).
    verify_counts = intervals = totals = next_ids
    if verify:
        # Per row: logits above the winner's, mass above it, tiles holding a NaN.
        verify_counts = torch.zeros(num_rows, 3, dtype=torch.int64, device=device)
    _stats_kernel[grid](
        *rows, info.seeds, info.positions, info.is_greedy, *ent, part, part_idx, verify_counts,
        vocab_size, tiling.num_tiles, BLOCK=tiling.block, HAS_ENTROPY=entropy is not None,
        HAS_RAW=has_raw, NEED_MIN=has_search, VERIFY=verify, **warps,
    )  # fmt: skip
    searches = tiling.searches if has_search else 0
    if verify and (info.need_top_k or info.need_top_p):  # min-p verifies without a pass
        _verify_kernel[grid](
            *rows, info.is_greedy, *ent, part, part_idx, verify_counts, vocab_size,
            tiling.num_tiles, BLOCK=tiling.block, TILES=tiling.tiles_pow2,
            HAS_ENTROPY=entropy is not None, **warps,
        )  # fmt: skip
    if has_search:
        intervals = torch.empty(2, num_rows, _NUM_INTERVALS.value, dtype=torch.int64,
                                device=device)  # fmt: skip
        totals = torch.zeros(searches, num_rows, 3, tiling.num_pivots, dtype=torch.int64,
                             device=device)  # fmt: skip
    for launch in range(searches):
        _search_kernel[grid](
            *rows, info.is_greedy, *ent, part, part_idx, verify_counts, intervals, totals,
            vocab_size, tiling.num_tiles, num_rows, launch, BLOCK=tiling.block,
            SEARCH_BLOCK=tiling.search_block, TILES=tiling.tiles_pow2, NUM=tiling.num_pivots,
            HAS_ENTROPY=entropy is not None, VERIFY=verify, SEARCH_K=info.need_top_k,
            SEARCH_P=info.need_top_p, SEARCH_E=has_ent_top_k, **warps,
        )  # fmt: skip
    has_final = has_trunc or has_subset
    fin = fin_idx = thresholds = part  # placeholders: the finish reads them only with a final
    if has_final:
        fin = torch.empty(num_rows, tiling.num_tiles, 3, dtype=torch.float32, device=device)
        fin_idx = torch.empty(num_rows, tiling.num_tiles, 2, dtype=torch.int32, device=device)
        thresholds = torch.empty(num_rows, 2, dtype=torch.float32, device=device)
        _final_kernel[grid](
            *rows, info.seeds, info.positions, info.is_greedy, *ent, part, part_idx,
            verify_counts, intervals, totals, fin, fin_idx, thresholds, vocab_size,
            tiling.num_tiles, num_rows, searches, BLOCK=tiling.block, TILES=tiling.tiles_pow2,
            NUM=tiling.num_pivots, HAS_ENTROPY=entropy is not None, HAS_TOP_K=info.need_top_k,
            HAS_TOP_P=info.need_top_p, HAS_MIN_P=info.need_min_p, HAS_ENT_TOP_K=has_ent_top_k,
            HAS_SUBSET=has_subset, VERIFY=verify, **warps,
        )  # fmt: skip
    _finish_kernel[(num_rows,)](
        *rows, info.is_greedy, *ent, part, part_idx, verify_counts, fin, fin_idx, thresholds,
        next_ids, logprobs, logprobs if entropies is None else entropies,
        next_ids if settled is None else settled, vocab_size, tiling.num_tiles,
        TILES=tiling.tiles_pow2, HAS_SAMPLED=not info.is_all_greedy, HAS_FINAL=has_final,
        HAS_ENTROPY=entropy is not None, HAS_RAW=has_raw, HAS_SUBSET=has_subset,
        HAS_ENT_TOP_K=has_ent_top_k, VERIFY=verify, RECORD_SETTLED=settled is not None,
        **warps,
    )  # fmt: skip


def settled_rows(
    logits: torch.Tensor, info: SamplingRows, entropy: EntropyPlan | None = None
) -> torch.Tensor:
    """bool [B]: the rows of a :func:`sample_triton` call whose token verification settled
    (their whole-row Gumbel-max lies in their allowed set, so no search or final pass ran for
    them). For measuring how often verification pays off (benchmark/bench_sampling.py)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows = logits.shape[0]
    device = logits.device
    settled = torch.zeros(num_rows, dtype=torch.int8, device=device)
    if num_rows:
        next_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
        logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
        entropies = None if entropy is None else torch.empty_like(logprobs)
        _launch(logits, info, entropy, next_ids, logprobs, entropies, True, settled)
    return settled.bool()
