"""Whole-vocabulary pieces of the ``pytorch`` sampling backend as C++ passes per row on CPU.

``sgl_kernel.sampling_torch`` computes them with torch ops, each one pass over ``[B, V]``
floats: for 64 rows of 49,152 on 2 cores the seeded Gumbel-max took ~7.7 ms (~15 ops: the
contract hash on int32, two logs, the subtraction, the threshold mask, the argmax) and the
softmax statistics behind logprobs, top-p and entropy ~3 ms (max, subtraction, exp, sums).

**Gumbel-max** (:func:`gumbel_argmax`): the same bits as the torch ops. The logs are torch's
own: on x86-64 torch computes ``log`` of float32 tensors with MKL's ``vmsLn`` (its ``VML_HA |
VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE`` mode), which libtorch carries, and this kernel calls the
same function in the same mode; every other step is exact integer arithmetic or a single
rounded float32 operation in torch's order. So the noise, the scores and the chosen tokens
are bitwise the torch path's (and the contract's, docs/sampling.md). :func:`load_kernel`
checks that on the host (the noise of a few rows against the torch ops, bit for bit) and keeps
the torch ops where it differs or where torch carries no ``vmsLn`` (a build without MKL). The
noise is computed exactly only where it can matter: ``u`` takes 2^23 values, and a table
built once per process holds the smallest and largest ``-g`` of each of 1,024 ranges of
them, so each column's score ``x - (-g)`` is bounded by its range's pair; a column whose upper
bound is below the largest lower bound of the row cannot be chosen, and only the others (a
few dozen of 49,152 for a model's logits) get their exact noise. 64 x 49,152: ~1.7 ms.

**Softmax statistics** (:func:`softmax_stats`): the row max, ``sum exp(x - max)`` and, for
entropy, ``sum exp(x - max) * (x - max)``, in one pass after the max, ``exp`` by a polynomial
(relative error < 2e-7), float32 lane sums over 1,024-column chunks added in double: within
float32 rounding of the torch ops, not their bits. Prompt logprobs use the same function
(``row_logsumexp``), so they still equal decode logprobs bit for bit.

**Nucleus candidates** (:func:`nucleus_candidates`): top-p without top-k needs each row's sorted
prefix up to its nucleus, which for a flat row at top-p 0.95 is thousands of tokens, past the
torch path's ``topk`` prefix, so it sorted whole rows (~1.4 ms each). The kernel bins a row's
columns by distance below its max (1/8 logit per bin, their softmax mass per bin), cuts after
the first bin where the mass reaches top_p (plus a margin) and radix-sorts only the columns
above the cut: by construction the row's sorted prefix, from which the sampler computes the
same thresholds as from a full sort, and checks them (a row it does not settle takes the old
path). 64 x 49,152 of N(0, 9) logits at top-p 0.95: ~6 ms against ~110.

Rows are spread over torch's threads, one thread a row (a row's result cannot depend on the
batch). Built at model load with the other CPU kernels
(:class:`~sglang.srt.layers.cpu_extension.CpuKernel`) unless ``--disable-cpu-fused-ops``; the
model runner registers :data:`KERNELS` with ``sgl_kernel.sampling_torch.use_cpu_kernels``.
"""

from __future__ import annotations

import logging

import torch

from sgl_kernel.sampling_torch import CpuSamplingKernels
from sglang.srt.layers.cpu_extension import CpuKernel

logger = logging.getLogger(__name__)

# Columns per chunk of a row: the noise's float buffers (4 KiB each) stay in L1.
_CHUNK = 1024

