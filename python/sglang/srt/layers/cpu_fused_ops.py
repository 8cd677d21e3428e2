"""One C++ call each for a decoder layer's elementwise pieces on CPU (``--disable-cpu-fused-ops``
turns them off): add + RMSNorm, SiLU-and-mul, RoPE, and the K/V store into the pool.

In torch these are 4-12 ops each (~55 a layer): at batch 1 each op's dispatch costs more
than its arithmetic, and in prefill every op reads and writes a full-size temporary (SiLU*up
alone was 9% of a float32 prefill step). Here each piece is one pass over its rows, the rows
split over torch's threads, each row computed by one thread in a fixed order (so a row's
result does not depend on the batch it is in or on the number of threads).

They round where the torch versions (and the HF models) round, so bfloat16 runs keep their
rounding points:

- :func:`add_rms_norm`: ``s = x + residual`` rounded to the dtype; ``out = weight *
  dtype(s * rsqrt(mean(s^2) + eps))`` with the statistics in float32 and the product rounded
  to the dtype. The sum of squares is accumulated in 16 float32 lanes (torch's order differs,
  so the last bit of the statistics may too).
- :func:`silu_and_mul`: ``dtype(silu(g)) * u``, ``silu(g) = g / (1 + exp(-g))`` with an exp
  polynomial of relative error < 2e-7 (torch's differs in the last bit at times); on AVX-512
  hosts the polynomial's steps are fused multiply-adds and the division is the CPU's
  reciprocal estimate refined by a Newton step (within 2 ulp), and with AVX512-BF16 the
  bfloat16 roundings are the CPU's conversion (the same bits; a vector holding a NaN or a
  denormal takes the software rounding, which the conversion does not match there).
- :func:`rope`: ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` in float32, rounded once:
  bitwise equal to :class:`~sglang.srt.layers.rotary_embedding.RotaryEmbedding`'s torch ops
  (built without FMA contraction for that).
- :func:`store_kv`: the rows of k and v copied to their slots.

Plain loops that the compiler vectorises for the host's own vector width (AVX2 or AVX-512;
``-O3 -march=native``), so the kernels serve every x86-64/aarch64 Linux host; SiLU-and-mul
also has a 16-lane path for AVX-512 hosts. Built at model
load (:class:`~sglang.srt.layers.cpu_extension.CpuKernel`); where the build fails,
:func:`load_kernel` returns False and the torch ops stay.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.cpu_extension import CPP_VECTOR_PRELUDE, CpuKernel

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

# These kernels take the prelude's scalar load1 (float32 or bfloat16 -> float32), and on AVX2
# hosts its load8 (the 8-column SiLU path).
_CPP_SOURCE = CPP_VECTOR_PRELUDE + r"""
#include <tuple>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = uint16_t;  // bfloat16 as its raw bits (the high half of a float32)
using sglang_cpu::load1;

// float32 -> T, bfloat16 rounded to nearest even (NaN stays a quiet NaN), as torch rounds.
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<bf16>(x != x ? 0x7fc0u : rounded);
}

#if defined(__AVX512F__)
// from_f32 on 16 lanes, stored at p.
inline void store_rounded(sglang_cpu::f32x16 v, float* p) { sglang_cpu::store16(v, p); }
inline void store_rounded(sglang_cpu::f32x16 v, bf16* p) {
  using namespace sglang_cpu;
#if defined(__AVX512BF16__)
  // The CPU's conversion rounds to nearest even as from_f32 does, except that it flushes
  // denormals to zero and keeps a NaN's sign and payload: lanes of either kind (fpclass 0xA1:
  // quiet NaN, signalling NaN, denormal) send the vector to the software rounding below.
  if (_mm512_fpclass_ps_mask((__m512)v, 0xA1) == 0) {
    const __m256bh h = _mm512_cvtneps_pbh((__m512)v);
    std::memcpy(p, &h, sizeof h);
    return;
  }
#endif
  const u32x16 bits = (u32x16)v;
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u16x16 h = __builtin_convertvector(v != v ? rounded * 0u + 0x7fc0u : rounded, u16x16);
  std::memcpy(p, &h, sizeof h);
}

