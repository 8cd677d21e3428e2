"""A C++ prefill (EXTEND) attention kernel for CPU (``--disable-cpu-attention-kernel`` turns it
off together with the decode kernel).

The torch fallback makes one SDPA call per request, and a request with a cached prefix first
gathers its whole K/V out of the pool with ``index_select``. This kernel is one call per layer
for the whole batch and reads K/V in place through the request-to-token table.

Contract (:func:`extend_attention`): the batch's new tokens are concatenated in batch order in
``q`` [T, H*D]; request ``i`` has ``prefix_lens[i]`` tokens cached before this step and
``extend_lens[i]`` new ones, whose K/V are already stored in the pool; its new token ``j``
(absolute position ``prefix_lens[i] + j``) attends to the keys at positions
``0 .. prefix_lens[i] + j`` (causal, bottom-right aligned), key ``pos`` living in slot
``req_to_token[req_pool_indices[i], pos]`` of the layer's ``k_cache``/``v_cache`` [S, KVH, D].
Query head ``hq`` uses KV head ``hq // (H / KVH)``. The output has ``q``'s dtype; sums and the
softmax are float32 (products too, but for the bfloat16 path below).

Algorithm (flash-style tiling with an online softmax):

* Work items are (request, KV head, block of new tokens): a request of ``n`` new tokens takes
  ``max(ceil(n / 128), min(4, ceil(n / 32)))`` blocks of equal size (big blocks read each K/V
  row fewer times; four keep a short prompt's work shared among threads). Longest first, one
  task per torch thread pulls them from an atomic counter, so a long request does not leave
  the other threads idle at the end. Items are independent, so the result does not depend on
  the thread count.
* An item's ``rows * G`` query vectors (the G query heads of its KV head for each row) are
  stored transposed, ``[D, M]`` with the query index innermost (padded to whole vectors), so
  every step below runs down vectors of queries: the softmax needs no horizontal reduction,
  and K/V rows are used as they lie in the pool (float32) or converted once per block
  (bfloat16), one broadcast element at a time.
* The keys the item's last row sees are walked in blocks of ``kKeyBlock`` (aligned to end at
  that row, so the causal diagonal takes as few blocks as possible). Per block and per tile of
  two vectors of queries, only the keys the tile's last row sees: scores ``kScoreKeys`` keys x
  the tile in registers; per query the running max and sum are updated (keys past the query's
  position get probability 0); the accumulator is rescaled and ``p . V`` added,
  ``kValueDims`` columns x the tile in registers. Each K/V row is read once per item, not
  once per query.
* ``exp`` is a degree-6 polynomial on a range reduction (relative error < 2e-7). The tiles use
  GCC vector extensions of the host's register width (16 floats with AVX-512, 8 with AVX2, 4
  with NEON), compiled with ``-O3 -march=native``; no intrinsics but the guarded ones below.
* With bfloat16 queries and K/V on a host with AVX512-BF16 (only where the compiler defines
  ``__AVX512BF16__``), both products use ``vdpbf16ps`` (bfloat16 pairs, exact products,
  float32 sums): twice the float32 FMA rate. There ``p`` is rounded to bfloat16 for ``p . V``
  (as SDPA's bfloat16 path does) and the denominators sum the rounded values. Elsewhere all
  arithmetic is float32 on the converted values.
* On a CPU with AMX (:func:`tiles_supported`) bfloat16 batches take a third path instead
  (``attend_item_tiles``): per block of ``kTileKeys`` (128) keys, both products are one call
  each of oneDNN's brgemm micro-kernel (torch's ``at::native::cpublas::brgemm``, which runs
  them on the tile unit), ``S = Q K^T`` with the block's keys repacked into pairs of dims (16 x
  16 transposes in registers) and ``acc += P V`` with its values as pairs of keys; work items
  are ``kTileRows`` (64) new tokens, the queries rows of ``[rows * G, D]`` and the online
  softmax runs along each row's 128 scores. Its numbers are the ``vdpbf16ps`` path's (exact
  products, float32 sums, ``p`` rounded to bfloat16), summed in another order. Measured on
  SmolLM2's heads (``benchmark/bench_cpu_extend_attention.py``, 2 threads, Emerald Rapids):
  1.9-2.6x the ``vdpbf16ps`` path, e.g. 13.4 against 27.0 ms a layer for 40 prompts of
  20-400 tokens; its time is then about half the softmax's ``exp`` and a quarter the tiles.

bfloat16 is handled as raw 16 bits (the high half of a float32). The head dim must be a
multiple of 16 (:func:`kernel_supports`); 64 and 128 get loops of a fixed trip count.
"""

from __future__ import annotations

import functools

import torch

