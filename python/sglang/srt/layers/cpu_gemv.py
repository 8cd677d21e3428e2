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
multiplies there (``--cpu-bf16-linear auto``).

On such an AVX2 host it also takes 5 to 16 rows (:func:`max_rows`), by a second path: tiles
of 2 weight rows x 6 input rows, one 8-float accumulator each, the lanes summed at the end.
The brgemm kernel's fixed cost per call (one per 96 x 48 slab of the weight) dominates at
these sizes; measured on SmolLM2's 121 matrices (Zen 3, 2 threads): 1.3-1.4x the brgemm
kernel at 5-8 rows, 1.2x at 12, 1.0-1.05x at 16 in float32; in bfloat16, against the float32
copy the layers multiply there otherwise, 2.1x at 5 rows, 1.6x at 8, 1.25-1.35x at 12-16. Its
sums run in another order than the 1-4 row path's. Built at model load
(:class:`~sglang.srt.layers.cpu_extension.CpuKernel`); where it is not built (no AVX2, a
failed build) :func:`load_kernel` returns False and the packed product serves every batch.
"""

from __future__ import annotations

import torch

from sglang.srt.layers.cpu_extension import CPP_VECTOR_PRELUDE, CpuKernel

# The most input rows small_linear takes on every host (see max_rows).
MAX_ROWS = 4

_CPP_SOURCE = CPP_VECTOR_PRELUDE + r"""
namespace {

using namespace sglang_cpu;

#if defined(SGLANG_CPU_AVX2)
constexpr int64_t kMaxRows = 16;  // up to here the tile path (run_tiles) takes the others
#else
constexpr int64_t kMaxRows = 4;
#endif
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


#if defined(SGLANG_CPU_AVX2)
// 5 to kMaxRows rows on AVX2 hosts, where the brgemm kernel's fixed cost per call outweighs
// its compute at these sizes. The lane-partial path above holds two registers per (weight
// row, x row), four x rows at most; here a tile of kTileW weight rows meets kTileX rows of x
// at a time, one 8-lane accumulator per (weight row, x row): 2 x 6 = 12 of the 16 registers,
// 8 loads per 12 FMAs. The weight rows stay in L1 while the x row groups pass, so the weight
// is read from memory once. Each output is its 8 lanes' sums over k in order, then a fixed
// tree over the lanes: the same bits in any batch and with any number of threads.
constexpr int64_t kTileW = 2, kTileX = 6;

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[i, j] (row stride N) for the kX rows of x and the kW weight rows at w (row stride K).
template <int64_t kW, int64_t kX, typename T>
inline void tile(const T* x, int64_t x_stride, const T* w, int64_t K, const T* bias, T* y,
                 int64_t N) {
  __m256 acc[kW][kX];
  for (int64_t j = 0; j < kW; ++j) {
    for (int64_t i = 0; i < kX; ++i) acc[j][i] = _mm256_setzero_ps();
  }
  for (int64_t k0 = 0; k0 < K; k0 += kLanes) {  // K is a multiple of 32
    for (int64_t j = 0; j < kW; ++j) prefetch_ahead(w + j * K + k0);
    for (int64_t k = k0; k < k0 + kLanes; k += 8) {
      __m256 wv[kW];
      for (int64_t j = 0; j < kW; ++j) wv[j] = load8(w + j * K + k);
      for (int64_t i = 0; i < kX; ++i) {
        const __m256 xv = load8(x + i * x_stride + k);
        for (int64_t j = 0; j < kW; ++j) acc[j][i] = _mm256_fmadd_ps(xv, wv[j], acc[j][i]);
      }
    }
  }
  for (int64_t j = 0; j < kW; ++j) {
    const float b = bias != nullptr ? load1(bias[j]) : 0.0f;
    for (int64_t i = 0; i < kX; ++i) store1(sum_lanes(acc[j][i]) + b, y + i * N + j);
  }
}

// The M rows of x against kW weight rows: groups of kTileX rows, then the rest.
template <int64_t kW, typename T>
void tile_rows(const T* x, int64_t x_stride, const T* w, int64_t K, const T* bias, T* y,
               int64_t N, int64_t M) {
  int64_t m = 0;
  for (; m + kTileX <= M; m += kTileX) {
    tile<kW, kTileX, T>(x + m * x_stride, x_stride, w, K, bias, y + m * N, N);
  }
  const T* xr = x + m * x_stride;
  T* yr = y + m * N;
  switch (M - m) {
    case 1: return tile<kW, 1, T>(xr, x_stride, w, K, bias, yr, N);
    case 2: return tile<kW, 2, T>(xr, x_stride, w, K, bias, yr, N);
    case 3: return tile<kW, 3, T>(xr, x_stride, w, K, bias, yr, N);
    case 4: return tile<kW, 4, T>(xr, x_stride, w, K, bias, yr, N);
    case 5: return tile<kW, 5, T>(xr, x_stride, w, K, bias, yr, N);
    default: return;
  }
}

template <typename T>
void run_tiles(const T* x, int64_t x_stride, const T* w, const T* bias, T* y, int64_t M,
               int64_t N, int64_t K) {
  static_assert(kTileW == 2, "the tail below handles one leftover weight row");
  const int64_t tiles = (N + kTileW - 1) / kTileW;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kTileW * K * sizeof(T)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileW;
      const T* b = bias != nullptr ? bias + n0 : nullptr;
      if (n0 + kTileW <= N) {
        tile_rows<kTileW, T>(x, x_stride, w + n0 * K, K, b, y + n0, N, M);
      } else {
        tile_rows<1, T>(x, x_stride, w + n0 * K, K, b, y + n0, N, M);
      }
    }
  });
}
#endif

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
    case 4: return run<4, T>(xp, xs, wp, bias, yp, N, K, native);
    default: break;
  }
