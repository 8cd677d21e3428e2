"""Prepacked weights for the linear layers on CPU (``--disable-cpu-weight-prepack``).

``F.linear`` on CPU hands a row-major ``[out, in]`` weight to MKL, which re-blocks it for its
micro-kernel on every call and runs single-threaded for one input row. oneDNN can instead keep
the weight in its own blocked layout, packed once, and multiply by it directly. Measured on 2
cores (SmolLM2-135M's 120 layer matrices, weights streamed from memory as in a real step)::

                      F.linear   packed
    float32,  1 row    44 ms      29 ms
    float32, 64 rows  154 ms      86 ms
    bfloat16, 1 row    19 ms      14 ms
    bfloat16, 64 rows  59 ms      47 ms

Where the brgemm kernel (layers/cpu_brgemm.py) is built and takes the weight (float32; bfloat16
on AVX512-BF16 hosts without AMX; a width that splits into blocks of 16-64 features), the copy
is that kernel's column blocks instead, which it multiplies 1.05-2.8x faster than oneDNN at
decode batch sizes and at about the same rate at prefill sizes; oneDNN's layout serves the rest.

On a CPU without native bfloat16 arithmetic (no AVX512-BF16 or AMX: an AVX2 host), oneDNN's
bfloat16 GEMM emulates it at a fraction of the float32 rate, so a bfloat16 model would run slower
than a float32 one. There the packed copy is made in float32 instead (``upcast_bf16``): the
product is computed in float32 from the bfloat16 values and rounded back to bfloat16, which is
the accumulation oneDNN's native kernel does too, so results agree up to summation order.

The packed copy sits beside the parameter (which weight loaders, ``get_weights_by_name`` and
weight updates keep using), so weights take twice their memory: the model runner logs the
cost. A :class:`PackedLinear` repacks whenever its weight changes, detected through the
tensor's storage pointer and in-place version counter, so every weight update path (disk,
tensor, distributed, resume after release) is covered without telling it.

Under ``torch.compile`` (``--enable-torch-compile``) that check cannot be traced: there the
product is the opaque op ``sglang::packed_linear`` on the copy made last, and the model runner
calls :meth:`PackedLinear.packed_weight` for every layer before each compiled forward instead.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sglang.srt.layers import cpu_brgemm
from sglang.srt.layers.batch_invariant import LinearHook
from sglang.srt.layers.cpu_brgemm import blocked_linear
from sglang.srt.layers.cpu_gemv import kernel_supports, small_linear
from sglang.srt.layers.linear import linear

# oneDNN picks the packed layout for this many input rows; 64 was the fastest hint for 1, 8, 64
# and 256 rows alike on SmolLM2's shapes (a hint of 1 is up to 1.6x slower at 8-64 rows).
_ROWS_HINT = 64
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The small-batch kernel (layers/cpu_gemv.py, when built) replaces the packed product up to
# its max_rows() input rows: on SmolLM2's layers at 1-4 rows on an Emerald Rapids host,
# 1.3-1.4x oneDNN's bfloat16 product (AMX there) and 0.97-1.08x the float32 brgemm kernel; at
# 5-16 rows on an AVX2 host (its tile path), 1.05-1.4x the float32 brgemm kernel and 1.25-2.1x
# the float32 copy a bfloat16 model's layers multiply there.


def packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``packed`` W's packed copy, in x's dtype: a 2-D copy is
    oneDNN's layout, a 3-D or 4-D one the brgemm kernel's column blocks (layers/cpu_brgemm.py).

    A float32 copy of a bfloat16 model's weight (``upcast_bf16``) computes in float32 and rounds
    the result to bfloat16: the brgemm kernel widens x and rounds its sums itself (no float32
    temporaries), oneDNN's layout multiplies a float32 copy of x.
    """
    if packed.dtype == x.dtype or (packed.dim() > 2 and x.dtype == torch.bfloat16):
        return _product(x, packed, bias)
    bias32 = None if bias is None else bias.float()
    return _product(x.float(), packed, bias32).to(x.dtype)


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if packed.dim() > 2:
        return blocked_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# The same product as an opaque op for compiled graphs: inductor's own lowering of
# _linear_pointwise only takes weights that inductor packed itself (freezing), not ours. Eager
# calls use packed_product directly (the dispatcher round trip costs ~10 us a call).
packed_linear_op = torch.library.custom_op(
    "sglang::packed_linear", packed_product, mutates_args=()
)


@packed_linear_op.register_fake
def _packed_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    n = cpu_brgemm.out_features(packed) if packed.dim() > 2 else packed.shape[0]
    return x.new_empty((*x.shape[:-1], n))


@functools.cache
def native_bf16_supported() -> bool:
    """Whether oneDNN has native bfloat16 kernels on this CPU (AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_supported() -> bool:
    """Whether this torch build has the oneDNN linear ops (a CPU build with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of a float32 or bfloat16 ``weight``: the brgemm kernel's column blocks
    where that kernel takes the weight (cpu_brgemm.blockable), else oneDNN's layout."""
    nb = cpu_brgemm.blockable(weight, torch.get_num_threads())
    if nb is not None:
        return cpu_brgemm.block_weight(weight, nb)
    return torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)


