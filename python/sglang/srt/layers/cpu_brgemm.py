"""Linear layers on CPU through oneDNN's brgemm micro-kernel, driven by our own loop.

oneDNN's packed ``linear`` (layers/cpu_prepack.py) decides its own blocking and thread split
per call and pays ~10 us of primitive lookup each time. At decode batch sizes its split suits
the wide layers but not the narrow ones: on SmolLM2's output, down and QKV products (576-960
output features) at 64 rows it reaches 320-340 GFLOP/s of this 2-core host's ~490 in float32.
Here the weight is copied once into column blocks, the threads split the blocks evenly (each
thread reads its own part of the weight, once per row chunk), and each block is one call of the
brgemm kernel that torch exports (``at::native::cpublas::brgemm``, a JIT-generated kernel
cached per shape) over up to ``ROW_CHUNK`` rows of the input:

    y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n])

- float32: blocks ``[N / nb, K, nb]`` (block ``b`` is the dense ``[K, nb]`` slab of output
  features ``b * nb ...``); the kernel writes the output in place, the bias added after.
- bfloat16 x and bias with float32 blocks (the float32 copies of a bfloat16 model's weights on
  a CPU without native bfloat16): x widened per row chunk into a per-thread buffer, each block
  summed in float32 as above, the bias added and the sum rounded once to bfloat16, where the
  float32 product of ``x.float()`` rounded by ``.to(bfloat16)`` made two temporaries a call
  (~3% of a bfloat16 decode step at 128 requests on an AVX2 host).
- bfloat16: blocks ``[N / nb, K / 2, nb, 2]`` (the "VNNI" pairs of k that ``vdpbf16ps``
  multiplies); the kernel accumulates in float32 into a per-thread buffer, and the bias is added
  there before one rounding to bfloat16 (to nearest even), as oneDNN's bfloat16 product does.
  Only on CPUs with AVX512-BF16 and no AMX: AMX's kernel wants its own B layout, untested here;
  there, and on CPUs without native bfloat16, the packed product stays.

On AVX2 hosts without AVX-512 (32 KiB of L1 data cache, 8-float registers) the float32 blocks
are multiplied ``K_CHUNK_AVX2`` values of k at a time, each call adding into the output the
last one left: a ``[96, nb]`` slab of the weight (18-24 KiB) stays in L1 while the chunk's rows
go past it, where the whole ``[K, nb]`` block (110-393 KiB) was read from L2 for every few rows.
Measured there (Zen 3, 2 threads, SmolLM2's layer shapes): 1.13-1.18x at 32-64 rows, 1.05-1.1x
at 512-2048. On AVX-512 hosts, where the unsplit loop was measured, k is not split.

Each output is a float32 sum over k in a fixed order (set by K and the host alone), so a row's
result does not depend on the other rows or on the thread count. Measured against oneDNN's
packed product on SmolLM2's layer shapes (2 threads, 30 copies of each weight so that they
stream from memory as in a step), on an AVX-512 host: in float32 1.05-1.8x on the narrow layers
at 3-128 rows, 1.0-1.1x on gate/up and the LM head, 0.95-1.05x at prefill sizes; in bfloat16
1.3-2.8x on the narrow layers at 1-64 rows. On the AVX2 host, k split: 1.25-1.35x at 32-64 rows,
0.95-1.0x at 512 rows, 0.95x at 2048.
``benchmark/bench_small_linear.py`` measures a whole step's matrices.

Built with the other kernels at model load (:class:`~sglang.srt.layers.cpu_extension.CpuKernel`)
on x86-64 hosts with AVX2, where torch's brgemm is oneDNN's; elsewhere :func:`load_kernel`
returns False and the packed product serves.
"""

from __future__ import annotations

import platform

import torch

from sglang.srt.layers.cpu_extension import CpuKernel, cpu_flags

