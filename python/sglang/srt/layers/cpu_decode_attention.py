"""A paged C++ decode-attention kernel for CPU (``--disable-cpu-attention-kernel`` turns it off).

Decode attention has one query token per request, so the work per (request, KV head) is tiny
and SDPA's per-call overhead dominates; SDPA also needs each request's keys dense, and the
pool does not hold them so (decode steps interleave the requests' new slots, on CPU in runs of
up to 32 consecutive slots per request: ReqKV.alloc_decode). This kernel takes
one layer's pool buffers and each request's ``req_to_token`` row and reads every K and V row
where it lies, once for all ``G = H / KVH`` query heads of its KV head. Per chunk of up to 512
keys of a request, for each KV head:

1. scores ``s[g, t] = scale * q[g] . k[t]``: per key, G 16-lane partial dot products; per block
   of 16 keys, a shuffle tree turns the 16 partial vectors of a head into its 16 scores;
2. softmax numerators ``p = exp(s - max)`` (a vectorised polynomial, relative error < 2e-7)
   and their sum;
3. ``acc[g] = sum_t p[g, t] v[t]``, the accumulators of up to 4 heads held in registers for a
   pass over the V rows.

A work item is one chunk of one request, for all its KV heads: each key's slot is read whole
(the K rows of every KV head, front to back, then the V rows), which streams from memory
1.02-1.16x faster than one KV head's 256 bytes of every slot (SmolLM2, 16-64 requests). Where that
leaves fewer than 2 items per thread (small batches), an item takes one KV head instead. The
items are handed to torch's threads longest first, one at a time; the chunks of a request that
has several are merged after (rescaled to their common max, then normalised). Each head's
arithmetic is the same in either item shape and the split into chunks depends on the length
only, so a request's result is the same bits in any batch and with any number of threads. Rows
are prefetched ahead (see kPrefetch), as their slots are scattered.

The vector code is GCC vector types of 16 floats (the prelude of
:mod:`~sglang.srt.layers.cpu_extension`), built with ``-O3 -march=native`` on hosts with
AVX-512 or AVX2 (elsewhere :func:`load_kernel` returns False). On AVX2 without AVX-512 the key
and value loops hold 8-float halves in registers, the value accumulators of three query heads
over half a 64-wide row per pass (12 of the 16 registers of 8 floats; 1.04-1.1x over one
head's whole row per pass, the same sums): written with 16-float vectors alone GCC spilled
them every key and selected lane by lane, and the kernel ran no faster than SDPA. The
softmax and the score reduction also take 8-float vectors there (with 16-float ones GCC kept
the running max and sum in memory: 1.2-1.35x in cache, 1.02-1.07x in float32 and 1.08-1.29x
in bfloat16 over DRAM, the same bits). In
bfloat16 on a CPU with AVX512-BF16 the scores use ``vdpbf16ps`` (exact products, float32 sums)
and so do the values, two keys at a time with the weights rounded to bfloat16, as SDPA's
bfloat16 path rounds them; ``native_bf16=False`` takes the widened float32 path that other
CPUs use. q, K and V share one dtype (float32 or bfloat16); the output has it too.

The extension is built at model load (:class:`~sglang.srt.layers.cpu_extension.CpuKernel`),
cached per source and CPU; where it is not built :func:`load_kernel` returns False and the
backend keeps SDPA.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.cpu_extension import CPP_VECTOR_PRELUDE, CpuKernel

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_CPP_SOURCE = CPP_VECTOR_PRELUDE + r"""
namespace {

using namespace sglang_cpu;

constexpr int64_t kKeyBlock = 16;   // keys scored together (one lane each after the reduction)
constexpr int64_t kMaxVecs = 16;    // head dim <= 256
constexpr int64_t kChunk = 512;    // keys per work item (see run; 1.15x over 256 at 60 x 350 keys)
// Fewer chunks than this per thread: an item per KV head (2 rather than 4: 1.05-1.15x at 4-6
// requests of 300 keys, where 4 chose items of one KV head).
constexpr int64_t kItemsPerThread = 2;
// Rows prefetched ahead, the slots being scattered: K rows kPrefetch keys ahead into L1 and
// kPrefetchL2 ahead into L2; each V row into L2 as its K row is scored, so that the value pass
// finds the chunk's V rows there (1.3-1.4x on a 60-request step of SmolLM2 over DRAM).
constexpr int64_t kPrefetch = 8;
constexpr int64_t kPrefetchL2 = 32;

// The lane-wise max of 16-float vectors, and of 8-float ones on AVX2 hosts.
inline f32x16 max_lanes(f32x16 a, f32x16 b) { return max16(a, b); }
#if defined(SGLANG_CPU_AVX2)
typedef int32_t i32x8 __attribute__((vector_size(32)));
inline __m256 max_lanes(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
#endif

// exp(x) for x <= 0, lane by lane: 2^n * e^r with n = round(x / ln 2) (rounded by adding and
// subtracting 1.5 * 2^23), |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 6 (relative
// error < 2e-7); x below -87 gives ~1.6e-38. V: f32x16, or __m256 on AVX2 hosts (the same
// expression, so the same bits); I: the int32 vector of its width.
template <typename V, typename I>
inline V exp_lanes(V x) {
  x = max_lanes(V{} - 87.0f, x);  // x < -87 ? -87 : x
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const V r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const V p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f +
      r * (8.3333338e-3f + r * 1.3888889e-3f)))));
  return p * (V)((__builtin_convertvector(n, I) + 127) << 23);
}


