"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers import cpu_fused_ops
from sglang.srt.layers.linear import default_weight_loader, set_weight_loader


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim, statistics in float32, the
    normalised value cast back to x's dtype before the weight multiply.

    One ``F.rms_norm`` call instead of five ops (less per-op overhead at batch 1), bitwise
    equal to the op-by-op version in float32 and bfloat16 (test_rms_norm_rounds_like_hf).
    The weight is applied outside: ``F.rms_norm`` with it multiplies before the rounding.
    """
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistics are computed in float32 and the normalised value is cast back to the input
    dtype before the weight multiply, which is what the HF Llama/Qwen norms do (so bfloat16 runs
    round the same way).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)
        # (x, weight, eps) -> normalised x; deterministic mode on CUDA swaps in a Triton kernel.
        self.norm_fn = rms_norm
        # Set by the model runner once the CPU fused kernels are built (cpu_fused_ops.py).
        self.use_cpu_fused_ops = False
        # Set by the model runner on CUDA: the Triton kernel (sgl_kernel.fused_elementwise).
        self.use_triton_fused_ops = False

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (any leading shape).

        Without ``residual`` returns ``norm(x)``. With it returns ``(norm(x + residual), x +
        residual)``: the sum is the next residual stream, so callers never add it themselves.
        The add happens in the input dtype, as in the HF decoder layers. Inputs are not mutated.
        """
        if (
            self.norm_fn is rms_norm
            and x.dtype == self.weight.dtype
            and (residual is None or residual.dtype == x.dtype)
        ):
            if self.use_cpu_fused_ops and cpu_fused_ops.supports(x):
                out, summed = cpu_fused_ops.add_rms_norm(x, residual, self.weight, self.eps)
                return out if residual is None else (out, summed)
            if self.use_triton_fused_ops and not torch.compiler.is_compiling():
                from sgl_kernel import fused_elementwise  # triton: loaded where it is used

                out, summed = fused_elementwise.add_rms_norm(x, residual, self.weight, self.eps)
                return out if residual is None else (out, summed)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
