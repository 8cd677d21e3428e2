"""The Scheduler process: an event loop that owns the waiting queue and the running batch.

The loop body (``event_loop``) is the whole algorithm at a glance: receive, dispatch, pick the
next batch, run it, process its result. Admission lives in schedule_policy, per-request KV moves
in req_kv, result processing and output streaming in scheduler_output.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.hf_transformers_utils import get_tokenizer
from sglang.srt.layers.sampler import derive_seed
from sglang.srt.managers.io_struct import (
    AbortReq,
    AbortReqOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerErrorOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.req_kv import ReqKV
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import (
    PrefillAdder,
    reserved_decode_tokens,
    sort_waiting_queue,
)
from sglang.srt.managers.scheduler_output import OutputProcessor
from sglang.srt.managers.tp_worker import TpModelWorker
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
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.forward_ct_decode = 0
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
        self.dispatch = TypeBasedDispatcher(
            [
                (TokenizedGenerateReqInput, self.handle_generate_request),
                (AbortReq, self.handle_abort),
                (FlushCacheReqInput, self.handle_flush_cache),
                (GetInternalStateReq, self.handle_get_internal_state),
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
            for msg in self.recv_requests():
                reply = self.dispatch(msg)
                if reply is not None:
                    self.send_to_tokenizer.send(dumps(reply))
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

    def recv_requests(self) -> list[Any]:
        """Everything queued on the socket; blocks briefly only when there is nothing to run."""
        busy = self.waiting_queue or not self.running_batch.is_empty() or self.chunked_req
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
        if self.server_args.log_level == "debug":
            self.tree_cache.check_integrity()

    # ---- batch selection --------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        if self.running_batch.is_empty():
            return None
        return self.update_running_batch()

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        """Admit waiting requests (and the chunked request's next chunk) into an extend batch."""
        num_running = len(self.running_batch)
        if self.chunked_req is None and (
            not self.waiting_queue or num_running >= self.max_running_requests
        ):
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
        for req in self.waiting_queue:
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
            stop_str_max_len=max((len(s.encode()) for s in sp.stop_strs), default=0),
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
        """Abort by exact rid (or all); each aborted request gets its final output now."""
        matches = (lambda rid: True) if recv.abort_all else (lambda rid: rid == recv.rid)
        message = recv.aborted_message or "Request aborted"
        aborted = [r for r in self.waiting_queue if matches(r.rid)]
        self.waiting_queue = [r for r in self.waiting_queue if not matches(r.rid)]
        if self.chunked_req is not None and matches(self.chunked_req.rid):
            aborted.append(self.chunked_req)
            self.chunked_req = None
        running = [r for r in self.running_batch.reqs if matches(r.rid)]
        self.running_batch.filter([r for r in self.running_batch.reqs if not matches(r.rid)])
        for req in aborted + running:
            self.kv.release(req)
            req.abort(message)
        self.output.finish(aborted + running)
        return AbortReqOutput(req_id=recv.req_id, num_aborted=len(aborted) + len(running))

    def handle_flush_cache(self, recv: FlushCacheReqInput) -> FlushCacheReqOutput:
        """Reset every KV structure; refused while any request holds or awaits KV."""
        busy = len(self.running_batch) + len(self.waiting_queue) + (self.chunked_req is not None)
        if busy:
            return FlushCacheReqOutput(
                success=False,
                req_id=recv.req_id,
                error_msg=f"{busy} request(s) are running or waiting; flush refused",
            )
        flushed = self.tree_cache.total_size()
        self.tree_cache.reset()
        self.kv.req_to_token_pool.clear()
        self.kv.allocator.clear()
        self.forward_ct_decode = 0
        self.new_token_ratio = self.init_new_token_ratio
        self.cur_batch = self.last_batch = None
        self.chunked_req = None
        return FlushCacheReqOutput(success=True, flushed_items=flushed, req_id=recv.req_id)

    def handle_get_internal_state(self, recv: GetInternalStateReq) -> GetInternalStateReqOutput:
        return GetInternalStateReqOutput(internal_state=self.internal_state(), req_id=recv.req_id)

    def internal_state(self) -> dict[str, Any]:
        pool = self.kv.req_to_token_pool
        return {
            "engine_paused": False,
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
            "new_token_ratio": self.new_token_ratio,
            "init_new_token_ratio": self.init_new_token_ratio,
            "weight_version": "default",
            "max_running_requests": self.max_running_requests,
        }


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, pipe_writer: Connection
) -> None:
    """Entry point of the scheduler subprocess: report ready (or the error), then loop."""
    configure_logger(server_args.log_level, prefix=" Scheduler")
    faulthandler.register(signal.SIGUSR1)
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