// kLocality: 3 prefetches into L1, 1 into L2 (GCC's __builtin_prefetch hint).
template <int kLocality = 3, typename T>
inline void prefetch_row(const T* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(row) + off, 0, kLocality);
  }
}

// The operands of one call, shared by every work item.
template <typename T>
struct Operands {
  const T* q;            // [B, H*D], row stride q_stride
  const T* k;            // pool [S, KVH, D], contiguous
  const T* v;
  const int64_t* table;  // req_to_token, row stride table_stride
  const int64_t* rows;   // [B] pool rows
  int64_t q_stride, table_stride, kvh, G, D;
  float scale;
  bool native_bf16;  // bfloat16 dot products by the CPU's own instruction, where it has one
};

// The G lane-partial dot products of the key row kr with the queries (qf: as float32; qraw: as
// given), stored at part + g * part_stride: 16 lanes, or on AVX2 hosts 8 (the sums of lanes j
// and j + 8, the reduction's first step). With bfloat16 operands on a CPU with AVX512-BF16, one
// instruction multiplies 32 bfloat16 pairs (exactly) and adds them into 16 float32 lanes;
// elsewhere the row is widened to float32 and multiplied in float32 (the same products).
// Always inlined: called once per key, and GCC stopped inlining it once the softmax moved into
// its own function (0.8x).
template <int kD, typename T>
__attribute__((always_inline)) inline void key_partials(const Operands<T>& op, const float* qf,
                                                        const T* qraw, const T* kr, float* part,
                                                        int64_t part_stride) {
  const int64_t G = op.G, D = kD ? kD : op.D;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t> && kD > 0 && kD % 32 == 0) {
    if (op.native_bf16) {
      __m512i kv[kD / 32];
      for (int64_t c = 0; c < kD / 32; ++c) kv[c] = _mm512_loadu_si512(kr + 32 * c);
      for (int64_t g = 0; g < G; ++g) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t c = 0; c < kD / 32; ++c) {
          s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qraw + g * kD + 32 * c),
                               (__m512bh)kv[c]);
        }
        _mm512_storeu_ps(part + g * part_stride, s);
      }
      return;
    }
  }
#endif
#if defined(SGLANG_CPU_AVX2)
  // The same partials in 8-float halves held in registers (GCC spills 16-float arrays here).
  __m256 kv8[2 * kMaxVecs];
  for (int64_t c = 0; c < 2 * D / kLanes; ++c) kv8[c] = load8(kr + 8 * c);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    __m256 lo = _mm256_mul_ps(load8(qg), kv8[0]), hi = _mm256_mul_ps(load8(qg + 8), kv8[1]);
    for (int64_t c = 1; c < D / kLanes; ++c) {
      lo = _mm256_fmadd_ps(load8(qg + c * kLanes), kv8[2 * c], lo);
      hi = _mm256_fmadd_ps(load8(qg + c * kLanes + 8), kv8[2 * c + 1], hi);
    }
    // The two halves' sum, which the 16-lane reduction would take first (block_scores).
    store8(_mm256_add_ps(lo, hi), part + g * part_stride);
  }
  return;
