"""Data parallelism: one TokenizerManager, N scheduler replicas, a controller between them.

::

    TokenizerManager ──ZMQ──► DataParallelController ──ZMQ──► scheduler DP rank 0..N-1
                                   ▲        │                      │ outputs, replies
                                   └────────┼──────────────────────┘ (one socket per rank,
                                            ▼                          in the order produced)
                                   DetokenizerManager ──► TokenizerManager

The controller is its own process (docs/distributed.md says why). It binds the socket the
TokenizerManager sends to, so the frontend is the same with or without DP. It

* dispatches each new request to one rank (``round_robin`` or ``shortest_queue``, counting
  each rank's unfinished requests) and remembers rid -> rank until the request finished, so an
  abort by rid reaches the rank that holds it;
* fans every control request out to every rank (``get_weights_by_name`` to rank 0 only) and
  sends ONE merged reply (:mod:`dp_reply_merge`) once every rank answered;
* forwards each rank's outputs to the detokenizer, and its replies only after them: a rank's
  outputs and replies travel on one socket in the order the rank produced them, and the merged
  reply leaves on the same socket as the outputs, so a pause that aborted requests returns
  after their final outputs, as with a single scheduler;
* reports the engine paused only when every rank is paused (``PauseStateOutput``), and a
  LoRA adapter as refusing admission while any rank says so (``LoRAPauseStateOutput``: every
  rank announces before it replies, so by the time the merged reply of a pause or continue
  by ``lora_name`` leaves, the state sent before it covers every rank).

:class:`DpRouter` holds the state (no sockets); :class:`DataParallelController` is the shell.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from sglang.srt.managers.dp_reply_merge import merge_replies, settle_lora_unload
from sglang.srt.managers.io_struct import (
    AbortReq,
    GetWeightsByNameReqInput,
    LoRAPauseStateOutput,
    PauseStateOutput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    SchedulerReply,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
)
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils import configure_logger, dumps, get_zmq_socket, kill_process_tree, loads

logger = logging.getLogger(__name__)

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")
# Frame tags of the rank -> controller messages: [rank, OUTPUT, payload, finished rids] and
# [rank, REPLY, payload].
OUTPUT = b"o"
REPLY = b"r"
# How often the launcher's watchdog checks the engine processes, and how long it waits after a
# death before stopping the rest.
_WATCH_INTERVAL_S = 0.2
_GROUP_GRACE_S = 1.0


def dp_rank_input_ipc_name(port_args: PortArgs, dp_rank: int) -> str:
    """Where DP rank ``dp_rank`` receives its requests (the controller connects)."""
    return f"{port_args.scheduler_input_ipc_name}-dp{dp_rank}"


def dp_output_ipc_name(port_args: PortArgs) -> str:
    """Where every DP rank sends its outputs and replies (the controller binds)."""
    return f"{port_args.scheduler_input_ipc_name}-dp-out"


# Destination of a message :class:`DpRouter` returns: a DP rank, or the frontend.
FRONTEND = -1


@dataclasses.dataclass
class _Pending:
    """A fanned-out control request waiting for ``targets`` to answer. ``request``: what was
    sent (to undo it where it succeeded when another rank refused); ``then``: for an undo, the
    merged reply to send the frontend once the undo is done."""

    targets: frozenset[int]
    replies: dict[int, Any]
    request: Any = None
    then: Any = None


class DpRouter:
    """Routing state of the controller: which rank holds which rid, the control requests
    awaiting replies, each rank's pause state. Pure: every method returns what to send."""

    def __init__(self, dp_size: int, method: str) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load balance method must be one of {LOAD_BALANCE_METHODS}")
        self.dp_size = dp_size
        self.method = method
        self.rid_to_rank: dict[str, int] = {}
        self.num_unfinished = [0] * dp_size
        self._next = 0  # round-robin cursor (also breaks shortest_queue ties in turn)
        self._pending: dict[str, _Pending] = {}
        self._paused: list[PauseStateOutput] = [PauseStateOutput(False)] * dp_size
        self._reported_paused = False
        self._paused_loras: list[set[str]] = [set() for _ in range(dp_size)]
        self._reported_paused_loras: set[str] = set()

    def assign(self, rid: str) -> int:
        """The rank a new request ``rid`` goes to (remembered until it finishes)."""
        order = [(self._next + i) % self.dp_size for i in range(self.dp_size)]
        if self.method == "shortest_queue":
            rank = min(order, key=lambda r: self.num_unfinished[r])
        else:
            rank = order[0]
        self._next = (rank + 1) % self.dp_size
        old = self.rid_to_rank.get(rid)
        if old is not None:  # a rid reused before its end reached us: forget the old one
            self.num_unfinished[old] -= 1
        self.rid_to_rank[rid] = rank
        self.num_unfinished[rank] += 1
        return rank

    def finished(self, rank: int, rids: list[str]) -> None:
        """``rids`` sent their final output from ``rank``."""
        for rid in rids:
            if self.rid_to_rank.get(rid) == rank:
                del self.rid_to_rank[rid]
                self.num_unfinished[rank] -= 1

    def targets(self, msg: Any) -> list[int]:
        """The ranks a control message goes to (and whose replies are awaited)."""
        if isinstance(msg, AbortReq) and not msg.abort_all and not msg.match_prefix:
            rank = self.rid_to_rank.get(msg.rid)
            if rank is not None:
                return [rank]
        if isinstance(msg, GetWeightsByNameReqInput):
            return [0]  # every rank holds the same weights
        return list(range(self.dp_size))

    def expect(self, req_id: str, targets: list[int], request: Any = None) -> None:
        self._pending[req_id] = _Pending(frozenset(targets), {}, request)

    def on_reply(self, rank: int, msg: Any) -> list[tuple[int, Any]]:
        """(destination, message) pairs to send once ``rank``'s reply ``msg`` is in: to the
        frontend the merged reply when it was the last one awaited, and the engine's pause
        state when it changed; to ranks, the undo of a request that some rank refused."""
        if isinstance(msg, PauseStateOutput):
            self._paused[rank] = msg
            paused = all(state.paused for state in self._paused)
            if paused == self._reported_paused:
                return []
            self._reported_paused = paused
            return [(FRONTEND, PauseStateOutput(paused, self._paused[0].mode if paused else None))]
        if isinstance(msg, LoRAPauseStateOutput):
            return self._on_lora_pause_state(rank, msg)
        req_id = getattr(msg, "req_id", None)
        pending = self._pending.get(req_id) if isinstance(req_id, str) else None
        if pending is None or not isinstance(req_id, str):
            logger.warning("DP rank %d sent an unexpected %s", rank, type(msg).__name__)
            return []
        pending.replies[rank] = msg
        if set(pending.replies) != pending.targets:
            return []
        del self._pending[req_id]
        if pending.then is not None:  # an undo finished: what stays released, then the reply
            still = set(pending.then.released_tags)
            still.update(*(out.released_tags for out in pending.replies.values()))
            return [(FRONTEND, dataclasses.replace(pending.then, released_tags=sorted(still)))]
        if isinstance(pending.request, UnloadLoRAAdapterReqInput):
            return [(FRONTEND, settle_lora_unload(pending.request.lora_name, pending.replies))]
        merged = merge_replies(pending.replies)
        return self._undo_partial(pending, merged) or [(FRONTEND, merged)]

    def _on_lora_pause_state(self, rank: int, msg: LoRAPauseStateOutput) -> list[tuple[int, Any]]:
        """The adapters refusing admission on any rank, sent when that set changed. The union:
        a request of such an adapter may be routed to a rank that holds it back."""
        self._paused_loras[rank] = set(msg.paused)
        paused = set().union(*self._paused_loras)
        if paused == self._reported_paused_loras:
            return []
        self._reported_paused_loras = paused
        return [(FRONTEND, LoRAPauseStateOutput(sorted(paused)))]

    def _undo_partial(self, pending: _Pending, merged: Any) -> list[tuple[int, Any]]:
        """A memory release that some rank refused is undone (resumed) on the ranks where it
        succeeded, so no rank is left released; the merged refusal goes out after that.
        (Other control requests are validated identically on every rank: see
        docs/distributed.md.)"""
        if not isinstance(pending.request, ReleaseMemoryOccupationReqInput) or merged.success:
            return []
        done = sorted(r for r, out in pending.replies.items() if out.success)
        if not done:
            return []
        undo = ResumeMemoryOccupationReqInput(pending.request.tags)
        refused = [out.released_tags for out in pending.replies.values() if not out.success]
        merged = dataclasses.replace(
            merged,
            message=f"{merged.message} (undone on DP rank(s) {done})",
            released_tags=sorted(set().union(*refused)),
        )
        self._pending[undo.req_id] = _Pending(frozenset(done), {}, undo, then=merged)
        return [(rank, undo) for rank in done]


