"""A C++ decode-attention kernel for CPU (``--disable-cpu-attention-kernel`` turns it off).

Decode attention has one query token per request, so the work per (request, KV head) is tiny
and SDPA's per-call overhead dominates: on SmolLM2-135M (9 query heads, 3 KV heads, head dim
64) at batch 64 and ~240 keys it reads K/V at ~5 GB/s in float32 and ~2.4 GB/s in bfloat16,
where one core streams ~12 GB/s. This kernel works on one (request, KV head) at a time and
reads each K and V row once for all ``G = H / KVH`` query heads of that KV head:

1. scores: ``s[g, t] = scale * q[g] . k[t]`` for the request's real keys ``t < len`` only,
   into a small float32 buffer;
2. softmax over each ``s[g]``: a vectorised max, then ``exp`` (a polynomial, vectorised by the
   compiler, relative error ~1e-7) and sum;
3. ``out[g] = sum_t p[g, t] * v[t] / sum_t p[g, t]``, accumulated in float32.

The loops are plain C++ with ``#pragma omp simd``, compiled with ``-O3 -march=native``, so the
compiler vectorises them for the host (AVX-512, AVX2, NEON) without hand-written intrinsics.
Queries and K/V may each be float32 or bfloat16; the output has the query's dtype. The (request,
KV head) pairs are spread over torch's threads with ``at::parallel_for``.

The extension is built on first use (the model runner does it at model load) by
:func:`~sglang.srt.layers.cpu_extension.build_cpu_extension`, cached per source and CPU; where
it cannot be built :func:`load_kernel` returns False and the backend keeps SDPA.
"""

from __future__ import annotations

from types import ModuleType

import torch

from sglang.srt.layers.cpu_extension import build_cpu_extension

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)

_CPP_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// bfloat16 is handled as its raw 16 bits (the high half of a float32), which the compiler
// vectorises; float32 passes through.
inline float load(float x) { return x; }
inline float load(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even (inputs are finite)
  *dst = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2) (rounded by adding and subtracting
// 1.5 * 2^23, which vectorises where floor may not), |r| <= ln 2 / 2, e^r by its Taylor
// polynomial of degree 6 (relative error < 2e-7); x below -87 gives ~1.6e-38 instead of 0-ish.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f +
      r * (8.3333338e-3f + r * 1.3888889e-3f)))));
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

constexpr int64_t kLanes = 16;       // dot products are summed in 16 lanes, reduced per block
constexpr int64_t kKeyBlock = 16;    // keys scored per block
constexpr int64_t kValueBlock = 4;   // value rows accumulated per pass over the accumulators

// A K or V row of D as float32: the row itself for float32, else converted into dst.
template <typename KT>
inline const float* row_f32(const KT* __restrict src, int64_t D, float* __restrict dst) {
  if constexpr (std::is_same_v<KT, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = load(src[d]);
    return dst;
  }
}

// Scratch floats that attend_one needs for G query heads of D and n keys.
inline int64_t buf_floats(int64_t G, int64_t D, int64_t n) {
  return 2 * G * D + kKeyBlock * D + kKeyBlock * kLanes + G * (n + 1);
}