#endif
  f32x16 kv[kMaxVecs];
  for (int64_t c = 0; c < D / kLanes; ++c) kv[c] = load16(kr + c * kLanes);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    f32x16 s = load16(qg) * kv[0];
    for (int64_t c = 1; c < D / kLanes; ++c) s += load16(qg + c * kLanes) * kv[c];
    store16(s, part + g * part_stride);
  }
}

// The scratch floats of a work item of G query heads and n keys (attend_chunk): the queries,
// the lane partials, the scores and (for add_values_bf16_pairs) the weights as bfloat16.
inline int64_t scratch_floats(int64_t G, int64_t D, int64_t n) {
  const int64_t n_pad = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  return G * D + G * kKeyBlock * kLanes + G * n_pad + (G * n_pad + 1) / 2;
}

// acc[g] = sum_t p[g, t] v[t] over the chunk's n keys (p: the softmax numerators, G rows of
// n_pad floats; v[t] the V row of slots[t]). The accumulators of up to kHeads query heads stay
// in registers for a pass over the V rows (a block's missing heads get weight 0).
template <int kD, int64_t kHeads, typename T>
void add_values_widened(const Operands<T>& op, const T* vh, const int64_t* slots, int64_t n,
                        const float* p, int64_t n_pad, float* acc) {
  const int64_t G = op.G, D = kD ? kD : op.D, nvec = D / kLanes, row = op.kvh * D;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  constexpr int64_t kVecs = kD ? kD / kLanes : kMaxVecs;
#if defined(SGLANG_CPU_AVX2)
  // The same sums with 16 registers of 8 floats: kHeads heads at once over a window of kW
  // 8-float columns (at most 12 accumulators; with the kHeads weights and one V vector, all
  // 16 registers), one pass over the V rows per window and group of heads; the V rows are
  // prefetched in the first pass only. Each sum runs over t in order, as above.
  constexpr int64_t kW = kHeads == 1   ? (kD >= 64 ? 8 : 2)
                         : kHeads <= 3 ? (kD > 0 && kD % 32 == 0 ? 4 : 2)
                                       : 2;
  static_assert(kHeads * kW <= 12, "the accumulators must fit in the registers");
  const int64_t halves = 2 * nvec;
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    const int64_t gn = std::min(kHeads, G - g0);
    for (int64_t c0 = 0; c0 < halves; c0 += kW) {
      const bool first_pass = g0 == 0 && c0 == 0;
      __m256 a[kHeads][kW];
      for (int64_t gi = 0; gi < kHeads; ++gi) {
        for (int64_t c = 0; c < kW; ++c) a[gi][c] = _mm256_setzero_ps();
      }
      for (int64_t t = 0; t < n; ++t) {
        if (first_pass && t + kPrefetch < n) {
          prefetch_row(vh + slots[t + kPrefetch] * row, row_bytes);
        }
        const T* vr = vh + slots[t] * row + 8 * c0;
        __m256 w[kHeads];
        for (int64_t gi = 0; gi < kHeads; ++gi) {
          w[gi] = _mm256_set1_ps(gi < gn ? p[(g0 + gi) * n_pad + t] : 0.0f);
        }
        for (int64_t c = 0; c < kW; ++c) {  // the sums, the weights and one V vector in registers
          const __m256 v = load8(vr + 8 * c);
          for (int64_t gi = 0; gi < kHeads; ++gi) a[gi][c] = _mm256_fmadd_ps(w[gi], v, a[gi][c]);
        }
      }
      for (int64_t gi = 0; gi < gn; ++gi) {
        for (int64_t c = 0; c < kW; ++c) {
          store8(a[gi][c], acc + (g0 + gi) * D + 8 * (c0 + c));
        }
      }
    }
  }
  return;
#endif
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    const int64_t gn = std::min(kHeads, G - g0);
    f32x16 a[kHeads][kVecs];
    for (int64_t gi = 0; gi < kHeads; ++gi) {
      for (int64_t c = 0; c < nvec; ++c) a[gi][c] = splat(0.0f);
    }
    for (int64_t t = 0; t < n; ++t) {
      if (t + kPrefetch < n) prefetch_row(vh + slots[t + kPrefetch] * row, row_bytes);
      const T* vr = vh + slots[t] * row;
      f32x16 vv[kVecs];
      for (int64_t c = 0; c < nvec; ++c) vv[c] = load16(vr + c * kLanes);
      for (int64_t gi = 0; gi < kHeads; ++gi) {
        const float w = gi < gn ? p[(g0 + gi) * n_pad + t] : 0.0f;
        for (int64_t c = 0; c < nvec; ++c) a[gi][c] += w * vv[c];
      }
    }
    for (int64_t gi = 0; gi < gn; ++gi) {
      for (int64_t c = 0; c < nvec; ++c) store16(a[gi][c], acc + (g0 + gi) * D + c * kLanes);
    }
  }
}