_CPP_SOURCE = r"""
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <utility>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

// MKL's vector natural log, inside libtorch_cpu when torch is built with MKL (its x86-64
// wheels): torch's log of a float32 tensor calls it (at::vml::vlog). Weak: null where this
// torch has none, and then the torch path stays.
extern "C" void vmsLn(int n, const float* a, float* r, long long mode) __attribute__((weak));

namespace {

// The mode torch passes: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE (mkl_vml_defines.h).
constexpr long long kTorchLnMode = 0x2 | 0x140000 | 0x100;
constexpr int64_t kChunk = CHUNK;
// The contract hash's multipliers (sgl_kernel/sampling_contract.py: HASH_MUL1, HASH_MUL2).
constexpr uint32_t kMul1 = 0x21F0AAADu;
constexpr uint32_t kMul2 = 0x735A2D97u;
constexpr float kInf = std::numeric_limits<float>::infinity();
// u's 23 bits m = bits >> 9 fall in 2^10 buckets of 2^13 values (by m >> 13 = bits >> 22).
constexpr int kBucketShift = 22;
constexpr int64_t kBuckets = int64_t{1} << (32 - kBucketShift);
// Columns a row's exact pass may take; past that the row takes the whole-row path.
constexpr int64_t kMaxCandidates = 512;

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#else
constexpr int kVecBytes = 32;  // one AVX register (GCC splits wider vectors badly)
#endif
using vf = float __attribute__((vector_size(kVecBytes)));
using vi = int32_t __attribute__((vector_size(kVecBytes)));
using vu = uint32_t __attribute__((vector_size(kVecBytes)));
constexpr int64_t kLanes = kVecBytes / 4;

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The contract hash of key ^ column (sampling_contract.hash32), per lane or for one column.
template <typename T>
inline T hash32(T h) {
  h ^= h >> 16;
  h *= kMul1;
  h ^= h >> 15;
  h *= kMul2;
  return h ^ (h >> 15);
}

// t[idx] per lane.
inline vf gather(const float* t, vi idx) {
#if defined(__AVX512F__)
  return (vf)_mm512_i32gather_ps((__m512i)idx, t, 4);
#else
  return (vf)_mm256_i32gather_ps(t, (__m256i)idx, 4);
#endif
}

// Bit l set where a[l] >= b (false for NaN).
inline uint32_t ge_mask(vf a, vf b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_GE_OQ);
#else
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b,
                                                                _CMP_GE_OQ)));
#endif
}

// neg_g[j] = log(-log(u[j])) (= -g), as torch's ops round it; u is overwritten.
inline void neg_gumbel_of_u(float* __restrict u, float* __restrict neg_g, int64_t n) {
  vmsLn(static_cast<int>(n), u, neg_g, kTorchLnMode);
  for (int64_t j = 0; j < n; ++j) u[j] = -neg_g[j];
  vmsLn(static_cast<int>(n), u, neg_g, kTorchLnMode);
}

// u = ((bits >> 9) + 0.5) * 2^-23 (exact in float32).
inline float uniform(uint32_t bits) { return (static_cast<float>(bits >> 9) + 0.5f) * 0x1p-23f; }

// -g for columns c0 .. c0 + n of the row with key ``key`` (the contract's noise).
void neg_gumbel_chunk(uint32_t key, int64_t c0, int64_t n, float* __restrict u,
                      float* __restrict neg_g) {
  for (int64_t j = 0; j < n; ++j) u[j] = uniform(hash32(key ^ static_cast<uint32_t>(c0 + j)));
  neg_gumbel_of_u(u, neg_g, n);
}

// The smallest and largest -g of each bucket of u's 2^23 values, computed once, by the same
// steps as the noise itself: every column's exact -g lies within its bucket's pair.
struct NoiseBounds {
  std::vector<float> lo, hi;

  NoiseBounds() : lo(kBuckets), hi(kBuckets) {
    alignas(64) float u[kChunk];
    alignas(64) float ng[kChunk];
    const int64_t per_bucket = (int64_t{1} << 23) / kBuckets;
    for (int64_t b = 0; b < kBuckets; ++b) {
      float mn = kInf, mx = -kInf;
      for (int64_t m0 = b * per_bucket; m0 < (b + 1) * per_bucket; m0 += kChunk) {
        for (int64_t j = 0; j < kChunk; ++j) u[j] = uniform(static_cast<uint32_t>(m0 + j) << 9);
        neg_gumbel_of_u(u, ng, kChunk);
        for (int64_t j = 0; j < kChunk; ++j) {
          mn = ng[j] < mn ? ng[j] : mn;
          mx = ng[j] > mx ? ng[j] : mx;
        }
      }
      lo[b] = mn;
      hi[b] = mx;
    }
  }
};

const NoiseBounds& noise_bounds() {
  static const NoiseBounds bounds;  // built by the first caller (thread-safe)
  return bounds;
}

// The largest lane of v (-inf when every lane is), and whether any lane of m is set.
inline float lane_max(vf v) {
  float best = -kInf;
  for (int64_t l = 0; l < kLanes; ++l) best = v[l] > best ? v[l] : best;
  return best;
}
inline bool any_lane(vi m) {
  bool any = false;
  for (int64_t l = 0; l < kLanes; ++l) any |= m[l] != 0;
  return any;
}

// A candidate: a score and its column.
struct Best {
  float value;
  int64_t index;
};

// The token of one row, every column's noise computed: the first argmax of x - neg_g (the
// first NaN where there is one), x < thr scored as the torch path scores it (minus +inf).
int64_t row_gumbel_argmax_exact(const float* __restrict x, int64_t V, uint32_t key,
                                bool has_thr, float thr) {
  alignas(64) float u[kChunk];
  alignas(64) float s[kChunk];
  Best best{-kInf, 0};
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t n = V - c0 < kChunk ? V - c0 : kChunk;
    neg_gumbel_chunk(key, c0, n, u, s);
    for (int64_t j = 0; j < n; ++j) {
      float score = x[c0 + j] - s[j];
      // torch: scores - (1 / float(x >= thr) - 1), i.e. minus 0 or minus +inf.
      if (has_thr) score = score - (x[c0 + j] >= thr ? 0.0f : kInf);
      if (score != score) return c0 + j;  // the first NaN wins (as torch's max(dim))
      if (score > best.value) best = {score, c0 + j};
    }
  }
  return best.index;
}

// The token of one row, with the noise computed exactly only where it can matter. Each
// column's score x - neg_g lies in [x - hi, x - lo] of its bucket (float subtraction is
// monotone), so with L the largest lower end over the allowed columns, a column whose upper
// end is below L scores below the column that set L and cannot be chosen. The others (a few
// dozen of 49,152 columns for real logits) get their exact noise and scores. Rows with NaN,
// with no allowed finite score, or with too many candidates take the exact path: the result
// is row_gumbel_argmax_exact's in every case.
int64_t row_gumbel_argmax(const float* __restrict x, int64_t V, uint32_t key, bool has_thr,
                          float thr, const NoiseBounds& nb) {
  const vf thr_v = vf{} + (has_thr ? thr : -kInf);
  vi lanes;
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = static_cast<int32_t>(l);
  const int64_t whole = V / kLanes * kLanes;
  // Pass 1: L, and whether the row holds NaN.
  vf low = vf{} - kInf;
  vi nan = vi{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const vf xv = loadv(x + j);
    const vu h = hash32((vu)(lanes + static_cast<int32_t>(j)) ^ key);
    vf lower = xv - gather(nb.hi.data(), (vi)(h >> kBucketShift));
    lower = xv >= thr_v ? lower : vf{} - kInf;
    low = lower > low ? lower : low;
    nan |= xv != xv;
  }
  float L = lane_max(low);
  bool has_nan = any_lane(nan);
  for (int64_t j = whole; j < V; ++j) {
    const uint32_t h = hash32(key ^ static_cast<uint32_t>(j));
    has_nan |= x[j] != x[j];
    const float lower = x[j] - nb.hi[h >> kBucketShift];
    if (x[j] >= thr_v[0] && lower > L) L = lower;
  }
  if (has_nan || !(L > -kInf)) return row_gumbel_argmax_exact(x, V, key, has_thr, thr);
  // Pass 2: the columns whose upper end reaches L, in column order.
  int64_t cand[kMaxCandidates];
  int64_t count = 0;
  const vf L_v = vf{} + L;
  for (int64_t j = 0; j < whole; j += kLanes) {
    const vf xv = loadv(x + j);
    const vu h = hash32((vu)(lanes + static_cast<int32_t>(j)) ^ key);
    const vf upper = xv - gather(nb.lo.data(), (vi)(h >> kBucketShift));
    uint32_t mask = ge_mask(upper, L_v) & ge_mask(xv, thr_v);
    while (mask != 0) {
      if (count == kMaxCandidates) return row_gumbel_argmax_exact(x, V, key, has_thr, thr);
      cand[count++] = j + __builtin_ctz(mask);
      mask &= mask - 1;
    }
  }
  for (int64_t j = whole; j < V; ++j) {
    const uint32_t h = hash32(key ^ static_cast<uint32_t>(j));
    if (x[j] >= thr_v[0] && x[j] - nb.lo[h >> kBucketShift] >= L) {
      if (count == kMaxCandidates) return row_gumbel_argmax_exact(x, V, key, has_thr, thr);
      cand[count++] = j;
    }
  }
  // The candidates' exact scores (allowed columns: the torch path subtracts 0 from them).
  alignas(64) float u[kMaxCandidates];
  alignas(64) float s[kMaxCandidates];
  for (int64_t i = 0; i < count; ++i) u[i] = uniform(hash32(key ^ static_cast<uint32_t>(cand[i])));
  neg_gumbel_of_u(u, s, count);
  Best best{-kInf, -1};
  for (int64_t i = 0; i < count; ++i) {
    const float score = x[cand[i]] - s[i];
    if (best.index < 0 || score > best.value) best = {score, cand[i]};
  }
  return best.index;
}

// exp(d) for d <= 0 (d = x - row max), 0 below -87.3 (where e^d leaves float32's normal
// range): 2^n * e^r with n = round(d / ln 2), |r| <= ln 2 / 2, e^r by its Taylor polynomial of
// degree 6 (relative error < 2e-7); exactly 1 at d = 0.
inline vf exp_nonpositive(vf d) {
  const vf lo = vf{} - 87.3f;
  const vf dc = d < lo ? lo : d;
  const vf n = (dc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf r = dc - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const vf p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f +
               r * (8.3333338e-3f + r * 1.3888889e-3f)))));
  const vf e = p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
  return d < lo ? vf{} : e;
}

inline float lane_sum(vf v) {
  float s = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// The row's max (-inf when every column is), and whether it holds NaN.
float row_max(const float* __restrict x, int64_t V, bool* has_nan) {
  const int64_t whole = V / kLanes * kLanes;
  vf mv = vf{} - kInf;
  vi nan = vi{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const vf xv = loadv(x + j);
    mv = xv > mv ? xv : mv;
    nan |= xv != xv;
  }
  float m = lane_max(mv);
  *has_nan = any_lane(nan);
  for (int64_t j = whole; j < V; ++j) {
    *has_nan |= x[j] != x[j];
    m = x[j] > m ? x[j] : m;
  }
  return m;
}

// One row's softmax statistics relative to its max m: sum e^(x - m) and, with the entropy,
// sum e^(x - m) * (x - m) (x - m clamped at -FLT_MAX, so -inf columns add 0). Float32 lane sums
// over chunks of kChunk columns, the chunks added in double: a fixed order (the row's result
// does not depend on the batch). A row holding NaN, +inf or only -inf gives NaN sums, as the
// torch ops do.
void row_softmax_stats(const float* __restrict x, int64_t V, bool with_entropy, float* max_out,
                       float* sum_out, float* dev_out) {
  const int64_t whole = V / kLanes * kLanes;
  bool has_nan;
  const float m = row_max(x, V, &has_nan);
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  *max_out = has_nan ? qnan : m;
  if (has_nan || !(m > -kInf && m < kInf)) {
    *sum_out = qnan;
    *dev_out = qnan;
    return;
  }
  const float floor = std::numeric_limits<float>::lowest();
  const vf m_v = vf{} + m, floor_v = vf{} + floor;
  double sum = 0.0, dev = 0.0;
  for (int64_t c0 = 0; c0 < whole; c0 += kChunk) {
    const int64_t end = c0 + kChunk < whole ? c0 + kChunk : whole;
    vf se = vf{}, sd = vf{};
    for (int64_t j = c0; j < end; j += kLanes) {
      vf d = loadv(x + j) - m_v;
      d = d < floor_v ? floor_v : d;
      const vf e = exp_nonpositive(d);
      se += e;
      if (with_entropy) sd += e * d;
    }
    sum += lane_sum(se);
    dev += lane_sum(sd);
  }
  for (int64_t j = whole; j < V; ++j) {
    float d = x[j] - m;
    d = d < floor ? floor : d;
    const float e = exp_nonpositive(vf{} + d)[0];
    sum += e;
    dev += e * d;
  }
  *sum_out = static_cast<float>(sum);
  *dev_out = static_cast<float>(dev);
}

// Nucleus candidates: columns are binned by d = m - x (m the row max), kBinsPerUnit bins per
// unit of d over [0, 32); a column with d beyond weighs under e^-32 of the max. The bins are
// filled a span of d at a time, the next span only when the cut lies beyond them (a trained
// model's row is cut within the first; N(0, 9) logits at top-p 0.95 within the second).
constexpr int kBinsPerUnit = 8;
constexpr float kSpanEnds[] = {8.0f, 12.0f, 16.0f, 32.0f};
constexpr int kNucleusBins = 256;  // kBinsPerUnit * the last span's end
// Each bin's mass is summed in this many slots (by lane), so that neighbouring columns of one
// bin do not wait on each other's addition.
constexpr int kSlots = 8;

// Bit l set where a[l] < b (false for NaN).
inline uint32_t lt_mask(vf a, vf b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_LT_OQ);
#else
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b,
                                                                _CMP_LT_OQ)));
#endif
}

// The softmax mass e^(x - m) of a row's columns per bin of d.
struct NucleusBins {
  double mass[kNucleusBins][kSlots] = {};

  // Adds the columns with lo <= d < hi.
  void add(const float* __restrict x, int64_t V, float m, float lo, float hi) {
    const int64_t whole = V / kLanes * kLanes;
    const vf m_v = vf{} + m, lo_v = vf{} + lo, hi_v = vf{} + hi;
    for (int64_t j = 0; j < whole; j += kLanes) {
      const vf d = m_v - loadv(x + j);
      uint32_t in = lt_mask(d, hi_v) & ge_mask(d, lo_v);
      if (in == 0) continue;
      const vf e = exp_nonpositive(vf{} - d);
      for (; in != 0; in &= in - 1) {
        const int l = __builtin_ctz(in);
        mass[static_cast<int>(d[l] * kBinsPerUnit)][l % kSlots] += e[l];
      }
    }
    for (int64_t j = whole; j < V; ++j) {
      const float d = m - x[j];
      if (d >= lo && d < hi) {
        mass[static_cast<int>(d * kBinsPerUnit)][0] += exp_nonpositive(vf{} - d)[0];
      }
    }
  }

  // The first bin b < bins whose cumulative mass times scale reaches the target; -1 if none.
  int cut(int bins, double scale, float target) const {
    double cum = 0.0;
    for (int b = 0; b < bins; ++b) {
      for (int s = 0; s < kSlots; ++s) cum += mass[b][s];
      if (cum * scale >= target) return b;
    }
    return -1;
  }
};

// The largest d a row's candidates may have: the end of the smallest bin b such that the
// columns of bins <= b hold at least `mass` of the row's softmax (e^(x - log_z), exp by the
// polynomial, summed per bin in double), or of every bin when none does; 0 (none) for a row
// holding NaN or +inf, with no finite value, or a non-finite log_z. d is monotone in x and
// the bin index floor(d * 8) exact, so the columns with d < limit are each at least as large as
// any other: sorted, they are the row's sorted prefix.
float row_nucleus_limit(const float* __restrict x, int64_t V, float log_z, float mass,
                        float* m_out) {
  bool has_nan;
  const float m = row_max(x, V, &has_nan);
  *m_out = m;
  if (has_nan || !(m > -kInf && m < kInf) || !(log_z > -kInf && log_z < kInf)) return 0.0f;
  const double scale = std::exp(static_cast<double>(m) - static_cast<double>(log_z));
  NucleusBins bins;
  float lo = 0.0f;
  int b = -1;
  for (const float hi : kSpanEnds) {
    bins.add(x, V, m, lo, hi);
    b = bins.cut(static_cast<int>(hi) * kBinsPerUnit, scale, mass);
    if (b >= 0) break;
    lo = hi;
  }
  b = b < 0 ? kNucleusBins - 1 : b;
  return static_cast<float>(b + 1) / kBinsPerUnit;
}

// The row's columns with m - x < limit, into out; none (out empty) where that is more than half
// the row, as sorting them would save nothing over the caller's sort of all of it.
void collect_candidates(const float* __restrict x, int64_t V, float m, float limit,
                        std::vector<float>& out) {
  out.clear();
  const int64_t whole = V / kLanes * kLanes, most = V / 2;
  const vf m_v = vf{} + m, limit_v = vf{} + limit;
  for (int64_t j = 0; j < whole; j += kLanes) {
    const vf xv = loadv(x + j);
    for (uint32_t in = lt_mask(m_v - xv, limit_v); in != 0; in &= in - 1) {
      out.push_back(xv[__builtin_ctz(in)]);
    }
    if (static_cast<int64_t>(out.size()) > most) break;
  }
  for (int64_t j = whole; j < V; ++j) {
    if (m - x[j] < limit) out.push_back(x[j]);
  }
  if (static_cast<int64_t>(out.size()) > most) out.clear();
}

// Sorts v[0, n) descending (no NaN; -0 after +0) by a radix sort of keys whose unsigned
// order is the floats' descending order, 11 bits a pass, skipping a pass where every key has
// the same digit. O(n), without the mispredicted branches of a comparison sort: with
// std::sort the whole kernel took 13.9 ms against 6.7 for 64 rows of N(0, 9) logits at top-p
// 0.95 (~4,700 candidates a row).
void sort_descending(float* __restrict v, int64_t n, std::vector<uint32_t>& keys,
                     std::vector<uint32_t>& spare) {
  keys.resize(n);
  spare.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, v + i, 4);
    keys[i] = (bits & 0x80000000u) ? bits : ~(bits | 0x80000000u);
  }
  uint32_t* src = keys.data();
  uint32_t* dst = spare.data();
  for (int shift = 0; shift < 32; shift += 11) {
    const uint32_t mask = shift == 22 ? 0x3FFu : 0x7FFu;
    int64_t offset[2048] = {};
    for (int64_t i = 0; i < n; ++i) offset[(src[i] >> shift) & mask] += 1;
    if (n == 0 || offset[(src[0] >> shift) & mask] == n) continue;
    int64_t total = 0;
    for (uint32_t d = 0; d <= mask; ++d) {
      const int64_t c = offset[d];
      offset[d] = total;
      total += c;
    }
    for (int64_t i = 0; i < n; ++i) dst[offset[(src[i] >> shift) & mask]++] = src[i];
    std::swap(src, dst);
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = (src[i] & 0x80000000u) ? src[i] : ~src[i] & 0x7FFFFFFFu;
    std::memcpy(v + i, &bits, 4);
  }
}

void check_keys(const at::Tensor& keys) {
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.is_contiguous(),
              "row_keys must be a contiguous int64 [B] tensor");
  TORCH_CHECK(vmsLn != nullptr, "this torch has no vmsLn (MKL)");
}

}  // namespace

bool has_torch_ln() { return vmsLn != nullptr; }

void prepare() {
  TORCH_CHECK(vmsLn != nullptr, "this torch has no vmsLn (MKL)");
  noise_bounds();
}

at::Tensor gumbel_argmax(at::Tensor x, at::Tensor row_keys, c10::optional<at::Tensor> thr,
                         bool exact) {
  check_keys(row_keys);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  row_keys.size(0) == x.size(0),
              "x must be a float32 [B, V] tensor with dense rows, B = row_keys' length");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "V must be in [1, 2^31)");
  const int64_t B = x.size(0), V = x.size(1);
  const float* thr_p = nullptr;
  if (thr.has_value()) {
    TORCH_CHECK(thr->dim() == 1 && thr->scalar_type() == at::kFloat && thr->is_contiguous() &&
                    thr->size(0) == B,
                "thr must be a contiguous float32 [B] tensor");
    thr_p = thr->data_ptr<float>();
  }
  const NoiseBounds& nb = noise_bounds();
  at::Tensor out = at::empty({B}, row_keys.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* kp = row_keys.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t key = static_cast<uint32_t>(kp[r]);
      const float t = thr_p ? thr_p[r] : 0.0f;
      op[r] = exact ? row_gumbel_argmax_exact(xp + r * stride, V, key, thr_p != nullptr, t)
                    : row_gumbel_argmax(xp + r * stride, V, key, thr_p != nullptr, t, nb);
    }
  });
  return out;
}

std::vector<at::Tensor> softmax_stats(at::Tensor x, bool with_entropy) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x must be a float32 [B, V] tensor with dense rows, V > 0");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor mx = at::empty({B}, x.options());
  at::Tensor se = at::empty({B}, x.options());
  at::Tensor sd = at::empty({B}, x.options());
  const float* xp = x.data_ptr<float>();
  float *mp = mx.data_ptr<float>(), *sp = se.data_ptr<float>(), *dp = sd.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row_softmax_stats(xp + r * stride, V, with_entropy, mp + r, sp + r, dp + r);
    }
  });
  return {mx, se, sd};
}

std::vector<at::Tensor> nucleus_candidates(at::Tensor x, at::Tensor log_z, at::Tensor mass) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x must be a float32 [B, V] tensor with dense rows, V > 0");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  for (const at::Tensor* t : {&log_z, &mass}) {
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == B,
                "log_z and mass must be contiguous float32 [B] tensors");
  }
  std::vector<std::vector<float>> rows(B);
  const float* xp = x.data_ptr<float>();
  const float *lp = log_z.data_ptr<float>(), *mp = mass.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> keys, spare;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      float m;
      const float limit = row_nucleus_limit(row, V, lp[r], mp[r], &m);
      collect_candidates(row, V, m, limit, rows[r]);
      sort_descending(rows[r].data(), static_cast<int64_t>(rows[r].size()), keys, spare);
    }
  });
  int64_t width = 1;
  for (const std::vector<float>& row : rows) {
    width = static_cast<int64_t>(row.size()) > width ? static_cast<int64_t>(row.size()) : width;
  }
  at::Tensor out = at::empty({B, width}, x.options());
  at::Tensor lengths = at::empty({B}, x.options().dtype(at::kLong));
  float* op = out.data_ptr<float>();
  int64_t* np = lengths.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = static_cast<int64_t>(rows[r].size());
      std::memcpy(op + r * width, rows[r].data(), n * sizeof(float));
      std::fill(op + r * width + n, op + (r + 1) * width, -kInf);
      np[r] = n;
    }
  });
  return {out, lengths};
}

at::Tensor neg_gumbel(at::Tensor row_keys, int64_t vocab_size) {
  check_keys(row_keys);
  TORCH_CHECK(vocab_size > 0 && vocab_size < (int64_t{1} << 31), "bad vocab_size");
  const int64_t B = row_keys.size(0);
  at::Tensor out = at::empty({B, vocab_size}, row_keys.options().dtype(at::kFloat));
  const int64_t* kp = row_keys.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float u[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t key = static_cast<uint32_t>(kp[r]);
      for (int64_t c0 = 0; c0 < vocab_size; c0 += kChunk) {
        const int64_t n = vocab_size - c0 < kChunk ? vocab_size - c0 : kChunk;
        neg_gumbel_chunk(key, c0, n, u, op + r * vocab_size + c0);
      }
    }
  });
  return out;
}
""".replace("CHUNK", str(_CHUNK))

