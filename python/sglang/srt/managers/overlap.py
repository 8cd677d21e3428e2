"""The overlap schedule: launch decode step N+1 before committing step N (docs/overlap.md).

On CUDA a step is queued without waiting for the device (TpModelWorker.launch_batch_generation),
so while the GPU runs step N the scheduler builds and queues step N+1, whose input ids are
step N's sampled ids read on the device; only then does it wait for step N's results and
commit them. The host work of a step (building it, launching it, committing its tokens) then
hides behind the GPU's.

Running ahead is allowed only in steady decoding, where step N+1 does not depend on anything
step N's tokens decide (:func:`run_ahead_blocker`). Everything else (a control message, a
prefill, a retraction, a change of the batch) first commits the step in flight, so the control
plane always sees committed state, as without overlap.

The one thing step N decides that step N+1 already assumed: a request that stops at step N
(EOS, a stop string) was fed into step N+1. Its extra row is computed and dropped, and the KV
slot that step wrote (its last token's K/V, valid in stream order) is released with the request.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.tp_worker import PendingStep
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import ServerArgs


def overlap_off_reason(args: ServerArgs) -> str | None:
    """Why every step is committed before the next is launched under ``args``; None when
    steady decode steps overlap."""
    if args.disable_overlap_schedule:
        return "--disable-overlap-schedule"
    if torch.device(args.device).type != "cuda":
        return "not a CUDA device (a step runs synchronously)"
    if args.tp_size > 1:
        return "tensor parallelism (the ranks commit every step in lockstep)"
    if args.enable_lora:
        return "LoRA adapters"
    return None


class InFlightStep(NamedTuple):
    """A launched step whose results are not committed yet."""

    batch: ScheduleBatch  # the batch it ran (its ``reqs`` may change before the commit)
    reqs: list[Req]  # the requests of its rows, in row order, as launched
    mode: ForwardMode
    pending: PendingStep

    @property
    def next_token_ids(self) -> torch.Tensor:
        return self.pending.next_token_ids


def run_ahead_blocker(
    step: InFlightStep, running: ScheduleBatch, max_running_requests: int, has_waiting: bool
) -> str | None:
    """Why the next decode step of ``running`` cannot be launched before ``step`` (in flight)
    is committed; None when it can. The caller also checks the scheduler-wide conditions
    (pause, memory, LoRA, free KV)."""
    if step.mode != ForwardMode.DECODE:
        return "the step in flight is a prefill"
    if running.reqs is not step.reqs:
        return "the batch changed"  # batches replace their list whenever they change
    if not running.has_sampling_info:
        return "the batch's sampling state is rebuilt from committed tokens"
    if running.sampling_info.grammars is not None:
        return "a grammar masks the next token by the committed ones"
    if has_waiting and len(running.reqs) < max_running_requests:
        return "waiting requests may be admitted"
    if any(len(r.output_ids) + 2 > r.sampling_params.max_new_tokens for r in step.reqs):
        return "a request reaches its length limit with the step in flight"
    return None