#if defined(__AVX512BF16__)
// The same sum for bfloat16 V on a CPU with AVX512-BF16: two keys at a time, their V rows
// interleaved element by element (within 128-bit lanes), so that one instruction adds
// p[t] v[t][d] + p[t+1] v[t+1][d] into the float32 lane of d, with the weights rounded to
// bfloat16 (as SDPA's bfloat16 path rounds them for its product with V). The interleaving
// permutes d within each 32 values; the stores undo it.
template <int kD, int64_t kHeads>
void add_values_bf16_pairs(const Operands<uint16_t>& op, const uint16_t* vh,
                           const int64_t* slots, int64_t n, const float* p, int64_t n_pad,
                           uint16_t* p16, float* acc) {
  constexpr int64_t kVecs = kD / 32;  // 32 bfloat16 per register
  const int64_t G = op.G, row = op.kvh * kD, row_bytes = kD * 2;
  for (int64_t i = 0; i < G * n_pad; i += kLanes) {  // padding weights are 0 (and stay 0)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + i)));
  }
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    const int64_t gn = std::min(kHeads, G - g0);
    __m512 lo[kHeads][kVecs], hi[kHeads][kVecs];
    for (int64_t gi = 0; gi < kHeads; ++gi) {
      for (int64_t c = 0; c < kVecs; ++c) lo[gi][c] = hi[gi][c] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < n; t += 2) {
      if (t + kPrefetch + 1 < n) {
        prefetch_row(vh + slots[t + kPrefetch] * row, row_bytes);
        prefetch_row(vh + slots[t + kPrefetch + 1] * row, row_bytes);
      }
      const uint16_t* r0 = vh + slots[t] * row;
      const uint16_t* r1 = t + 1 < n ? vh + slots[t + 1] * row : r0;  // its weight is 0
      __m512i vlo[kVecs], vhi[kVecs];
      for (int64_t c = 0; c < kVecs; ++c) {
        const __m512i x = _mm512_loadu_si512(r0 + 32 * c), y = _mm512_loadu_si512(r1 + 32 * c);
        vlo[c] = _mm512_unpacklo_epi16(x, y);
        vhi[c] = _mm512_unpackhi_epi16(x, y);
      }
      for (int64_t gi = 0; gi < kHeads; ++gi) {
        uint32_t pair = 0;
        if (gi < gn) std::memcpy(&pair, p16 + (g0 + gi) * n_pad + t, sizeof pair);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
        for (int64_t c = 0; c < kVecs; ++c) {
          lo[gi][c] = _mm512_dpbf16_ps(lo[gi][c], (__m512bh)vlo[c], w);
          hi[gi][c] = _mm512_dpbf16_ps(hi[gi][c], (__m512bh)vhi[c], w);
        }
      }
    }
    // Lane j of lo holds d = 8 (j / 4) + j % 4 of its 32, of hi d = 8 (j / 4) + 4 + j % 4.
    for (int64_t gi = 0; gi < gn; ++gi) {
      for (int64_t c = 0; c < kVecs; ++c) {
        alignas(64) float l[kLanes], h[kLanes];
        _mm512_store_ps(l, lo[gi][c]);
        _mm512_store_ps(h, hi[gi][c]);
        float* out = acc + (g0 + gi) * kD + 32 * c;
        for (int64_t j = 0; j < kLanes; ++j) {
          out[8 * (j / 4) + j % 4] = l[j];
          out[8 * (j / 4) + 4 + j % 4] = h[j];
        }
      }
    }
  }
}
#endif

template <int kD, int64_t kHeads, typename T>
void add_values(const Operands<T>& op, const T* vh, const int64_t* slots, int64_t n,
                const float* p, int64_t n_pad, uint16_t* p16, float* acc) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t> && kD > 0 && kD % 32 == 0) {
    if (op.native_bf16) {
      return add_values_bf16_pairs<kD, kHeads>(op, vh, slots, n, p, n_pad, p16, acc);
    }
  }
#endif
  add_values_widened<kD, kHeads, T>(op, vh, slots, n, p, n_pad, acc);
}

