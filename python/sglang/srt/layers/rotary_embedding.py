"""Rotary position embeddings (the "rotate_half"/NeoX layout used by HF Llama, Qwen, Mistral).

For a head vector ``x`` whose first ``rotary_dim`` entries rotate, with ``h = rotary_dim / 2``::

    out[:h]          = x[:h] * cos - x[h:2h] * sin
    out[h:2h]        = x[h:2h] * cos + x[:h] * sin
    out[2h:head_dim] = x[2h:]                       (pass-through when partial_rotary_factor < 1)

``cos``/``sin`` of ``position * inv_freq`` are precomputed in float32 for every position below
``max_position`` and gathered by position, so a forward pass is a few vectorised ops.

Supported ``rope_scaling`` types (the ``rope_type`` or legacy ``type`` key):

- none / ``"default"``: plain RoPE.
- ``"linear"``: every inverse frequency divided by ``factor``.
- ``"dynamic"`` (dynamic NTK): HF only rescales once a sequence grows past the pretraining
  length; the cache here covers exactly ``max_position`` rows, so it is plain RoPE there, which is
  what HF computes for every position below ``max_position_embeddings``.
- ``"llama3"``: Llama-3.1 band-wise frequency scaling.
- ``"yarn"``: YaRN ramp between interpolated and extrapolated frequencies, cos/sin scaled by the
  attention factor (mscale).

Anything else (e.g. ``"longrope"``) raises ValueError.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sglang.srt.layers import cpu_fused_ops

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


def _base_inv_freq(rope_theta: float, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (rope_theta**exponents)


def _llama3_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], max_position: int
) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", max_position)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, and the
    # band in between blends the two linearly in 1/wavelength.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    rope_theta: float, rotary_dim: int, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and the attention factor that scales cos/sin (as in the YaRN paper)."""
    original_max = scaling.get("original_max_position_embeddings", max_position)
    factor = scaling.get("factor") or max_position / original_max

    def mscale(scale: float, coeff: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coeff * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(
                factor, scaling["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope_theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = _base_inv_freq(rope_theta, rotary_dim)
    interpolation = extrapolation / factor
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _inv_freq_for(
    rope_theta: float, rotary_dim: int, max_position: int, rope_scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] float32, cos/sin multiplier) for a scaling config."""
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type in ("default", "dynamic"):
        return _base_inv_freq(rope_theta, rotary_dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(rope_theta, rotary_dim) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_base_inv_freq(rope_theta, rotary_dim), scaling, max_position), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rope_theta, rotary_dim, scaling, max_position)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: default, linear, dynamic, "
        "llama3, yarn"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened q/k given absolute positions.

    The cos/sin cache is a plain float32 attribute, not a buffer, so ``model.to(bfloat16)`` does
    not round it; it follows the device of ``positions`` lazily.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(torch.float32)[None, :]
        # [max_position, rotary_dim]: cos in the first half of each row, sin in the second.
        self._cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_scaling
        # (positions, (cos, sin) at them) of the last call: every layer passes the same tensor.
        self._last: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None
        # Set by the model runner once the CPU fused kernels are built (cpu_fused_ops.py).
        self.use_cpu_fused_ops = False
        # Set by the model runner on CUDA: the Triton kernel (sgl_kernel.fused_elementwise).
        self.use_triton_fused_ops = False

    def cos_sin_table(self, device: torch.device) -> torch.Tensor:
        """The float32 ``[max_position, rotary_dim]`` table of cos (first half of a row) and
        sin (second half) that the fused RoPE kernels take, moved to ``device`` once."""
        if self._cos_sin.device != device:
            self._cos_sin = self._cos_sin.to(device)
        return self._cos_sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)
        half = self.rotary_dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half : self.rotary_dim].float()
        parts = [(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype)]
        if self.rotary_dim < self.head_dim:
            parts.append(x[..., self.rotary_dim :])
        return torch.cat(parts, dim=-1).view(num_tokens, -1)

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rotary_dim/2]`` at ``positions``."""
        cos_sin = self.cos_sin_table(positions.device).index_select(0, positions)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def start_forward(self) -> None:
        """Forget the gathered cos/sin of the previous forward pass (the model calls this
        first). A result kept across passes would escape a CUDA graph capture: a pass
        captured with the same ``positions`` tensor as the pass before it would reuse that
        pass's eager result instead of recording the gather, and replay stale rotations."""
        self._last = None

    def _cos_sin_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_gather`, computed once per forward: every layer passes the same
        ``positions`` tensor, so the result is reused within a pass (see
        :meth:`start_forward`)."""
        if torch.compiler.is_compiling():
            # A compiled layer gathers in its graph (inductor fuses it into the rotation): the
            # identity cache is Python state that a graph must not depend on.
            return self._gather(positions)
        if self._last is None or positions is not self._last[0]:
            self._last = (positions, self._gather(positions))
        return self._last[1]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, H*D]`` and ``k`` ``[T, KVH*D]`` at ``positions`` ``[T]``.

        Returns new tensors of the same shapes and dtypes (math in float32); inputs are not
        modified. Precondition: every position is in ``[0, max_position)``.
        """
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, n*D]`` (any number of heads, e.g. q and k side by side) in one
        pass; returns a new tensor. Same precondition as :meth:`forward`."""
        if positions.dtype == torch.int64:
            if self.use_cpu_fused_ops and cpu_fused_ops.supports(x):
                table = self.cos_sin_table(x.device)
                return cpu_fused_ops.rope(x, positions, table, self.head_dim, self.rotary_dim)
            if self.use_triton_fused_ops and not torch.compiler.is_compiling():
                from sgl_kernel import fused_elementwise  # triton: loaded where it is used

                table = self.cos_sin_table(x.device)
                return fused_elementwise.rope(x, positions, table, self.head_dim, self.rotary_dim)
        cos, sin = self._cos_sin_at(positions)
        return self._rotate(x, cos, sin)

    def stores_kv(self, positions: torch.Tensor, pool: MHATokenToKVPool | None) -> bool:
        """Whether :meth:`rotate_and_store` serves this pass: the Triton kernels are on (the
        model runner sets both flags on CUDA) and nothing is being traced."""
        return (
            self.use_triton_fused_ops
            and pool is not None
            and pool.use_triton_store
            and positions.dtype == torch.int64
            and not torch.compiler.is_compiling()
        )

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        loc: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate ``q`` ``[T, H*D]`` (returned, a new tensor) and ``k`` ``[T, KVH*D]``, and
        write the rotated k and ``v`` to slots ``loc`` of ``k_buf``/``v_buf`` ``[slots, KVH,
        D]``: one Triton kernel instead of a rotation and a K/V store (one kernel fewer per
        layer, ~1 us of a ~1 ms batch-1 step on an H100). Only where :meth:`stores_kv`."""
        from sgl_kernel import fused_elementwise  # triton: loaded where it is used

        table = self.cos_sin_table(q.device)
        return fused_elementwise.rope_store_kv(
            q, k, v, positions, table, self.head_dim, self.rotary_dim, k_buf, v_buf, loc
        )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}"
        )


def get_rope(
    head_dim: int,
    rope_theta: float,
    max_position: int,
    rope_scaling: dict[str, Any] | None = None,
    partial_rotary_factor: float = 1.0,
) -> RotaryEmbedding:
    """Build a RotaryEmbedding; raises ValueError for an unsupported scaling type."""
    rotary_dim = int(head_dim * partial_rotary_factor)
    inv_freq, attention_scaling = _inv_freq_for(rope_theta, rotary_dim, max_position, rope_scaling)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, attention_scaling)


def rope_params_from_config(config: Any) -> tuple[float, dict[str, Any] | None, float]:
    """``(rope_theta, rope_scaling, partial_rotary_factor)`` of a HF config.

    Reads transformers 5's ``rope_parameters`` dict when present, else the 4.x attributes
    ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor``.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return float(theta), dict(params), float(partial or 1.0)
    theta = getattr(config, "rope_theta", None) or 10000.0
    partial = getattr(config, "partial_rotary_factor", None) or 1.0
    return float(theta), getattr(config, "rope_scaling", None), float(partial)
