"""TpModelWorker: batch -> forward -> sample, launched now, results on the host later.

A step is launched (:meth:`TpModelWorker.launch_batch_generation`) and its results collected
later (:meth:`PendingStep.result`): on CUDA the launch queues the forward pass, the sampler and
the copies of the results to the host without waiting for the device, so the scheduler can
prepare and launch the next step while this one runs (the overlap schedule, docs/overlap.md).
"""

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


class PendingStep(Protocol):
    """A launched step. ``next_token_ids`` [B] are its sampled ids where the next step's
    inputs can read them without a host round trip (on the step's device, in stream order)."""

    next_token_ids: torch.Tensor

    def result(self) -> GenerationBatchResult:
        """The step's results on the host; waits for the device when they are not there yet."""
        ...


class ModelWorker(Protocol):
    """What the Scheduler core needs to run a step (TpModelWorker, or a test's scripted fake)."""

    def launch_batch_generation(
        self,
        forward_batch: ForwardBatch,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> PendingStep: ...


class DeviceResults:
    """A :class:`PendingStep` over device tensors: every copy to the host is queued at once
    (non-blocking, into pinned memory on CUDA) and one event marks their end; :meth:`result`
    waits for that event only, not for the work queued after it."""

    def __init__(self, next_token_ids: torch.Tensor, fields: tuple[torch.Tensor | None, ...]):
        self.next_token_ids = next_token_ids
        self._host = [None if t is None else t.to("cpu", non_blocking=True) for t in fields]
        self._done: torch.cuda.Event | None = None
        if next_token_ids.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> GenerationBatchResult:
        if self._done is not None:
            self._done.synchronize()
        lists: list[Any] = [None if t is None else t.tolist() for t in self._host]
        return GenerationBatchResult(*lists)


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

    def launch_batch_generation(
        self,
        forward_batch: ForwardBatch,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> DeviceResults:
        """Queue the model on ``forward_batch`` and the sampling of one token per request;
        no host sync on CUDA (the results travel to the host behind them)."""
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
        return DeviceResults(out.next_token_ids, fields)