// One (request, KV head): q -> G query heads of D (kD if nonzero, else head_dim; a multiple of
// kLanes), keys/values rows of D at the strides given, n real keys; writes G heads of D to out.
// buf holds buf_floats(G, D, n) floats.
template <int kD, typename QT, typename KT>
void attend_one(const QT* __restrict q, const KT* __restrict k, const KT* __restrict v,
                QT* __restrict out, int64_t n, int64_t G, int64_t head_dim, int64_t k_stride,
                int64_t v_stride, float scale, float* __restrict buf) {
  const int64_t D = kD ? kD : head_dim;
  float* __restrict qf = buf;                     // [G, D] scaled queries
  float* __restrict acc = qf + G * D;             // [G, D] value accumulators
  float* __restrict rows = acc + G * D;           // [kKeyBlock, D] converted K or V rows
  float* __restrict part = rows + kKeyBlock * D;  // [kKeyBlock, kLanes] partial dot products
  float* __restrict inv_sum = part + kKeyBlock * kLanes;  // [G] 1 / softmax denominators
  float* __restrict scores = inv_sum + G;                 // [G, n]
  for (int64_t i = 0; i < G * D; ++i) qf[i] = load(q[i]) * scale;

  // Scores, a block of keys at a time: lane-wise partial sums (no horizontal reduction per
  // key), then each key's kLanes partials summed, vectorised across the block's keys.
  const float* krow[kKeyBlock];
  for (int64_t t0 = 0; t0 < n; t0 += kKeyBlock) {
    const int64_t nb = std::min(kKeyBlock, n - t0);
    for (int64_t t = 0; t < nb; ++t) krow[t] = row_f32(k + (t0 + t) * k_stride, D, rows + t * D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      for (int64_t t = 0; t < nb; ++t) {
        const float* kr = krow[t];
        float* pt = part + t * kLanes;
#pragma omp simd
        for (int64_t w = 0; w < kLanes; ++w) pt[w] = qg[w] * kr[w];
        for (int64_t c = kLanes; c < D; c += kLanes) {
#pragma omp simd
          for (int64_t w = 0; w < kLanes; ++w) pt[w] += qg[c + w] * kr[c + w];
        }
      }
      float* sg = scores + g * n + t0;
#pragma omp simd
      for (int64_t t = 0; t < nb; ++t) {
        float sum = 0.0f;
        for (int64_t w = 0; w < kLanes; ++w) sum += part[t * kLanes + w];
        sg[t] = sum;
      }
    }
  }

  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float m = sg[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < n; ++t) m = sg[t] > m ? sg[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      const float p = exp_nonpositive(sg[t] - m);
      sg[t] = p;
      sum += p;
    }
    inv_sum[g] = 1.0f / sum;
  }

  // Values, kValueBlock rows per pass over the accumulators (a lone row for the remainder).
  std::fill(acc, acc + G * D, 0.0f);
  int64_t t = 0;
  for (; t + kValueBlock <= n; t += kValueBlock) {
    const float* v0 = row_f32(v + t * v_stride, D, rows);
    const float* v1 = row_f32(v + (t + 1) * v_stride, D, rows + D);
    const float* v2 = row_f32(v + (t + 2) * v_stride, D, rows + 2 * D);
    const float* v3 = row_f32(v + (t + 3) * v_stride, D, rows + 3 * D);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = scores + g * n + t;
      const float p0 = pg[0], p1 = pg[1], p2 = pg[2], p3 = pg[3];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
  }
  for (; t < n; ++t) {
    const float* vr = row_f32(v + t * v_stride, D, rows);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + t];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * vr[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) store(acc[g * D + d] * inv_sum[g], out + g * D + d);
  }
}

template <int kD, typename QT, typename KT>
void run(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
         const std::vector<int64_t>& lens, double scale, torch::Tensor& out) {
  const int64_t B = keys.size(0), KVH = keys.size(1), D = keys.size(3);
  const int64_t G = q.size(1) / (KVH * D), max_len = keys.size(2);
  const QT* qp = reinterpret_cast<const QT*>(q.data_ptr());
  const KT* kp = reinterpret_cast<const KT*>(keys.data_ptr());
  const KT* vp = reinterpret_cast<const KT*>(values.data_ptr());
  QT* op = reinterpret_cast<QT*>(out.data_ptr());
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  const int64_t kb = keys.stride(0), kh = keys.stride(1), kt = keys.stride(2);
  const int64_t vb = values.stride(0), vh = values.stride(1), vt = values.stride(2);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(buf_floats(G, D, max_len));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, h = i % KVH;
      attend_one<kD, QT, KT>(qp + b * q_stride + h * G * D, kp + b * kb + h * kh,
                             vp + b * vb + h * vh, op + b * out_stride + h * G * D, lens[b], G,
                             D, kt, vt, static_cast<float>(scale), buf.data());
    }
  });
}

