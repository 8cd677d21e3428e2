"""A C++ product for the few-row linear layers of small decode batches on CPU.

With one to four input rows (batch-1 decode and the tail of a batch) a linear layer is bound by
reading its weight, once, from memory; oneDNN's packed kernel reads bfloat16 weights there at
about half the memory bandwidth of a 2-core host (SmolLM2-135M's 121 layers: ~14 ms a step).
This kernel streams the row-major weight itself (no packed copy involved), spread over torch's
threads in blocks of output features, and multiplies each weight row by every input row while
it is in registers:

    y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n])     for m < M <= 4

accumulated in float32 (16 lanes per output, the lanes of 16 outputs summed by one shuffle
tree), rounded once to the output dtype (bfloat16: to nearest even), the bias added before
the rounding. bfloat16 products use the CPU's ``vdpbf16ps`` where it has AVX512-BF16, else
they are widened to float32 (the same products). The vector code is GCC vector types of 16
floats (the prelude of :mod:`~sglang.srt.layers.cpu_extension`); on a CPU with AVX2 and no
AVX-512 the weight loop keeps each row's partials as two 8-float registers, added pairwise
before an 8-wide reduction (built with the 16-float code alone, GCC kept the accumulators in
memory there and the kernel read at ~8 GB/s instead of ~18). On such a host it reads a
bfloat16 model's own bfloat16 weights, half the bytes of the float32 copies the packed product
multiplies there (``--cpu-bf16-linear auto``). Built at model load
(:class:`~sglang.srt.layers.cpu_extension.CpuKernel`); where it is not built (no AVX2, a
failed build) :func:`load_kernel` returns False and the packed product serves every batch.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.cpu_extension import CPP_VECTOR_PRELUDE, CpuKernel

# The most input rows small_linear takes (cpu_prepack uses it up to SMALL_BATCH_ROWS).
MAX_ROWS = 4

_CPP_SOURCE = CPP_VECTOR_PRELUDE + r"""
namespace {

using namespace sglang_cpu;

constexpr int64_t kMaxRows = 4;
constexpr int64_t kBlock = 16;  // output features reduced together

// The weight streams through each thread in order; asking for the line 16 KiB ahead into L2
// keeps enough reads in flight to reach the memory's rate (the hardware prefetchers alone
// left a bfloat16 step's 121 matrices at ~14 GB/s on an Emerald Rapids host; with this,
// ~21 GB/s, as a plain streaming read).
constexpr int64_t kPrefetchBytes = 16 << 10;
template <typename T>
inline void prefetch_ahead(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, 0, 2);
}

#if defined(SGLANG_CPU_AVX2)
// Without AVX-512: a row's 16 lane partials added pairwise into 8 (lane j and j + 8), held in
// one register (GCC keeps 16-float accumulators in memory here, which ran at half the
// weight's streaming rate).
using Partial = __m256;

// The 16 sums of part[0..15]'s lanes.
inline f32x16 reduce_partials(const Partial* part) {
  f32x16 out;
  store8(sum_lanes8(part), reinterpret_cast<float*>(&out));
  store8(sum_lanes8(part + 8), reinterpret_cast<float*>(&out) + 8);
  return out;
}

// Lane partials of weight row w with the kM input rows: part[m].
template <int64_t kM, typename T>
inline void row_partials(const T* x, int64_t x_stride, const T* w, int64_t K, bool,
                         Partial* part) {
  __m256 lo[kM], hi[kM];
  for (int64_t m = 0; m < kM; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    prefetch_ahead(w + k);
    const __m256 w0 = load8(w + k), w1 = load8(w + k + 8);
    for (int64_t m = 0; m < kM; ++m) {
      lo[m] = _mm256_fmadd_ps(load8(x + m * x_stride + k), w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(load8(x + m * x_stride + k + 8), w1, hi[m]);
    }
  }
  for (int64_t m = 0; m < kM; ++m) part[m] = _mm256_add_ps(lo[m], hi[m]);
}
#else
using Partial = f32x16;

inline f32x16 reduce_partials(const Partial* part) { return sum_lanes16(part); }

// Lane partials of weight row w with the kM input rows: part[m] (16 floats).
template <int64_t kM, typename T>
inline void row_partials(const T* x, int64_t x_stride, const T* w, int64_t K, bool native,
                         Partial* part) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (native) {
      __m512 acc[kM];
      for (int64_t m = 0; m < kM; ++m) acc[m] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32) {
        prefetch_ahead(w + k);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int64_t m = 0; m < kM; ++m) {
          acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * x_stride + k),
                                    wv);
        }
      }
      for (int64_t m = 0; m < kM; ++m) std::memcpy(&part[m], &acc[m], sizeof acc[m]);
      return;
    }
  }
