"""The scheduler process shell: sockets, signals and the event loop around the Scheduler core.

The loop body is the whole algorithm at a glance: receive, dispatch, run one step. Everything
it calls lives in the core (scheduler.py), which knows nothing of ZMQ.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq
from tqdm import tqdm

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.hf_transformers_utils import get_tokenizer
from sglang.srt.managers.data_parallel_controller import OUTPUT as DP_OUTPUT
from sglang.srt.managers.data_parallel_controller import REPLY as DP_REPLY
from sglang.srt.managers.data_parallel_controller import (
    configure_dp_rank,
    dp_output_ipc_name,
    dp_rank_input_ipc_name,
)
from sglang.srt.managers.io_struct import (
    BatchTokenIDOutput,
    SchedulerErrorOutput,
    SchedulerReply,
)
from sglang.srt.managers.req_kv import ReqKV
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.weight_state import WeightState
from sglang.srt.mem_cache import create_prefix_cache
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils import configure_logger, dumps, get_zmq_socket, loads

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 50


def build_scheduler(
    server_args: ServerArgs,
    send_output: Callable[[BatchTokenIDOutput], None],
    send_reply: Callable[[Any], None],
) -> Scheduler:
    """Load the model and wire a Scheduler core to it (no sockets involved)."""
    model_config = ModelConfig(
        server_args.model_path,
        context_length=server_args.context_length,
        dtype=server_args.dtype,
        trust_remote_code=server_args.trust_remote_code,
        device=server_args.device,
        load_format=server_args.load_format,
    )
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        tokenizer = get_tokenizer(
            server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code
        )
    worker = TpModelWorker(server_args, model_config)
    runner = worker.model_runner
    tree_cache = create_prefix_cache(
        server_args.disable_radix_cache, runner.allocator, server_args.page_size
    )
    kv = ReqKV(
        runner.req_to_token_pool,
        runner.allocator,
        tree_cache,
        server_args.page_size,
        WeightState(version=server_args.weight_version),
    )
    return Scheduler(
        server_args,
        model_config,
        worker,
        runner,
        kv,
        runner.max_running_requests,
        tokenizer,
        send_output,
        send_reply,
    )


def _dp_senders(
    sock: zmq.Socket, dp_rank: int
) -> tuple[Callable[[BatchTokenIDOutput], None], Callable[[Any], None]]:
    """Output and reply sinks of DP rank ``dp_rank``: both go to the controller on ONE socket,
    so a reply never overtakes the outputs sent before it. Outputs carry their finished rids
    (the controller forgets where those ran without unpickling the output)."""
    rank = str(dp_rank).encode()

    def send_output(msg: BatchTokenIDOutput) -> None:
        finished = [rid for rid, r in zip(msg.rids, msg.finished_reasons) if r is not None]
        sock.send_multipart([rank, DP_OUTPUT, dumps(msg), dumps(finished)])

    def send_reply(msg: Any) -> None:
        sock.send_multipart([rank, DP_REPLY, dumps(msg)])

    return send_output, send_reply


class SchedulerProcess:
    """Owns the sockets; feeds the core and forwards what it sends."""

    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, dp_rank: int | None = None
    ) -> None:
        context = zmq.Context(2)
        self.send_to_tokenizer = get_zmq_socket(
            context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False
        )
        if dp_rank is not None:  # a data-parallel rank talks to the DP controller
            self.recv_sock = get_zmq_socket(
                context, zmq.PULL, dp_rank_input_ipc_name(port_args, dp_rank), bind=True
            )
            to_controller = get_zmq_socket(
                context, zmq.PUSH, dp_output_ipc_name(port_args), bind=False
            )
            send_output, send_reply = _dp_senders(to_controller, dp_rank)
            self.scheduler = build_scheduler(server_args, send_output, send_reply)
            return
        self.recv_sock = get_zmq_socket(
            context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True
        )
        send_to_detokenizer = get_zmq_socket(
            context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False
        )
        # Replies take the outputs' route (see SchedulerReply) so they never overtake them.
        self.scheduler = build_scheduler(
            server_args,
            lambda msg: send_to_detokenizer.send(dumps(msg)),
            lambda msg: send_to_detokenizer.send(dumps(SchedulerReply(msg))),
        )

    def ready_info(self) -> dict[str, Any]:
        core = self.scheduler
        return {
            "status": "ready",
            "max_total_num_tokens": core.max_total_num_tokens,
            "max_req_input_len": core.max_req_input_len,
            "context_length": core.model_config.context_len,
            "vocab_size": core.model_config.vocab_size,
            "max_running_requests": core.max_running_requests,
        }

    def event_loop(self) -> None:
        while True:
            self.scheduler.process_input_requests(self.recv_requests())
            self.scheduler.run_step()

    def recv_requests(self) -> list[Any]:
        """Everything queued on the socket; blocks briefly only when there is nothing to run."""
        busy = self.scheduler.has_runnable_work()
        msgs = []
        if self.recv_sock.poll(0 if busy else _IDLE_POLL_MS):
            while True:
                try:
                    msgs.append(loads(self.recv_sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return msgs


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    pipe_writer: Connection,
    dp_rank: int | None = None,
) -> None:
    """Entry point of the scheduler subprocess: report ready (or the error), then loop.
    ``dp_rank``: this process is that data-parallel rank, behind the DP controller."""
    prefix = " Scheduler" if dp_rank is None else f" Scheduler DP{dp_rank}"
    configure_logger(server_args.log_level, prefix=prefix)
    faulthandler.register(signal.SIGUSR1)
    # tqdm's default lock is a multiprocessing semaphore, which this process cannot release when
    # it is killed at shutdown (the resource tracker then warns about a leak): use a thread lock.
    tqdm.set_lock(threading.RLock())
    try:
        if dp_rank is not None:
            configure_dp_rank(server_args, dp_rank)  # threads, memory, device: before loading
        process = SchedulerProcess(server_args, port_args, dp_rank)
    except Exception as e:  # any failure at start-up is reported to the launcher verbatim
        logger.error("Scheduler failed to start:\n%s", traceback.format_exc())
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    pipe_writer.send(process.ready_info())
    try:
        process.event_loop()
    except Exception as e:
        logger.error("Scheduler crashed:\n%s", traceback.format_exc())
        where = "" if dp_rank is None else f"DP rank {dp_rank}: "
        process.send_to_tokenizer.send(
            dumps(SchedulerErrorOutput(f"{where}{type(e).__name__}: {e}"))
        )
        raise
