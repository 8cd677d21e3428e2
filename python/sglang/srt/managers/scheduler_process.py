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

import torch
import zmq
from tqdm import tqdm

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.distributed.parallel_state import get_tp_group, init_distributed_environment
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
from sglang.srt.managers.overlap import overlap_off_reason
from sglang.srt.managers.rank_weight_sync import RankWeightSync
from sglang.srt.managers.req_kv import ReqKV, decode_run_length
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_group_io import (
    TpReplies,
    TpTurnInputs,
    peer_start_failure,
    publish_start_failure,
    tp_collective,
)
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.weight_state import WeightState
from sglang.srt.mem_cache import create_prefix_cache
from sglang.srt.server_args import PortArgs, ServerArgs, rank_label
from sglang.srt.utils import configure_logger, dumps, get_zmq_socket, loads
from sglang.srt.utils.gc_freeze import freeze_startup_heap, set_gc_threshold

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 50
# How long a TP rank waits for its peers when --dist-timeout is not given.
DEFAULT_DIST_TIMEOUT_S = 600


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
        model_override_args=server_args.model_override_args(),
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
        decode_run=decode_run_length(
            server_args.device, server_args.page_size, runner.allocator.size
        ),
    )
    overlap_off = overlap_off_reason(server_args)
    if overlap_off is not None and torch.device(server_args.device).type == "cuda":
        logger.info("Overlap schedule off: %s", overlap_off)
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
        overlap=overlap_off is None,
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
    """Owns the sockets; feeds the core and forwards what it sends.

    With tensor parallelism (a group of more than one, see tp_group_io) only TP rank 0 has
    sockets: it receives each turn's messages and broadcasts them; every rank buffers its
    replies, which rank 0 gathers and sends merged at the end of the turn."""

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        dp_rank: int | None = None,
        tp_rank: int = 0,
    ) -> None:
        self.group = get_tp_group()
        self.send_to_tokenizer: zmq.Socket | None = None
        self.recv_sock: zmq.Socket | None = None
        send_output: Callable[[BatchTokenIDOutput], None] = _drop
        send_reply: Callable[[Any], None] = _drop
        if tp_rank == 0:
            send_output, send_reply = self._open_sockets(port_args, dp_rank)
        self.turns: TpTurnInputs | None = None
        self.replies: TpReplies | None = None
        if self.group.world_size > 1:
            self.turns = TpTurnInputs(self.group, self._recv_frames)
            self.replies = TpReplies(self.group, send_reply)
            send_reply = self.replies.add
        self.scheduler = build_scheduler(server_args, send_output, send_reply)
        if self.turns is not None:
            self.scheduler.pause.follow_leader_clock()
        if server_args.tp_size * server_args.dp_size > 1:
            # Every scheduler rank joins a trainer's weight-broadcast group itself (upstream's
            # layout); with a single rank the frontend joins for it.
            sync = RankWeightSync(
                self.scheduler.weights, (dp_rank or 0) * server_args.tp_size + tp_rank
            )
            for msg_type, handler in sync.handlers():
                self.scheduler.dispatch.register(msg_type, handler)

    def _open_sockets(
        self, port_args: PortArgs, dp_rank: int | None
    ) -> tuple[Callable[[BatchTokenIDOutput], None], Callable[[Any], None]]:
        """Bind the input socket and connect the output ones; returns the two sinks."""
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
            return _dp_senders(to_controller, dp_rank)
        self.recv_sock = get_zmq_socket(
            context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True
        )
        send_to_detokenizer = get_zmq_socket(
            context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False
        )
        # Replies take the outputs' route (see SchedulerReply) so they never overtake them.
        return (
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
            "model_type": getattr(core.model_config.hf_config, "model_type", None),
            "architectures": core.model_config.architectures,
        }

    def event_loop(self) -> None:
        while True:
            self.scheduler.process_input_requests(self.recv_requests())
            self.scheduler.run_step()
            if self.replies is not None:
                self.replies.flush()

    def recv_requests(self) -> list[Any]:
        """This turn's messages: what the socket holds (TP: rank 0's, broadcast)."""
        if self.turns is None:
            return [loads(frame) for frame in self._recv_frames()]
        msgs, deadline_due = self.turns.next_turn(self.scheduler.pause.deadline_due)
        if deadline_due:  # decided by rank 0's clock for the state every rank is in now
            self.scheduler.pause.expire()
        return msgs

    def _recv_frames(self) -> list[bytes]:
        """Everything queued on the socket; blocks briefly only when there is nothing to run."""
        assert self.recv_sock is not None, "only TP rank 0 reads the socket"
        busy = self.scheduler.has_runnable_work()
        frames: list[bytes] = []
        if self.recv_sock.poll(0 if busy else _IDLE_POLL_MS):
            while True:
                try:
                    frames.append(self.recv_sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return frames


def _drop(msg: Any) -> None:
    """The sink of TP ranks other than 0: rank 0 sends the group's outputs."""


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    pipe_writer: Connection,
    dp_rank: int | None = None,
    tp_rank: int = 0,
    dist_init_method: str | None = None,
) -> None:
    """Entry point of the scheduler subprocess: report ready (or the error), then loop.
    ``dp_rank``: this process is that data-parallel rank, behind the DP controller;
    ``tp_rank``: its rank in the replica's tensor-parallel group, which meets at
    ``dist_init_method`` (``tcp://host:port``) when ``tp_size > 1``."""
    label = rank_label(dp_rank, tp_rank, server_args.tp_size)
    configure_logger(server_args.log_level, prefix=f" Scheduler {label}".rstrip())
    faulthandler.register(signal.SIGUSR1)
    # tqdm's default lock is a multiprocessing semaphore, which this process cannot release when
    # it is killed at shutdown (the resource tracker then warns about a leak): use a thread lock.
    tqdm.set_lock(threading.RLock())
    try:
        if server_args.dp_size * server_args.tp_size > 1:
            configure_dp_rank(server_args, dp_rank or 0, tp_rank)  # before loading
        if server_args.tp_size > 1:
            assert dist_init_method is not None, "a TP rank needs the group's rendezvous"
            join_tp_group(server_args, tp_rank, dist_init_method)
        process = SchedulerProcess(server_args, port_args, dp_rank, tp_rank)
        # Every rank built its model: a peer that failed is noticed here, before "ready".
        tp_collective("start-up barrier", process.group.barrier)
    except Exception as e:  # any failure at start-up is reported to the launcher verbatim
        logger.error("Scheduler failed to start:\n%s", traceback.format_exc())
        message = f"{type(e).__name__}: {e}"
        if dist_init_method is not None and server_args.tp_size > 1:
            # A peer that failed first is the cause: name it (it may run on another node).
            cause = peer_start_failure(dist_init_method, server_args.tp_size, tp_rank)
            message = cause if cause is not None else message
            publish_start_failure(dist_init_method, tp_rank, message)
        pipe_writer.send({"status": "error", "message": message})
        return  # exiting closes this rank's connections: its peers' collectives fail at once
    freeze_startup_heap(f"Scheduler {label}".rstrip())
    set_gc_threshold(server_args.gc_threshold, f"Scheduler {label}".rstrip())
    pipe_writer.send(process.ready_info())
    try:
        process.event_loop()
    except Exception as e:
        logger.error("Scheduler crashed:\n%s", traceback.format_exc())
        if process.send_to_tokenizer is not None:
            where = f"{label}: " if label else ""
            process.send_to_tokenizer.send(
                dumps(SchedulerErrorOutput(f"{where}{type(e).__name__}: {e}"))
            )
        raise


def join_tp_group(server_args: ServerArgs, tp_rank: int, init_method: str) -> None:
    """Join this replica's tensor-parallel group: gloo on CPU, NCCL on CUDA (the device was
    set by configure_dp_rank); ``--dist-timeout`` bounds the rendezvous and every collective."""
    backend = "nccl" if server_args.device == "cuda" else "gloo"
    timeout_s = server_args.dist_timeout or DEFAULT_DIST_TIMEOUT_S
    init_distributed_environment(server_args.tp_size, tp_rank, init_method, backend, timeout_s)
