"""Batch-invariant linear algebra for ``--enable-deterministic-inference`` (DESIGN §7).

On CPU, ``F.linear`` picks its GEMM kernel (and the order of the K-reduction) from the number
of rows and the alignment of the input, so the same row gives different bits alone and inside
a batch. Here every product is computed on blocks of exactly ``ROW_BLOCK`` rows (the last one
zero-padded) in a freshly allocated, aligned buffer: every call has the same shape, so each row's
reduction order depends on nothing but the row itself.

Measured on 2 cores (SmolLM2 shapes, float32, 30 layers): a decode step of 64 rows costs about
the same as plain ``F.linear``; a 400-token prefill about 1.9x; a single row about 6x (it is
padded to a full block). Only this mode pays it.

With the Triton attention backend (the deterministic default on CUDA) the Triton kernels of
:mod:`sgl_kernel.batch_invariant` take over: a fixed-tile matmul without split-K and a
one-row-per-program RMSNorm (CUDA's own reductions pick their strategy from the shape).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

ROW_BLOCK = 32
MKL_STRICT_REPRODUCIBILITY = "AUTO,STRICT"


@runtime_checkable
class LinearHook(Protocol):
    """A module whose matrix product is swappable: ``linear_fn(x, weight, bias)``."""

    linear_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@runtime_checkable
class NormHook(Protocol):
    """A module whose RMSNorm is swappable: ``norm_fn(x, weight, eps)``."""

    norm_fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def pin_cpu_blas_numerics() -> None:
    """Put MKL in its strict Conditional Numerical Reproducibility mode (``MKL_CBWR``).

    Without it MKL's float32 GEMM (under ``F.scaled_dot_product_attention`` and ``torch.mm`` on
    CPU) rounds a row differently by the memory alignment of its operands and by how the work is
    split between threads, so an attention query's bits would depend on its neighbours. MKL reads
    the variable once, at its first call: this must run before the process computes anything
    (the scheduler process calls it first thing). A value the user set is kept.
    """
    os.environ.setdefault("MKL_CBWR", MKL_STRICT_REPRODUCIBILITY)


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose rows are bitwise independent of the other rows."""
    lead, in_features = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, in_features)
    num_rows = rows.shape[0]
    num_blocks = max(1, -(-num_rows // ROW_BLOCK))
    padded = rows.new_zeros(num_blocks * ROW_BLOCK, in_features)
    padded[:num_rows] = rows
    out = rows.new_empty(num_blocks * ROW_BLOCK, weight.shape[0])
    for b in range(num_blocks):
        block = slice(b * ROW_BLOCK, (b + 1) * ROW_BLOCK)
        torch.mm(padded[block], weight.t(), out=out[block])
    out = out[:num_rows]
    if bias is not None:
        out = out + bias  # elementwise: invariant
    return out.reshape(*lead, weight.shape[0])


def enable_batch_invariant_mode(model: nn.Module, kernels: str = "torch") -> int:
    """Switch every module with a ``linear_fn`` hook to a batch-invariant product, and with
    ``kernels="triton"`` every ``norm_fn`` hook to the Triton RMSNorm as well.

    ``kernels`` is ``"torch"`` (fixed row blocks through torch.mm: CPU) or ``"triton"``
    (CUDA, or CPU under TRITON_INTERPRET=1). Returns how many linear modules were switched
    (the caller checks it is not zero).
    """
    if kernels not in ("torch", "triton"):
        raise ValueError(f"kernels must be 'torch' or 'triton', got {kernels!r}")
    linear_fn, norm_fn = batch_invariant_linear, None
    if kernels == "triton":
        from sgl_kernel.batch_invariant import matmul_batch_invariant, rms_norm_batch_invariant

        linear_fn, norm_fn = matmul_batch_invariant, rms_norm_batch_invariant
    count = 0
    for module in model.modules():
        if isinstance(module, LinearHook):
            module.linear_fn = linear_fn
            count += 1
        if norm_fn is not None and isinstance(module, NormHook):
            module.norm_fn = norm_fn
    return count
