"""Builds the engine's small C++ CPU kernels (attention) once per process and host.

Each kernel module hands its C++ source to :func:`build_cpu_extension`, which compiles it with
``torch.utils.cpp_extension.load_inline`` (``-O3 -march=native``) on first use and caches it in
torch's extensions directory (``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), in a
folder per Python and torch version, under a name that includes a hash of the source and of
the CPU's feature flags: a cache shared by different hosts never hands one a binary built for
another's instruction set, nor one built against another torch. Where a kernel cannot be built
(not Linux on x86-64/aarch64, no compiler, a failed build) it logs a warning once and returns
None; the caller keeps its torch fallback.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

logger = logging.getLogger(__name__)

# The torch headers every kernel is compiled against (put before its declaration): the tensor
# type, at::empty, at::parallel_for, the brgemm micro-kernel, and what the pybind11 bindings
# that load_inline generates need. Not <torch/extension.h>, load_inline's default: parsing it
# (torch's whole C++ API and autograd) took ~23 s of each kernel's build on 2 cores, these
# headers ~10 s.
CPP_TORCH_HEADERS = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
"""

# C++ shared by the 16-float kernels (prepended to each one's source; used on AVX-512 and AVX2
# hosts, see avx2_host): GCC vector types of 16 float32 lanes (one AVX-512 register, two AVX2
# ones); loads and stores of 16 float32 or bfloat16 values (bfloat16 handled as its raw 16
# bits, the high half of a float32; stores round to nearest even, for finite values); a lane
# max; a reduction of 16 vectors to their 16 lane sums; and, on AVX2 hosts without AVX-512
# (SGLANG_CPU_AVX2), 8-float loads, stores and sums for the kernels' own AVX2 hot loops.
CPP_VECTOR_PRELUDE = r"""

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// An x86 CPU with AVX2 and no AVX-512: a 16-float vector is two of its registers, and GCC
// handles such oversized vectors badly (cross-register shuffles and compare-and-selects one
// lane at a time, arrays of them kept in memory). The hot loops take 8-float paths there.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SGLANG_CPU_AVX2 1
#endif

namespace sglang_cpu {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

constexpr int64_t kLanes = 16;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
}
inline void store16(f32x16 v, float* p) { std::memcpy(p, &v, sizeof v); }
inline void store16(f32x16 v, uint16_t* p) {
  u32x16 bits = (u32x16)v;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  const u16x16 h = __builtin_convertvector(bits >> 16, u16x16);
  std::memcpy(p, &h, sizeof h);
}
inline float load1(float x) { return x; }
inline float load1(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// One float32 value stored as float32, or as bfloat16 rounded to nearest even (as store16).
inline void store1(float v, float* p) { *p = v; }
inline void store1(float v, uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}
inline f32x16 splat(float x) { return f32x16{} + x; }

// a > b ? a : b, lane by lane (b where either is NaN). Without AVX-512 GCC lowers a 16-float
// vector compare-and-select one lane at a time; there it is one max per AVX register.
inline f32x16 max16(f32x16 a, f32x16 b) {
#if defined(SGLANG_CPU_AVX2)
  f32x16 out;
  const __m256* pa = reinterpret_cast<const __m256*>(&a);
  const __m256* pb = reinterpret_cast<const __m256*>(&b);
  __m256* o = reinterpret_cast<__m256*>(&out);
  o[0] = _mm256_max_ps(pa[0], pb[0]);
  o[1] = _mm256_max_ps(pa[1], pb[1]);
  return out;
#else
  return a > b ? a : b;
#endif
}

#if defined(SGLANG_CPU_AVX2)
// 8 float32 lanes from 8 float32 or bfloat16 values (as load16); store8 of float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(__m256 v, float* p) { _mm256_storeu_ps(p, v); }

// The 8 lane sums of x[0..7] (8-float vectors): two horizontal-add levels leave each 128-bit
// half holding four of the sums of that half's lanes; adding the halves finishes them.
inline __m256 sum_lanes8(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// out[j] = the sum of the 16 lanes of v[j], without the shuffle tree below (which GCC lowers one
// lane at a time here): add each vector's halves, then reduce eight at a time.
inline f32x16 sum_lanes16(const f32x16* v) {
  __m256 half[16];
  for (int i = 0; i < 16; ++i) {
    const __m256* p = reinterpret_cast<const __m256*>(&v[i]);
    half[i] = _mm256_add_ps(p[0], p[1]);
  }
  f32x16 out;
  __m256* o = reinterpret_cast<__m256*>(&out);
  o[0] = sum_lanes8(half);
  o[1] = sum_lanes8(half + 8);
  return out;
}
#else
// out[j] = the sum of the 16 lanes of v[j]: a shuffle-add tree (15 pair steps), which leaves
// lane j holding v[bit-reversed j]; a final shuffle restores the order.
inline f32x16 sum_lanes16(const f32x16* v) {
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                   11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  }
  const f32x16 d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10,
                                           26, 12, 28, 14, 30) +
                   __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11,
                                           27, 13, 29, 15, 31);
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#endif

}  // namespace sglang_cpu
"""

# name -> the built module, or None once it failed (warned once).
_built: dict[str, ModuleType | None] = {}


@functools.cache
def cpu_flags() -> str:
    """This CPU's feature-flags line of /proc/cpuinfo (empty if there is none); read once (~30
    us a read, and the packing of every weight asks)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _cpu_flags_hash() -> str:
    """A short hash of this CPU's feature flags."""
    return hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]