#endif
  f32x16 acc[kM];
  for (int64_t m = 0; m < kM; ++m) acc[m] = f32x16{};
  for (int64_t k = 0; k < K; k += kLanes) {
    prefetch_ahead(w + k);
    const f32x16 wv = load16(w + k);
    for (int64_t m = 0; m < kM; ++m) acc[m] += load16(x + m * x_stride + k) * wv;
  }
  for (int64_t m = 0; m < kM; ++m) part[m] = acc[m];
}
#endif

template <int64_t kM, typename T>
void run(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t N, int64_t K,
         bool native) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // ~64 KiB of weight per task at least, so that small layers do not pay for the threads.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kBlock * K * sizeof(T)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    Partial part[kM][kBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kBlock, nb = std::min(kBlock, N - n0);
      for (int64_t j = 0; j < kBlock; ++j) {
        Partial row[kM];
        if (j < nb) {
          row_partials<kM, T>(x, x_stride, w + (n0 + j) * K, K, native, row);
        } else {
          for (int64_t m = 0; m < kM; ++m) row[m] = Partial{};
        }
        for (int64_t m = 0; m < kM; ++m) part[m][j] = row[m];
      }
      for (int64_t m = 0; m < kM; ++m) {
        f32x16 sums = reduce_partials(part[m]);
        if (bias != nullptr) {
          for (int64_t j = 0; j < nb; ++j) sums[j] += load16(bias + n0 + j)[0];
        }
        alignas(64) T out[kLanes];
        store16(sums, out);
        std::memcpy(y + m * N + n0, out, nb * sizeof(T));
      }
    }
  });
}

template <typename T>
void dispatch_rows(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& y,
                   bool native) {
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const int64_t N = w.size(0), K = w.size(1), xs = x.stride(0);
  switch (x.size(0)) {
    case 1: return run<1, T>(xp, xs, wp, bias, yp, N, K, native);
    case 2: return run<2, T>(xp, xs, wp, bias, yp, N, K, native);
    case 3: return run<3, T>(xp, xs, wp, bias, yp, N, K, native);
    default: return run<4, T>(xp, xs, wp, bias, yp, N, K, native);
  }
}

}  // namespace

at::Tensor small_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias,
                           bool native_bf16) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x must have 1 to 4 rows");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must have one dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only");
  TORCH_CHECK(weight.is_contiguous() && x.stride(1) == 1, "weight and x's rows must be dense");
  TORCH_CHECK(weight.size(1) % 32 == 0, "in_features must be a multiple of 32");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == weight.size(0),
                "bias must be a dense [N] tensor of x's dtype");
  }
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    dispatch_rows<float>(x, weight, has_bias ? bias->data_ptr<float>() : nullptr, y, native_bf16);
  } else {
    const uint16_t* b = has_bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
    dispatch_rows<uint16_t>(x, weight, b, y, native_bf16);
  }
  return y;
}
"""

_CPP_DECLARATION = (
    "at::Tensor small_linear(at::Tensor x, at::Tensor weight, "
    "c10::optional<at::Tensor> bias, bool native_bf16);"
)

_KERNEL = CpuKernel(
    "sglang_cpu_small_linear",
    _CPP_DECLARATION,
    _CPP_SOURCE,
    ["small_linear"],
    "CPU small-batch linear kernel",
    needs_avx2=True,
)


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernel once per process
    (layers/cpu_extension.py). Returns True when :func:`small_linear` can be used."""
    return _KERNEL.load()


def kernel_supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`small_linear` takes these operands: loaded, CPU, 1 to ``MAX_ROWS`` dense
    rows of float32 or bfloat16, a contiguous weight of the same dtype with ``in_features`` a
    multiple of 32, no bias or a dense one of that dtype."""
    return (
        _KERNEL.module is not None
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.is_cpu
        and weight.is_cpu
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.is_contiguous()
        and weight.shape[1] % 32 == 0
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, native_bf16: bool = True
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [M, K] with ``1 <= M <= MAX_ROWS`` (see the module
    docstring for the arithmetic); [M, N] in x's dtype. ``native_bf16=False`` makes a host
    with AVX512-BF16 take the portable bfloat16 path (the tests compare the two).

    Precondition: :func:`kernel_supports` holds.
    """
    return _KERNEL.loaded.small_linear(x, weight, bias, native_bf16)