// from_f32<T> on 16 lanes, back as float32: what store_rounded stores, read back. Its own
// branches rather than store_rounded's bits widened: that was 0.92x on SiLU-and-mul.
inline sglang_cpu::f32x16 rounded16(sglang_cpu::f32x16 v, const float*) { return v; }
inline sglang_cpu::f32x16 rounded16(sglang_cpu::f32x16 v, const bf16*) {
  using namespace sglang_cpu;
#if defined(__AVX512BF16__)
  if (_mm512_fpclass_ps_mask((__m512)v, 0xA1) == 0) {  // as in store_rounded
    return (f32x16)_mm512_cvtpbh_ps(_mm512_cvtneps_pbh((__m512)v));
  }
#endif
  const u32x16 bits = (u32x16)v;
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  return (f32x16)(v != v ? rounded * 0u + 0x7fc00000u : rounded);
}
#endif

// Rows per parallel task: about 16K elements each, so small batches run on the calling
// thread (no fork) and large ones are split evenly.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / row_elems); }

// exp(x) for x in [-87, 88] (clamped): 2^n e^r with |r| <= ln 2 / 2 and e^r by its degree-6
// Taylor polynomial (relative error < 2e-7); branch-free so that loops of it vectorise.
inline float exp_poly(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f +
      r * (8.3333338e-3f + r * 1.3888889e-3f)))));
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

constexpr int64_t kAcc = 16;  // float32 accumulators of a row's sum of squares

template <typename T>
void add_rms_norm_rows(const T* x, int64_t x_stride, const T* res, int64_t res_stride,
                       const T* w, float eps, int64_t rows, int64_t N, T* out, T* sum_out) {
  at::parallel_for(0, rows, grain(N), [&](int64_t begin, int64_t end) {
    std::vector<float> s(N);
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict xi = x + i * x_stride;
      float* __restrict si = s.data();
      if (res != nullptr) {
        const T* __restrict ri = res + i * res_stride;
        T* __restrict so = sum_out + i * N;
        for (int64_t j = 0; j < N; ++j) {
          so[j] = from_f32<T>(load1(xi[j]) + load1(ri[j]));
          si[j] = load1(so[j]);
        }
      } else {
        for (int64_t j = 0; j < N; ++j) si[j] = load1(xi[j]);
      }
      float acc[kAcc] = {};
      int64_t j = 0;
      for (; j + kAcc <= N; j += kAcc) {
        for (int64_t l = 0; l < kAcc; ++l) acc[l] += si[j + l] * si[j + l];
      }
      for (; j < N; ++j) acc[j % kAcc] += si[j] * si[j];
      float total = 0.0f;
      for (int64_t l = 0; l < kAcc; ++l) total += acc[l];
      const float inv = 1.0f / std::sqrt(total / static_cast<float>(N) + eps);
      T* __restrict oi = out + i * N;
      for (int64_t k = 0; k < N; ++k) {
        oi[k] = from_f32<T>(load1(from_f32<T>(si[k] * inv)) * load1(w[k]));
      }
    }
  });
}