_CPP_DECLARATION = """
bool has_torch_ln();
void prepare();
at::Tensor gumbel_argmax(at::Tensor x, at::Tensor row_keys, c10::optional<at::Tensor> thr,
    bool exact);
at::Tensor neg_gumbel(at::Tensor row_keys, int64_t vocab_size);
std::vector<at::Tensor> softmax_stats(at::Tensor x, bool with_entropy);
std::vector<at::Tensor> nucleus_candidates(at::Tensor x, at::Tensor log_z, at::Tensor mass);
"""

_KERNEL = CpuKernel(
    "sglang_cpu_sampling",
    _CPP_DECLARATION,
    _CPP_SOURCE,
    [
        "has_torch_ln",
        "prepare",
        "gumbel_argmax",
        "neg_gumbel",
        "softmax_stats",
        "nucleus_candidates",
    ],
    "CPU sampling kernel",
    needs_avx2=True,
    # Every float step rounds on its own, as torch's separate ops do.
    extra_cflags=("-ffp-contract=off",),
)

# load_kernel's verdict once per process: None before the first call.
_usable: bool | None = None


def build_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernels, nothing run: what the model
    runner does side by side with the other kernels' builds. True when built."""
    return _KERNEL.load()


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernels once per process and check them
    on this host: True when :func:`gumbel_argmax` gives the torch path's bits (the noise of a few
    rows compared with ``sgl_kernel.sampling_torch``'s ops, bit for bit). False, and logged,
    where it cannot be built, torch has no ``vmsLn`` or the bits differ."""
    global _usable
    if _usable is None:
        _usable = _KERNEL.load() and _same_bits_as_torch()
    return _usable


def _same_bits_as_torch() -> bool:
    from sgl_kernel.sampling_contract import noise_row_keys
    from sgl_kernel.sampling_torch import gumbel_noise

    module = _KERNEL.loaded
    if not module.has_torch_ln():
        logger.info("CPU sampling kernel: this torch has no MKL vmsLn; using the torch ops")
        return False
    # Seeds at the ends of the 32-bit range, a vocabulary with a partial chunk and vector tail.
    seeds = torch.tensor([0, 1, 0x9E3779B9, 0xFFFFFFFF], dtype=torch.int64)
    positions = torch.tensor([0, 7, 1000, 2**31], dtype=torch.int64)
    vocab = 3 * _CHUNK + 37
    expected = gumbel_noise(seeds, positions, vocab).neg_()  # -g, as the torch path draws it
    got = module.neg_gumbel(noise_row_keys(seeds, positions), vocab)
    if torch.equal(got.view(torch.int32), expected.view(torch.int32)):
        module.prepare()  # the noise bounds (~2^23 noise values, once per process)
        return True
    logger.warning("CPU sampling kernel: its noise differs from torch's on this host; using torch")
    return False


def gumbel_argmax(
    x: torch.Tensor, thr: torch.Tensor | None, row_keys: torch.Tensor
) -> torch.Tensor:
    """Per row of ``x`` [B, V] (float32, dense rows: logits / temperature), the first argmax
    over v of ``x[v] + g[v]`` with the row's contract noise g (``row_keys`` [B] int64 from
    ``noise_row_keys``), columns with ``x[v] < thr[row]`` excluded (``thr`` [B] float32, or
    None); a row holding NaN scores gives its first NaN. Bitwise
    ``sgl_kernel.sampling_torch._gumbel_argmax_full``. Returns [B] int64.
    Precondition: :func:`load_kernel` returned True."""
    thr = None if thr is None else thr.contiguous()
    return _KERNEL.loaded.gumbel_argmax(x, row_keys.contiguous(), thr, False)


def gumbel_argmax_exact(
    x: torch.Tensor, thr: torch.Tensor | None, row_keys: torch.Tensor
) -> torch.Tensor:
    """:func:`gumbel_argmax` with every column's noise computed (no bucket bounds): the
    reference the tests hold the bounded pass to. Precondition: :func:`load_kernel`."""
    return _KERNEL.loaded.gumbel_argmax(x, row_keys, thr, True)


def softmax_stats(
    x: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of ``x`` [B, V] (float32, dense rows): ``(max m, sum exp(x - m), sum exp(x - m)
    * (x - m))``, the last only ``with_entropy`` (else None), as
    ``sgl_kernel.sampling_torch.SoftmaxStats`` holds them. One pass per row after its max:
    ``exp`` by a polynomial (relative error < 2e-7), float32 lane sums over 1,024-column chunks
    added in double, a fixed order per row (not the torch ops' bits). NaN sums where the row
    holds NaN, +inf or only -inf, as the torch ops give. Precondition: :func:`load_kernel`."""
    row_max, sum_exp, sum_exp_dev = _KERNEL.loaded.softmax_stats(x, with_entropy)
    return row_max, sum_exp, sum_exp_dev if with_entropy else None


