"""Activation functions of the MLP blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers import cpu_fused_ops


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (gate then up, fused)."""

    def __init__(self) -> None:
        super().__init__()
        # Set by the model runner once the CPU fused kernels are built (cpu_fused_ops.py).
        self.use_cpu_fused_ops = False
        # Set by the model runner on CUDA: the Triton kernel (sgl_kernel.fused_elementwise).
        self.use_triton_fused_ops = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_fused_ops and cpu_fused_ops.supports(x):
            return cpu_fused_ops.silu_and_mul(x)
        if self.use_triton_fused_ops and not torch.compiler.is_compiling():
            from sgl_kernel import fused_elementwise  # triton: loaded where it is used

            return fused_elementwise.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