// The scores of one block of 16 keys of one query head: out[j] = scale * (the sum of the
// lanes of key j's partial vector at part + j * kLanes; see key_partials).
inline void block_scores(const float* part, float scale, float* out) {
#if defined(SGLANG_CPU_AVX2)
  // Each key's two halves are already added; the 16-lane tree's last steps remain.
  __m256 half[kKeyBlock];
  for (int64_t j = 0; j < kKeyBlock; ++j) half[j] = load8(part + j * kLanes);
  store8(sum_lanes8(half) * scale, out);
  store8(sum_lanes8(half + 8) * scale, out + 8);
#else
  f32x16 vecs[kKeyBlock];
  for (int64_t j = 0; j < kKeyBlock; ++j) vecs[j] = load16(part + j * kLanes);
  store16(sum_lanes16(vecs) * scale, out);
#endif
}

// In place over one head's scores s[0, n_pad): s[t] = exp(s[t] - max) for t < n, 0 after;
// *m = the max over t < n, *l = the sum of the numerators (lanes summed in order 0..15).
inline void softmax_numerators(float* s, int64_t n, int64_t n_pad, float* m, float* l) {
#if defined(SGLANG_CPU_AVX2)
  // Written with 16-float vectors, GCC kept the loop-carried max and sum in memory and moved
  // them through general registers each step (a fifth of the kernel's time in a profile).
  __m256 mv = _mm256_set1_ps(s[0]);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(load8(s + t), mv);
  float mx = mv[0];
  for (int64_t w = 1; w < 8; ++w) mx = std::max(mx, mv[w]);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
  for (int64_t t = 0; t < n_pad; t += kLanes) {
    __m256 lo = exp_lanes<__m256, i32x8>(load8(s + t) - mx);
    __m256 hi = exp_lanes<__m256, i32x8>(load8(s + t + 8) - mx);
    store8(lo, s + t);
    store8(hi, s + t + 8);
    if (t + kLanes > n) {
      std::fill(s + n, s + t + kLanes, 0.0f);
      lo = load8(s + t);
      hi = load8(s + t + 8);
    }
    sum_lo += lo;
    sum_hi += hi;
  }
  float total = 0.0f;
  for (int64_t w = 0; w < 8; ++w) total += sum_lo[w];
  for (int64_t w = 0; w < 8; ++w) total += sum_hi[w];
#else
  // The max over 16 lanes at a time, then across them: a scalar loop is one dependent
  // max per key (a quarter of the kernel's time in a profile).
  f32x16 mv = splat(s[0]);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) mv = max16(load16(s + t), mv);
  float mx = mv[0];
  for (int64_t w = 1; w < kLanes; ++w) mx = std::max(mx, mv[w]);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  f32x16 sum = splat(0.0f);
  for (int64_t t = 0; t < n_pad; t += kLanes) {
    f32x16 p = exp_lanes<f32x16, i32x16>(load16(s + t) - mx);
    if (t + kLanes > n) {
      for (int64_t w = n - t; w < kLanes; ++w) p[w] = 0.0f;
    }
    store16(p, s + t);
    sum += p;
  }
  float total = 0.0f;
  for (int64_t w = 0; w < kLanes; ++w) total += sum[w];
#endif
  *m = mx;
  *l = total;
}

