"""The Scheduler core: the waiting queue, the running batch and every request's lifecycle.

It owns no socket and no process: its dependencies come in through the constructor (the model
worker, the request KV manager, weight and memory handlers, and two sinks: outputs to the
detokenizer, replies to the tokenizer manager), so tests drive it in-process with a fake worker.
The process shell (scheduler_process.py) reads messages and calls, each loop turn::

    scheduler.process_input_requests(messages)
    scheduler.run_step()

With ``overlap`` (the overlap schedule, managers/overlap.py) a decode step may stay in flight
across turns: ``in_flight`` is the launched step not committed yet; every path but the steady
decode one commits it first (:meth:`finish_in_flight`), so handlers see committed state.

A request's ``status`` (schedule_batch.ReqStatus) changes only in :meth:`admit`,
:meth:`start_decoding`, :meth:`retract`, :meth:`finish`, :meth:`pause_in_place` and
:meth:`unpause`; each releases what
the request holds before it moves. :meth:`check_invariants` proves nothing leaked.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.constrained.base_grammar_backend import (
    GrammarSpec,
    InvalidGrammarError,
    create_grammar_backend,
    grammar_spec,
)
from sglang.srt.lora.control import LoRAControl
from sglang.srt.lora.scheduling import admissible, unpaused
from sglang.srt.managers.control_hooks import SchedulerHooks
from sglang.srt.managers.io_struct import (
    AbortReq,
    AbortReqOutput,
    BatchTokenIDOutput,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GetWeightsByNameReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    PauseStateOutput,
    ProfileReq,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from sglang.srt.managers.memory_occupation import MemoryBackend, MemoryOccupation
from sglang.srt.managers.overlap import InFlightStep, run_ahead_blocker
from sglang.srt.managers.pause_state import PauseModeError, PauseState, resolve_pause_mode
from sglang.srt.managers.req_intake import QUEUE_FULL_MESSAGE, make_req, refusal
from sglang.srt.managers.req_kv import ReqKV
from sglang.srt.managers.schedule_batch import Req, ReqStatus, ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    PrefillAdder,
    SharedPrompts,
    reserved_decode_tokens,
    sort_waiting_queue,
)
from sglang.srt.managers.scheduler_invariants import check_invariants
from sglang.srt.managers.scheduler_output import OutputProcessor
from sglang.srt.managers.scheduler_profiler import SchedulerProfiler
from sglang.srt.managers.tp_worker import ModelWorker
from sglang.srt.managers.weight_updater import HasModel, WeightUpdater
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import TypeBasedDispatcher

logger = logging.getLogger(__name__)

_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
_NEW_TOKEN_RATIO_DECAY_STEPS = 600
_RETRACT_RATIO_BUMP = 0.1
_KV_TOO_SMALL = "The KV cache is too small for this request"


class ModelOwner(HasModel, MemoryBackend, Protocol):
    """The ModelRunner as the scheduler sees it: the live model and its memory."""

    def cuda_graph_state(self) -> dict[str, Any]: ...

    def routed_experts(self, slots: torch.Tensor) -> str: ...


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        model_config: ModelConfig,
        worker: ModelWorker,
        runner: ModelOwner,
        kv: ReqKV,
        max_running_requests: int,
        tokenizer: Any,
        send_output: Callable[[BatchTokenIDOutput], None],
        send_reply: Callable[[Any], None],
        overlap: bool = False,
    ) -> None:
        """``runner`` owns the model and its memory (the ModelRunner); ``kv`` wraps its pools
        and the prefix cache. ``send_output`` takes per-request outputs (to the detokenizer),
        ``send_reply`` control replies and unsolicited state messages (to the tokenizer).
        ``overlap``: launch each steady decode step before committing the one in flight."""
        self.server_args = server_args
        self.model_config = model_config
        self.worker = worker
        self.runner = runner
        self.kv = kv
        self.tree_cache = kv.tree_cache
        self.max_total_num_tokens = kv.allocator.size
        self.max_running_requests = max_running_requests
        self.max_req_input_len = min(model_config.context_len, self.max_total_num_tokens) - 1
        self.send_reply = send_reply

        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.pause = PauseState()
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.overlap = overlap
        self.in_flight: InFlightStep | None = None  # launched, not committed (overlap only)
        self.num_steps_ahead = 0  # decode steps launched before the one in flight committed
        self.forward_ct_decode = 0
        self.num_loop_turns = 0  # tests wait for N more turns instead of sleeping
        self.init_new_token_ratio = min(0.7 * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * _MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio = self.init_new_token_ratio
        # The invariants are checked whenever the scheduler goes idle and before a flush (a
        # tree walk and a pass over the free list, once per busy period); in debug mode on
        # every idle turn.
        self.debug_checks = server_args.log_level == "debug"
        self._was_busy = False

        # LoRA (docs/lora.md): the worker's adapter registry and the adapter-scoped control.
        self.lora = getattr(worker, "lora_manager", None)
        self.lora_ctl = LoRAControl(self, self.lora)
        if self.lora is not None:
            kv.lora_uid = self.lora.uid
        weight_state = kv.weights
        self.output = OutputProcessor(
            weight_state,
            tokenizer,
            send_output,
            server_args.stream_interval,
            version_of=self.lora_ctl.version_of,
        )
        hooks = SchedulerHooks(
            abort_all=lambda message: self.abort_matching(lambda rid: True, message),
            num_kv_holders=self.num_kv_holders,
            flush_cache=lambda: self.flush_cache().success,
            invalidate_cache=self._invalidate_cache,
            num_alive=self.num_alive,
        )
        self.memory = MemoryOccupation(
            runner, hooks, restore_weights=lambda: self.weights.restore_after_resume()
        )
        self.weights = WeightUpdater(
            runner,
            model_config,
            weight_state,
            self.memory,
            hooks,
            custom_weight_loader=server_args.custom_weight_loader,
        )
        # Constrained decoding (docs/constrained_decoding.md); None with --grammar-backend none.
        self.grammar_backend = create_grammar_backend(
            server_args.grammar_backend,
            tokenizer,
            model_config.vocab_size,
            any_whitespace=not server_args.constrained_json_disable_any_whitespace,
        )
        self.profiler = SchedulerProfiler()
        self.dispatch = TypeBasedDispatcher(
            [
                (TokenizedGenerateReqInput, self.handle_generate_request),
                (AbortReq, self.handle_abort),
                (FlushCacheReqInput, self.handle_flush_cache),
                (GetInternalStateReq, self.handle_get_internal_state),
                (PauseGenerationReqInput, self.handle_pause),
                (ContinueGenerationReqInput, self.handle_continue),
                (UpdateWeightFromDiskReqInput, self.weights.update_from_disk),
                (UpdateWeightsFromTensorReqInput, self.weights.update_from_tensor),
                (GetWeightsByNameReqInput, self.weights.get_weights_by_name),
                (UpdateWeightVersionReqInput, self.weights.update_weight_version),
                (ReleaseMemoryOccupationReqInput, self.memory.release),
                (ResumeMemoryOccupationReqInput, self.memory.resume),
                (LoadLoRAAdapterReqInput, self.lora_ctl.handle_load),
                (LoadLoRAAdapterFromTensorsReqInput, self.lora_ctl.handle_load),
                (UnloadLoRAAdapterReqInput, self.lora_ctl.handle_unload),
                (ProfileReq, self.profiler.handle),
            ]
        )

    # ---- one loop turn ----------------------------------------------------------------------
    def process_input_requests(self, msgs: list[Any]) -> None:
        """Handle each message in arrival order; each control request gets its reply now
        (a ``wait`` pause later, once drained). The step in flight is committed first."""
        if msgs:
            self.finish_in_flight()
        for msg in msgs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self._admit_request_isolated(msg)
            else:
                self.reply(self.dispatch(msg))

    def run_step(self) -> bool:
        """Launch at most one forward pass and commit the step before it. False when none ran
        (idle, paused, memory released, or the step's requests were finished before it ran);
        :meth:`has_runnable_work` says whether another turn has work."""
        self.num_loop_turns += 1
        committed = self.run_ahead_blocker() is not None and self.finish_in_flight()
        self.check_pause()
        self.lora_ctl.check_drains()
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch is None:
            # A turn that committed a step goes idle only on the next turn, after the input
            # that came meanwhile (as without overlap: a client's next request, sent on this
            # step's output, is taken before the idle checks run).
            if not (self.finish_in_flight() or committed):
                self.on_idle()
            return False
        self._was_busy = True
        assert batch.forward_batch is not None, "a batch to run has been prepared"
        pending = self.worker.launch_batch_generation(
            batch.forward_batch, batch.sampling_info, batch.return_logprob, batch.top_logprobs_nums
        )
        self.profiler.step()
        previous = self.in_flight
        self.in_flight = InFlightStep(batch, batch.reqs, batch.forward_mode, pending)
        if previous is not None:
            self.num_steps_ahead += 1
            self.commit(previous)
        if not self.overlap or batch.forward_mode == ForwardMode.EXTEND:
            self.finish_in_flight()  # a prefill changes the batch: nothing runs ahead of it
        self.last_batch = batch
        return True

    def finish_in_flight(self) -> bool:
        """Wait for the step in flight (if any) and commit its results; whether there was one."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return False
        self.commit(step)
        return True

    def commit(self, step: InFlightStep) -> None:
        """Commit ``step``'s results into its requests (finishing and streaming them)."""
        result = step.pending.result()
        if step.mode == ForwardMode.EXTEND:
            self.process_extend_result(step.batch, result)
        else:
            self.process_decode_result(step.reqs, result)

    def run_ahead_blocker(self) -> str | None:
        """Why the step in flight must be committed before the next is built; None when the
        next decode step may be launched first (see managers/overlap.py)."""
        step = self.in_flight
        if step is None:
            return "no step in flight"
        if not self.overlap:
            return "the overlap schedule is off"
        if self.pause.pending is not None or not self.pause.admits_new():
            return "a pause"
        if self.memory.blocks_forward():
            return "memory released"
        if self.lora is not None:
            return "LoRA adapters"
        if self.chunked_req is not None:
            return "a chunked prefill"
        running = self.running_batch
        has_waiting = bool(self.waiting_queue)
        reason = run_ahead_blocker(step, running, self.max_running_requests, has_waiting)
        if reason is None and not self.kv.ensure_free(running.decode_tokens_needed(ahead=True)):
            reason = "the KV pool is short"
        return reason

    def has_runnable_work(self) -> bool:
        """Whether the next turn has something to do (the shell then does not block on input):
        a step to run, or a drained ``wait`` pause to answer."""
        if self.in_flight is not None:
            return True
        if self.pause.pending is not None and not self.num_draining():
            return True
        if self.lora_ctl.has_drain_to_answer():
            return True
        if not self.pause.allows_forward() or self.memory.blocks_forward():
            return False
        return bool(
            unpaused(self.waiting_queue, self.lora_ctl.no_admission())
            or self.chunked_req
            or unpaused(self.running_batch.reqs, self.lora_ctl.no_decode())
        )

    def reply(self, msg: Any) -> None:
        if msg is not None:
            self.send_reply(msg)

    def on_idle(self) -> None:
        self.new_token_ratio = self.init_new_token_ratio
        if self.debug_checks or self._was_busy:
            self.check_invariants()
        self._was_busy = False

    def check_invariants(self) -> None:
        """Raise AssertionError if a KV slot or pool row is not owned by exactly one of: the
        free list, the prefix cache, one admitted request (see scheduler_invariants)."""
        in_flight = None if self.in_flight is None else self.in_flight.reqs
        check_invariants(
            self.kv, self.waiting_queue, self.chunked_req, self.running_batch, in_flight
        )

    # ---- batch selection --------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Prefill first (the chunked request's next chunk even while draining), else decode;
        None when idle, paused or while memory is released."""
        if not self.pause.allows_forward() or self.memory.blocks_forward():
            return None
        admit_new = self.pause.admits_new()
        if admit_new or self.chunked_req is not None:
            batch = self.get_new_batch_prefill(admit_new)
            if batch is not None:
                return batch
        if self.running_batch.is_empty():
            return None
        return self.update_running_batch()

    def get_new_batch_prefill(self, admit_new: bool = True) -> ScheduleBatch | None:
        """Admit waiting requests (and the chunked request's next chunk) into an extend batch."""
        num_running = len(self.running_batch)
        waiting = self.waiting_queue if admit_new else []
        if self.chunked_req is None and (not waiting or num_running >= self.max_running_requests):
            return None
        sort_waiting_queue(self.waiting_queue, self.server_args.schedule_policy, self.kv)
        if waiting and self.lora is not None:
            blocked = self.lora_ctl.no_admission()
            limit = self.server_args.max_loras_per_batch
            waiting = admissible(waiting, self.kv_holders(), blocked, limit)
        chunk = self.server_args.chunked_prefill_size
        adder = PrefillAdder(
            kv=self.kv,
            rem_total_tokens=self.kv.available_tokens()
            - reserved_decode_tokens(self.running_batch.reqs, self.new_token_ratio),
            rem_input_tokens=self.server_args.max_prefill_tokens,
            rem_chunk_tokens=None if chunk == -1 else chunk,
            new_token_ratio=self.new_token_ratio,
            page_size=self.server_args.page_size,
            max_requests=self.server_args.prefill_max_requests,
        )
        # Prompts this batch computes: a waiting request that begins with enough of the same
        # tokens waits a round and then finds them cached (share_computed) instead of
        # computing them a second time.
        computing = SharedPrompts(self.kv.tree_cache.keeps_inserted, self.server_args.page_size)
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
            computing.add(self.chunked_req)
            num_running += 1
        admitted = 0
        for req in waiting:
            if num_running + admitted >= self.max_running_requests:
                break
            if computing.defers(req):
                continue
            if not adder.add_one_req(req):
                break
            admitted += 1
            computing.add(req)
        if not adder.can_run:
            return None
        new_reqs = adder.can_run[len(adder.can_run) - admitted :]
        batch = self._new_batch(adder.can_run)
        batch.forward_batch = batch.prepare_for_extend()
        if batch.forward_batch is None:
            logger.warning("KV pool exhausted while admitting a prefill; retrying later")
            for req in new_reqs:
                self.kv.unlock_unadmitted(req)
            return None
        self.admit(new_reqs)
        self.chunked_req = adder.new_chunked_req
        return batch

    def update_running_batch(self) -> ScheduleBatch | None:
        """Prepare a decode step, retracting requests when the KV pool cannot hold it."""
        batch = self._decode_batch()
        if batch.is_empty():
            return None
        # Running ahead of the step in flight (overlap; run_ahead_blocker checked the KV).
        ahead = self.in_flight.next_token_ids if self.in_flight is not None else None
        needed = batch.decode_tokens_needed(ahead=ahead is not None)
        if not self.kv.ensure_free(needed) and self.chunked_req is not None:
            # A chunked prefill holds KV that running requests need: it yields first.
            chunked, self.chunked_req = self.chunked_req, None
            self.retract(chunked)
            self.waiting_queue.insert(0, chunked)
        if not self.kv.ensure_free(needed) and len(batch) > 1:
            retracted = batch.select_retractions(needed, self.retract)
            logger.warning("KV cache full: retracted %d request(s)", len(retracted))
            self.waiting_queue = retracted + self.waiting_queue
            if batch is not self.running_batch:
                gone = {id(r) for r in retracted}
                self.running_batch.filter([r for r in self.running_batch.reqs if id(r) not in gone])
            self.new_token_ratio = min(1.0, self.new_token_ratio + _RETRACT_RATIO_BUMP)
        batch.forward_batch = batch.prepare_for_decode(ahead)
        if batch.forward_batch is None:
            # One request is left, alone in the pool, and its next token does not fit. (Not
            # when running ahead, whose KV run_ahead_blocker checked; the step in flight is
            # committed first all the same, so that its slots are released with the request.)
            self.finish_in_flight()
            stuck = [r for r in batch.reqs if not r.finished]
            self.finish(stuck, {"type": "abort", "message": _KV_TOO_SMALL})
            return None
        self.forward_ct_decode += 1
        self.new_token_ratio = max(
            self.min_new_token_ratio,
            self.new_token_ratio
            - (self.init_new_token_ratio - self.min_new_token_ratio) / _NEW_TOKEN_RATIO_DECAY_STEPS,
        )
        return batch

    def _decode_batch(self) -> ScheduleBatch:
        """The running batch, or (while an adapter is paused in place) a batch of its other
        requests: the paused ones keep their place and KV but decode nothing."""
        reqs = unpaused(self.running_batch.reqs, self.lora_ctl.no_decode())
        return self.running_batch if reqs is self.running_batch.reqs else self._new_batch(reqs)

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.kv, self.model_config.vocab_size, self.server_args.device)

    # ---- results ----------------------------------------------------------------------------
    def process_extend_result(self, batch: ScheduleBatch, result: Any) -> None:
        done = self.output.commit_extend(batch, result)
        self.finish([r for r in done if r.finished])
        for req in batch.reqs:  # finished ones cached theirs when released
            if not req.finished:
                self.kv.share_computed(req)
        self.output.stream_due(done)
        self.start_decoding([r for r in done if not r.finished])

    def process_decode_result(self, reqs: list[Req], result: Any) -> None:
        """Commit a decode step of ``reqs`` (its rows). Requests finished since it was launched
        (by the step before, in overlap mode) are skipped; those it finishes while the next
        step is in flight give back the slot that step fills for them too."""
        committed = self.output.commit_decode(reqs, result)
        ended = [r for r in committed if r.finished]
        if self.in_flight is not None and self.in_flight.reqs is reqs:
            for req in ended:
                req.kv_len += 1  # its last token's K/V, written by the step in flight
        self.finish(ended)
        self.output.stream_due(committed)

    # ---- the lifecycle: the only methods that change Req.status -----------------------------
    def admit(self, reqs: list[Req]) -> None:
        """WAITING -> PREFILLING (more chunks to go) or RUNNING; they just got their pool row
        and KV slots in the extend batch being built, and leave the waiting queue."""
        gone = {id(r) for r in reqs}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in gone]
        for req in reqs:
            req.status = ReqStatus.PREFILLING if req.is_chunked else ReqStatus.RUNNING

    def start_decoding(self, reqs: list[Req]) -> None:
        """PREFILLING / RUNNING -> RUNNING in the running batch: their prefill is complete."""
        for req in reqs:
            req.status = ReqStatus.RUNNING
        self.running_batch.merge(self._new_batch(reqs))

    def retract(self, req: Req) -> None:
        """PREFILLING / RUNNING / PAUSED -> WAITING: release its KV and pool row (computed KV
        goes to the prefix cache). The caller removes it from its batch and queues it; its
        output so far is kept and re-prefilled on re-admission."""
        self.kv.release(req)
        req.on_retract()
        req.status = ReqStatus.WAITING

    def finish(self, reqs: list[Req], reason: dict[str, Any] | None = None) -> None:
        """Any state -> FINISHED, for every end: stop, length, abort, rejection, KV too small,
        scheduler-side errors. ``reason`` (when given) overrides a request's own, unless it
        already finished by itself. Releases what each holds, removes it from the queue or
        batch it is in, and sends its final output."""
        if not reqs:
            return
        for req in reqs:
            if reason is not None and not req.finished:
                req.finished_reason = dict(reason)
            if req.return_routed_experts:  # read before the slots are released
                # Positions [start, seqlen - 1): the tokens fed to the model (a prompt-only
                # request's last prompt token fed a sample that was dropped).
                end = req.prompt_len + len(req.output_ids) - 1
                slots = self.kv.computed_slots(req)[req.routed_experts_start_len : end]
                req.routed_experts = self.runner.routed_experts(slots)
            self.kv.release(req)
            req.status = ReqStatus.FINISHED
        gone = {id(r) for r in reqs}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in gone]
        if self.chunked_req is not None and id(self.chunked_req) in gone:
            self.chunked_req = None
        self.running_batch.filter([r for r in self.running_batch.reqs if id(r) not in gone])
        self.output.stream(reqs)

    def pause_in_place(self) -> None:
        """RUNNING / PREFILLING -> PAUSED for every KV holder (they keep their KV)."""
        for req in self.kv_holders():
            req.status = ReqStatus.PAUSED

    def unpause(self) -> None:
        """PAUSED -> RUNNING (PREFILLING for the chunked request); requests of an adapter
        paused by name stay PAUSED."""
        for req in self.running_batch.reqs:
            paused = req.lora_name in self.lora_ctl.paused
            req.status = ReqStatus.PAUSED if paused else ReqStatus.RUNNING
        if self.chunked_req is not None:
            self.chunked_req.status = ReqStatus.PREFILLING

    def retract_where(self, pred: Callable[[Req], bool], running: bool = True) -> int:
        """Move the chunked request, and (``running``) the running requests, that ``pred``
        selects back to the front of the waiting queue, in order, releasing their KV."""
        chunked = self.chunked_req
        retracted = [r for r in self.running_batch.reqs if pred(r)] if running else []
        gone = {id(r) for r in retracted}
        self.running_batch.filter([r for r in self.running_batch.reqs if id(r) not in gone])
        if chunked is not None and pred(chunked):
            retracted.append(chunked)
            self.chunked_req = None
        for req in retracted:
            self.retract(req)
        self.waiting_queue = retracted + self.waiting_queue
        return len(retracted)

    def set_paused(self, pred: Callable[[Req], bool], paused: bool) -> None:
        """RUNNING <-> PAUSED for the running requests ``pred`` selects (an adapter paused in
        place; they keep their KV). Requests stay PAUSED while the engine itself is paused."""
        status = ReqStatus.PAUSED if paused or self.pause.paused else ReqStatus.RUNNING
        for req in self.running_batch.reqs:
            if pred(req):
                req.status = status

    def retract_all(self) -> int:
        """Move the running batch and the chunked request back to the waiting queue, in order."""
        return self.retract_where(lambda req: True)

    def _invalidate_cache(self) -> None:
        self.tree_cache.invalidate()

    def kv_holders(self) -> list[Req]:
        """Requests holding KV: the running batch (paused in place included), the chunked one."""
        chunked = [] if self.chunked_req is None else [self.chunked_req]
        return self.running_batch.reqs + chunked

    def num_kv_holders(self) -> int:
        return len(self.running_batch) + (self.chunked_req is not None)

    def num_draining(self) -> int:
        """KV holders a ``wait`` pause waits for: not those of an adapter paused in place
        (they would never finish)."""
        blocked = self.lora_ctl.no_decode()
        if not blocked:
            return self.num_kv_holders()
        return len(unpaused(self.kv_holders(), blocked))

    def num_alive(self) -> int:
        return self.num_kv_holders() + len(self.waiting_queue)

    def _num_private_tokens(self) -> int:
        ahead = set() if self.in_flight is None else {id(r) for r in self.in_flight.reqs}
        return sum(self.kv.num_private_slots(r, id(r) in ahead) for r in self.kv_holders())

    # ---- request handlers -------------------------------------------------------------------
    def _admit_request_isolated(self, recv: TokenizedGenerateReqInput) -> None:
        """A failure while taking one request in finishes that request, not the scheduler."""
        try:
            self.handle_generate_request(recv)
        except Exception as e:
            logger.error("Rejected request %r:\n%s", recv.rid, traceback.format_exc())
            req = next((r for r in self.waiting_queue if r.rid == recv.rid), None)
            if req is None:  # its own parameters may be what failed: answer with defaults
                req = Req(recv.rid, [], SamplingParams(), 0, set())
            self.finish([req], {"type": "abort", "message": f"Invalid request: {e}"})

    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = make_req(recv, self.model_config, self.server_args.random_seed)
        reason = refusal(req, self.max_req_input_len, self.max_total_num_tokens)
        spec = grammar_spec(req.sampling_params)
        if reason is None and spec is not None:
            reason = self._attach_grammar(req, spec)
        name = req.lora_name
        if name is not None and not self.lora_ctl.is_loaded(name):
            reason = f"LoRA adapter {name!r} is not loaded"
        if reason is not None:
            self.finish([req], {"type": "abort", "message": reason})
            return
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.waiting_queue) >= limit:
            # As upstream: the frontend answers 503 (retry later), not a failed request.
            self.finish([req], {"type": "abort", "message": QUEUE_FULL_MESSAGE,
                                "status_code": 503})
            return
        self.waiting_queue.append(req)

    def _attach_grammar(self, req: Req, spec: GrammarSpec) -> str | None:
        """Give ``req`` a matcher for its grammar; why it cannot have one (None: it has)."""
        if self.grammar_backend is None:
            return "Constrained decoding is off (--grammar-backend none)"
        # The stop tokens end the output once the grammar is complete; with ignore_eos (no
        # stop token of its own) the model's EOS still does.
        stops = sorted(req.eos_token_ids or self.model_config.eos_token_ids)
        try:
            req.grammar = self.grammar_backend.matcher(spec, stops)
        except InvalidGrammarError as e:
            return str(e)
        return None

    def handle_abort(self, recv: AbortReq) -> AbortReqOutput:
        """Abort by exact rid, rid prefix (when asked) or all; each gets its final output now."""
        if recv.lora_name is not None:
            name = recv.lora_name
            num = self.abort_where(lambda r: r.lora_name == name, recv.aborted_message or "")
            return AbortReqOutput(req_id=recv.req_id, num_aborted=num)
        if recv.abort_all:
            matches: Callable[[str], bool] = lambda rid: True
        elif recv.match_prefix:
            matches = lambda rid: rid.startswith(recv.rid)
        else:
            matches = lambda rid: rid == recv.rid
        num = self.abort_matching(matches, recv.aborted_message or "Request aborted")
        return AbortReqOutput(req_id=recv.req_id, num_aborted=num)

    def abort_matching(self, matches: Callable[[str], bool], message: str) -> int:
        """Finish every matching request (waiting, chunked or running) with type "abort"."""
        return self.abort_where(lambda r: matches(r.rid), message)

    def abort_where(self, pred: Callable[[Req], bool], message: str) -> int:
        """Finish every request (waiting, chunked or running) ``pred`` selects, as aborted."""
        everyone = self.waiting_queue + self.kv_holders()
        aborted = [r for r in everyone if pred(r)]
        self.finish(aborted, {"type": "abort", "message": message or "Request aborted"})
        return len(aborted)

    def handle_flush_cache(self, recv: FlushCacheReqInput) -> FlushCacheReqOutput:
        out = self.flush_cache()
        out.req_id = recv.req_id
        return out

    def flush_cache(self) -> FlushCacheReqOutput:
        """Reset every KV structure. Refused while a request holds KV (running, chunked);
        waiting requests (new, or retracted by a pause) hold none and stay queued. The
        invariants are checked first: a leak must show here, not vanish in the reset."""
        holders = self.num_kv_holders()
        if holders:
            return FlushCacheReqOutput(
                success=False,
                error_msg=f"{holders} request(s) hold KV cache (running or paused in place)",
            )
        self.check_invariants()
        flushed = self.tree_cache.total_size()
        self.tree_cache.reset()
        self.kv.req_to_token_pool.clear()
        self.kv.allocator.clear()
        self.forward_ct_decode = 0
        self.new_token_ratio = self.init_new_token_ratio
        self.cur_batch = self.last_batch = None
        return FlushCacheReqOutput(success=True, flushed_items=flushed)

    # ---- pause / continue (the PauseState machine) ------------------------------------------
    def handle_pause(self, recv: PauseGenerationReqInput) -> PauseGenerationReqOutput | None:
        """Pause per DESIGN §5. A ``wait`` pause is answered later, once drained."""
        if recv.lora_name is not None:
            return self.lora_ctl.pause(recv)
        try:
            mode, flush = resolve_pause_mode(recv.mode, recv.clear_cache)
            if recv.timeout_s is not None and not recv.timeout_s > 0:
                raise PauseModeError(f"timeout_s must be > 0, got {recv.timeout_s}")
        except PauseModeError as e:
            return PauseGenerationReqOutput(success=False, message=str(e), req_id=recv.req_id)
        if self.pause.pending is not None:
            self.reply(self.end_drain(retract=False))  # a newer pause supersedes a drain
        self.pause.start(recv, mode, flush)
        self.reply(PauseStateOutput(paused=True, mode=mode))
        if mode == "wait":
            return self.end_drain(retract=False) if not self.num_draining() else None
        return self.apply_pause(recv.req_id, mode, flush)

    def apply_pause(self, req_id: str, mode: str, flush: bool) -> PauseGenerationReqOutput:
        num_aborted = num_retracted = 0
        if mode == "abort":
            num_aborted = self.abort_matching(lambda rid: True, "Aborted by pause_generation")
        elif mode == "retract":
            num_retracted = self.retract_all()
        self.pause_in_place()
        flushed = flush and self.flush_cache().success
        return PauseGenerationReqOutput(
            success=True,
            message="Generation paused successfully.",
            mode=mode,
            num_running=len(self.running_batch),
            num_retracted=num_retracted,
            num_aborted=num_aborted,
            num_waiting=len(self.waiting_queue),
            flushed=flushed,
            req_id=req_id,
        )

    def end_drain(self, retract: bool) -> PauseGenerationReqOutput:
        """End the drain of a ``wait`` pause (retracting stragglers when it timed out)."""
        recv = self.pause.end_drain()
        return self.apply_pause(recv.req_id, "retract" if retract else "wait", self.pause.flush)

    def check_pause(self) -> None:
        """Each loop turn: end a finished or timed-out drain; honour an expired lease."""
        if self.pause.pending is not None:
            if not self.num_draining() or self.pause.drain_expired():
                self.reply(self.end_drain(retract=self.num_draining() > 0))
        elif self.pause.lease_expired():
            logger.warning("Pause lease expired after the trainer's timeout; continuing")
            self.resume_generation()

    def resume_generation(self) -> None:
        self.pause.resume()
        self.unpause()
        self.reply(PauseStateOutput(paused=False))

    def handle_continue(self, recv: ContinueGenerationReqInput) -> ContinueGenerationReqOutput:
        if recv.lora_name is not None:
            return self.lora_ctl.cont(recv)
        was_paused = self.pause.paused
        if self.pause.pending is not None:
            self.reply(self.end_drain(retract=False))
        self.resume_generation()
        return ContinueGenerationReqOutput(success=True, was_paused=was_paused, req_id=recv.req_id)

    # ---- introspection ----------------------------------------------------------------------
    def handle_get_internal_state(self, recv: GetInternalStateReq) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(internal_state=self.internal_state(), req_id=recv.req_id)

    def internal_state(self) -> dict[str, Any]:
        pool = self.kv.req_to_token_pool
        return {
            "engine_paused": self.pause.paused,
            "pause_phase": self.pause.phase.value,
            "pause_mode": self.pause.mode,
            "paused_since": self.pause.since,
            "waiting_queue_size": len(self.waiting_queue),
            "running_batch_size": len(self.running_batch),
            "running_batch_rids": [r.rid for r in self.running_batch.reqs],
            "waiting_queue_rids": [r.rid for r in self.waiting_queue],
            "cur_batch_is_none": self.cur_batch is None,
            "last_batch_is_none": self.last_batch is None,
            "chunked_req_is_none": self.chunked_req is None,
            "tree_cache_size": self.tree_cache.total_size(),
            "req_to_token_pool_used": pool.size - pool.available_size(),
            "available_kv_tokens": self.kv.available_tokens(),
            "free_kv_tokens": self.kv.allocator.available_size(),
            "private_kv_tokens": self._num_private_tokens(),
            "max_total_num_tokens": self.max_total_num_tokens,
            "forward_ct_decode": self.forward_ct_decode,
            "num_loop_turns": self.num_loop_turns,
            "new_token_ratio": self.new_token_ratio,
            "init_new_token_ratio": self.init_new_token_ratio,
            "weight_version": self.weights.version,
            "memory_released_tags": sorted(self.memory.released),
            "max_running_requests": self.max_running_requests,
            "tp_size": self.server_args.tp_size,
            "cuda_graph": self.runner.cuda_graph_state(),
            "overlap_schedule": self.overlap,
            "num_steps_ahead": self.num_steps_ahead,
            **self.lora_ctl.internal_state(),
        }