from sglang.srt.layers import cpu_brgemm
from sglang.srt.layers.cpu_extension import CpuKernel, cpu_flags
from sglang.srt.layers.cpu_prepack import native_bf16_supported

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_CPP_SOURCE = r"""

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

// One vector register of floats: 16 with AVX-512, 8 with AVX, else 4 (SSE, NEON). Generic
// vectors wider than the host's registers are lowered piecewise, which GCC does poorly (an
// AVX2 build with 16-float vectors ran ~30x slower).
#if defined(__AVX512F__)
constexpr int64_t kVecBytes = 64;
#elif defined(__AVX__)
constexpr int64_t kVecBytes = 32;
#else
constexpr int64_t kVecBytes = 16;
#endif
using vf = float __attribute__((vector_size(kVecBytes)));
using vi = int32_t __attribute__((vector_size(kVecBytes)));  // exp's exponent bits
constexpr int64_t kLanes = kVecBytes / 4;

// Unaligned vector load/store (the pool's rows are only 4-byte aligned in general).
inline vf loadv(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

inline float load(float x) { return x; }
inline float load(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even (outputs are finite)
  *dst = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0, per lane: 2^n * e^r with n = round(x / ln 2) (rounded by adding and
// subtracting 1.5 * 2^23), |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 6 (relative
// error < 2e-7); x is clamped at -87 (~1.6e-38, not 0).
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const vf p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f +
      r * (8.3333338e-3f + r * 1.3888889e-3f)))));
  return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

constexpr int64_t kKeyBlock = 32;  // keys per block of the online softmax
// A request's new tokens are split into work items of at most kQueryRows, and into at least
// kMinItems where it has more than (kMinItems - 1) * kMinQueryRows (one item per kMinQueryRows
// where fewer), so that a short prompt still gives the threads work to share (item_blocks).
constexpr int64_t kQueryRows = 128;
constexpr int64_t kMinQueryRows = 32;
constexpr int64_t kMinItems = 4;
// The AMX path (attend_item_tiles): keys per block (one brgemm call per product) and new
// tokens per work item.
constexpr int64_t kTileKeys = 128;
constexpr int64_t kTileRows = 64;
// Register tiles over two vectors of queries: scores kScoreKeys keys, p . V kValueDims columns,
// so 2 * 8 accumulators where there are 32 vector registers (AVX-512, NEON), 2 * 4 where there
// are 16 (AVX2, SSE).
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int64_t kScoreKeys = 8;
constexpr int64_t kValueDims = 8;
#else
constexpr int64_t kScoreKeys = 4;
constexpr int64_t kValueDims = 4;
#endif
// Running max before any key: the first block's rescale exp(kNoMax - max) is ~0 and multiplies
// the zeroed accumulators and sums.
constexpr float kNoMax = -1e30f;

// The running max of the query rows [m, m + kLanes) after the block's kl keys (scores s, [kl,
// Mp]): key t0 + t counts for a row whose position (lim) is at least t0 + t (causal). Without
// kMasked every row sees every key (blocks before the diagonal: no compare per key, measured
// 1.02-1.12x on the whole kernel, same bits).
template <bool kMasked>
inline vf block_max(const float* __restrict s, int64_t kl, int64_t Mp, int64_t m, int64_t t0,
                    vf lim, vf old_max) {
  vf new_max = old_max;
  for (int64_t t = 0; t < kl; ++t) {
    const vf st = loadv(s + t * Mp + m);
    if constexpr (kMasked) {
      new_max = (static_cast<float>(t0 + t) <= lim) & (st > new_max) ? st : new_max;
    } else {
      new_max = st > new_max ? st : new_max;
    }
  }
  return new_max;
}

// p = exp(score - max) for key t0 + t (0 where the row's position lim is below t0 + t).
template <bool kMasked>
inline vf block_prob(vf score, vf new_max, int64_t t0, int64_t t, vf lim) {
  const vf p = exp_nonpositive(score - new_max);
  if constexpr (kMasked) return static_cast<float>(t0 + t) <= lim ? p : vf{};
  return p;
}

// Closes a block for the rows [m, m + kLanes): alpha = exp(old max - new max) rescales the
// running sum (and, in the value tiles, the accumulators); the block's sum is added.
inline void update_softmax_stats(int64_t m, vf old_max, vf new_max, vf block_sum,
                                 float* __restrict alpha, float* __restrict run_sum,
                                 float* __restrict run_max) {
  const vf a = exp_nonpositive(old_max - new_max);
  storev(alpha + m, a);
  storev(run_sum + m, loadv(run_sum + m) * a + block_sum);
  storev(run_max + m, new_max);
}

// The online softmax of the rows [m, m + kLanes) over the block's kl keys: scores s [kl, Mp]
// replaced by p in place, the running max and sum updated, alpha set (kMasked: block_max).
template <bool kMasked>
inline void block_softmax(float* __restrict s, int64_t kl, int64_t Mp, int64_t m, int64_t t0,
                          vf lim, float* __restrict alpha, float* __restrict run_sum,
                          float* __restrict run_max) {
  const vf old_max = loadv(run_max + m);
  const vf new_max = block_max<kMasked>(s, kl, Mp, m, t0, lim, old_max);
  vf sum = {};
  for (int64_t t = 0; t < kl; ++t) {
    const vf p = block_prob<kMasked>(loadv(s + t * Mp + m), new_max, t0, t, lim);
    storev(s + t * Mp + m, p);
    sum += p;
  }
  update_softmax_stats(m, old_max, new_max, sum, alpha, run_sum, run_max);
}

// s[t][m, m + 16 NV) = sum_d qt[d][m ...] * krow[t][d] for kScoreKeys keys (rows of D floats;
// qt is [D, Mp], s is [kKeyBlock, Mp]).
template <int64_t NV>
inline void score_tile(const float* __restrict qt, const float* const* krow, int64_t D,
                       int64_t Mp, int64_t m, float* __restrict s) {
  vf acc[kScoreKeys][NV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf qv[NV];
    for (int64_t c = 0; c < NV; ++c) qv[c] = loadv(qt + d * Mp + m + c * kLanes);
    for (int64_t t = 0; t < kScoreKeys; ++t) {
      const float k = krow[t][d];
      for (int64_t c = 0; c < NV; ++c) acc[t][c] += qv[c] * k;
    }
  }
  for (int64_t t = 0; t < kScoreKeys; ++t) {
    for (int64_t c = 0; c < NV; ++c) storev(s + t * Mp + m + c * kLanes, acc[t][c]);
  }
}

// a[i][c] = alpha[m + c * kLanes ...] * acct[d + i][m + c * kLanes ...]: a value tile's running
// sums (acct is [D, Mp]), rescaled to the new softmax max, in registers.
template <int64_t NV>
inline void load_scaled_tile(const float* __restrict acct, const float* __restrict alpha,
                             int64_t d, int64_t Mp, int64_t m, vf (&a)[kValueDims][NV]) {
  for (int64_t c = 0; c < NV; ++c) {
    const vf al = loadv(alpha + m + c * kLanes);
    for (int64_t i = 0; i < kValueDims; ++i) {
      a[i][c] = loadv(acct + (d + i) * Mp + m + c * kLanes) * al;
    }
  }
}

// The tile back into acct (the inverse of load_scaled_tile's addressing).
template <int64_t NV>
inline void store_tile(const vf (&a)[kValueDims][NV], int64_t d, int64_t Mp, int64_t m,
                       float* __restrict acct) {
  for (int64_t i = 0; i < kValueDims; ++i) {
    for (int64_t c = 0; c < NV; ++c) storev(acct + (d + i) * Mp + m + c * kLanes, a[i][c]);
  }
}

// acct[d, d + kValueDims)[m, m + 16 NV) = alpha[m ...] * acct[...] + sum_{t < nb} p[t][m ...] *
// vrow[t][d ...] (acct is [D, Mp], p is [kKeyBlock, Mp]).
template <int64_t NV>
inline void value_tile(const float* __restrict p, const float* const* vrow, int64_t nb,
                       int64_t d, int64_t Mp, int64_t m, const float* __restrict alpha,
                       float* __restrict acct) {
  vf a[kValueDims][NV];
  load_scaled_tile<NV>(acct, alpha, d, Mp, m, a);
  for (int64_t t = 0; t < nb; ++t) {
    vf pv[NV];
    for (int64_t c = 0; c < NV; ++c) pv[c] = loadv(p + t * Mp + m + c * kLanes);
    for (int64_t i = 0; i < kValueDims; ++i) {
      const float v = vrow[t][d + i];
      for (int64_t c = 0; c < NV; ++c) a[i][c] += pv[c] * v;
    }
  }
  store_tile<NV>(a, d, Mp, m, acct);
}

struct Item {
  int64_t req;   // request (batch index)
  int64_t head;  // KV head
  int64_t row0;  // first new token of the block (0-based within the request)
  int64_t rows;  // new tokens in the block
  int64_t cost;  // rows * keys seen by the last one, for ordering
};

struct Batch {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  int64_t q_stride, out_stride, k_stride, k_head, v_stride, v_head;
  const int64_t* slots;  // req_to_token
  int64_t slots_stride;
  std::vector<int64_t> pool_row, prefix, q_offset;
  int64_t G, D;
  float scale;
  bool tiles;  // bfloat16 products as brgemm calls (AMX hosts; attend_item_tiles)
};

// Query vectors (rows * G) of an item, padded to whole vectors.
inline int64_t padded_rows(int64_t rows, int64_t G) {
  return (rows * G + kLanes - 1) / kLanes * kLanes;
}

// Scratch floats for one item of up to kQueryRows rows.
inline int64_t buf_floats(int64_t G, int64_t D) {
  const int64_t m = padded_rows(kQueryRows, G);
  return 2 * m * D + m * kKeyBlock + 2 * kKeyBlock * D + D + 4 * m;
}

// Everything is laid out with the query vectors (m = row * G + g) innermost, so the online
// softmax (max, exp, sums, rescale) runs down whole vectors with no horizontal reduction and
// K/V rows are used in their pool layout (one broadcast float at a time).
template <int kD, typename QT, typename KT>
void attend_item(const Batch& b, const Item& it, float* __restrict buf) {
  const int64_t D = kD ? kD : b.D, G = b.G;
  const int64_t M = it.rows * G, Mp = padded_rows(it.rows, G);
  float* __restrict qt = buf;                         // [D, Mp] scaled queries (pad: 0)
  float* __restrict acct = qt + Mp * D;               // [D, Mp] unnormalised outputs
  float* __restrict s = acct + Mp * D;                // [kKeyBlock, Mp] scores, then p
  float* __restrict kbuf = s + Mp * kKeyBlock;        // [kKeyBlock, D] converted key rows
  float* __restrict vbuf = kbuf + kKeyBlock * D;      // [kKeyBlock, D] converted value rows
  float* __restrict zero_row = vbuf + kKeyBlock * D;  // [D] zeros (keys past the last)
  float* __restrict run_max = zero_row + D;           // [Mp]
  float* __restrict run_sum = run_max + Mp;           // [Mp]
  float* __restrict alpha = run_sum + Mp;             // [Mp] rescale of acct for this block
  float* __restrict last_pos = alpha + Mp;            // [Mp] position of each vector's row

  const QT* q = static_cast<const QT*>(b.q);
  const int64_t head_col = it.head * G * D;  // first column of this KV head's query heads
  const int64_t tok0 = b.q_offset[it.req] + it.row0;
  const int64_t first_pos = b.prefix[it.req] + it.row0;  // position of the item's first row
  // Transposed with contiguous stores (strided stores would each touch another cache line).
  const QT* q_item = q + tok0 * b.q_stride + head_col;
  for (int64_t d = 0; d < D; ++d) {
    float* dst = qt + d * Mp;
    for (int64_t r = 0; r < it.rows; ++r) {
      for (int64_t g = 0; g < G; ++g) dst[r * G + g] = load(q_item[r * b.q_stride + g * D + d]);
    }
    for (int64_t m = 0; m < M; ++m) dst[m] *= b.scale;
    std::fill(dst + M, dst + Mp, 0.0f);
  }
  for (int64_t m = 0; m < Mp; ++m) {  // pad vectors take the last row's causal limit
    last_pos[m] = static_cast<float>(first_pos + std::min(m / G, it.rows - 1));
  }
  std::fill(acct, acct + Mp * D, 0.0f);
  std::fill(zero_row, zero_row + D, 0.0f);
  std::fill(run_max, run_max + Mp, kNoMax);
  std::fill(run_sum, run_sum + Mp, 0.0f);

  const KT* kp = static_cast<const KT*>(b.k) + it.head * b.k_head;
  const KT* vp = static_cast<const KT*>(b.v) + it.head * b.v_head;
  const int64_t* slots = b.slots + b.pool_row[it.req] * b.slots_stride;
  const int64_t num_keys = first_pos + it.rows;  // keys seen by the item's last row
  const float* krow[kKeyBlock + kScoreKeys];
  const float* vrow[kKeyBlock];
  // Blocks end at num_keys (the first one is the short one), so the causal triangle of the
  // item's rows takes the last block or two instead of straddling one more.
  for (int64_t t0 = 0, nb = (num_keys - 1) % kKeyBlock + 1; t0 < num_keys;
       t0 += nb, nb = kKeyBlock) {
    for (int64_t t = 0; t < nb; ++t) {
      const int64_t slot = slots[t0 + t];
      const KT* kr = kp + slot * b.k_stride;
      const KT* vr = vp + slot * b.v_stride;
      if constexpr (std::is_same_v<KT, float>) {
        krow[t] = kr;
        vrow[t] = vr;
      } else {
        float* kd = kbuf + t * D;
        float* vd = vbuf + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kd[d] = load(kr[d]);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vd[d] = load(vr[d]);
        krow[t] = kd;
        vrow[t] = vd;
      }
    }
    // Whole tiles of keys: the ones past nb score zero and are never read (the softmax and
    // p . V stop at nb).
    const int64_t nb_tiles = (nb + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
    for (int64_t t = nb; t < nb_tiles; ++t) krow[t] = zero_row;
    // Per tile of rows (two vectors, the last maybe one), only the keys its last row sees:
    // the causal triangle on the diagonal costs half a block, not a whole one. A tile that
    // sees none of the block keeps its state as it is.
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kLanes) {
      const int64_t nv = std::min<int64_t>(2, (Mp - m0) / kLanes);
      const int64_t last_row = std::min((m0 + nv * kLanes - 1) / G, it.rows - 1);
      const int64_t kl = std::clamp<int64_t>(first_pos + last_row + 1 - t0, 0, nb);
      if (kl == 0) continue;
      for (int64_t t = 0; t < kl; t += kScoreKeys) {
        if (nv == 2) {
          score_tile<2>(qt, krow + t, D, Mp, m0, s + t * Mp);
        } else {
          score_tile<1>(qt, krow + t, D, Mp, m0, s + t * Mp);
        }
      }
      // Online softmax per vector of rows: key t0 + t is visible to a row at position >= it
      // (masked only where some row of the tile is before the block's last key).
      const bool seen = t0 + kl <= first_pos + m0 / G + 1;
      for (int64_t m = m0; m < m0 + nv * kLanes; m += kLanes) {
        const vf lim = loadv(last_pos + m);
        if (seen) {
          block_softmax<false>(s, kl, Mp, m, t0, lim, alpha, run_sum, run_max);
        } else {
          block_softmax<true>(s, kl, Mp, m, t0, lim, alpha, run_sum, run_max);
        }
      }
      for (int64_t d = 0; d < D; d += kValueDims) {
        if (nv == 2) {
          value_tile<2>(s, vrow, kl, d, Mp, m0, alpha, acct);
        } else {
          value_tile<1>(s, vrow, kl, d, Mp, m0, alpha, acct);
        }
      }
    }
  }

  QT* out = static_cast<QT*>(b.out);
  for (int64_t m = 0; m < M; ++m) {
    const float inv = 1.0f / run_sum[m];
    QT* dst = out + (tok0 + m / G) * b.out_stride + head_col + (m % G) * D;
    for (int64_t d = 0; d < D; ++d) store(acct[d * Mp + m] * inv, dst + d);
  }
}

#if defined(__AVX512BF16__)
// bfloat16 queries and K/V on a host with AVX512-BF16: both products take bfloat16 pairs with
// vdpbf16ps (two multiply-adds per float32 lane, products exact, float32 sums), twice the
// float32 FMA rate. Queries and K/V are used as stored; p is rounded to bfloat16 for p . V (as
// SDPA's bfloat16 path does) and the softmax denominators sum the rounded values, so each
// output is an exact weighted mean of the value rows.
using vu = uint32_t __attribute__((vector_size(kVecBytes)));  // pairs of bfloat16
using u16v = uint16_t __attribute__((vector_size(kVecBytes / 2)));

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

inline __m512bh as_bh(vu x) { return (__m512bh)x; }

// The bfloat16 bits of each float (round to nearest even), in the high halves.
inline vu round_bf16_high(vf x) {
  vu bits = (vu)x;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bits & 0xffff0000u;
}

// s[t][m ...] = scale * sum_i qp[i][m ...] . krow[t][pair i] (pairs of bfloat16 as uint32;
// qp is [D / 2, Mp]).
template <int64_t NV>
inline void score_tile_bf16(const uint32_t* __restrict qp, const uint16_t* const* krow,
                            int64_t D, int64_t Mp, int64_t m, float scale,
                            float* __restrict s) {
  vf acc[kScoreKeys][NV] = {};
  for (int64_t i = 0; i < D / 2; ++i) {
    vu qv[NV];
    for (int64_t c = 0; c < NV; ++c) {
      __builtin_memcpy(&qv[c], qp + i * Mp + m + c * kLanes, sizeof(vu));
    }
    for (int64_t t = 0; t < kScoreKeys; ++t) {
      const vu k = vu{} + load_pair(krow[t] + 2 * i);
      for (int64_t c = 0; c < NV; ++c) {
        acc[t][c] = (vf)_mm512_dpbf16_ps((__m512)acc[t][c], as_bh(qv[c]), as_bh(k));
      }
    }
  }
  for (int64_t t = 0; t < kScoreKeys; ++t) {
    for (int64_t c = 0; c < NV; ++c) storev(s + t * Mp + m + c * kLanes, acc[t][c] * scale);
  }
}

// acct[d ...][m ...] = alpha * acct + sum_j pp[j][m ...] . vp[j][d ...] over key pairs j
// (pp [kKeyBlock / 2, Mp] and vp [kKeyBlock / 2, D]: pairs of bfloat16 as uint32).
template <int64_t NV>
inline void value_tile_bf16(const uint32_t* __restrict pp, const uint32_t* __restrict vp,
                            int64_t pairs, int64_t d, int64_t D, int64_t Mp, int64_t m,
                            const float* __restrict alpha, float* __restrict acct) {
  vf a[kValueDims][NV];
  load_scaled_tile<NV>(acct, alpha, d, Mp, m, a);
  for (int64_t j = 0; j < pairs; ++j) {
    vu pv[NV];
    for (int64_t c = 0; c < NV; ++c) {
      __builtin_memcpy(&pv[c], pp + j * Mp + m + c * kLanes, sizeof(vu));
    }
    for (int64_t i = 0; i < kValueDims; ++i) {
      const vu v = vu{} + vp[j * D + d + i];
      for (int64_t c = 0; c < NV; ++c) {
        a[i][c] = (vf)_mm512_dpbf16_ps((__m512)a[i][c], as_bh(pv[c]), as_bh(v));
      }
    }
  }
  store_tile<NV>(a, d, Mp, m, acct);
}

// The V rows of keys [0, 2 * pairs) (at slots[t]; zero_row from nb on) as pairs of keys:
// vp[j * D + d] = V[2j][d] | V[2j + 1][d] << 16, the B operand of p . V in bfloat16 pairs.
inline void pack_value_pairs(const uint16_t* vbase, int64_t v_stride, const int64_t* slots,
                             int64_t nb, int64_t pairs, int64_t D, const uint16_t* zero_row,
                             uint32_t* __restrict vp) {
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* v0 = 2 * j < nb ? vbase + slots[2 * j] * v_stride : zero_row;
    const uint16_t* v1 = 2 * j + 1 < nb ? vbase + slots[2 * j + 1] * v_stride : zero_row;
    uint32_t* dst = vp + j * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = v0[d] | (static_cast<uint32_t>(v1[d]) << 16);
  }
}

// Scratch floats for one item of up to kQueryRows rows on the bfloat16 path.
inline int64_t buf_floats_bf16(int64_t G, int64_t D) {
  const int64_t m = padded_rows(kQueryRows, G);
  return m * D / 2 + m * D + m * kKeyBlock + m * kKeyBlock / 2 + kKeyBlock * D / 2 + D +
         4 * m;
}

// block_softmax with p rounded to bfloat16 and stored as pairs of keys, pp [kKeyBlock / 2, Mp]
// (the A operand of p . V); the sums add the rounded values.
template <bool kMasked>
inline void block_softmax_bf16(const float* __restrict s, int64_t kl, int64_t Mp, int64_t m,
                               int64_t t0, vf lim, uint32_t* __restrict pp,
                               float* __restrict alpha, float* __restrict run_sum,
                               float* __restrict run_max) {
  const vf old_max = loadv(run_max + m);
  const vf new_max = block_max<kMasked>(s, kl, Mp, m, t0, lim, old_max);
  vf sum = {};
  for (int64_t j = 0; j < (kl + 1) / 2; ++j) {
    vu half[2];
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t t = 2 * j + e;
      const vf p = block_prob<kMasked>(loadv(s + t * Mp + m), new_max, t0, t, lim);
      // with an odd kl the last pair has one key (its partner's score is not computed)
      half[e] = t < kl ? round_bf16_high(p) : vu{};
      sum += (vf)half[e];
    }
    const vu packed = (half[0] >> 16) | half[1];
    __builtin_memcpy(pp + j * Mp + m, &packed, sizeof packed);
  }
  update_softmax_stats(m, old_max, new_max, sum, alpha, run_sum, run_max);
}

template <int kD>
void attend_item_bf16(const Batch& b, const Item& it, float* __restrict buf) {
  const int64_t D = kD ? kD : b.D, G = b.G;
  const int64_t M = it.rows * G, Mp = padded_rows(it.rows, G);
  uint32_t* __restrict qp = reinterpret_cast<uint32_t*>(buf);  // [D / 2, Mp] query pairs
  float* __restrict acct = buf + Mp * D / 2;                     // [D, Mp] unnormalised
  float* __restrict s = acct + Mp * D;                           // [kKeyBlock, Mp] scores
  uint32_t* __restrict pp = reinterpret_cast<uint32_t*>(s + Mp * kKeyBlock);  // p pairs
  uint32_t* __restrict vp = pp + Mp * kKeyBlock / 2;  // [kKeyBlock / 2, D] value pairs
  uint16_t* __restrict zero_row = reinterpret_cast<uint16_t*>(vp + kKeyBlock * D / 2);
  float* __restrict run_max = reinterpret_cast<float*>(zero_row) + D;  // [Mp]
  float* __restrict run_sum = run_max + Mp;
  float* __restrict alpha = run_sum + Mp;
  float* __restrict last_pos = alpha + Mp;

  const uint16_t* q = static_cast<const uint16_t*>(b.q);
  const int64_t head_col = it.head * G * D;
  const int64_t tok0 = b.q_offset[it.req] + it.row0;
  const int64_t first_pos = b.prefix[it.req] + it.row0;
  const uint16_t* q_item = q + tok0 * b.q_stride + head_col;
  for (int64_t i = 0; i < D / 2; ++i) {  // contiguous stores, as in attend_item
    uint32_t* dst = qp + i * Mp;
    for (int64_t r = 0; r < it.rows; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        dst[r * G + g] = load_pair(q_item + r * b.q_stride + g * D + 2 * i);
      }
    }
    std::fill(dst + M, dst + Mp, 0u);
  }
  for (int64_t m = 0; m < Mp; ++m) {
    last_pos[m] = static_cast<float>(first_pos + std::min(m / G, it.rows - 1));
  }
  std::fill(acct, acct + Mp * D, 0.0f);
  std::fill(zero_row, zero_row + D, uint16_t{0});
  std::fill(run_max, run_max + Mp, kNoMax);
  std::fill(run_sum, run_sum + Mp, 0.0f);

  const uint16_t* kbase = static_cast<const uint16_t*>(b.k) + it.head * b.k_head;
  const uint16_t* vbase = static_cast<const uint16_t*>(b.v) + it.head * b.v_head;
  const int64_t* slots = b.slots + b.pool_row[it.req] * b.slots_stride;
  const int64_t num_keys = first_pos + it.rows;
  const uint16_t* krow[kKeyBlock + kScoreKeys];
  for (int64_t t0 = 0, nb = (num_keys - 1) % kKeyBlock + 1; t0 < num_keys;
       t0 += nb, nb = kKeyBlock) {
    pack_value_pairs(vbase, b.v_stride, slots + t0, nb, (nb + 1) / 2, D, zero_row, vp);
    for (int64_t t = 0; t < nb; ++t) krow[t] = kbase + slots[t0 + t] * b.k_stride;
    const int64_t nb_tiles = (nb + kScoreKeys - 1) / kScoreKeys * kScoreKeys;
    for (int64_t t = nb; t < nb_tiles; ++t) krow[t] = zero_row;
    for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kLanes) {  // tiles of rows as in attend_item
      const int64_t nv = std::min<int64_t>(2, (Mp - m0) / kLanes);
      const int64_t last_row = std::min((m0 + nv * kLanes - 1) / G, it.rows - 1);
      const int64_t kl = std::clamp<int64_t>(first_pos + last_row + 1 - t0, 0, nb);
      if (kl == 0) continue;
      for (int64_t t = 0; t < kl; t += kScoreKeys) {
        if (nv == 2) {
          score_tile_bf16<2>(qp, krow + t, D, Mp, m0, b.scale, s + t * Mp);
        } else {
          score_tile_bf16<1>(qp, krow + t, D, Mp, m0, b.scale, s + t * Mp);
        }
      }
      const int64_t pairs = (kl + 1) / 2;
      const bool seen = t0 + kl <= first_pos + m0 / G + 1;  // as in attend_item
      for (int64_t m = m0; m < m0 + nv * kLanes; m += kLanes) {
        const vf lim = loadv(last_pos + m);
        if (seen) {
          block_softmax_bf16<false>(s, kl, Mp, m, t0, lim, pp, alpha, run_sum, run_max);
        } else {
          block_softmax_bf16<true>(s, kl, Mp, m, t0, lim, pp, alpha, run_sum, run_max);
        }
      }
      for (int64_t d = 0; d < D; d += kValueDims) {
        if (nv == 2) {
          value_tile_bf16<2>(pp, vp, pairs, d, D, Mp, m0, alpha, acct);
        } else {
          value_tile_bf16<1>(pp, vp, pairs, d, D, Mp, m0, alpha, acct);
        }
      }
    }
  }

  uint16_t* out = static_cast<uint16_t*>(b.out);
  for (int64_t m = 0; m < M; ++m) {
    const float inv = 1.0f / run_sum[m];
    uint16_t* dst = out + (tok0 + m / G) * b.out_stride + head_col + (m % G) * D;
    for (int64_t d = 0; d < D; ++d) store(acct[d * Mp + m] * inv, dst + d);
  }
}

// ---- bfloat16 on AMX: both products as brgemm calls -------------------------------------------
// On a host with AMX the two products of a key block are oneDNN brgemm calls (torch's
// at::native::cpublas::brgemm, which runs them on the tile unit): S = Q K^T with the block's
// keys repacked as VNNI pairs of dims ([D / 2, kTileKeys, 2]), then acc += P V with the block's
// values as pairs of keys ([kTileKeys / 2, D, 2]). Queries are rows here ([Mp, D], row
// m = r * G + g, padded to whole tiles of 16 with zeros), so the online softmax runs along a
// row of kTileKeys scores. The numbers are the bfloat16 path's: exact products, float32 sums,
// p rounded to bfloat16 and the denominators summing the rounded values.

inline int64_t tile_padded_rows(int64_t rows, int64_t G) { return (rows * G + 15) / 16 * 16; }

// Scratch floats for one item of up to kTileRows rows on the AMX path.
inline int64_t buf_floats_tiles(int64_t G, int64_t D) {
  const int64_t m = tile_padded_rows(kTileRows, G);
  return m * D / 2 + D * kTileKeys + m * kTileKeys / 2 + m * kTileKeys + m * D + 4 * m + D;
}

// One row's softmax over the block: its first kl scores count (the keys it sees). Writes the
// row's p (rounded to bfloat16; 0 past kl) and returns the block's max (old_max if kl == 0);
// *sum gets the sum of the rounded p.
inline float softmax_row(const float* __restrict srow, int64_t kl, float scale, float old_max,
                         uint16_t* __restrict prow, float* __restrict sum) {
  const vi lane = __builtin_convertvector(
      (vf){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, vi);
  vf x[kTileKeys / kLanes];
  vf mx = vf{} + old_max;
  for (int64_t c = 0; c < kTileKeys / kLanes; ++c) {
    x[c] = loadv(srow + c * kLanes) * scale;
    mx = (lane + static_cast<int32_t>(c * kLanes) < static_cast<int32_t>(kl)) & (x[c] > mx)
             ? x[c] : mx;
  }
  const float new_max = _mm512_reduce_max_ps((__m512)mx);
  vf total = {};
  for (int64_t c = 0; c < kTileKeys / kLanes; ++c) {
    if (c * kLanes >= kl) {  // keys the row does not see (the causal diagonal): p = 0
      std::fill(prow + c * kLanes, prow + kTileKeys, uint16_t{0});
      break;
    }
    const vf p = exp_nonpositive(x[c] - new_max);
    const vu bits = (lane + static_cast<int32_t>(c * kLanes) < static_cast<int32_t>(kl))
                        ? round_bf16_high(p) : vu{};
    total += (vf)bits;
    const u16v half = __builtin_convertvector(bits >> 16, u16v);
    __builtin_memcpy(prow + c * kLanes, &half, sizeof half);
  }
  *sum = _mm512_reduce_add_ps((__m512)total);
  return new_max;
}

// One butterfly round of a 16 x 16 transpose of 32-bit values: rows r and r + B (r & B == 0)
// swap their blocks of B values.
template <int B>
inline void butterfly(vu (&x)[16]) {
  for (int r = 0; r < 16; ++r) {
    if (r & B) continue;
    vu lo, hi;
    if constexpr (B == 8) {
      lo = __builtin_shufflevector(x[r], x[r + B], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                   21, 22, 23);
      hi = __builtin_shufflevector(x[r], x[r + B], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                   27, 28, 29, 30, 31);
    } else if constexpr (B == 4) {
      lo = __builtin_shufflevector(x[r], x[r + B], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11,
                                   24, 25, 26, 27);
      hi = __builtin_shufflevector(x[r], x[r + B], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15,
                                   28, 29, 30, 31);
    } else if constexpr (B == 2) {
      lo = __builtin_shufflevector(x[r], x[r + B], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25,
                                   12, 13, 28, 29);
      hi = __builtin_shufflevector(x[r], x[r + B], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27,
                                   14, 15, 30, 31);
    } else {
      lo = __builtin_shufflevector(x[r], x[r + B], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26,
                                   12, 28, 14, 30);
      hi = __builtin_shufflevector(x[r], x[r + B], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27,
                                   13, 29, 15, 31);
    }
    x[r] = lo;
    x[r + B] = hi;
  }
}

// The block's K rows (keys [0, nb) at slots[t]; zero_row past nb) as VNNI pairs of dims:
// kp32[i * kTileKeys + t] = the pair (2i, 2i + 1) of key t. By 16 x 16 transposes in
// registers where the head dim is a multiple of 32 (contiguous 64-byte stores), else one pair
// at a time.
inline void pack_key_pairs(const uint16_t* kbase, int64_t k_stride, const int64_t* slots,
                           int64_t nb, int64_t D, const uint16_t* zero_row,
                           uint32_t* __restrict kp32) {
  if (D % 32 != 0) {
    for (int64_t t = 0; t < kTileKeys; ++t) {
      const uint16_t* kr = t < nb ? kbase + slots[t] * k_stride : zero_row;
      for (int64_t i = 0; i < D / 2; ++i) kp32[i * kTileKeys + t] = load_pair(kr + 2 * i);
    }
    return;
  }
  for (int64_t tb = 0; tb < kTileKeys; tb += 16) {
    const uint16_t* rows[16];
    for (int64_t j = 0; j < 16; ++j) {
      rows[j] = tb + j < nb ? kbase + slots[tb + j] * k_stride : zero_row;
    }
    for (int64_t c = 0; c < D / 32; ++c) {  // 16 pairs of dims at a time
      vu x[16];
      for (int64_t j = 0; j < 16; ++j) __builtin_memcpy(&x[j], rows[j] + 32 * c, sizeof(vu));
      butterfly<8>(x);
      butterfly<4>(x);
      butterfly<2>(x);
      butterfly<1>(x);
      for (int64_t i = 0; i < 16; ++i) {
        __builtin_memcpy(kp32 + (16 * c + i) * kTileKeys + tb, &x[i], sizeof(vu));
      }
    }
  }
}

template <int kD>
void attend_item_tiles(const Batch& b, const Item& it, float* __restrict buf) {
  const int64_t D = kD ? kD : b.D, G = b.G;
  const int64_t M = it.rows * G, Mp = tile_padded_rows(it.rows, G);
  uint16_t* __restrict qa = reinterpret_cast<uint16_t*>(buf);  // [Mp, D] queries
  uint16_t* __restrict kp = qa + Mp * D;                         // [D / 2, kTileKeys, 2]
  uint16_t* __restrict vpk = kp + D * kTileKeys;                 // [kTileKeys / 2, D, 2]
  uint16_t* __restrict pb = vpk + kTileKeys * D;                 // [Mp, kTileKeys] p
  float* __restrict s = reinterpret_cast<float*>(pb + Mp * kTileKeys);  // [Mp, kTileKeys]
  float* __restrict acc = s + Mp * kTileKeys;                    // [Mp, D] unnormalised
  float* __restrict run_max = acc + Mp * D;                      // [Mp]
  float* __restrict run_sum = run_max + Mp;
  float* __restrict new_max = run_sum + Mp;
  float* __restrict block_sum = new_max + Mp;
  uint16_t* __restrict zero_row = reinterpret_cast<uint16_t*>(block_sum + Mp);  // [D]

  const uint16_t* q = static_cast<const uint16_t*>(b.q);
  const int64_t head_col = it.head * G * D;
  const int64_t tok0 = b.q_offset[it.req] + it.row0;
  const int64_t first_pos = b.prefix[it.req] + it.row0;
  for (int64_t r = 0; r < it.rows; ++r) {
    __builtin_memcpy(qa + r * G * D, q + (tok0 + r) * b.q_stride + head_col,
                     G * D * sizeof(uint16_t));
  }
  std::fill(qa + M * D, qa + Mp * D, uint16_t{0});
  std::fill(pb, pb + Mp * kTileKeys, uint16_t{0});  // pad rows keep p = 0
  std::fill(acc, acc + Mp * D, 0.0f);
  std::fill(run_max, run_max + Mp, kNoMax);
  std::fill(run_sum, run_sum + Mp, 0.0f);
  std::fill(new_max, new_max + Mp, kNoMax);
  std::fill(block_sum, block_sum + Mp, 0.0f);
  std::fill(zero_row, zero_row + D, uint16_t{0});

  const uint16_t* kbase = static_cast<const uint16_t*>(b.k) + it.head * b.k_head;
  const uint16_t* vbase = static_cast<const uint16_t*>(b.v) + it.head * b.v_head;
  const int64_t* slots = b.slots + b.pool_row[it.req] * b.slots_stride;
  const int64_t num_keys = first_pos + it.rows;
  uint32_t* __restrict kp32 = reinterpret_cast<uint32_t*>(kp);
  uint32_t* __restrict vp32 = reinterpret_cast<uint32_t*>(vpk);
  // Blocks end at num_keys (the first one is the short one), as in attend_item.
  for (int64_t t0 = 0, nb = (num_keys - 1) % kTileKeys + 1; t0 < num_keys;
       t0 += nb, nb = kTileKeys) {
    // The next block's K/V rows into the cache while this one is computed: the slots are
    // scattered, so the hardware prefetcher does not see them coming.
    const int64_t next_end = std::min(num_keys, t0 + nb + kTileKeys);
    for (int64_t t = t0 + nb; t < next_end; ++t) {
      for (int64_t off = 0; off < D; off += 32) {
        __builtin_prefetch(kbase + slots[t] * b.k_stride + off, 0, 3);
        __builtin_prefetch(vbase + slots[t] * b.v_stride + off, 0, 3);
      }
    }
    // Keys past nb: zero K and V (their p is 0 too).
    pack_key_pairs(kbase, b.k_stride, slots + t0, nb, D, zero_row, kp32);
    pack_value_pairs(vbase, b.v_stride, slots + t0, nb, kTileKeys / 2, D, zero_row, vp32);
    at::native::cpublas::brgemm(Mp, kTileKeys, D, D, kTileKeys, kTileKeys, false,
                                reinterpret_cast<const at::BFloat16*>(qa),
                                reinterpret_cast<const at::BFloat16*>(kp), s, true);
    for (int64_t m = 0; m < M; ++m) {  // key t0 + t is visible to the row at position >= it
      const int64_t kl = std::clamp<int64_t>(first_pos + m / G + 1 - t0, 0, nb);
      new_max[m] = softmax_row(s + m * kTileKeys, kl, b.scale, run_max[m],
                               pb + m * kTileKeys, block_sum + m);
    }
    for (int64_t m = 0; m < Mp; m += kLanes) {
      update_softmax_stats(m, loadv(run_max + m), loadv(new_max + m), loadv(block_sum + m),
                           new_max, run_sum, run_max);  // new_max now holds alpha
    }
    for (int64_t m = 0; m < M; ++m) {
      const float a = new_max[m];
      if (a == 1.0f) continue;
      float* row = acc + m * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] *= a;
    }
    at::native::cpublas::brgemm(Mp, D, kTileKeys, kTileKeys, D, D, true,
                                reinterpret_cast<const at::BFloat16*>(pb),
                                reinterpret_cast<const at::BFloat16*>(vpk), acc, true);
  }

  uint16_t* out = static_cast<uint16_t*>(b.out);
  for (int64_t m = 0; m < M; ++m) {
    const float inv = 1.0f / run_sum[m];
    uint16_t* dst = out + (tok0 + m / G) * b.out_stride + head_col + (m % G) * D;
    for (int64_t d = 0; d < D; ++d) store(acc[m * D + d] * inv, dst + d);
  }
}
#endif  // __AVX512BF16__

template <int kD, typename QT, typename KT>
void run(const Batch& b, const std::vector<Item>& items) {
#if defined(__AVX512BF16__)
  constexpr bool kDot = std::is_same_v<QT, uint16_t> && std::is_same_v<KT, uint16_t>;
#else
  constexpr bool kDot = false;
#endif
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), n);
  int64_t floats = buf_floats(b.G, b.D);
#if defined(__AVX512BF16__)
  if constexpr (kDot) floats = b.tiles ? buf_floats_tiles(b.G, b.D) : buf_floats_bf16(b.G, b.D);
#endif
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    std::vector<float> buf(floats);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
#if defined(__AVX512BF16__)
      if constexpr (kDot) {
        if (b.tiles) {
          attend_item_tiles<kD>(b, items[i], buf.data());
        } else {
          attend_item_bf16<kD>(b, items[i], buf.data());
        }
        continue;
      }
#endif
      attend_item<kD, QT, KT>(b, items[i], buf.data());
    }
#if defined(__AVX512BF16__)
    if (kDot && b.tiles) at::native::cpublas::brgemm_release(true);
#endif
  });
}

template <typename QT, typename KT>
void dispatch_head_dim(const Batch& b, const std::vector<Item>& items) {
  switch (b.D) {
    case 64: return run<64, QT, KT>(b, items);
    case 128: return run<128, QT, KT>(b, items);
    default: return run<0, QT, KT>(b, items);
  }
}

std::vector<int64_t> to_vector(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1, name, " must be a 1-d CPU tensor");
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// Work items (per KV head) for a request's n new tokens on the vector paths. An item reads
// every K/V row its last token sees, so bigger items read each row fewer times: 128 rows
// against 32 ran 1.04-1.14x on SmolLM2's heads for 16 prompts of 800-1,600 tokens, whose K/V
// come from L3 or memory (float32 and bfloat16, 1-2 threads). The count depends on n alone,
// so a request's result does not depend on the batch or the threads.
int64_t item_blocks(int64_t n) {
  const int64_t fewest = std::min(kMinItems, (n + kMinQueryRows - 1) / kMinQueryRows);
  return std::max((n + kQueryRows - 1) / kQueryRows, fewest);
}

}  // namespace

at::Tensor extend_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor req_to_token, at::Tensor req_pool_indices,
                               at::Tensor prefix_lens, at::Tensor extend_lens,
                               double scale, bool tiles) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  req_to_token.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 2 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q must be [T, H*D], k_cache/v_cache [S, KVH, D]");
  TORCH_CHECK(q.stride(1) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "the head dim must be contiguous");
  TORCH_CHECK(float_or_bf16(q) && float_or_bf16(k_cache), "float32 or bfloat16 only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache differ");
  const int64_t S = k_cache.size(0), KVH = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(D % kLanes == 0, "the head dim must be a multiple of 16");
  TORCH_CHECK(q.size(1) % (KVH * D) == 0, "H*D not a multiple of KVH*D");
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong &&
                  req_to_token.stride(1) == 1,
              "req_to_token must be [R, max_ctx] int64 with contiguous rows");

  Batch b;
  b.pool_row = to_vector(req_pool_indices, "req_pool_indices");
  b.prefix = to_vector(prefix_lens, "prefix_lens");
  const std::vector<int64_t> ext = to_vector(extend_lens, "extend_lens");
  const int64_t B = static_cast<int64_t>(ext.size());
  TORCH_CHECK(static_cast<int64_t>(b.pool_row.size()) == B &&
                  static_cast<int64_t>(b.prefix.size()) == B, "batch sizes differ");
  b.G = q.size(1) / (KVH * D);
  b.D = D;
  b.scale = static_cast<float>(scale);
  const bool bf16 = q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16;
#if defined(__AVX512BF16__)
  b.tiles = tiles && bf16;
#else
  TORCH_CHECK(!(tiles && bf16), "this build has no AMX path (no AVX512-BF16)");
  b.tiles = false;
#endif
  b.slots = req_to_token.data_ptr<int64_t>();
  b.slots_stride = req_to_token.stride(0);

  // Validate every slot that will be read (an out-of-range one would read outside the pool)
  // and lay out the work items.
  std::vector<Item> items;
  int64_t offset = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t row = b.pool_row[i], prefix = b.prefix[i], n = ext[i];
    TORCH_CHECK(row >= 0 && row < req_to_token.size(0), "req_pool_indices out of range");
    TORCH_CHECK(prefix >= 0 && n >= 0 && prefix + n <= req_to_token.size(1),
                "prefix_lens/extend_lens out of range");
    const int64_t* slots = b.slots + row * b.slots_stride;
    for (int64_t p = 0; p < prefix + n; ++p) {
      TORCH_CHECK(slots[p] >= 0 && slots[p] < S, "req_to_token holds a slot outside the pool");
    }
    b.q_offset.push_back(offset);
    offset += n;
    // Blocks of equal size (e.g. 129 rows -> 65 + 64, not 128 + 1).
    const int64_t blocks = b.tiles ? (n + kTileRows - 1) / kTileRows : item_blocks(n);
    for (int64_t blk = 0, row0 = 0; blk < blocks; ++blk) {
      const int64_t rows = (n - row0) / (blocks - blk);
      const int64_t cost = rows * (prefix + row0 + rows);
      for (int64_t h = 0; h < KVH; ++h) items.push_back({i, h, row0, rows, cost});
      row0 += rows;
    }
  }
  TORCH_CHECK(offset == q.size(0), "q has ", q.size(0), " rows, extend_lens sum to ", offset);
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });

  at::Tensor out = at::empty({q.size(0), q.size(1)}, q.options());
  b.q = q.data_ptr();
  b.out = out.data_ptr();
  b.k = k_cache.data_ptr();
  b.v = v_cache.data_ptr();
  b.q_stride = q.stride(0);
  b.out_stride = out.stride(0);
  b.k_stride = k_cache.stride(0);
  b.k_head = k_cache.stride(1);
  b.v_stride = v_cache.stride(0);
  b.v_head = v_cache.stride(1);
  const bool q32 = q.scalar_type() == at::kFloat, kv32 = k_cache.scalar_type() == at::kFloat;
  if (q32 && kv32) {
    dispatch_head_dim<float, float>(b, items);
  } else if (q32) {
    dispatch_head_dim<float, uint16_t>(b, items);
  } else if (kv32) {
    dispatch_head_dim<uint16_t, float>(b, items);
  } else {
    dispatch_head_dim<uint16_t, uint16_t>(b, items);
  }
  return out;
}
"""