# Input rows per brgemm call: the chunk of x (at most 256 rows x K values) stays in L2 while
# the thread's weight blocks stream past it.
ROW_CHUNK = 256
# Values of k per float32 brgemm call on AVX2 hosts without AVX-512 (see the module docstring;
# 96 divides SmolLM2's 576 and 1536, and ran 1.03-1.08x faster than 64, 128 or 192 at 32-64 rows).
K_CHUNK_AVX2 = 96

_CPP_SOURCE = r"""

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowChunk = ROW_CHUNK_VALUE;
// float32 values of k per brgemm call, 0 for all of K: split on AVX2 hosts without AVX-512 only
// (the build targets the host, -march=native).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kKChunk = K_CHUNK_VALUE;
#else
constexpr int64_t kKChunk = 0;
#endif

// float32 -> bfloat16 bits, rounded to nearest even, a NaN kept a quiet NaN (as torch's
// conversion); a loop of these vectorises.
inline uint16_t to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7fc0u : rounded);
}

// Block b's float32 sums acc ([rows, nb]) plus the bias (bfloat16, or none), each rounded once
// into rows [m0, m0 + rows) of the bfloat16 output y ([M, N]); bias32 is nb floats of scratch.
void round_block(const float* acc, const at::BFloat16* bias, float* bias32, uint16_t* Y,
                 int64_t m0, int64_t rows, int64_t N, int64_t nb, int64_t b) {
  for (int64_t j = 0; j < nb; ++j) {
    bias32[j] = bias != nullptr ? static_cast<float>(bias[b * nb + j]) : 0.0f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * nb;
    uint16_t* out = Y + (m0 + r) * N + b * nb;
    for (int64_t j = 0; j < nb; ++j) out[j] = to_bf16_bits(a[j] + bias32[j]);
  }
}

// One float32 block: C ([rows, nb], row stride ldc) = A ([rows, K]) x block (k chunked on
// AVX2 hosts, each call after the first adding into C).
inline void block_f32(const float* A, const float* block, float* C, int64_t rows, int64_t K,
                      int64_t nb, int64_t ldc) {
  const int64_t step = kKChunk > 0 ? kKChunk : K;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    at::native::cpublas::brgemm(rows, nb, std::min(step, K - k0), K, nb, ldc, k0 > 0, A + k0,
                                block + k0 * nb, C, false);
  }
}

// The columns [b0, b1) of the blocks: float32 straight into y (ldc = N), bias added after.
void run_f32(const float* A, const float* B, const float* bias, float* Y, int64_t M, int64_t K,
             int64_t N, int64_t nb, int64_t b0, int64_t b1) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    for (int64_t b = b0; b < b1; ++b) {
      float* C = Y + m0 * N + b * nb;
      block_f32(A + m0 * K, B + b * K * nb, C, rows, K, nb, N);
      if (bias != nullptr) {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < nb; ++j) C[r * N + j] += bias[b * nb + j];
        }
      }
    }
  }
}

// bfloat16 x and bias with float32 blocks (a bfloat16 model's float32 copies on a CPU without
// native bfloat16): x's rows widened once per row chunk into this thread's buffer, each block
// into a float32 buffer, the bias added there and the sum rounded once to bfloat16. The same
// bits as widening x, the float32 product and rounding its result, without the two temporaries.
void run_mixed(const at::BFloat16* A, const float* B, const at::BFloat16* bias, uint16_t* Y,
               int64_t M, int64_t K, int64_t N, int64_t nb, int64_t b0, int64_t b1) {
  std::vector<float> a32(std::min(kRowChunk, M) * K);
  std::vector<float> acc(std::min(kRowChunk, M) * nb);
  std::vector<float> bias32(nb);
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    const at::BFloat16* a = A + m0 * K;
    for (int64_t i = 0; i < rows * K; ++i) a32[i] = static_cast<float>(a[i]);
    for (int64_t b = b0; b < b1; ++b) {
      block_f32(a32.data(), B + b * K * nb, acc.data(), rows, K, nb, nb);
      round_block(acc.data(), bias, bias32.data(), Y, m0, rows, N, nb, b);
    }
  }
}

// bfloat16: each block accumulates in float32 into acc ([rows, nb]), then bias and rounding.
void run_bf16(const at::BFloat16* A, const at::BFloat16* B, const at::BFloat16* bias,
              uint16_t* Y, int64_t M, int64_t K, int64_t N, int64_t nb, int64_t b0, int64_t b1) {
  std::vector<float> acc(std::min(kRowChunk, M) * nb);
  std::vector<float> bias32(nb);
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t rows = std::min(kRowChunk, M - m0);
    for (int64_t b = b0; b < b1; ++b) {
      at::native::cpublas::brgemm(rows, nb, K, K, nb, nb, false, A + m0 * K, B + b * K * nb,
                                  acc.data(), true);
      round_block(acc.data(), bias, bias32.data(), Y, m0, rows, N, nb, b);
    }
  }
  at::native::cpublas::brgemm_release(true);
}

}  // namespace

at::Tensor blocked_linear(at::Tensor x, at::Tensor blocked,
                             c10::optional<at::Tensor> bias) {
  // bfloat16 x with float32 blocks: the mixed path (run_mixed), a bfloat16 result.
  const bool mixed = x.scalar_type() == at::kBFloat16 && blocked.scalar_type() == at::kFloat;
  const bool bf16 = x.scalar_type() == at::kBFloat16 && !mixed;
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only");
  TORCH_CHECK(blocked.scalar_type() == x.scalar_type() || mixed,
              "the weight must have x's dtype (or be float32 for a bfloat16 x)");
  TORCH_CHECK(x.dim() == 2 && blocked.dim() == (bf16 ? 4 : 3),
              "x must be [M, K] and the blocked weight [N / nb, K, nb] (bfloat16: "
              "[N / nb, K / 2, nb, 2])");
  const int64_t K = x.size(1);
  TORCH_CHECK(bf16 ? blocked.size(1) * 2 == K && blocked.size(3) == 2 : blocked.size(1) == K,
              "x must be [M, K] and the blocked weight of in_features K");
  TORCH_CHECK(x.is_contiguous() && blocked.is_contiguous(),
              "x and the blocked weight must be contiguous");
  const int64_t M = x.size(0), NB = blocked.size(0), nb = blocked.size(2), N = NB * nb;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                    bias->numel() == N,
                "bias must be a dense [N] tensor of x's dtype");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // One contiguous run of blocks per thread, so each reads its part of the weight only.
  const int64_t threads = at::get_num_threads();
  const int64_t grain = (NB + threads - 1) / threads;
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    if (mixed) {
      run_mixed(x.data_ptr<at::BFloat16>(), blocked.data_ptr<float>(),
                has_bias ? bias->data_ptr<at::BFloat16>() : nullptr,
                reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N, nb, b0, b1);
    } else if (bf16) {
      run_bf16(x.data_ptr<at::BFloat16>(), blocked.data_ptr<at::BFloat16>(),
               has_bias ? bias->data_ptr<at::BFloat16>() : nullptr,
               reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N, nb, b0, b1);
    } else {
      run_f32(x.data_ptr<float>(), blocked.data_ptr<float>(),
              has_bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N, nb,
              b0, b1);
    }
  });
  return y;
}
""".replace("ROW_CHUNK_VALUE", str(ROW_CHUNK)).replace("K_CHUNK_VALUE", str(K_CHUNK_AVX2))