// One chunk [t0, t1) of request b for its KV heads [h0, h1) (kSpan: their number where fixed at
// compile time, else 0): for each of their query heads g (counted from the item's first), the
// softmax max m[g] and sum l[g] over the chunk's keys and acc[g] = sum_t exp(s[g,t] - m[g]) v[t]
// (unnormalised). scratch holds scratch_floats((h1 - h0) * G, D, t1 - t0) floats.
template <int kD, int64_t kHeads, int64_t kSpan, typename T>
void attend_chunk(const Operands<T>& op, int64_t b, int64_t t0, int64_t t1, int64_t h0,
                  int64_t h1, float* scratch, float* m, float* l, float* acc) {
  const int64_t KVH = kSpan ? kSpan : h1 - h0, G = op.G, H = KVH * G, D = kD ? kD : op.D;
  const int64_t row = op.kvh * D;  // a slot's row: every KV head's D values
  const int64_t n = t1 - t0, n_pad = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t span_bytes = KVH * D * static_cast<int64_t>(sizeof(T));  // the item's part of a row
  const int64_t* slots = op.table + op.rows[b] * op.table_stride + t0;
  const T* k = op.k + h0 * D;                    // the item's KV heads, at k + slot * row
  const T* v = op.v + h0 * D;
  float* qf = scratch;                           // [H, D] queries as float32
  float* part = qf + H * D;                      // [H, kKeyBlock, kLanes] lane partials
  float* scores = part + H * kKeyBlock * kLanes;  // [H, n_pad]
  const T* qb = op.q + b * op.q_stride + h0 * G * D;
  for (int64_t i = 0; i < H * D; ++i) qf[i] = load1(qb[i]);

  // Scores: per key, the lane-partial dot products of every query head with its KV head's
  // part of the slot (the item's span of the slot's K row, read front to back); per block of
  // 16 keys, one reduction tree per query head turns 16 partial vectors into 16 scores.
  for (int64_t t = 0; t < std::min(n, kPrefetchL2); ++t) {
    prefetch_row<1>(k + slots[t] * row, span_bytes);
  }
  std::fill(part, part + H * kKeyBlock * kLanes, 0.0f);
  for (int64_t tb = 0; tb < n; tb += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, n - tb);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t t = tb + j;
      if (t + kPrefetch < n) prefetch_row(k + slots[t + kPrefetch] * row, span_bytes);
      if (t + kPrefetchL2 < n) prefetch_row<1>(k + slots[t + kPrefetchL2] * row, span_bytes);
      prefetch_row<1>(v + slots[t] * row, span_bytes);
      const T* kr = k + slots[t] * row;
      for (int64_t h = 0; h < KVH; ++h) {
        key_partials<kD, T>(op, qf + h * G * D, qb + h * G * D, kr + h * D,
                            part + h * G * kKeyBlock * kLanes + j * kLanes, kKeyBlock * kLanes);
      }
    }
    if (nb < kKeyBlock) {  // the last block's unused partials: zero, so its lanes stay finite
      for (int64_t g = 0; g < H; ++g) {
        std::fill(part + (g * kKeyBlock + nb) * kLanes, part + (g + 1) * kKeyBlock * kLanes,
                  0.0f);
      }
    }
    for (int64_t g = 0; g < H; ++g) {
      block_scores(part + g * kKeyBlock * kLanes, op.scale, scores + g * n_pad + tb);
    }
  }

  // Softmax numerators over the real keys; the padding lanes become 0.
  for (int64_t g = 0; g < H; ++g) softmax_numerators(scores + g * n_pad, n, n_pad, m + g, l + g);

  // The values, one KV head at a time: its rows of the chunk's slots are in L2 by now.
  uint16_t* p16 = reinterpret_cast<uint16_t*>(scores + H * n_pad);
  for (int64_t h = 0; h < KVH; ++h) {
    add_values<kD, kHeads, T>(op, v + h * D, slots, n, scores + h * G * n_pad, n_pad,
                              p16 + h * G * n_pad, acc + h * G * D);
  }
}

struct Item {
  int64_t b, t0, t1, h0, h1;  // request b's keys [t0, t1) for its KV heads [h0, h1)
  int64_t part;  // index of its chunk's partial result when request b is split, else -1
};

struct Split {  // a request b computed in `count` chunks, partials first .. first + count
  int64_t b, first, count;
};