#if defined(__AVX512F__)
// a * b + c rounded once (this file is built without contraction, for RoPE's sake).
inline sglang_cpu::f32x16 fma16(sglang_cpu::f32x16 a, sglang_cpu::f32x16 b,
                                sglang_cpu::f32x16 c) {
  return (sglang_cpu::f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}

// silu(g) * u over 16 columns: exp_poly's steps on vectors with each a * b + c fused (the
// separate products and sums bound the loop: 1.3-1.5x with fusion and the CPU's bfloat16
// conversion), and 1 / (1 + e) by the CPU's 14-bit reciprocal estimate refined by one Newton
// step (within 2 ulp of the division, whose vector instruction costs ~16 cycles per 16
// lanes). from_f32's rounding.
template <typename T>
inline void silu_mul16(const T* g, const T* u, T* o) {
  using namespace sglang_cpu;
  f32x16 x = load16(g);
  f32x16 y = -x;
  y = y < -87.0f ? splat(-87.0f) : y;
  y = y > 88.0f ? splat(88.0f) : y;
  const f32x16 n = fma16(y, splat(1.44269504088896341f), splat(12582912.0f)) - 12582912.0f;
  const f32x16 r =
      fma16(-n, splat(1.428606765330187e-06f), fma16(-n, splat(0.693145751953125f), y));
  f32x16 p = fma16(r, splat(1.3888889e-3f), splat(8.3333338e-3f));
  for (const float c : {4.1666668e-2f, 1.6666667e-1f, 0.5f, 1.0f, 1.0f}) {
    p = fma16(r, p, splat(c));
  }
  const f32x16 e = p * (f32x16)((__builtin_convertvector(n, i32x16) + 127) << 23);
  const f32x16 den = 1.0f + e;
  f32x16 inv = (f32x16)_mm512_rcp14_ps((__m512)den);
  inv = inv * fma16(-den, inv, splat(2.0f));
  store_rounded(rounded16(x * inv, o) * load16(u), o);
}
#endif

#if defined(SGLANG_CPU_AVX2)
// The scalar loop below on 8 columns (GCC did not vectorise it: SiLU-and-mul was ~4% of a
// float32 run on an AVX2 host): exp_poly's operations in its order, then the same division and
// from_f32 roundings, so each lane is the scalar loop's result to the bit.
inline __m256 splat8(float x) { return _mm256_set1_ps(x); }

inline __m256 exp_poly8(__m256 x) {
  x = _mm256_min_ps(splat8(88.0f), _mm256_max_ps(splat8(-87.0f), x));  // as std::min/max
  const __m256 n = _mm256_sub_ps(
      _mm256_add_ps(_mm256_mul_ps(x, splat8(1.44269504088896341f)), splat8(12582912.0f)),
      splat8(12582912.0f));
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, splat8(0.693145751953125f))),
                                 _mm256_mul_ps(n, splat8(1.428606765330187e-06f)));
  __m256 p = _mm256_add_ps(splat8(8.3333338e-3f), _mm256_mul_ps(r, splat8(1.3888889e-3f)));
  for (const float c : {4.1666668e-2f, 1.6666667e-1f, 0.5f, 1.0f, 1.0f}) {
    p = _mm256_add_ps(splat8(c), _mm256_mul_ps(r, p));
  }
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// from_f32<T> on 8 lanes, back as float32 (rounded values), and stored at p.
inline __m256 round8(__m256 v, float*) { return v; }
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}
inline __m256 round8(__m256 v, bf16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}
inline void store_rounded8(__m256 v, float* p) { _mm256_storeu_ps(p, v); }
inline void store_rounded8(__m256 v, bf16* p) {
  const __m256i h = bf16_bits8(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

template <typename T>
inline void silu_mul8(const T* g, const T* u, T* o) {
  const __m256 x = sglang_cpu::load8(g);
  const __m256 e = exp_poly8(_mm256_xor_ps(x, splat8(-0.0f)));
  const __m256 act = round8(_mm256_div_ps(x, _mm256_add_ps(splat8(1.0f), e)), o);
  store_rounded8(_mm256_mul_ps(act, sglang_cpu::load8(u)), o);
}
#endif

template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, int64_t rows, int64_t d, T* out) {
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict g = x + i * x_stride;
      const T* __restrict u = g + d;
      T* __restrict o = out + i * d;
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= d; j += 16) silu_mul16(g + j, u + j, o + j);
#elif defined(SGLANG_CPU_AVX2)
      for (; j + 8 <= d; j += 8) silu_mul8(g + j, u + j, o + j);
#endif
      for (; j < d; ++j) {
        const float gj = load1(g[j]);
        const float act = load1(from_f32<T>(gj / (1.0f + exp_poly(-gj))));
        o[j] = from_f32<T>(act * load1(u[j]));
      }
    }
  });
}

template <typename T>
void rope_rows(const T* x, int64_t x_stride, const int64_t* pos, const float* cos_sin,
               int64_t rows, int64_t heads, int64_t D, int64_t R, T* out) {
  const int64_t half = R / 2;
  at::parallel_for(0, rows, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict c = cos_sin + pos[i] * R;
      const float* __restrict s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* __restrict xi = x + i * x_stride + h * D;
        T* __restrict oi = out + (i * heads + h) * D;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = load1(xi[j]), x2 = load1(xi[half + j]);
          oi[j] = from_f32<T>(x1 * c[j] - x2 * s[j]);
          oi[half + j] = from_f32<T>(x2 * c[j] + x1 * s[j]);
        }
        for (int64_t j = R; j < D; ++j) oi[j] = xi[j];
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1,
              name, " must be a CPU matrix with dense rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, " must be float32 or bfloat16");
}

