"""The Scheduler process: an event loop that owns the waiting queue and the running batch.

The loop body (``event_loop``) is the whole algorithm at a glance: receive, dispatch, pick the
next batch, run it, process its result. Admission lives in schedule_policy, per-request KV moves
in req_kv, result processing and output streaming in scheduler_output.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq
from tqdm import tqdm

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.hf_transformers_utils import get_tokenizer
from sglang.srt.layers.sampler import derive_seed
from sglang.srt.managers.io_struct import (
    AbortReq,
    AbortReqOutput,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GetWeightsByNameReqInput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    SchedulerErrorOutput,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from sglang.srt.managers.memory_occupation import MemoryOccupation
from sglang.srt.managers.pause_state import PauseModeError, PauseState, resolve_pause_mode
from sglang.srt.managers.req_kv import ReqKV
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    PrefillAdder,
    reserved_decode_tokens,
    sort_waiting_queue,
)
from sglang.srt.managers.scheduler_output import OutputProcessor
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.weight_updater import WeightUpdater
from sglang.srt.mem_cache import create_prefix_cache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils import TypeBasedDispatcher, configure_logger, dumps, get_zmq_socket, loads

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 50
_MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
_NEW_TOKEN_RATIO_DECAY_STEPS = 600
_RETRACT_RATIO_BUMP = 0.1


class Scheduler:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        self.server_args = server_args
        self.model_config = ModelConfig(
            server_args.model_path,
            context_length=server_args.context_length,
            dtype=server_args.dtype,
            trust_remote_code=server_args.trust_remote_code,
            device=server_args.device,
            load_format=server_args.load_format,
        )
        self.tokenizer = None
        if not server_args.skip_tokenizer_init:
            self.tokenizer = get_tokenizer(
                server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code
            )
        self.tp_worker = TpModelWorker(server_args, self.model_config)
        runner = self.tp_worker.model_runner
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_running_requests = runner.max_running_requests
        self.max_req_input_len = min(self.model_config.context_len, self.max_total_num_tokens) - 1
        self.tree_cache = create_prefix_cache(
            server_args.disable_radix_cache, runner.allocator, server_args.page_size
        )
        self.kv = ReqKV(
            runner.req_to_token_pool, runner.allocator, self.tree_cache, server_args.page_size
        )

        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.pause: PauseState | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.forward_ct_decode = 0
        # Loop turns completed: tests wait for N more turns instead of sleeping.
        self.num_loop_turns = 0
        self.init_new_token_ratio = min(0.7 * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = self.init_new_token_ratio * _MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio = self.init_new_token_ratio

        context = zmq.Context(2)
        self.recv_sock = get_zmq_socket(
            context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True
        )
        self.send_to_tokenizer = get_zmq_socket(
            context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False
        )
        send_to_detokenizer = get_zmq_socket(
            context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False
        )
        self.output = OutputProcessor(
            self.kv,
            self.tokenizer,
            lambda msg: send_to_detokenizer.send(dumps(msg)),
            server_args.stream_interval,
        )
        self.weights = WeightUpdater(self)
        self.memory = MemoryOccupation(self)
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
            ]
        )

    def ready_info(self) -> dict[str, Any]:
        return {
            "status": "ready",
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "context_length": self.model_config.context_len,
            "vocab_size": self.model_config.vocab_size,
            "max_running_requests": self.max_running_requests,
        }

    # ---- the loop ---------------------------------------------------------------------------
    def event_loop(self) -> None:
        while True:
            self.num_loop_turns += 1
            for msg in self.recv_requests():
                self.reply(self.dispatch(msg))
            self.check_pause()
            batch = self.get_next_batch_to_run()
            self.cur_batch = batch
            if batch is None:
                self.on_idle()
                continue
            result = self.tp_worker.forward_batch_generation(
                batch.forward_batch,
                batch.sampling_info,
                batch.return_logprob,
                batch.top_logprobs_nums,
            )
            if batch.forward_mode == ForwardMode.EXTEND:
                self.process_extend_result(batch, result)
            else:
                self.process_decode_result(batch, result)
            self.last_batch = batch

    def reply(self, msg: Any) -> None:
        if msg is not None:
            self.send_to_tokenizer.send(dumps(msg))

    def recv_requests(self) -> list[Any]:
        """Everything queued on the socket; blocks briefly only when there is nothing to run."""
        busy = self.has_runnable_work()
        msgs = []
        if self.recv_sock.poll(0 if busy else _IDLE_POLL_MS):
            while True:
                try:
                    msgs.append(loads(self.recv_sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return msgs

    def on_idle(self) -> None:
        self.new_token_ratio = self.init_new_token_ratio
        # Requests paused in place hold private KV that the check cannot count: skip then.
        if self.server_args.log_level == "debug" and not self.has_kv_holders():
            self.tree_cache.check_integrity()

    # ---- batch selection --------------------------------------------------------------------
    def has_runnable_work(self) -> bool:
        if (self.pause is not None and not self.pause.draining) or self.memory.blocks_forward():
            return False
        return bool(self.waiting_queue or self.chunked_req or not self.running_batch.is_empty())

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """Prefill first (unless paused or draining), else decode; None when idle, paused or
        while memory is released."""
        if (self.pause is not None and not self.pause.draining) or self.memory.blocks_forward():
            return None
        if self.pause is None or self.chunked_req is not None:
            batch = self.get_new_batch_prefill(admit_new=self.pause is None)
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
        chunk = self.server_args.chunked_prefill_size
        adder = PrefillAdder(
            kv=self.kv,
            rem_total_tokens=self.kv.available_tokens()
            - reserved_decode_tokens(self.running_batch.reqs, self.new_token_ratio),
            rem_input_tokens=self.server_args.max_prefill_tokens,
            rem_chunk_tokens=None if chunk == -1 else chunk,
            new_token_ratio=self.new_token_ratio,
            page_size=self.server_args.page_size,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
            num_running += 1
        admitted = 0
        for req in waiting:
            if num_running + admitted >= self.max_running_requests:
                break
            if not adder.add_one_req(req):
                break
            admitted += 1
        if not adder.can_run:
            return None
        new_reqs = adder.can_run[len(adder.can_run) - admitted :]
        self.waiting_queue = self.waiting_queue[admitted:]
        batch = self._new_batch(adder.can_run)
        batch.forward_batch = batch.prepare_for_extend()
        if batch.forward_batch is None:
            logger.warning("KV pool exhausted while admitting a prefill; retrying later")
            for req in new_reqs:
                self.kv.unlock_unadmitted(req)
            self.waiting_queue = new_reqs + self.waiting_queue
            return None
        self.chunked_req = adder.new_chunked_req
        return batch

    def update_running_batch(self) -> ScheduleBatch | None:
        """Prepare a decode step, retracting requests when the KV pool cannot hold it."""
        batch = self.running_batch
        needed = batch.decode_tokens_needed()
        if not self.kv.ensure_free(needed) and len(batch) > 1:
            retracted = batch.retract_decode(needed)
            logger.warning("KV cache full: retracted %d request(s)", len(retracted))
            self.waiting_queue = retracted + self.waiting_queue
            self.new_token_ratio = min(1.0, self.new_token_ratio + _RETRACT_RATIO_BUMP)
        batch.forward_batch = batch.prepare_for_decode()
        if batch.forward_batch is None:
            # A single request longer than the whole pool can never finish.
            req = batch.reqs[0]
            req.abort("The KV cache is too small for this request")
            self.output.finish([req])
            batch.filter([])
            return None
        self.forward_ct_decode += 1
        self.new_token_ratio = max(
            self.min_new_token_ratio,
            self.new_token_ratio
            - (self.init_new_token_ratio - self.min_new_token_ratio) / _NEW_TOKEN_RATIO_DECAY_STEPS,
        )
        return batch

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.kv, self.model_config.vocab_size, self.server_args.device)

    # ---- results ----------------------------------------------------------------------------
    def process_extend_result(self, batch: ScheduleBatch, result: Any) -> None:
        done = self.output.commit_extend(batch, result)
        self.running_batch.merge(self._new_batch([r for r in done if not r.finished]))

    def process_decode_result(self, batch: ScheduleBatch, result: Any) -> None:
        self.output.commit_decode(batch, result)
        batch.filter([r for r in batch.reqs if not r.finished])

    # ---- request handlers -------------------------------------------------------------------
    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        sp = recv.sampling_params
        eos = set(sp.stop_token_ids or [])
        if not sp.ignore_eos:
            eos |= self.model_config.eos_token_ids
        req = Req(
            rid=recv.rid,
            origin_input_ids=list(recv.input_ids),
            sampling_params=sp,
            sampling_seed=sp.sampling_seed
            if sp.sampling_seed is not None
            else derive_seed(self.server_args.random_seed, recv.rid),
            eos_token_ids=eos,
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            stream=recv.stream,
            return_entropy=recv.return_entropy,
            entropy_mode=recv.entropy_mode,
            entropy_top_k=recv.entropy_top_k,
        )
        if not recv.input_ids:
            req.abort("The prompt is empty")
        elif len(recv.input_ids) > self.max_req_input_len:
            req.abort(
                f"The prompt has {len(recv.input_ids)} tokens; at most "
                f"{self.max_req_input_len} fit in the context or KV pool"
            )
        if req.finished:
            self.output.finish([req])
            return
        self.waiting_queue.append(req)

    def handle_abort(self, recv: AbortReq) -> AbortReqOutput:
        """Abort by exact rid, rid prefix (when asked) or all; each gets its final output now."""
        if recv.abort_all:
            matches = lambda rid: True
        elif recv.match_prefix:
            matches = lambda rid: rid.startswith(recv.rid)
        else:
            matches = lambda rid: rid == recv.rid
        num = self.abort_matching(matches, recv.aborted_message or "Request aborted")
        return AbortReqOutput(req_id=recv.req_id, num_aborted=num)

    def abort_matching(self, matches: Any, message: str) -> int:
        """Finish every matching request (waiting, chunked or running) with type "abort"."""
        aborted = [r for r in self.waiting_queue if matches(r.rid)]
        self.waiting_queue = [r for r in self.waiting_queue if not matches(r.rid)]
        if self.chunked_req is not None and matches(self.chunked_req.rid):
            aborted.append(self.chunked_req)
            self.chunked_req = None
        aborted += [r for r in self.running_batch.reqs if matches(r.rid)]
        self.running_batch.filter([r for r in self.running_batch.reqs if not matches(r.rid)])
        for req in aborted:
            self.kv.release(req)
            req.abort(message)
        self.output.finish(aborted)
        return len(aborted)

    def handle_flush_cache(self, recv: FlushCacheReqInput) -> FlushCacheReqOutput:
        out = self.flush_cache()
        out.req_id = recv.req_id
        return out

    def flush_cache(self) -> FlushCacheReqOutput:
        """Reset every KV structure. Refused while a request holds KV (running, chunked);
        waiting requests (new, or retracted by a pause) hold none and stay queued."""
        holders = self.num_kv_holders()
        if holders:
            return FlushCacheReqOutput(
                success=False,
                error_msg=f"{holders} request(s) hold KV cache (running or paused in place)",
            )
        flushed = self.tree_cache.total_size()
        self.tree_cache.reset()
        self.kv.req_to_token_pool.clear()
        self.kv.allocator.clear()
        self.forward_ct_decode = 0
        self.new_token_ratio = self.init_new_token_ratio
        self.cur_batch = self.last_batch = None
        return FlushCacheReqOutput(success=True, flushed_items=flushed)

    # ---- pause / continue -------------------------------------------------------------------
    def handle_pause(self, recv: PauseGenerationReqInput) -> PauseGenerationReqOutput | None:
        """Pause per DESIGN §5. A ``wait`` pause is answered later, once drained."""
        try:
            mode, flush = resolve_pause_mode(recv.mode, recv.clear_cache)
            if recv.timeout_s is not None and not recv.timeout_s > 0:
                raise PauseModeError(f"timeout_s must be > 0, got {recv.timeout_s}")
        except PauseModeError as e:
            return PauseGenerationReqOutput(success=False, message=str(e), req_id=recv.req_id)
        if self.pause is not None and self.pause.pending is not None:
            self.reply(self.finish_pause(retract=False))  # a newer pause supersedes a drain
        self.pause = PauseState.create(recv, mode, flush)
        if mode == "wait":
            return self.finish_pause(retract=False) if not self.has_kv_holders() else None
        return self.apply_pause(recv, mode, flush)

    def apply_pause(
        self, recv: PauseGenerationReqInput, mode: str, flush: bool
    ) -> PauseGenerationReqOutput:
        num_aborted = num_retracted = 0
        if mode == "abort":
            num_aborted = self.abort_matching(lambda rid: True, "Aborted by pause_generation")
        elif mode == "retract":
            num_retracted = self.retract_all()
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
            req_id=recv.req_id,
        )

    def retract_all(self) -> int:
        """Move the running batch and the chunked request back to the waiting queue, in order."""
        retracted = self.running_batch.retract_all()
        if self.chunked_req is not None:
            self.kv.release(self.chunked_req)
            self.chunked_req.on_retract()
            retracted.append(self.chunked_req)
            self.chunked_req = None
        self.waiting_queue = retracted + self.waiting_queue
        return len(retracted)

    def finish_pause(self, retract: bool) -> PauseGenerationReqOutput:
        """End the drain of a ``wait`` pause (retracting stragglers when it timed out)."""
        recv, self.pause.pending = self.pause.pending, None
        return self.apply_pause(recv, "retract" if retract else "wait", self.pause.flush)

    def check_pause(self) -> None:
        """Each loop turn: end a finished or timed-out drain; honour an expired lease."""
        if self.pause is None:
            return
        if self.pause.draining:
            if not self.has_kv_holders() or self.pause.drain_expired():
                self.reply(self.finish_pause(retract=self.has_kv_holders()))
        elif self.pause.lease_expired():
            logger.warning("Pause lease expired after the trainer's timeout; continuing")
            self.pause = None

    def num_kv_holders(self) -> int:
        """Requests holding KV: running (paused in place included) and the chunked one."""
        return len(self.running_batch) + (self.chunked_req is not None)

    def has_kv_holders(self) -> bool:
        return self.num_kv_holders() > 0

    def handle_continue(self, recv: ContinueGenerationReqInput) -> ContinueGenerationReqOutput:
        was_paused = self.pause is not None
        if was_paused and self.pause.draining:
            self.reply(self.finish_pause(retract=False))
        self.pause = None
        return ContinueGenerationReqOutput(success=True, was_paused=was_paused, req_id=recv.req_id)

    def handle_get_internal_state(self, recv: GetInternalStateReq) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(internal_state=self.internal_state(), req_id=recv.req_id)

    def internal_state(self) -> dict[str, Any]:
        pool = self.kv.req_to_token_pool
        return {
            "engine_paused": self.pause is not None,
            "pause_mode": None if self.pause is None else self.pause.mode,
            "paused_since": None if self.pause is None else self.pause.since,
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
            "max_total_num_tokens": self.max_total_num_tokens,
            "forward_ct_decode": self.forward_ct_decode,
            "num_loop_turns": self.num_loop_turns,
            "new_token_ratio": self.new_token_ratio,
            "init_new_token_ratio": self.init_new_token_ratio,
            "weight_version": self.weights.version,
            "memory_released_tags": sorted(self.memory.released),
            "max_running_requests": self.max_running_requests,
        }


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, pipe_writer: Connection
) -> None:
    """Entry point of the scheduler subprocess: report ready (or the error), then loop."""
    configure_logger(server_args.log_level, prefix=" Scheduler")
    faulthandler.register(signal.SIGUSR1)
    # tqdm's default lock is a multiprocessing semaphore, which this process cannot release when
    # it is killed at shutdown (the resource tracker then warns about a leak): use a thread lock.
    tqdm.set_lock(threading.RLock())
    try:
        scheduler = Scheduler(server_args, port_args)
    except Exception as e:  # any failure at start-up is reported to the launcher verbatim
        logger.error("Scheduler failed to start:\n%s", traceback.format_exc())
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    pipe_writer.send(scheduler.ready_info())
    try:
        scheduler.event_loop()
    except Exception as e:
        logger.error("Scheduler crashed:\n%s", traceback.format_exc())
        scheduler.send_to_tokenizer.send(dumps(SchedulerErrorOutput(f"{type(e).__name__}: {e}")))
        raise