template <int kD, int64_t kHeads, typename T>
void run(const Operands<T>& op, const std::vector<int64_t>& lens, T* out, int64_t out_stride) {
  const int64_t B = static_cast<int64_t>(lens.size()), KVH = op.kvh, G = op.G, H = KVH * G;
  const int64_t D = op.D, threads = at::get_num_threads();
  // Each request is computed in chunks of kChunk keys, whose partial softmaxes are merged
  // after: the chunks keep every thread busy at small batches (batch-1 decode), and as the
  // split depends on the length alone, a request's result does not depend on the batch it is
  // in or on the number of threads. An item takes all KV heads of its chunk, reading whole
  // slots, unless that leaves too few items to share out: then one KV head each. Every head's
  // arithmetic is the same either way, so are the bits.
  int64_t num_chunks = 0;
  for (int64_t b = 0; b < B; ++b) num_chunks += (lens[b] + kChunk - 1) / kChunk;
  const int64_t heads_per_item = num_chunks >= kItemsPerThread * threads ? KVH : 1;
  std::vector<Item> items;
  std::vector<Split> splits;
  int64_t parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lens[b], chunks = (n + kChunk - 1) / kChunk;
    if (chunks > 1) splits.push_back({b, parts, chunks});
    for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
      const int64_t part = chunks > 1 ? parts++ : -1;
      for (int64_t h0 = 0; h0 < KVH; h0 += heads_per_item) {
        items.push_back({b, t0, std::min(n, t0 + kChunk), h0, h0 + heads_per_item, part});
      }
    }
  }
  // Longest first, handed out one at a time: the threads finish together.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    return x.t1 - x.t0 > y.t1 - y.t0;
  });
  const int64_t part_floats = H * (D + 2);  // m[H], l[H], acc[H, D]
  std::vector<float> partials(parts * part_floats);
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_floats(heads_per_item * G, D, kChunk));
    std::vector<float> result(part_floats);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      float* res = it.part >= 0 ? partials.data() + it.part * part_floats : result.data();
      const int64_t g0 = it.h0 * G, g1 = it.h1 * G;  // its query heads
      float *m = res + g0, *l = res + H + g0, *acc = res + 2 * H + g0 * D;
      if (heads_per_item == 1) {  // the loops over the item's heads compiled away
        attend_chunk<kD, kHeads, 1, T>(op, it.b, it.t0, it.t1, it.h0, it.h1, scratch.data(), m,
                                       l, acc);
      } else {
        attend_chunk<kD, kHeads, 0, T>(op, it.b, it.t0, it.t1, it.h0, it.h1, scratch.data(), m,
                                       l, acc);
      }
      if (it.part >= 0) continue;
      T* o = out + it.b * out_stride + g0 * D;
      for (int64_t g = 0; g < g1 - g0; ++g) {
        const float inv = 1.0f / l[g];
        for (int64_t c = 0; c < D; c += kLanes) {
          store16(load16(acc + g * D + c) * inv, o + g * D + c);
        }
      }
    }
  });
  // Merge the chunks of each split request: rescale each to the common max, then normalise.
  const int64_t num_split = static_cast<int64_t>(splits.size());
  at::parallel_for(0, num_split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t s = begin; s < end; ++s) {
      const Split& sp = splits[s];
      const float* first = partials.data() + sp.first * part_floats;
      T* o = out + sp.b * out_stride;
      for (int64_t g = 0; g < H; ++g) {
        float mx = first[g];
        for (int64_t c = 1; c < sp.count; ++c) mx = std::max(mx, first[c * part_floats + g]);
        float total = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t c = 0; c < sp.count; ++c) {
          const float* pc = first + c * part_floats;
          const float w = std::exp(pc[g] - mx);
          total += w * pc[H + g];
          for (int64_t d = 0; d < D; ++d) acc[d] += w * pc[2 * H + g * D + d];
        }
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < D; c += kLanes) {
          store16(load16(acc.data() + c) * inv, o + g * D + c);
        }
      }
    }
  });
}

template <typename T>
void dispatch_head_dim(const Operands<T>& op, const std::vector<int64_t>& lens, T* out,
                       int64_t out_stride) {
  // kHeads: query heads whose value accumulators fit in the registers at once (3 where the
  // group size is a multiple of 3, e.g. SmolLM2's 9/3, so that no pass carries an idle head).
  // Without AVX-512 there are 16 registers of 8 floats: the value pass then takes kHeads heads
  // over part of the row at a time (see add_values_widened).
#if defined(SGLANG_CPU_AVX2)
  switch (op.D) {
    case 64:
      if (op.G % 3 == 0) return run<64, 3, T>(op, lens, out, out_stride);
      return run<64, 1, T>(op, lens, out, out_stride);
    case 128:
      if (op.G % 3 == 0) return run<128, 3, T>(op, lens, out, out_stride);
      return run<128, 1, T>(op, lens, out, out_stride);
    default: return run<0, 1, T>(op, lens, out, out_stride);
  }
#endif
  switch (op.D) {
    case 64:
      if (op.G % 3 == 0) return run<64, 3, T>(op, lens, out, out_stride);
      return run<64, 4, T>(op, lens, out, out_stride);
    case 128: return run<128, 2, T>(op, lens, out, out_stride);
    default: return run<0, 1, T>(op, lens, out, out_stride);
  }
}