template <typename T>
const T* ptr(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T>
T* mut_ptr(at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x,
                                                      c10::optional<at::Tensor> residual,
                                                      at::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == N && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [N] vector of x's dtype");
  at::Tensor out = at::empty({rows, N}, x.options());
  at::Tensor summed = x;
  const bool has_res = residual.has_value();
  if (has_res) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    summed = at::empty({rows, N}, x.options());
  }
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(ptr<float>(x), x.stride(0),
                             has_res ? ptr<float>(*residual) : nullptr,
                             has_res ? residual->stride(0) : 0, ptr<float>(weight),
                             static_cast<float>(eps), rows, N, mut_ptr<float>(out),
                             has_res ? mut_ptr<float>(summed) : nullptr);
  } else {
    add_rms_norm_rows<bf16>(ptr<bf16>(x), x.stride(0),
                            has_res ? ptr<bf16>(*residual) : nullptr,
                            has_res ? residual->stride(0) : 0, ptr<bf16>(weight),
                            static_cast<float>(eps), rows, N, mut_ptr<bf16>(out),
                            has_res ? mut_ptr<bf16>(summed) : nullptr);
  }
  return {out, summed};
}

at::Tensor silu_and_mul(at::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must have an even number of columns (gate, then up)");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_and_mul_rows<float>(ptr<float>(x), x.stride(0), rows, d, mut_ptr<float>(out));
  } else {
    silu_and_mul_rows<bf16>(ptr<bf16>(x), x.stride(0), rows, d, mut_ptr<bf16>(out));
  }
  return out;
}

at::Tensor rope(at::Tensor x, at::Tensor positions, at::Tensor cos_sin,
                   int64_t head_dim, int64_t rotary_dim) {
  check_rows(x, "x");
  TORCH_CHECK(head_dim > 0 && x.size(1) % head_dim == 0,
              "x's width must be a multiple of head_dim");
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
              "rotary_dim must be even and in (0, head_dim]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 &&
                  cos_sin.size(1) == rotary_dim && cos_sin.is_contiguous(),
              "cos_sin must be a contiguous float32 [max_position, rotary_dim] table");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == x.size(0),
              "positions must be int64 [rows]");
  const at::Tensor pos = positions.contiguous();
  const int64_t rows = x.size(0), P = cos_sin.size(0);
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < P, "position ", p[i], " outside [0, ", P, ")");
  }
  at::Tensor out = at::empty({rows, x.size(1)}, x.options());
  const int64_t heads = x.size(1) / head_dim;
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(ptr<float>(x), x.stride(0), p, cos_sin.data_ptr<float>(), rows, heads,
                     head_dim, rotary_dim, mut_ptr<float>(out));
  } else {
    rope_rows<bf16>(ptr<bf16>(x), x.stride(0), p, cos_sin.data_ptr<float>(), rows, heads,
                    head_dim, rotary_dim, mut_ptr<bf16>(out));
  }
  return out;
}

void store_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor loc, at::Tensor k,
              at::Tensor v) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  v_cache.dim() == 3,
              "the pool buffers must be contiguous [slots, heads, head_dim]");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1, "loc must be int64 [rows]");
  const int64_t rows = loc.size(0), S = k_cache.size(0);
  const at::Tensor* srcs[2] = {&k, &v};
  const at::Tensor* dsts[2] = {&k_cache, &v_cache};
  for (int c = 0; c < 2; ++c) {
    const at::Tensor& src = *srcs[c];
    const at::Tensor& dst = *dsts[c];
    TORCH_CHECK(src.dim() == 3 && src.size(0) == rows && src.size(1) == dst.size(1) &&
                    src.size(2) == dst.size(2) && dst.size(0) == S,
                "k/v must be [rows, heads, head_dim] of the pool's shape");
    TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "k/v must have the pool's dtype");
    TORCH_CHECK(src.stride(2) == 1 && src.stride(1) == src.size(2),
                "k/v rows must be dense");
  }
  const at::Tensor slots = loc.contiguous();
  const int64_t* l = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(l[i] >= 0 && l[i] < S, "slot ", l[i], " outside [0, ", S, ")");
  }
  const int64_t row_bytes = k_cache.size(1) * k_cache.size(2) * k_cache.element_size();
  for (int c = 0; c < 2; ++c) {
    const char* src = static_cast<const char*>(srcs[c]->data_ptr());
    char* dst = static_cast<char*>(dsts[c]->data_ptr());
    const int64_t src_stride = srcs[c]->stride(0) * srcs[c]->element_size();
    at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / row_bytes),
                     [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(dst + l[i] * row_bytes, src + i * src_stride, row_bytes);
      }
    });
  }
}
"""

_CPP_DECLARATION = """
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x,
    c10::optional<at::Tensor> residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor rope(at::Tensor x, at::Tensor positions, at::Tensor cos_sin,
    int64_t head_dim, int64_t rotary_dim);
