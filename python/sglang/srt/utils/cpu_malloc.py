"""glibc malloc settings for a process that runs a model on CPU (``--disable-cpu-malloc-tuning``
turns them off).

torch's CPU tensors come from ``malloc``. glibc serves every block over its mmap threshold
(at most 32 MiB) with a fresh ``mmap`` and hands it back to the kernel on ``free``, so each
prefill chunk's large temporaries (a float32 gate/up output of 8,192 tokens is 100 MB) are
page-faulted in again, 4 KiB at a time, in every layer: ~1.2 us a page on this project's
hosts, 2 M faults and ~2.6 s of CPU time in a float32 run of the offline benchmark. With
:func:`keep_freed_memory` every block comes from the heap and freed memory stays there for the
next step, as a caching allocator keeps it; the process's resident memory then stays at its
peak.

Kept memory is bounded: glibc cannot always reuse a freed block for a request of the same size
(an aligned request needs a little more room, and a small block parked in its per-thread cache
can sit right after the hole), so a pattern of same-size blocks can keep growing the heap.
:class:`FreedMemoryCap` hands the free memory back to the kernel whenever it passes a limit.
:func:`return_freed_memory` does it at once: the engine calls it when it releases its KV cache
or weights (``release_memory_occupation``), so that a trainer sharing the machine gets that
memory.

All are no-ops where the C library is not glibc (2.33 or later, for ``mallinfo2``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]


@cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2  # glibc 2.33 and later only
    except (OSError, AttributeError):
        return None
    return libc


def freed_bytes() -> int:
    """Free bytes held in the heap (``mallinfo2().fordblks``; 0 without glibc). It walks the
    heap's free lists: ~0.4 ms with a model's heap."""
    libc = _glibc()
    return 0 if libc is None else int(libc.mallinfo2().fordblks)


def heap_bytes() -> int:
    """Bytes the heap takes from the kernel (``mallinfo2().arena``: its main arena, which
    serves every block under :func:`keep_freed_memory`; 0 without glibc)."""
    libc = _glibc()
    return 0 if libc is None else int(libc.mallinfo2().arena)


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap (no mmap) and never trim the heap on ``free``, so
    that a step's freed temporaries are reused by the next without page faults. Returns
    whether the settings took (False where the C library is not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def return_freed_memory() -> None:
    """Give the heap's free memory back to the kernel (``malloc_trim(0)``: the free top of the
    heap and the free pages inside it)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class FreedMemoryCap:
    """Bounds the free memory that :func:`keep_freed_memory` keeps: :meth:`step` (once per
    forward pass) looks every ``every`` calls and, when more than ``limit`` bytes are free in
    the heap, gives them back to the kernel (:func:`return_freed_memory`). Free holes inside
    the heap still count as free once their pages are given back, so while they exceed the
    limit each look trims again: resident memory stays bounded, at the cost of faulting those
    pages in again when they are reused."""

    def __init__(self, limit: int, every: int = 64) -> None:
        self.limit = limit
        self.every = every
        self._calls = 0

    def step(self) -> None:
        self._calls += 1
        if self._calls % self.every == 0 and freed_bytes() > self.limit:
            return_freed_memory()