class DataParallelController:
    """The controller's sockets around a :class:`DpRouter`."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        self.router = DpRouter(server_args.dp_size, server_args.resolved_load_balance_method())
        context = zmq.Context(2)
        self.recv_from_tokenizer = get_zmq_socket(
            context, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True
        )
        self.recv_from_ranks = get_zmq_socket(
            context, zmq.PULL, dp_output_ipc_name(port_args), bind=True
        )
        self.send_to_ranks = [
            get_zmq_socket(context, zmq.PUSH, dp_rank_input_ipc_name(port_args, r), bind=False)
            for r in range(server_args.dp_size)
        ]
        self.send_to_detokenizer = get_zmq_socket(
            context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False
        )

    def event_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        poller.register(self.recv_from_ranks, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                if sock is self.recv_from_tokenizer:
                    self.handle_input(self.recv_from_tokenizer.recv())
                else:
                    self.handle_rank_message(self.recv_from_ranks.recv_multipart())

    def handle_input(self, data: bytes) -> None:
        """A message of the frontend: a request to one rank, a control message to its ranks.
        The bytes are forwarded as received (a weight tensor is pickled once)."""
        msg = loads(data)
        if isinstance(msg, TokenizedGenerateReqInput):
            self.send_to_ranks[self.router.assign(msg.rid)].send(data)
            return
        targets = self.router.targets(msg)
        req_id = getattr(msg, "req_id", None)
        if isinstance(req_id, str):
            self.router.expect(req_id, targets, msg)
        for rank in targets:
            self.send_to_ranks[rank].send(data)

    def handle_rank_message(self, frames: list[bytes]) -> None:
        rank = int(frames[0])
        if frames[1] == OUTPUT:
            self.send_to_detokenizer.send(frames[2])
            self.router.finished(rank, loads(frames[3]))
            return
        for dest, out in self.router.on_reply(rank, loads(frames[2])):
            if dest == FRONTEND:
                self.send_to_detokenizer.send(dumps(SchedulerReply(out)))
            else:
                self.send_to_ranks[dest].send(dumps(out))


def configure_dp_rank(server_args: ServerArgs, dp_rank: int, tp_rank: int = 0) -> None:
    """Give this scheduler rank (DP rank ``dp_rank``, TP rank ``tp_rank``) its share of the
    machine, before the model is loaded. The ranks on one node are ``dp_size * tp_size /
    nnodes``; this one is the ``local``-th of them (DP-major, then its TP ranks on this node).

    * CPU: 1/N of the torch threads (at least one), and 1/N of the memory that a single
      scheduler would take for its KV cache (unless --max-total-tokens fixes the size), so N
      ranks neither oversubscribe the cores nor the RAM;
    * CUDA: GPU ``local`` (of the visible ones). With fewer GPUs than ranks, ranks of
      different DP replicas share them (local % GPUs; the TP ranks of one replica always get
      distinct GPUs, which NCCL needs); each rank then needs --max-total-tokens, since sizing
      the KV cache from free memory would race with the other ranks on that GPU.
    """
    import torch

    tp_per_node = server_args.tp_size // server_args.nnodes
    num_local = server_args.dp_size * tp_per_node
    local = dp_rank * tp_per_node + tp_rank % tp_per_node
    if server_args.device == "cuda":
        num_gpus = torch.cuda.device_count()
        if num_gpus == 0:
            raise RuntimeError("no CUDA device visible")
        if num_gpus < tp_per_node:
            raise RuntimeError(
                f"{tp_per_node} tensor-parallel ranks on this node need as many GPUs (NCCL "
                f"runs one rank of a group per GPU); {num_gpus} visible"
            )
        if num_gpus < num_local and server_args.max_total_tokens is None:
            raise RuntimeError(
                f"{num_local} scheduler ranks on this node with {num_gpus} GPU(s): ranks "
                "share a GPU, which needs --max-total-tokens (the KV cache size of each rank)"
            )
        torch.cuda.set_device(local % num_gpus)
        return
    from sglang.srt.model_executor.model_runner import _DEFAULT_CPU_KV_FRACTION

    torch.set_num_threads(max(1, torch.get_num_threads() // num_local))
    if server_args.max_total_tokens is None:
        fraction = server_args.mem_fraction_static or _DEFAULT_CPU_KV_FRACTION
        server_args.mem_fraction_static = fraction / num_local


def start_group_watchdog(procs: list[Any], grace_s: float = _GROUP_GRACE_S) -> threading.Thread:
    """Watch the engine's child processes (in the launcher); once one has exited, kill the
    others after ``grace_s`` (the frontend names the one that died first, in that time), so a
    dead DP rank never leaves the other replicas running. Only processes that are still ours
    (not yet reaped) are killed."""

    def watch() -> None:
        while all(proc.is_alive() for proc in procs):
            time.sleep(_WATCH_INTERVAL_S)
        dead = [proc.name for proc in procs if not proc.is_alive()]
        time.sleep(grace_s)
        alive = [proc for proc in procs if proc.is_alive() and proc.pid is not None]
        if not alive:  # a shutdown: everything went together
            return
        logger.error(
            "Engine process(es) %s exited; stopping %s",
            ", ".join(dead), ", ".join(proc.name for proc in alive),
        )
        for proc in alive:
            kill_process_tree(proc.pid)

    thread = threading.Thread(target=watch, name="sglang-dp-group-watchdog", daemon=True)
    thread.start()
    return thread


def run_data_parallel_controller_process(
    server_args: ServerArgs, port_args: PortArgs, pipe_writer: Connection
) -> None:
    """Entry of the controller process: bind, report ready (or the error), then loop."""
    from sglang.srt.managers.detokenizer_manager import exit_when_parent_dies

    configure_logger(server_args.log_level, prefix=" DP controller")
    exit_when_parent_dies()
    try:
        controller = DataParallelController(server_args, port_args)
    except Exception as e:
        logger.error("DP controller failed to start:\n%s", traceback.format_exc())
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    pipe_writer.send({"status": "ready"})
    controller.event_loop()
