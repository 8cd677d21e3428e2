"""Attention backends, registered by name and imported lazily."""

from __future__ import annotations

import importlib

# name -> "module:Class", or None for backends that are known but not built here.
_BACKENDS: dict[str, str | None] = {
    "torch_native": "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend",
    # Chosen by --enable-deterministic-inference (batch-invariant, prefill/decode-consistent).
    "torch_native_deterministic": (
        "sglang.srt.layers.attention.deterministic_backend:DeterministicAttnBackend"
    ),
    "triton": "sglang.srt.layers.attention.triton_backend:TritonAttnBackend",
    # Per query and per fixed key block: batch-invariant, and decode equals prefill.
    "triton_deterministic": (
        "sglang.srt.layers.attention.triton_backend:TritonDeterministicAttnBackend"
    ),
    "flashinfer": None,
}


def get_attention_backend_class(name: str) -> type:
    """The backend class registered as ``name``.

    Raises ValueError for an unknown name (listing the supported ones) and for a known backend
    that this build does not provide.
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: {sorted(_BACKENDS)}")
    target = _BACKENDS[name]
    if target is None:
        available = sorted(n for n, t in _BACKENDS.items() if t is not None)
        raise ValueError(
            f"attention backend {name!r} is not available on this build; available: {available}"
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