class PackedLinear:
    """A ``linear_fn`` (``(x, weight, bias) -> y``) multiplying by a packed copy of ``weight``.

    One instance serves one module: it holds the packed copy of the last weight it saw and
    repacks when that weight's storage, shape, dtype or version changes. Inputs it cannot take
    (another dtype or device, an inference-mode weight without a version counter) go through
    the plain :func:`~sglang.srt.layers.linear.linear`, with the same result up to rounding.
    With ``upcast_bf16`` a bfloat16 weight is packed in float32 and the product computed in
    float32 (the output is still bfloat16).
    """

    def __init__(self, upcast_bf16: bool = False) -> None:
        self.upcast_bf16 = upcast_bf16
        self._key: tuple[int, int, torch.dtype, tuple[int, ...]] | None = None
        self._packed: torch.Tensor | None = None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Traced: the copy of the last packed_weight() call, which the compiled layers
            # make before every forward (CompiledDecoderLayers.prepare), outside the graph. It
            # is a graph input, so one graph serves every layer.
            if self._packed is None or x.dtype != weight.dtype:
                return linear(x, weight, bias)
            return packed_linear_op(x, self._packed, bias)
        if kernel_supports(x, weight, bias):
            # A few rows (small decode batches): the weight is read once whatever the layout,
            # and this kernel streams it at the memory's rate (layers/cpu_gemv.py).
            return small_linear(x, weight, bias)
        packed = self.packed_weight(weight) if x.dtype == weight.dtype else None
        if packed is None:
            return linear(x, weight, bias)
        return packed_product(x, packed, bias)

    def packed_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight`` (packed now if it changed), or None if it cannot be."""
        if (
            weight.device.type != "cpu"
            or weight.dtype not in _PACKABLE_DTYPES
            or weight.dim() != 2
            or weight.numel() == 0
            or weight.is_inference()
            # oneDNN packs bfloat16 only where the CPU computes in it (--cpu-bf16-linear bf16
            # on an AVX2 host): the plain product serves.
            or (
                weight.dtype == torch.bfloat16
                and not self.upcast_bf16
                and not native_bf16_supported()
            )
        ):
            return None
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
        if key != self._key or self._packed is None:
            self._packed = None  # free the old copy before making the new one
            source = weight.detach()
            if self.upcast_bf16 and source.dtype == torch.bfloat16:
                source = source.float()
            self._packed = _pack(source)
            self._key = key
        return self._packed

    def clear(self) -> None:
        """Drop the packed copy (it is made again by the next call)."""
        self._key, self._packed = None, None

    @property
    def packed_dtype(self) -> torch.dtype | None:
        """The dtype of the packed copy (None when there is none)."""
        return None if self._packed is None else self._packed.dtype

    @property
    def blocked(self) -> bool:
        """Whether the packed copy is the brgemm kernel's column blocks (layers/cpu_brgemm.py)
        rather than oneDNN's layout."""
        return self._packed is not None and self._packed.dim() > 2

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copy (0 when there is none)."""
        if self._packed is None:
            return 0
        return self._packed.numel() * self._packed.element_size()


def enable_cpu_weight_prepack(model: nn.Module, upcast_bf16: bool = False) -> list[PackedLinear]:
    """Give every module with a ``linear_fn`` hook its own :class:`PackedLinear`
    (``upcast_bf16``: float32 copies of bfloat16 weights, see the module docstring).

    Returns the new functions, so that the caller can pack them eagerly (see
    :func:`pack_now`) and clear them when the weights are released.
    """
    packers = []
    for module in model.modules():
        if isinstance(module, LinearHook):
            packer = PackedLinear(upcast_bf16)
            module.linear_fn = packer
            packers.append(packer)
    return packers


def pack_now(model: nn.Module) -> int:
    """Pack every weight whose module has a :class:`PackedLinear`, now rather than at the first
    forward pass; returns the bytes the packed copies take.

    Modules hold their weight as ``weight``; the logits processor is given the LM head's, which
    is the ``lm_head`` (or, tied, the embedding) weight of the model, or that weight's float32
    copy where the processor has one (``fp32_head``, --enable-fp32-lm-head).
    """
    head = getattr(model, "lm_head", None)
    total = 0
    for module in model.modules():
        packer = getattr(module, "linear_fn", None)
        if not isinstance(packer, PackedLinear):
            continue
        weight = getattr(module, "weight", None)
        if weight is None and head is not None:
            weight = head.weight
            fp32_head = getattr(module, "fp32_head", None)
            if fp32_head is not None:
                weight = fp32_head.weight(weight)
        if isinstance(weight, torch.Tensor):
            packer.packed_weight(weight)
            total += packer.nbytes
    return total
