"""Builds the engine's small C++ CPU kernels (attention) once per process and host.

Each kernel module hands its C++ source to :func:`build_cpu_extension`, which compiles it with
``torch.utils.cpp_extension.load_inline`` (``-O3 -march=native``) on first use and caches it in
torch's extensions directory under a name that includes a hash of the source and of the CPU's
feature flags, so a cache shared by different hosts never hands one a binary built for
another's instruction set. Where a kernel cannot be built (not Linux on x86-64/aarch64, no
compiler, a failed build) it logs a warning once and returns None; the caller keeps its torch
fallback.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from types import ModuleType

logger = logging.getLogger(__name__)

# name -> the built module, or None once it failed (warned once).
_built: dict[str, ModuleType | None] = {}


def _cpu_flags_hash() -> str:
    """A short hash of this CPU's feature flags (empty if /proc/cpuinfo has none)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def platform_supported() -> bool:
    """Whether the kernels are built on this platform at all (Linux on x86-64 or aarch64)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")


def build_cpu_extension(
    name: str, declaration: str, source: str, functions: list[str], what: str
) -> ModuleType | None:
    """The compiled module ``name`` exporting ``functions`` (declared in ``declaration``,
    defined in ``source``), built or loaded from the cache once per process; None (warned once,
    naming ``what``) where it cannot be built. Logs the build or load time."""
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

            source_hash = hashlib.sha256((declaration + source).encode()).hexdigest()[:12]
            module = load_inline(
                name=f"{name}_{source_hash}_{_cpu_flags_hash()}",
                cpp_sources=[declaration, source],
                functions=functions,
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
            )
        except Exception as exc:  # any build or load failure: keep the torch fallback
            logger.warning("%s could not be built (%s); using the torch fallback", what, exc)
        else:
            logger.info("built %s in %.1f s", what, time.perf_counter() - start)
    _built[name] = module
    return module
