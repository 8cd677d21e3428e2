"""Drive the Scheduler core in-process: a scripted model worker and sinks that record outputs.

The fake worker's next token is a pure function of (last input token, its position), so a
request's tokens are the same whether it runs alone, in a batch, chunked, paused, retracted and
re-prefilled, or resubmitted: any duplicated, dropped or reordered token shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from sglang.srt.managers.req_kv import ReqKV, decode_run_length
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import GenerationBatchResult
from sglang.srt.managers.weight_state import WeightState
from sglang.srt.mem_cache import create_prefix_cache
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

FIRST_TOKEN = 10  # scripted tokens avoid the tiny tokenizer's special ids (0..2)
FAKE_LOGPROB = -0.5
FAKE_ENTROPY = 0.25


def scripted_token(last_id: int, position: int, vocab_size: int) -> int:
    """The fake model's next token after ``last_id`` sitting at ``position``."""
    return FIRST_TOKEN + (last_id * 31 + position * 7) % (vocab_size - FIRST_TOKEN)


def expected_output(prompt: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    """What an uninterrupted greedy run of the fake model produces."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(scripted_token(ids[-1], len(ids) - 1, vocab_size))
    return ids[len(prompt) :]


class ReadyStep:
    """A PendingStep whose results are known at launch (the fake worker's)."""

    def __init__(self, result: GenerationBatchResult) -> None:
        self._result = result
        self.next_token_ids = torch.tensor(result.next_token_ids, dtype=torch.int64)

    def result(self) -> GenerationBatchResult:
        return self._result


class FakeWorker:
    """A ModelWorker that runs no model: scripted tokens, constant logprobs and entropy."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_forwards = 0
        self.extended_tokens = 0  # prompt tokens computed by the extend steps so far

    def launch_batch_generation(
        self,
        forward_batch: ForwardBatch,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> ReadyStep:
        return ReadyStep(
            self.forward_batch_generation(
                forward_batch, sampling_info, return_logprob, top_logprobs_nums
            )
        )

    def forward_batch_generation(
        self,
        forward_batch: ForwardBatch,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: list[int] | None,
    ) -> GenerationBatchResult:
        self.num_forwards += 1
        ids = forward_batch.input_ids.tolist()
        positions = forward_batch.positions.tolist()
        if forward_batch.forward_mode == ForwardMode.EXTEND:
            self.extended_tokens += sum(forward_batch.extend_seq_lens_cpu)
            ends = torch.tensor(forward_batch.extend_seq_lens_cpu).cumsum(0).tolist()
            last = [(ids[e - 1], positions[e - 1]) for e in ends]
        else:
            last = list(zip(ids, positions))
        tokens = [scripted_token(t, p, self.vocab_size) for t, p in last]
        batch_size = len(tokens)
        top_k = max(top_logprobs_nums or [0])
        rows = forward_batch.input_logprob_rows
        num_rows = 0 if rows is None else int(rows.numel())
        input_k = forward_batch.input_top_logprobs_num
        return GenerationBatchResult(
            next_token_ids=tokens,
            next_token_logprobs=[FAKE_LOGPROB] * batch_size if return_logprob else None,
            top_logprobs_val=[[FAKE_LOGPROB] * top_k] * batch_size if top_k else None,
            top_logprobs_idx=[[t] * top_k for t in tokens] if top_k else None,
            input_token_logprobs=[FAKE_LOGPROB] * num_rows if rows is not None else None,
            input_top_logprobs_val=[[FAKE_LOGPROB] * input_k] * num_rows if input_k else None,
            input_top_logprobs_idx=[[FIRST_TOKEN] * input_k] * num_rows if input_k else None,
            entropies=[FAKE_ENTROPY] * batch_size,
        )


@dataclass
class RidRecord:
    """Everything the detokenizer would have received for one rid."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    finished_reasons: list[dict[str, Any]] = field(default_factory=list)
    messages_after_final: int = 0
    num_retractions: int = 0
    weight_version: str = ""  # the label the last message carried
    cached_tokens: int = 0  # as the last message reported it


class OutputSink:
    """Collects BatchTokenIDOutput messages per rid, and control replies in order."""

    def __init__(self) -> None:
        self.by_rid: dict[str, RidRecord] = {}
        self.replies: list[Any] = []

    def on_output(self, msg: BatchTokenIDOutput) -> None:
        for i, rid in enumerate(msg.rids):
            rec = self.by_rid.setdefault(rid, RidRecord())
            if rec.finished_reasons:
                rec.messages_after_final += 1
            rec.output_ids += msg.decode_ids[i]
            rec.num_retractions = msg.retraction_counts[i]
            rec.weight_version = msg.weight_version
            rec.cached_tokens = msg.cached_tokens[i]
            if msg.output_token_logprobs_val is not None:
                rec.logprobs += msg.output_token_logprobs_val[i]
            if msg.output_token_entropy_val is not None:
                rec.entropies += msg.output_token_entropy_val[i]
            if msg.finished_reasons[i] is not None:
                rec.finished_reasons.append(msg.finished_reasons[i])

    def on_reply(self, msg: Any) -> None:
        self.replies.append(msg)

    def last_reply(self, kind: type) -> Any:
        return next(r for r in reversed(self.replies) if isinstance(r, kind))

    def finished(self, rid: str) -> bool:
        rec = self.by_rid.get(rid)
        return rec is not None and bool(rec.finished_reasons)


def make_core(
    model_dir: str, overlap: bool = False, **server_kwargs: Any
) -> tuple[Scheduler, FakeWorker, OutputSink]:
    """A Scheduler core over the real pools, prefix cache and weights of ``model_dir`` (a tiny
    model), with the fake worker in place of the forward pass; ``overlap``: the overlap
    schedule, as on CUDA (the fake worker's steps are done at launch, the control flow is
    the same)."""
    server_kwargs.setdefault("max_total_tokens", 256)
    server_kwargs.setdefault("random_seed", 0)
    args = ServerArgs(model_path=model_dir, device="cpu", **server_kwargs)
    model_config = ModelConfig(model_dir, device="cpu")
    runner = ModelRunner(args, model_config)
    cache = create_prefix_cache(args.disable_radix_cache, runner.allocator, args.page_size)
    kv = ReqKV(
        runner.req_to_token_pool,
        runner.allocator,
        cache,
        args.page_size,
        WeightState(version=args.weight_version),
        decode_run=decode_run_length(args.device, args.page_size, runner.allocator.size),
    )
    worker = FakeWorker(model_config.vocab_size)
    sink = OutputSink()
    core = Scheduler(
        args,
        model_config,
        worker,
        runner,
        kv,
        runner.max_running_requests,
        None,
        sink.on_output,
        sink.on_reply,
        overlap=overlap,
    )
    return core, worker, sink


def submit(
    core: Scheduler,
    rid: str,
    prompt: list[int],
    max_new_tokens: int = 8,
    **request: Any,
) -> None:
    """Send one greedy generate request (``ignore_eos``) into the core, as the shell would."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    params.update(request.pop("sampling", {}))
    sp = SamplingParams(**params)
    sp.normalize()
    req = TokenizedGenerateReqInput(rid, "", prompt, sp, **request)
    core.process_input_requests([req])


def control(core: Scheduler, sink: OutputSink, msg: Any) -> Any:
    """Send one control request; returns its reply (None for a ``wait`` pause still draining)."""
    before = len(sink.replies)
    core.process_input_requests([msg])
    replies = [r for r in sink.replies[before:] if getattr(r, "req_id", None) == msg.req_id]
    return replies[-1] if replies else None


def run_until_idle(core: Scheduler, max_steps: int = 10_000) -> int:
    """Run loop turns while the core has runnable work (checking the invariants after each);
    returns the number of turns."""
    steps = 0
    while core.has_runnable_work():
        core.run_step()
        core.check_invariants()
        steps += 1
        assert steps < max_steps, "the scheduler never went idle"
    core.check_invariants()
    return steps


def assert_no_leak(core: Scheduler) -> None:
    """With nothing admitted: every slot is free or cached (evictable), no pool row is used.
    Checked without any flush."""
    core.check_invariants()
    state = core.internal_state()
    assert state["running_batch_size"] == 0 and state["chunked_req_is_none"]
    assert state["req_to_token_pool_used"] == 0
    assert state["available_kv_tokens"] == state["max_total_num_tokens"]
    assert state["private_kv_tokens"] == 0
