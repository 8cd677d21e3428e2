"""TpModelWorker: batch -> forward -> sample, returning host-side results."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.sampler import Sampler
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import ServerArgs


class GenerationBatchResult(NamedTuple):
    """Host-side results of one step, one entry per request of the batch (in batch order)."""

    next_token_ids: list[int]
    next_token_logprobs: list[float] | None  # chosen token's logprob when any request asks
    top_logprobs_val: list[list[float]] | None  # [B][K], K = max top_logprobs_num of the batch
    top_logprobs_idx: list[list[int]] | None
    input_token_logprobs: list[float] | None  # flat over ForwardBatch.input_logprob_rows
    input_top_logprobs_val: list[list[float]] | None
    input_top_logprobs_idx: list[list[int]] | None
    # Entropy of each row's distribution when some request of the batch asks (0 in the rows
    # that do not), None otherwise; definitions in docs/entropy.md.
    entropies: list[float] | None = None


class ModelWorker(Protocol):
    """What the Scheduler core needs to run a step (TpModelWorker, or a test's scripted fake)."""

    def forward_batch_generation(
        self,
        forward_batch: ForwardBatch,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> GenerationBatchResult: ...


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig) -> None:
        self.model_runner = ModelRunner(server_args, model_config)
        # LoRA adapters (docs/lora.md): hooks on the model's projections, slots, registry.
        self.lora_manager: LoRAManager | None = None
        if server_args.enable_lora:
            self.lora_manager = LoRAManager(self.model_runner.model, server_args)
        self.sampler = Sampler(
            server_args.sampling_backend, server_args.entropy_mode, server_args.entropy_top_k
        )

    def forward_batch_generation(
        self,
        forward_batch: ForwardBatch,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> GenerationBatchResult:
        """Run the model on ``forward_batch`` and sample one token per request."""
        if self.lora_manager is None:
            logits_output = self.model_runner.forward(forward_batch)
        else:
            self.lora_manager.prepare_batch(forward_batch)
            try:
                logits_output = self.model_runner.forward(forward_batch)
            finally:
                self.lora_manager.finish_batch()
        with torch.inference_mode():
            logits = logits_output.next_token_logits
            sampling_info.apply_logits_processors(logits)
            out = self.sampler.forward(logits, sampling_info, return_logprob, top_logprobs_nums)
            sampling_info.cumulate_output_tokens(out.next_token_ids)
        fields = (
            out.next_token_ids,
            out.logprobs,
            out.top_logprobs_val,
            out.top_logprobs_idx,
            logits_output.input_token_logprobs,
            logits_output.input_top_logprobs_val,
            logits_output.input_top_logprobs_idx,
            out.entropies,
        )
        return GenerationBatchResult(*_to_host_lists(fields))


def _to_host_lists(tensors: tuple[torch.Tensor | None, ...]) -> list[Any]:
    """The step's results as Python lists, with one wait for the device: every copy is queued
    first (non-blocking), then the stream is synchronized once (nothing on CPU)."""
    host = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    if any(t is not None and t.device.type == "cuda" for t in tensors):
        torch.cuda.current_stream().synchronize()
    return [None if t is None else t.tolist() for t in host]