def nucleus_candidates(
    x: torch.Tensor, log_z: torch.Tensor, mass: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` [B, V] (float32, dense rows): the row's largest values, sorted
    descending, as few as hold at least ``mass[row]`` of its softmax (``exp(x - log_z[row])``,
    exp by the polynomial) to the resolution of one bin of 1/8 logit below the row max (so a
    few more than needed, and never part of a tie). Every column left out is at most every
    column kept, so the values are the row's sorted prefix. A row whose mass the columns within
    32 of its max do not reach gets all of those. A row gets none (length 0) where that would
    be more than half of it, or it holds NaN or +inf, or only -inf, or its ``log_z`` is not
    finite. Returns (values [B, W] padded with -inf after each row's own, lengths [B] int64),
    W the largest length (at least 1). ``log_z``, ``mass``: [B] float32.
    Precondition: :func:`load_kernel`."""
    values, lengths = _KERNEL.loaded.nucleus_candidates(x, log_z.contiguous(), mass.contiguous())
    return values, lengths


def neg_gumbel(row_keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``-g`` = log(-log(u)) of the contract noise, [B, vocab_size] float32, as
    ``sgl_kernel.sampling_torch._neg_gumbel_from_keys`` computes it (for the checks).
    Precondition: :func:`load_kernel` returned True."""
    return _KERNEL.loaded.neg_gumbel(row_keys, vocab_size)


# What the model runner registers with sgl_kernel.sampling_torch.use_cpu_kernels.
KERNELS = CpuSamplingKernels(gumbel_argmax, softmax_stats, nucleus_candidates)
