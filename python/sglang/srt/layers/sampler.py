"""Sampling backends, registered by name and imported lazily.

``pytorch`` is the tuned torch sampler (:mod:`sgl_kernel.sampling_torch`, the CPU default),
``triton`` the fused kernel (:mod:`sgl_kernel.sampling`, the CUDA default). Both implement the
contract of :mod:`sgl_kernel.sampling_contract` (the counter-based seeded noise of
docs/sampling.md, the entropy definitions of docs/entropy.md) and choose the same tokens as
its plain oracle for the same logits and seeds. The contract's public helpers, the row
logsumexp of the torch backend and its switch to native CPU kernels
(``use_cpu_kernels``, set by the model runner) are re-exported here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from sgl_kernel.sampling_contract import (
    ENTROPY_MODES,
    HASH_MUL1,
    HASH_MUL2,
    MASK32,
    POSITION_SALT,
    EntropyPlan,
    SampleOutput,
    gumbel_noise,
    hash32,
    noise_row_keys,
)
from sgl_kernel.sampling_torch import CpuSamplingKernels, row_logsumexp, use_cpu_kernels
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import derive_seed

__all__ = [
    "ENTROPY_MODES",
    "CpuSamplingKernels",
    "HASH_MUL1",
    "HASH_MUL2",
    "MASK32",
    "POSITION_SALT",
    "SAMPLING_BACKENDS",
    "SampleOutput",
    "Sampler",
    "derive_seed",
    "get_logsumexp",
    "get_sampling_backend",
    "gumbel_noise",
    "hash32",
    "noise_row_keys",
    "row_logsumexp",
    "use_cpu_kernels",
]

SampleFn = Callable[
    [torch.Tensor, SamplingBatchInfo, bool, "list[int] | None", "EntropyPlan | None"],
    SampleOutput,
]

# name -> (module, sampling function, its logsumexp); imported on first use so that `triton`
# is only loaded when asked.
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "pytorch": ("sgl_kernel.sampling_torch", "sample_torch", "row_logsumexp"),
    "triton": ("sgl_kernel.sampling", "sample_triton", "row_logsumexp_triton"),
}
SAMPLING_BACKENDS = tuple(_BACKENDS)


def _backend_attr(name: str, index: int) -> Callable:
    if name not in _BACKENDS:
        raise ValueError(
            f"Unknown sampling backend {name!r}; supported: {', '.join(SAMPLING_BACKENDS)}"
        )
    module = _BACKENDS[name][0]
    return getattr(importlib.import_module(module), _BACKENDS[name][index])


def get_sampling_backend(name: str) -> SampleFn:
    """The sampling function registered as ``name``; ValueError listing the names otherwise."""
    return _backend_attr(name, 1)


def get_logsumexp(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The row logsumexp ([B, V] -> [B] float32) whose bits backend ``name`` uses for the
    chosen token's logprob: prompt logprobs computed with it equal decode logprobs exactly."""
    return _backend_attr(name, 2)


class Sampler:
    """One sampling step through the backend ``backend``, with the server's entropy default
    (``entropy_mode``, ``entropy_top_k``) for requests that want entropy without choosing."""

    def __init__(
        self, backend: str = "pytorch", entropy_mode: str = "raw", entropy_top_k: int = 0
    ) -> None:
        if entropy_mode not in ENTROPY_MODES:
            raise ValueError(f"entropy mode must be one of {ENTROPY_MODES}, got {entropy_mode!r}")
        self.name = backend
        self.entropy_mode = entropy_mode
        self.entropy_top_k = entropy_top_k
        self._sample = get_sampling_backend(backend)

    def forward(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> SampleOutput:
        """Pick one token per row of ``logits`` [B, V] (float32, bfloat16 or float16).

        Precondition: ``info.apply_logits_processors(logits)`` has already run (penalties are
        part of the logits). Does not mutate ``logits``; the caller advances positions with
        ``info.cumulate_output_tokens`` afterwards. ``entropies`` is set when some row of
        ``info`` wants entropy (others hold 0), None otherwise.
        """
        plan = info.entropy_plan(self.entropy_mode, self.entropy_top_k)
        return self._sample(logits, info, return_logprob, top_logprobs_nums, plan)