template <typename T>
void launch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& table, const at::Tensor& rows,
            const std::vector<int64_t>& lens, double scale, bool native_bf16,
            at::Tensor& out) {
  const int64_t KVH = k_cache.size(1), D = k_cache.size(2);
  const Operands<T> op{reinterpret_cast<const T*>(q.data_ptr()),
                       reinterpret_cast<const T*>(k_cache.data_ptr()),
                       reinterpret_cast<const T*>(v_cache.data_ptr()),
                       table.data_ptr<int64_t>(),
                       rows.data_ptr<int64_t>(),
                       q.stride(0),
                       table.stride(0),
                       KVH,
                       q.size(1) / (KVH * D),
                       D,
                       static_cast<float>(scale),
                       native_bf16};
  dispatch_head_dim<T>(op, lens, reinterpret_cast<T*>(out.data_ptr()), out.stride(0));
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor req_to_token, at::Tensor req_pool_indices,
                               at::Tensor seq_lens, double scale, bool native_bf16) {
  TORCH_CHECK(q.dim() == 2 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q must be [b, H*D], k_cache/v_cache [slots, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.stride(1) == 1,
              "the pool buffers must be contiguous and q's rows dense");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must have one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only");
  const int64_t KVH = k_cache.size(1), D = k_cache.size(2), B = q.size(0);
  TORCH_CHECK(D % kLanes == 0 && D <= kLanes * kMaxVecs, "the head dim must be 16, 32, ..., 256");
  TORCH_CHECK(q.size(1) % (KVH * D) == 0, "H*D must be a multiple of KVH*D");
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong &&
                  req_to_token.stride(1) == 1,
              "req_to_token must be a row-major int64 table");
  TORCH_CHECK(req_pool_indices.numel() == B && seq_lens.numel() == B, "batch mismatch");
  const at::Tensor rows = req_pool_indices.to(at::kLong).contiguous();
  const at::Tensor lens64 = seq_lens.to(at::kLong).contiguous();
  std::vector<int64_t> lens(lens64.data_ptr<int64_t>(), lens64.data_ptr<int64_t>() + B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = rows.data_ptr<int64_t>()[b];
    TORCH_CHECK(row >= 0 && row < req_to_token.size(0), "req_pool_indices out of range");
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= req_to_token.size(1),
                "seq_lens must be in [1, req_to_token.size(1)]");
  }
  at::Tensor out = at::empty({B, q.size(1)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    launch<float>(q, k_cache, v_cache, req_to_token, rows, lens, scale, native_bf16, out);
  } else {
    launch<uint16_t>(q, k_cache, v_cache, req_to_token, rows, lens, scale, native_bf16, out);
  }
  return out;
}
"""

_CPP_DECLARATION = (
    "at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, "
    "at::Tensor v_cache, at::Tensor req_to_token, at::Tensor req_pool_indices, "
    "at::Tensor seq_lens, double scale, bool native_bf16);"
)

_KERNEL = CpuKernel(
    "sglang_cpu_decode_attn",
    _CPP_DECLARATION,
    _CPP_SOURCE,
    ["decode_attention"],
    "CPU decode-attention kernel",
    needs_avx2=True,
)


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernel once per process
    (layers/cpu_extension.py). Returns True when :func:`decode_attention` can be used."""
    return _KERNEL.load()


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these operands (CPU; float32 or bfloat16 for all
    three; dense rows of ``q``; contiguous pool buffers; a head dim of 16, 32, ..., 256); the
    caller uses SDPA otherwise."""
    return (
        all(t.device.type == "cpu" for t in (q, k_cache, v_cache))
        and q.dtype in _SUPPORTED_DTYPES
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and q.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape[-1] % 16 == 0
        and k_cache.shape[-1] <= 256
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    native_bf16: bool = True,
) -> torch.Tensor:
    """Decode attention of ``q`` [b, H*D] over one layer's pool buffers ``k_cache`` /
    ``v_cache`` [slots, KVH, D]: row ``i`` attends to the keys at slots
    ``req_to_token[req_pool_indices[i], :seq_lens[i]]`` (``1 <= seq_lens[i]``; int CPU tensors
    [b]). Query head ``j`` uses KV head ``j // (H / KVH)``. Returns [b, H*D] in ``q``'s dtype,
    computed in float32. Raises RuntimeError for operands outside that contract.

    ``native_bf16=False`` makes a host with AVX512-BF16 take the portable code path for
    bfloat16 dot products, as hosts without it do (the tests compare the two).

    Precondition: :func:`load_kernel` returned True and :func:`kernel_supports` holds.
    """
    return _KERNEL.loaded.decode_attention(
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scale, native_bf16
    )