def avx2_host() -> bool:
    """Whether this CPU has AVX2 (every AVX-512 CPU has it too). The kernels written with the
    prelude's 16-float vectors need it: they use one AVX-512 register per vector, or take
    8-float AVX2 paths in their hot loops (built without those, on AVX2 they ran 2-3x slower,
    no faster than torch). Elsewhere (aarch64, older x86) their callers keep the torch path."""
    return " avx2" in cpu_flags()


def platform_supported() -> bool:
    """Whether the kernels are built on this platform at all (Linux on x86-64 or aarch64)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")


def build_cpu_extension(
    name: str,
    declaration: str,
    source: str,
    functions: list[str],
    what: str,
    extra_cflags: tuple[str, ...] = (),
) -> ModuleType | None:
    """The compiled module ``name`` exporting ``functions`` (declared in ``declaration``,
    defined in ``source``; ``extra_cflags`` after the common flags), built or loaded from the
    cache once per process; None (warned once, naming ``what``) where it cannot be built. Logs
    the build or load time."""
    if name in _built:
        return _built[name]
    module = None
    if not platform_supported():
        logger.warning(
            "%s unavailable on %s/%s; using the torch fallback",
            what,
            platform.system(),
            platform.machine(),
        )
    else:
        start = time.perf_counter()
        try:
            from torch.utils.cpp_extension import load_inline

            flags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
            key = "\n".join([declaration, source, *flags])
            source_hash = hashlib.sha256(key.encode()).hexdigest()[:12]
            full_name = f"{name}_{source_hash}_{_cpu_flags_hash()}"
            build_dir = _build_directory(full_name)
            with _exclusive_build(build_dir, what):
                module = load_inline(
                    name=full_name,
                    cpp_sources=[CPP_TORCH_HEADERS, declaration, source],
                    no_implicit_headers=True,
                    functions=functions,
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=build_dir,
                )
        except Exception as exc:  # any build or load failure: keep the torch fallback
            logger.warning("%s could not be built (%s); using the torch fallback", what, exc)
        else:
            logger.info("built %s in %.1f s", what, time.perf_counter() - start)
    _built[name] = module
    return module


def _build_directory(full_name: str) -> str:
    """The folder (created) where ``full_name`` is built: under torch's extensions root, one
    folder per Python and torch version (torch's own default is per Python version only)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    version = f"sglang_py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    path = os.path.join(root, version, full_name)
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _exclusive_build(build_dir: str, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``build_dir`` while torch builds or loads there.

    torch guards a build with a ``lock`` file that only the builder removes: a build killed
    midway (Ctrl-C or SIGKILL during a first start) leaves it, and every later start would wait
    on it forever. An flock ends with its holder, so under it a ``lock`` file can only be such
    a leftover, and is removed. Another process building the same kernel is waited for (logged).
    """
    import fcntl  # POSIX only; the kernels are built on Linux only (platform_supported)

    with open(os.path.join(build_dir, "sglang_build.flock"), "a") as holder:
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("%s: waiting for another process building it in %s", what, build_dir)
            fcntl.flock(holder, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("%s: removing %s, left by a build that was stopped", what, stale)
            os.remove(stale)
        yield  # the flock ends when the file closes


def load_side_by_side(loaders: Sequence[Callable[[], object]]) -> None:
    """Run the kernels' ``load_kernel`` functions on worker threads, one per core, and wait
    for them all. Each build is a compiler subprocess, so builds overlap: a first start takes
    about as long as its longest builds rather than all of them in turn. The results stay
    where each kernel module keeps them."""
    if not loaders:
        return
    workers = max(1, min(len(loaders), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cpu-kernel-build") as pool:
        for future in [pool.submit(load) for load in loaders]:
            future.result()


class CpuKernel:
    """One kernel module's extension, built on first :meth:`load` (the model runner calls it at
    model load, not mid-step) and then held. ``needs_avx2``: written with the prelude's
    16-float vectors, so not built on a CPU without AVX2 (:func:`avx2_host`).
    ``extra_cflags``: compiler flags of this kernel only."""

    def __init__(
        self,
        name: str,
        declaration: str,
        source: str,
        functions: list[str],
        what: str,
        needs_avx2: bool = False,
        extra_cflags: tuple[str, ...] = (),
    ) -> None:
        self.name, self.declaration, self.source = name, declaration, source
        self.functions, self.what, self.needs_avx2 = functions, what, needs_avx2
        self.extra_cflags = extra_cflags
        # The built module once load() succeeded.
        self.module: ModuleType | None = None
        self._lock = threading.Lock()  # one build at a time (load_side_by_side uses threads)

    def load(self) -> bool:
        """Build (or load from torch's extension cache) the extension once per process; True
        when its functions can be called. Thread-safe."""
        with self._lock:
            return self._load()

    def _load(self) -> bool:
        if self.module is None:
            if self.needs_avx2 and not avx2_host():
                logger.info("%s: this CPU has no AVX2; using torch", self.what)
                return False
            self.module = build_cpu_extension(
                self.name,
                self.declaration,
                self.source,
                self.functions,
                self.what,
                self.extra_cflags,
            )
        return self.module is not None

    @property
    def loaded(self) -> ModuleType:
        """The built module. Precondition: :meth:`load` returned True."""
        assert self.module is not None, f"{self.what}: load() must succeed first"
        return self.module
