"""Device functions of the fused sampler (:mod:`sgl_kernel.sampling`): what one program does
with one tile of a logits row, and how the partial results of a row's tiles are combined.

A row of V logits is cut into ``cdiv(V, BLOCK)`` tiles of BLOCK columns, a constant of the
device and the vocabulary (never of the batch). Each kernel of the sampler runs one program per
(tile, row); per-tile partials are combined by :func:`merged_softmax` and
:func:`merged_argmax` in one fixed reduction tree. So a row's bits depend on its own logits
only, never on the batch or on which kernels ran before.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_kernel.sampling_contract import (
    HASH_MUL1,
    HASH_MUL2,
    POSITION_SALT,
    UNIFORM_SCALE,
    UNIFORM_SHIFT,
)

_MUL1 = tl.constexpr(HASH_MUL1)
_MUL2 = tl.constexpr(HASH_MUL2)
_SALT = tl.constexpr(POSITION_SALT)
_U_SHIFT = tl.constexpr(UNIFORM_SHIFT)
_U_SCALE = tl.constexpr(UNIFORM_SCALE)
RAW = tl.constexpr(1)
SAMPLED = tl.constexpr(3)
# Probability mass as a fixed-point integer: p * 2**44, truncated. Integer sums are exact in
# any order, so the top-p mass of a pivot does not depend on how the row was cut or summed.
MASS_SCALE = tl.constexpr(2.0**44)

# Fields of the per-tile statistics (float32 [B, tiles, STATS]; argmax indices in a separate
# int32 [B, tiles, 2]: the logits' argmax, then the Gumbel-max's).
X = tl.constexpr(0)  # max, sum exp, sum exp * dev of x = logits / T (3 fields)
L = tl.constexpr(3)  # the same of the raw logits (raw-entropy rows with T != 1)
MIN_L = tl.constexpr(6)
MIN_X = tl.constexpr(7)
BEST_L = tl.constexpr(8)
BEST_S = tl.constexpr(9)
STATS = tl.constexpr(10)
# Fields of the final pass's per-tile partials (float32 [B, tiles, 3] and int32 [B, tiles, 2]).
FIN_BEST = tl.constexpr(0)
FIN_S = tl.constexpr(1)
FIN_A = tl.constexpr(2)


@triton.jit
def hash32(x):
    """The contract hash on uint32 (multiplication wraps mod 2**32; shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * _MUL1
    x = x ^ (x >> 15)
    x = x * _MUL2
    return x ^ (x >> 15)


@triton.jit
def row_noise_key(seeds_ptr, positions_ptr, row):
    """The row's noise key: hash(seed ^ hash(position ^ salt))."""
    seed_key = hash32(tl.load(positions_ptr + row).to(tl.uint32) ^ _SALT)
    return hash32(tl.load(seeds_ptr + row).to(tl.uint32) ^ seed_key)


@triton.jit
def neg_log_gumbel(row_key, cols):
    """log(-log(u)) = -g of the contract noise at columns ``cols`` (int32) of a row."""
    bits = hash32(row_key ^ cols.to(tl.uint32))
    u = ((bits >> _U_SHIFT).to(tl.float32) + 0.5) * _U_SCALE
    return tl.log(-tl.log(u))


@triton.jit
def softmax_stats(v, WITH_DEV: tl.constexpr):
    """(max m, sum exp(v - m), sum exp(v - m)(v - m)) of a tile; -inf entries have
    probability 0 and add nothing (no NaN from 0 * -inf)."""
    m = tl.max(v, axis=0)
    base = tl.where(m == float("-inf"), 0.0, m)
    # -inf -> -FLT_MAX: exp is still 0, and 0 * -FLT_MAX is 0 where 0 * -inf would be NaN.
    dev = tl.maximum(v - base, -3.4028234663852886e38)
    e = tl.exp(dev)
    a = tl.zeros([], dtype=tl.float32)
    if WITH_DEV:
        a = tl.sum(e * dev, axis=0)
    return m, tl.sum(e, axis=0), a


@triton.jit
def merged_softmax(ptr, ok):
    """Combine per-tile (m, s, a) triples at ``ptr``, ``ptr + 1``, ``ptr + 2`` ([T] pointers,
    ``ok`` masking padding) into the row's (max, sum exp(v - max), sum exp(v - max)(v - max))."""
    m = tl.load(ptr, mask=ok, other=float("-inf"))
    s = tl.load(ptr + 1, mask=ok, other=0.0)
    a = tl.load(ptr + 2, mask=ok, other=0.0)
    big = tl.max(m, axis=0)
    base = tl.where(big == float("-inf"), 0.0, big)
    shift = tl.where(m == float("-inf"), 0.0, m - base)  # <= 0; rescales a tile's sums
    alpha = tl.exp(shift)
    return big, tl.sum(alpha * s, axis=0), tl.sum(alpha * (a + s * shift), axis=0)


@triton.jit
def merged_argmax(vals, idx):
    """(max, smallest index holding it) over per-tile (max, first index) pairs."""
    best = tl.max(vals, axis=0)
    return best, tl.min(tl.where(vals == best, idx, 2147483647), axis=0)


@triton.jit
def entropy_of(s, a):
    """log S - A / S; 0 for the empty sums of statistics a row did not collect."""
    s = tl.where(s > 0.0, s, 1.0)
    return tl.log(s) - a / s


@triton.jit
def tile_argmax(v, cols):
    """(max, first column holding it) of a tile; column 0 when the tile is all -inf."""
    best = tl.max(v, axis=0)
    idx = tl.min(tl.where(v == best, cols, 2147483647), axis=0)
    return best, tl.where(best == float("-inf"), 0, idx)


@triton.jit
def sort_key(v):
    """float32 -> int32 with the same order (-0.0 folded into +0.0: they compare equal)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def key_value(key):
    """Inverse of :func:`sort_key` (``key`` int64 holding an int32 key)."""
    k = key.to(tl.int32)
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def narrow(lo, hi, pivots, holds):
    """New [lo, hi] of a search for the largest key with a property that holds up to the
    answer and not above it: the largest pivot where it holds, below the smallest where not."""
    new_lo = tl.max(tl.where(holds, pivots, lo), axis=0)
    new_hi = tl.min(tl.where(holds, hi, pivots - 1), axis=0)
    return new_lo, new_hi


@triton.jit
def pivots_of(lo, hi, NUM: tl.constexpr):
    """NUM int64 pivots in (lo, hi], evenly spread (ceil), for a non-empty interval."""
    j = tl.arange(0, NUM).to(tl.int64) + 1
    return lo + ((hi - lo) * j + NUM) // (NUM + 1)


@triton.jit
def tile_keys(part_ptr):
    """The (min, max) sort keys of a tile's logits and of its x = logits / T, from the stats
    pass's partials at ``part_ptr`` (the minima are written when the batch searches)."""
    min_l = sort_key(tl.load(part_ptr + MIN_L)).to(tl.int64)
    max_l = sort_key(tl.load(part_ptr + BEST_L)).to(tl.int64)
    min_x = sort_key(tl.load(part_ptr + MIN_X)).to(tl.int64)
    max_x = sort_key(tl.load(part_ptr + X)).to(tl.int64)
    return min_l, max_l, min_x, max_x


@triton.jit
def count_tile(row_ptr, begin, end, temp, log_z, k_piv, p_piv, e_piv, k_cmp, p_cmp, e_cmp,
               k_above, p_above, e_above, SEARCH_BLOCK: tl.constexpr, NUM: tl.constexpr,
               SEARCH_K: tl.constexpr, SEARCH_P: tl.constexpr,
               SEARCH_E: tl.constexpr):  # fmt: skip
    """Over columns [begin, end): per pivot, the count of logits whose key is >= the pivot
    (top-k, entropy top-k) and the fixed-point probability mass of x >= the pivot (top-p).

    A search compares only where its ``*_cmp`` flag says the tile's keys overlap its interval.
    Where ``*_above`` says every key of the tile is above the interval (so above every pivot),
    a count is the tile's column count without reading it, and the mass is the tile's total
    (each column's mass truncated as in the compare, so the sum is the same integer). Otherwise
    the tile adds nothing. Compares accumulate elementwise into [NUM, SEARCH_BLOCK] and are
    reduced once at the end. Pivots exceed the key of -inf, so padding columns never count."""
    # [NUM, SEARCH_BLOCK] (pivots x columns): Triton's default layout then gives each thread
    # whole columns with every pivot in its registers, so a column's key is compared where it
    # was loaded (no per-step layout exchange through shared memory).
    k_piv32 = k_piv.to(tl.int32)[:, None]
    p_piv32 = p_piv.to(tl.int32)[:, None]
    e_piv32 = e_piv.to(tl.int32)[:, None]
    k_acc = tl.zeros([NUM, SEARCH_BLOCK], dtype=tl.int32)
    e_acc = tl.zeros([NUM, SEARCH_BLOCK], dtype=tl.int32)
    p_acc = tl.zeros([NUM, SEARCH_BLOCK], dtype=tl.int64)
    p_all = tl.zeros([SEARCH_BLOCK], dtype=tl.int64)
    stop = tl.where(k_cmp | e_cmp | p_cmp | p_above, end, begin)
    for start in range(begin, stop, SEARCH_BLOCK):
        cols = start + tl.arange(0, SEARCH_BLOCK)
        logit = tl.load(row_ptr + cols, mask=cols < end, other=float("-inf")).to(tl.float32)
        l_key = sort_key(logit)[None, :]
        if SEARCH_K:  # noqa: SIM102 (constexpr guard: compiled out)
            if k_cmp:
                k_acc += (l_key >= k_piv32).to(tl.int32)
        if SEARCH_E:  # noqa: SIM102 (constexpr guard: compiled out)
            if e_cmp:
                e_acc += (l_key >= e_piv32).to(tl.int32)
        if SEARCH_P:  # noqa: SIM102 (constexpr guard: compiled out)
            if p_cmp | p_above:
                x = tl.math.div_rn(logit, temp)
                mass = (tl.exp(x - log_z) * MASS_SCALE).to(tl.int64)
                if p_cmp:
                    p_acc += tl.where(sort_key(x)[None, :] >= p_piv32, mass[None, :], 0)
                else:
                    p_all += mass
    columns = (end - begin).to(tl.int64)
    k_count = tl.sum(k_acc, axis=1).to(tl.int64) + tl.where(k_above, columns, 0)
    e_count = tl.sum(e_acc, axis=1).to(tl.int64) + tl.where(e_above, columns, 0)
    return k_count, e_count, tl.sum(p_acc, axis=1) + tl.sum(p_all, axis=0)