#if defined(SGLANG_CPU_AVX2)
  run_tiles<T>(xp, xs, wp, bias, yp, x.size(0), N, K);
#endif
}

}  // namespace

at::Tensor small_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias,
                           bool native_bf16) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "x must have 1 to " + std::to_string(kMaxRows) + " rows");
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

int64_t max_rows() { return kMaxRows; }
"""

_CPP_DECLARATION = (
    "at::Tensor small_linear(at::Tensor x, at::Tensor weight, "
    "c10::optional<at::Tensor> bias, bool native_bf16);\n"
    "int64_t max_rows();"
)

_KERNEL = CpuKernel(
    "sglang_cpu_small_linear",
    _CPP_DECLARATION,
    _CPP_SOURCE,
    ["small_linear", "max_rows"],
    "CPU small-batch linear kernel",
    needs_avx2=True,
)


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernel once per process
    (layers/cpu_extension.py). Returns True when :func:`small_linear` can be used."""
    return _KERNEL.load()


def max_rows() -> int:
    """The most input rows :func:`small_linear` takes here: 16 where the kernel was built for
    a CPU with AVX2 and no AVX-512 (the tile path, see the module docstring), ``MAX_ROWS``
    elsewhere and while it is not loaded."""
    module = _KERNEL.module
    return int(module.max_rows()) if module is not None else MAX_ROWS


def kernel_supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`small_linear` takes these operands: loaded, CPU, 1 to :func:`max_rows` dense
    rows of float32 or bfloat16, a contiguous weight of the same dtype with ``in_features`` a
    multiple of 32, no bias or a dense one of that dtype."""
    return (
        _KERNEL.module is not None
        and x.dim() == 2
        and 1 <= x.shape[0] <= max_rows()
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
    """``x @ weight.T + bias`` for ``x`` [M, K] with ``1 <= M <= max_rows()`` (see the module
    docstring for the arithmetic); [M, N] in x's dtype. ``native_bf16=False`` makes a host
    with AVX512-BF16 take the portable bfloat16 path (the tests compare the two).

    Precondition: :func:`kernel_supports` holds.
    """
    return _KERNEL.loaded.small_linear(x, weight, bias, native_bf16)