void store_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor loc, at::Tensor k,
    at::Tensor v);
"""

_KERNEL = CpuKernel(
    "sglang_cpu_fused_ops",
    _CPP_DECLARATION,
    _CPP_SOURCE,
    ["add_rms_norm", "silu_and_mul", "rope", "store_kv"],
    "CPU fused elementwise kernels",
    # No a*b+c contraction into FMA: RoPE's products and sums then round exactly as torch's
    # separate ops do.
    extra_cflags=("-ffp-contract=off",),
)


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernels once per process
    (layers/cpu_extension.py). Returns True when the functions below can be called."""
    return _KERNEL.load()


def supports(x: torch.Tensor) -> bool:
    """Whether ``x`` can go to these kernels: a CPU float32/bfloat16 tensor with a dense last
    dim, not traced by torch.compile (whose graphs keep the torch ops, which inductor fuses
    itself)."""
    return (
        x.is_cpu
        and x.dtype in _SUPPORTED_DTYPES
        and x.dim() >= 1
        and x.stride(-1) == 1
        and not torch.compiler.is_compiling()
    )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(s), s)`` with ``s = x + residual`` (``s = x`` without a residual) and
    ``norm(s) = weight * dtype(s * rsqrt(mean(s^2) + eps))`` over the last dim, as
    :class:`~sglang.srt.layers.layernorm.RMSNorm` rounds. ``x`` (any leading shape, rows dense)
    and ``residual`` share a shape and dtype; ``weight`` ``[N]`` has that dtype. Returns new
    tensors of ``x``'s shape (``s`` is ``x`` itself when there is no residual)."""
    if x.dim() == 2:  # the models' case: no reshapes (~3 us a call at batch-1 decode)
        out, summed = _KERNEL.loaded.add_rms_norm(x, residual, weight, eps)
        return out, (x if residual is None else summed)
    shape = x.shape
    n = shape[-1]
    res = None if residual is None else residual.reshape(-1, n)
    out, summed = _KERNEL.loaded.add_rms_norm(x.reshape(-1, n), res, weight, eps)
    return out.view(shape), (x if residual is None else summed.view(shape))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``dtype(silu(x[..., :d])) * x[..., d:]`` for ``x`` ``[..., 2d]`` (rows dense); a new
    ``[..., d]`` tensor."""
    if x.dim() == 2:
        return _KERNEL.loaded.silu_and_mul(x)
    d2 = x.shape[-1]
    return _KERNEL.loaded.silu_and_mul(x.reshape(-1, d2)).view(*x.shape[:-1], d2 // 2)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> torch.Tensor:
    """RoPE (rotate-half layout) of ``x`` ``[T, n * head_dim]`` (rows dense, any row stride)
    at ``positions`` (int64 ``[T]``, each in ``[0, cos_sin.shape[0])``, else RuntimeError):
    ``cos_sin`` is the float32 ``[max_position, rotary_dim]`` table of cos (first half) and
    sin (second half). Returns a new contiguous tensor; the last ``head_dim - rotary_dim``
    entries of each head pass through."""
    return _KERNEL.loaded.rope(x, positions, cos_sin, head_dim, rotary_dim)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """``k_cache[loc] = k`` and ``v_cache[loc] = v``: the pool buffers ``[S, H, D]``
    (contiguous), ``k``/``v`` ``[T, H, D]`` of their dtype with dense rows, ``loc`` int64
    ``[T]`` of distinct slots in ``[0, S)`` (RuntimeError otherwise)."""
    _KERNEL.loaded.store_kv(k_cache, v_cache, loc, k, v)
