"""How the ranks of one tensor-parallel group share a loop turn's inputs and replies.

One scheduler process per TP rank; they take every scheduling decision alike because they see
the same inputs at the same loop turn::

    turn k:   rank 0: receive from ZMQ ─┐ broadcast (frames, deadline verdict)
              every rank: process_input_requests(msgs); run_step()   (forward in lockstep)
              every rank with replies this turn: gather them to rank 0 ─► ONE merged reply

* **Inputs** (:class:`TpTurnInputs`): rank 0 alone reads its socket and its clock; the raw
  message frames and the verdict on the pause deadline (lease or drain, see
  ``PauseState.deadline_due``) are broadcast on the gloo CPU group. Other ranks never touch a
  socket or a clock for a decision: they block in the broadcast until rank 0's next turn.
* **Replies** (:class:`TpReplies`): the core's replies are buffered during the turn. All ranks
  run the same handlers on the same inputs, so they have replies at the same turns (the
  gather is skipped when there are none, on every rank alike); rank 0 merges each request's
  replies (``dp_reply_merge.merge_tp_replies``: a failure on any rank fails the reply and names
  it, ``"TP rank 1: ..."``) and sends one. Because the gather follows the turn's forward pass,
  a reply (a pause above all) leaves only after every rank committed that forward.
* **Outputs** go from rank 0 only (every rank computed the same tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.distributed.parallel_state import GroupCoordinator
from sglang.srt.managers.dp_reply_merge import merge_tp_replies
from sglang.srt.utils import loads

logger = logging.getLogger(__name__)


class TpPeerLost(RuntimeError):
    """A collective of the group failed: a peer died (its connections closed) or did not
    answer within ``--dist-timeout``. This rank cannot go on alone."""


def tp_collective(what: str, call: Callable[[], Any]) -> Any:
    """``call()`` (a collective of the group); its failure as :class:`TpPeerLost`."""
    try:
        return call()
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TpPeerLost(
            f"the tensor-parallel group lost a peer during the {what} (a rank died or timed "
            f"out): {reason}"
        ) from e


class TpTurnInputs:
    """Each loop turn's messages, identical on every rank of the group."""

    def __init__(self, group: GroupCoordinator, recv_frames: Callable[[], list[bytes]]) -> None:
        """``recv_frames``: rank 0's reader of its socket (unused on other ranks)."""
        self.group = group
        self.recv_frames = recv_frames

    def next_turn(self, deadline_due: Callable[[], bool]) -> tuple[list[Any], bool]:
        """(the messages of this turn, whether the current pause deadline has passed), as
        rank 0 saw them; blocks on other ranks until rank 0 starts its turn."""
        if self.group.is_first_rank:
            turn: Any = (self.recv_frames(), deadline_due())
        else:
            turn = None
        frames, due = tp_collective("turn broadcast", lambda: self.group.broadcast_object(turn))
        return [loads(f) for f in frames], due


class TpReplies:
    """Buffers a turn's replies on every rank; rank 0 sends the merged ones."""

    def __init__(self, group: GroupCoordinator, send: Callable[[Any], None]) -> None:
        self.group = group
        self.send = send
        self.buffer: list[Any] = []

    def add(self, msg: Any) -> None:
        self.buffer.append(msg)

    def flush(self) -> None:
        """End of a turn: gather the buffered replies to rank 0 and send them merged."""
        if not self.buffer:  # the same on every rank: they handled the same inputs
            return
        mine, self.buffer = self.buffer, []
        gathered = tp_collective("reply gather", lambda: self.group.gather_object(mine))
        if gathered is not None:
            for msg in merge_turn_replies(gathered):
                self.send(msg)


def merge_turn_replies(per_rank: list[list[Any]]) -> list[Any]:
    """Rank 0's replies of one turn, in order, each merged with the other ranks' reply to the
    same request (matched by ``req_id``; a rank without one makes it a failure naming that
    rank). Messages without a ``req_id`` (pause-state notices) are rank 0's."""
    by_rank: list[dict[str, Any]] = [
        {m.req_id: m for m in msgs if isinstance(getattr(m, "req_id", None), str)}
        for msgs in per_rank
    ]
    merged = []
    for msg in per_rank[0]:
        req_id = getattr(msg, "req_id", None)
        if not isinstance(req_id, str):
            merged.append(msg)
            continue
        replies = {0: msg}
        for rank in range(1, len(per_rank)):
            other = by_rank[rank].get(req_id)
            if other is None or type(other) is not type(msg):
                logger.error("TP rank %d did not answer %s %s", rank, type(msg).__name__, req_id)
                other = _missing_reply(msg, rank)
            replies[rank] = other
        merged.append(merge_tp_replies(replies))
    return merged


def _missing_reply(msg: Any, rank: int) -> Any:
    """A failed copy of ``msg`` standing for the reply that ``rank`` did not send."""
    import dataclasses

    if not dataclasses.is_dataclass(msg) or isinstance(msg, type):
        return msg
    names = {f.name for f in dataclasses.fields(msg)}
    changes: dict[str, Any] = {}
    if "success" in names:
        changes["success"] = False
    for name in ("message", "error_msg", "error_message"):
        if name in names:
            changes[name] = f"no reply from TP rank {rank} (the ranks diverged)"
    return dataclasses.replace(msg, **changes)


# Start-up failures are also written to the rendezvous store (hosted by TP rank 0's process),
# so that rank 0 can name the rank that failed even when it runs on another node.
_START_FAILURE_KEY = "sglang/start-failure/{}"
_STORE_TIMEOUT_S = 5.0


def _store_client(init_method: str) -> Any:
    import datetime

    import torch.distributed as dist

    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S))


def publish_start_failure(init_method: str, tp_rank: int, message: str) -> None:
    """Leave ``message`` (why TP rank ``tp_rank`` failed to start) for the group's rank 0;
    best effort (the store may be gone)."""
    try:
        _store_client(init_method).set(_START_FAILURE_KEY.format(tp_rank), message)
    except Exception:  # the peers still notice the failure: this rank's connections close
        logger.debug("could not publish the start-up failure", exc_info=True)


def peer_start_failure(init_method: str, tp_size: int, tp_rank: int) -> str | None:
    """``"TP rank R failed to start: <its error>"`` for the first other rank that published
    one, else None; best effort."""
    try:
        store = _store_client(init_method)
        for rank in range(tp_size):
            key = _START_FAILURE_KEY.format(rank)
            if rank != tp_rank and store.check([key]):
                return f"TP rank {rank} failed to start: {store.get(key).decode()}"
    except Exception:
        logger.debug("could not read the peers' start-up failures", exc_info=True)
    return None