_CPP_DECLARATION = (
    "at::Tensor blocked_linear(at::Tensor x, at::Tensor blocked, "
    "c10::optional<at::Tensor> bias);"
)

_KERNEL = CpuKernel(
    "sglang_cpu_brgemm_linear",
    _CPP_DECLARATION,
    _CPP_SOURCE,
    ["blocked_linear"],
    "CPU brgemm linear kernel",
)


def host_supported() -> bool:
    """Whether torch's brgemm is oneDNN's JIT kernel here: x86-64 with AVX2 and oneDNN on
    (elsewhere torch falls back to a plain GEMM per call, slower than the packed product)."""
    return (
        platform.machine() == "x86_64"
        and " avx2" in cpu_flags()
        and torch.backends.mkldnn.is_available()
        and bool(torch.backends.mkldnn.enabled)
    )


def bf16_supported() -> bool:
    """Whether bfloat16 weights take the kernel here: AVX512-BF16 and no AMX (see the module
    docstring), with oneDNN allowed to use them (``ONEDNN_MAX_CPU_ISA`` can cap it below)."""
    flags = cpu_flags()
    return (
        host_supported()
        and " avx512_bf16" in flags
        and " amx_bf16" not in flags
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def load_kernel() -> bool:
    """Build (or load from torch's extension cache) the kernel once per process
    (layers/cpu_extension.py). Returns True when :func:`blocked_linear` can be used."""
    return host_supported() and _KERNEL.load()


def is_loaded() -> bool:
    """Whether :func:`load_kernel` has succeeded in this process."""
    return _KERNEL.module is not None


def column_block(out_features: int, threads: int) -> int | None:
    """The column block width for a weight of ``out_features`` rows, or None if it has no
    width the kernel takes (a multiple of 16 dividing ``out_features``).

    The widest of 64, 48, 32 and 16 that splits evenly over ``threads`` (576 features: 12
    blocks of 48, where 9 blocks of 64 would leave one thread idle a ninth of the time), else
    the widest that divides. Wide blocks suit large row counts (gate/up at 8,192 rows: 64
    columns 0.99x oneDNN's rate, 48 columns 0.95x); the narrow layers' blocks of 48 match
    those of 32 at every row count measured.
    """
    for nb in (64, 48, 32, 16):
        if out_features % nb == 0 and (out_features // nb) % max(threads, 1) == 0:
            return nb
    for nb in (64, 48, 32, 16):
        if out_features % nb == 0:
            return nb
    return None


def blockable(weight: torch.Tensor, threads: int) -> int | None:
    """The column block width for ``weight`` ``[N, K]`` if the kernel takes it here (loaded;
    float32, or bfloat16 with :func:`bf16_supported` and K even), else None."""
    if not is_loaded() or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16:
        if not bf16_supported() or weight.shape[1] % 2:
            return None
    elif weight.dtype != torch.float32:
        return None
    return column_block(weight.shape[0], threads)


def block_weight(weight: torch.Tensor, nb: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` in column blocks of ``nb`` output features.

    float32: ``[N / nb, K, nb]`` with ``[b, k, j] = weight[b * nb + j, k]``. bfloat16:
    ``[N / nb, K / 2, nb, 2]`` with ``[b, k // 2, j, k % 2] = weight[b * nb + j, k]``.
    """
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.bfloat16:
        return w.reshape(n // nb, nb, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.t().reshape(k, n // nb, nb).permute(1, 0, 2).contiguous()


def out_features(blocked: torch.Tensor) -> int:
    """N of a :func:`block_weight` copy."""
    return blocked.shape[0] * blocked.shape[2]


def blocked_linear(
    x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[..., K]`` and ``blocked`` = ``block_weight(W)`` of x's
    dtype; ``[..., N]`` in x's dtype. A bfloat16 x (and bias) may also take float32 blocks:
    the float32 product of the widened x, its sums (bias included) rounded once to bfloat16.

    Precondition: :func:`load_kernel` returned True (and for bfloat16, :func:`bf16_supported`).
    """
    if x.dim() == 2 and x.is_contiguous():  # the models' case: no reshapes (~2 us a call)
        return _KERNEL.loaded.blocked_linear(x, blocked, bias)
    lead = x.shape[:-1]
    # Contiguous rows: the row stride is part of the brgemm kernel's cache key.
    out = _KERNEL.loaded.blocked_linear(x.reshape(-1, x.shape[-1]).contiguous(), blocked, bias)
    return out.view(*lead, out.shape[-1])