// The head dims of common models get loops of a fixed trip count; others a runtime one.
template <typename QT, typename KT>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& keys,
                       const torch::Tensor& values, const std::vector<int64_t>& lens,
                       double scale, torch::Tensor& out) {
  switch (keys.size(3)) {
    case 64: return run<64, QT, KT>(q, keys, values, lens, scale, out);
    case 128: return run<128, QT, KT>(q, keys, values, lens, scale, out);
    default: return run<0, QT, KT>(q, keys, values, lens, scale, out);
  }
}

template <typename QT>
void dispatch_kv(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                 const std::vector<int64_t>& lens, double scale, torch::Tensor& out) {
  if (keys.scalar_type() == at::kFloat) {
    dispatch_head_dim<QT, float>(q, keys, values, lens, scale, out);
  } else {
    dispatch_head_dim<QT, uint16_t>(q, keys, values, lens, scale, out);
  }
}

}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                               torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 2 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "q must be [b, H*D], keys/values [b, KVH, len, D]");
  TORCH_CHECK(q.size(0) == keys.size(0) && lens.numel() == keys.size(0), "batch mismatch");
  TORCH_CHECK(q.size(1) % (keys.size(1) * keys.size(3)) == 0, "H*D not a multiple of KVH*D");
  TORCH_CHECK(q.stride(1) == 1 && keys.stride(3) == 1 && values.stride(3) == 1,
              "the head dim must be contiguous");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values differ in dtype");
  TORCH_CHECK(keys.size(3) % kLanes == 0, "the head dim must be a multiple of 16");
  for (const auto& t : {q, keys}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
                "float32 or bfloat16 only");
  }
  const torch::Tensor lens64 = lens.to(at::kLong).contiguous();
  std::vector<int64_t> lens_v(lens64.data_ptr<int64_t>(),
                              lens64.data_ptr<int64_t>() + lens64.numel());
  for (int64_t n : lens_v) {
    TORCH_CHECK(n >= 1 && n <= keys.size(2), "lens must be in [1, keys.size(2)]");
  }
  torch::Tensor out = torch::empty_like(q, at::MemoryFormat::Contiguous);
  if (q.scalar_type() == at::kFloat) {
    dispatch_kv<float>(q, keys, values, lens_v, scale, out);
  } else {
    dispatch_kv<uint16_t>(q, keys, values, lens_v, scale, out);
  }
  return out;
}
"""

_CPP_DECLARATION = (
    "torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, "
    "torch::Tensor lens, double scale);"
)

# The built module once load_kernel() succeeded.
_module: ModuleType | None = None


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernel once per process
    (layers/cpu_extension.py). Returns True when :func:`decode_attention` can be used."""
    global _module
    if _module is None:
        _module = build_cpu_extension(
            "sglang_cpu_decode_attn",
            _CPP_DECLARATION,
            _CPP_SOURCE,
            ["decode_attention"],
            "CPU decode-attention kernel",
        )
    return _module is not None


def kernel_supports(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these operands (CPU, float32/bfloat16, contiguous
    head dim, a multiple of 16); the caller uses SDPA otherwise."""
    return (
        q.device.type == "cpu"
        and keys.device.type == "cpu"
        and q.dtype in _SUPPORTED_DTYPES
        and keys.dtype in _SUPPORTED_DTYPES
        and values.dtype == keys.dtype
        and q.stride(-1) == 1
        and keys.stride(-1) == 1
        and values.stride(-1) == 1
        and keys.shape[-1] % 16 == 0
    )


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of ``q`` [b, H*D] over ``keys``/``values`` [b, KVH, len, D] (any
    strides but a contiguous head dim, a multiple of 16), row ``i`` attending to its first
    ``lens[i]`` keys only (``1 <= lens[i] <= len``; ``lens`` an int CPU tensor [b]). Query head
    ``j`` uses KV head ``j // (H / KVH)``. Returns [b, H*D] in ``q``'s dtype, computed in
    float32.

    Precondition: :func:`load_kernel` returned True and :func:`kernel_supports` holds.
    """
    assert isinstance(_module, ModuleType), "load_kernel() must succeed first"
    return _module.decode_attention(q, keys, values, lens, scale)
