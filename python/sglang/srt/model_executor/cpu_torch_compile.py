"""``--enable-torch-compile`` on CPU: the decoder layers compiled by inductor.

A decoder layer that offers the two fusion hooks ``pre_attention(positions, hidden, residual)
-> (q, k, v, residual)`` and ``post_attention(attn_out, residual) -> (hidden, residual)``
(models/llama.py and the models built on it) gets each compiled into one graph, traced once
for all layers (their parameters are graph inputs, so a model's layers share the graphs)::

    pre_attention graph:   add + RMSNorm, QKV product, (q/k norm,) RoPE gather and rotation
    attention              eager: the backend's step (KV store, SDPA), never traced
    post_attention graph:  O product, add + RMSNorm, gate/up product, SiLU * up, down product

The linear products stay oneDNN's packed-weight kernels, as the opaque op
``sglang::packed_linear`` (layers/cpu_prepack.py) on the packed copies, which
:meth:`CompiledDecoderLayers.prepare` brings up to date before every forward, outside the
graphs (a weight update repacks them). What the graphs remove is the Python and
per-op dispatch cost of the small ops between the products (norms, residual adds, RoPE,
activation, slicing), fused into a few C++ loops.

Shapes: the token dimension is dynamic. Dynamo compiles the first shape it sees statically and
makes the token count symbolic at the second; one-token steps keep their own graphs (dynamo
specialises sizes 0 and 1), and so does the first layer (no residual yet). :func:`warm_up` runs
a 1-token and a 2-token prefill at start-up, after which a step of any size reuses those graphs
(6 in all): compilation happens once, before the first request. (One model per process: the
graphs are cached per Python function, so a second model of other shapes in the same process
would compile its own and make dynamo mark more dimensions dynamic.)

Not used in deterministic mode (its batch-invariant products have their own path), with
tensor parallelism (the all-reduce inside the layers) or with LoRA adapters (their Python
per-request grouping): the model runner checks.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.cpu_prepack import PackedLinear
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.warmup import run_dummy_prefill

# The fusion hooks of a decoder layer that are compiled (see the module docstring).
_HOOKS = ("pre_attention", "post_attention")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model``: the children of every ``nn.ModuleList`` attribute named
    ``layers`` (the layout of every model in ``sglang.srt.models``)."""
    found: list[nn.Module] = []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            found.extend(layers)
    return found


class CompiledDecoderLayers:
    """Installs compiled fusion hooks on a model's decoder layers (mutates them: instance
    attributes shadow the methods). Raises ValueError when a layer lacks the hooks.

    Before each forward the caller must call :meth:`prepare` with the batch: it picks the
    compiled or the eager hooks for that step and brings the packed weights up to date (the
    graphs read the packed copies without checking them).
    """

    def __init__(self, model: nn.Module, max_decode_batch_size: int) -> None:
        self.max_decode_batch_size = max_decode_batch_size
        # Whether this step runs the compiled hooks (set by prepare()).
        self.active = True
        self.layers = decoder_layers(model)
        missing = [type(x).__name__ for x in self.layers if not all(hasattr(x, h) for h in _HOOKS)]
        if not self.layers or missing:
            raise ValueError(
                f"{type(model).__name__}: no decoder layers with {' and '.join(_HOOKS)} to compile"
            )
        # One compiled function per (layer class, hook), shared by the layers of that class.
        compiled: dict[tuple[type, str], Callable[..., Any]] = {}
        for layer in self.layers:
            for hook in _HOOKS:
                eager = getattr(type(layer), hook)
                key = (type(layer), hook)
                if key not in compiled:
                    compiled[key] = torch.compile(eager)
                setattr(layer, hook, types.MethodType(self._switch(eager, compiled[key]), layer))
        # (packer, the weight it packs) of every linear layer inside the compiled layers.
        self._packers: list[tuple[PackedLinear, nn.Module]] = []
        for layer in self.layers:
            for module in layer.modules():
                packer = getattr(module, "linear_fn", None)
                if isinstance(packer, PackedLinear):
                    self._packers.append((packer, module))

    def _switch(
        self, eager: Callable[..., Any], compiled: Callable[..., Any]
    ) -> Callable[..., Any]:
        """A hook that runs ``compiled`` while :attr:`active`, ``eager`` otherwise."""

        def hook(layer: nn.Module, *args: Any) -> Any:
            return (compiled if self.active else eager)(layer, *args)

        return hook

    def prepare(self, forward_batch: ForwardBatch) -> None:
        """Choose the hooks for this step: compiled for a prefill and for a decode batch of at
        most ``max_decode_batch_size`` requests (``--torch-compile-max-bs``); and repack every
        layer weight that changed since its last packing (nothing to do otherwise)."""
        self.active = (
            not forward_batch.is_decode
            or forward_batch.batch_size <= self.max_decode_batch_size
        )
        for packer, module in self._packers:
            # The module's current weight: release/resume and updates replace its data.
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            packer.packed_weight(weight)


def warm_up(
    run_forward: Callable[[ForwardBatch], object], req_to_token_pool: ReqToTokenPool
) -> float:
    """Compile now: run throwaway 1-token and 2-token prefills through ``run_forward`` (the
    model runner's forward), which traces the one-token graphs (those of every batch-1 decode
    step too) and the dynamic-size ones that every larger step reuses. Returns the seconds it
    took. The steps write K/V only to the dummy slot and give their request row back."""
    start = time.perf_counter()
    for num_tokens in (1, 2):
        run_dummy_prefill(run_forward, req_to_token_pool, [num_tokens])
    return time.perf_counter() - start