_CPP_DECLARATION = (
    "at::Tensor extend_attention(at::Tensor q, at::Tensor k_cache, "
    "at::Tensor v_cache, at::Tensor req_to_token, at::Tensor req_pool_indices, "
    "at::Tensor prefix_lens, at::Tensor extend_lens, double scale, bool tiles);"
)

_KERNEL = CpuKernel(
    "sglang_cpu_extend_attn",
    _CPP_DECLARATION,
    _CPP_SOURCE,
    ["extend_attention"],
    "CPU prefill-attention kernel",
)


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernel once per process
    (layers/cpu_extension.py). Returns True when :func:`extend_attention` can be used."""
    return _KERNEL.load()


@functools.cache
def tiles_supported() -> bool:
    """Whether bfloat16 batches take the AMX path here (see the module docstring): a CPU with
    AMX's bfloat16 tiles, and torch's brgemm is oneDNN's with native bfloat16 allowed
    (``ONEDNN_MAX_CPU_ISA`` can cap it below)."""
    return " amx_bf16" in cpu_flags() and cpu_brgemm.host_supported() and native_bf16_supported()


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`extend_attention` can be called on these operands: the kernel is loaded
    (:func:`load_kernel`), all on CPU, float32/bfloat16, contiguous head dim, a multiple of 16.
    The caller uses SDPA otherwise."""
    return (
        _KERNEL.module is not None
        and q.device.type == "cpu"
        and k_cache.device.type == "cpu"
        and q.dtype in _SUPPORTED_DTYPES
        and k_cache.dtype in _SUPPORTED_DTYPES
        and v_cache.dtype == k_cache.dtype
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
        and k_cache.shape[-1] % 16 == 0
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    tiles: bool | None = None,
) -> torch.Tensor:
    """Causal prefill attention for a batch, one call per layer (see the module docstring).

    ``q`` [T, H*D] (any row stride, contiguous columns): the new tokens of all requests,
    concatenated in batch order (``T == extend_lens.sum()``). ``k_cache``/``v_cache``
    [S, KVH, D]: one layer's pool buffers, already holding the new tokens' K/V.
    ``req_to_token`` [R, max_ctx] int64, ``req_pool_indices`` [B] int64, ``prefix_lens`` and
    ``extend_lens`` [B] int64 CPU tensors. Returns [T, H*D] in ``q``'s dtype, accumulated in
    float32. Raises RuntimeError on inconsistent operands (including a slot outside the pool).
    ``tiles`` picks the AMX path for bfloat16 q and K/V (None: :func:`tiles_supported`; True
    where this build lacks AVX512-BF16 raises RuntimeError); other dtypes ignore it.

    Precondition: :func:`kernel_supports` holds.
    """
    if tiles is None:
        tiles = tiles_supported()
    return _KERNEL.loaded.extend_attention(
        q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale, tiles
    )
