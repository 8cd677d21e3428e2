"""DetokenizerManager: turns the scheduler's output token ids into incremental text.

Runs in its own process (:func:`run_detokenizer_process`). It receives
``BatchTokenIDOutput`` (new ids per rid) and sends ``BatchStrOutput`` (new ids + new text per
rid) to the TokenizerManager. It is the only owner of the decoded text offsets (DESIGN §4).

Incremental decoding, per rid (``ids`` are the output ids received so far)::

    ids:   [ ...... confirmed ...... | window context | new ids ]
                                     ^surr_offset     ^read_offset
    decoded_text = text of ids[:read_offset]
    delta        = decode(ids[surr_offset:]) minus its prefix decode(ids[surr_offset:read_offset])

Decoding a window with some context keeps tokenizers that drop a leading space on the first
token (SentencePiece) exact. A delta that ends in U+FFFD is a partial UTF-8 character: it is
held back until more ids complete it. Of ``decoded_text``, the last ``stop_str_max_len - 1``
characters are held back while the request runs, so a stream never shows a prefix of a stop
string that the final text trims.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    SchedulerReply,
)
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils import (
    TypeBasedDispatcher,
    configure_logger,
    dumps,
    get_zmq_socket,
    loads,
)
from sglang.srt.utils.gc_freeze import set_gc_threshold

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# The message of a request finished because its output could not be decoded.
DETOKENIZATION_FAILED = "detokenization failed"

# BatchStrOutput fields copied unchanged from BatchTokenIDOutput.
_PASSTHROUGH_FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "retraction_counts",
    "output_token_logprobs_val",
    "output_token_logprobs_idx",
    "output_top_logprobs_val",
    "output_top_logprobs_idx",
    "input_token_logprobs_val",
    "input_token_logprobs_idx",
    "input_top_logprobs_val",
    "input_top_logprobs_idx",
    "output_token_entropy_val",
    "weight_version_spans",
    "weight_version",
    "routed_experts",
)


@dataclass
class DecodeState:
    """Decoding progress of one rid (see the module docstring for the offsets)."""

    ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    decoded_text: str = ""
    sent_len: int = 0  # characters of decoded_text already sent


class DetokenizerManager:
    """Incremental detokenization state for every running rid.

    ``tokenizer`` is a Hugging Face tokenizer, or None to pass ids through with empty text
    (``skip_tokenizer_init``). :meth:`handle_batch_token_id_output` is pure apart from the
    per-rid state it owns, so it is unit-testable without sockets.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}
        # Rids whose decoding failed: finished for their caller, their later ids are dropped
        # until the scheduler's final message for them.
        self.failed_rids: set[str] = set()
        # Failed rids the scheduler still runs: the event loop sends an AbortReq for each, so
        # the scheduler frees their KV now instead of decoding them to their end.
        self.rids_to_abort: list[str] = []

    def handle_batch_token_id_output(self, msg: BatchTokenIDOutput) -> BatchStrOutput:
        """Decode the new ids of every rid of ``msg``; drops the state of finished rids.

        Fault isolation: when decoding the batch raises, each rid is decoded alone; a rid that
        still fails is finished with ``{"type": "abort", "message": ...}`` and the others are
        served; a failed rid the scheduler still runs is queued in :attr:`rids_to_abort`.
        Raises only when even that is impossible (a malformed message).
        """
        saved = {
            rid: dataclasses.replace(self.states[rid], ids=list(self.states[rid].ids))
            for rid in msg.rids
            if rid in self.states
        }
        try:
            return self._handle_batch(msg)
        except Exception:
            logger.exception(
                "Decoding a batch of %d request(s) failed; isolating the failure", len(msg.rids)
            )
        for rid in msg.rids:  # undo the partial progress of the failed attempt
            self.states.pop(rid, None)
        self.states.update(saved)
        return _concat([self._handle_one(msg, i) for i in range(len(msg.rids))])

    def _handle_one(self, msg: BatchTokenIDOutput, i: int) -> BatchStrOutput:
        """Entry ``i`` of ``msg`` decoded alone; on failure its rid is finished with an error."""
        one = _select(msg, i)
        try:
            return self._handle_batch(one)
        except Exception as e:
            rid = msg.rids[i]
            logger.exception("Decoding the output of %s failed; finishing it", rid)
            self.states.pop(rid, None)
            if msg.finished_reasons[i] is None:  # the scheduler still runs it: abort it there
                self.failed_rids.add(rid)
                self.rids_to_abort.append(rid)
            out = self._passthrough(one, [""])
            out.finished_reasons = [
                {"type": "abort", "message": f"{DETOKENIZATION_FAILED}: {type(e).__name__}: {e}"}
            ]
            return out

    def _handle_batch(self, msg: BatchTokenIDOutput) -> BatchStrOutput:
        msg = self._drop_failed(msg)
        if self.tokenizer is None:
            output_strs = [""] * len(msg.rids)
        else:
            output_strs = self._decode_batch(msg)
        return self._passthrough(msg, output_strs)

    @staticmethod
    def _passthrough(msg: BatchTokenIDOutput, output_strs: list[str]) -> BatchStrOutput:
        extra = {name: getattr(msg, name) for name in _PASSTHROUGH_FIELDS}
        return BatchStrOutput(
            rids=list(msg.rids),
            finished_reasons=list(msg.finished_reasons),
            output_strs=output_strs,
            output_ids=[list(ids) for ids in msg.decode_ids],
            **extra,
        )

    def _drop_failed(self, msg: BatchTokenIDOutput) -> BatchTokenIDOutput:
        """``msg`` without the entries of failed rids (a final entry ends the rid's failure)."""
        if not self.failed_rids or not self.failed_rids.intersection(msg.rids):
            return msg
        keep = []
        for i, rid in enumerate(msg.rids):
            if rid not in self.failed_rids:
                keep.append(i)
            elif msg.finished_reasons[i] is not None:
                self.failed_rids.discard(rid)
        return _concat_tokens([_select(msg, i) for i in keep], msg)

    def _decode_batch(self, msg: BatchTokenIDOutput) -> list[str]:
        """Advance every rid's decode state; returns the text each may emit now."""
        tokenizer = self.tokenizer
        assert tokenizer is not None  # the caller passes ids through without one
        states = []
        for i, rid in enumerate(msg.rids):
            state = self.states.setdefault(rid, DecodeState())
            state.ids.extend(
                _ids_for_text(msg.decode_ids[i], msg.finished_reasons[i], msg.no_stop_trim[i])
            )
            states.append(state)
        # One batch_decode call per (skip_special_tokens, spaces_between_special_tokens) group.
        groups: dict[tuple[bool, bool], list[int]] = {}
        for i in range(len(msg.rids)):
            key = (msg.skip_special_tokens[i], msg.spaces_between_special_tokens[i])
            groups.setdefault(key, []).append(i)
        for (skip, spaces), members in groups.items():
            windows = [
                states[i].ids[states[i].surr_offset : states[i].read_offset] for i in members
            ]
            fulls = [states[i].ids[states[i].surr_offset :] for i in members]
            texts = tokenizer.batch_decode(
                windows + fulls,
                skip_special_tokens=skip,
                spaces_between_special_tokens=spaces,
            )
            for j, i in enumerate(members):
                finished = msg.finished_reasons[i] is not None
                _advance(states[i], texts[j], texts[len(members) + j], finished)
        output_strs = []
        for i, rid in enumerate(msg.rids):
            reason = msg.finished_reasons[i]
            if reason is None:
                output_strs.append(_emit_running(states[i], msg.stop_str_max_len[i]))
            else:
                output_strs.append(_emit_finished(states[i], reason, msg.no_stop_trim[i]))
                del self.states[rid]
        return output_strs

    @staticmethod
    def forward_reply(msg: SchedulerReply) -> Any:
        """A scheduler reply goes on to the TokenizerManager as it is, behind the outputs the
        scheduler sent before it (this process handles messages in order)."""
        return msg.payload

    def take_aborts(self) -> list[AbortReq]:
        """One AbortReq per rid queued in :attr:`rids_to_abort` (the queue is emptied).

        The scheduler finishes such a rid at once, freeing its KV; its final message ends the
        rid's failure here and is not forwarded, so the caller sees one terminal output only.
        The scheduler's reply reaches the TokenizerManager, which has no call waiting on it.
        """
        rids, self.rids_to_abort = self.rids_to_abort, []
        return [AbortReq(rid=rid, aborted_message=DETOKENIZATION_FAILED) for rid in rids]

    def event_loop(
        self,
        recv_socket: zmq.Socket,
        send_socket: zmq.Socket,
        scheduler_socket: zmq.Socket | None = None,
    ) -> None:
        """Receive, decode and forward messages forever (until the process is killed).
        ``scheduler_socket`` (to the scheduler's input) carries the aborts of failed rids."""
        dispatcher = TypeBasedDispatcher(
            [
                (BatchTokenIDOutput, self.handle_batch_token_id_output),
                (SchedulerReply, self.forward_reply),
            ]
        )
        while True:
            try:
                out = dispatcher(loads(recv_socket.recv()))
            except Exception:  # a malformed message: nothing to send for it, keep serving
                logger.exception("Dropped a message the detokenizer cannot handle")
                out = None
            if out is not None and (not isinstance(out, BatchStrOutput) or out.rids):
                send_socket.send(dumps(out))  # (a batch may end up empty)
            for abort in self.take_aborts():
                if scheduler_socket is not None:
                    scheduler_socket.send(dumps(abort))


def _select(msg: Any, i: int) -> Any:
    """A copy of a batch message (token ids or strings) with only entry ``i``."""
    values = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        values[f.name] = [value[i]] if isinstance(value, list) else value
    return type(msg)(**values)


def _concat(parts: list[Any]) -> Any:
    """One message from messages selected (:func:`_select`) from the same message: their
    per-rid lists are joined, the other fields (None lists, the version label) shared."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(parts[0]):
        first = getattr(parts[0], f.name)
        if isinstance(first, list):
            values[f.name] = [x for p in parts for x in getattr(p, f.name)]
        else:
            values[f.name] = first
    return type(parts[0])(**values)


def _concat_tokens(parts: list[BatchTokenIDOutput], template: BatchTokenIDOutput) -> Any:
    """``parts`` as one message; with none, ``template`` with every per-rid list empty."""
    if parts:
        return _concat(parts)
    empty: dict[str, Any] = {
        f.name: []
        for f in dataclasses.fields(template)
        if isinstance(getattr(template, f.name), list)
    }
    return dataclasses.replace(template, **empty)


def _ids_for_text(
    new_ids: list[int], finished_reason: dict[str, Any] | None, no_stop_trim: bool
) -> list[int]:
    """The new ids that contribute to the text: a matched stop token id is not shown."""
    if (
        finished_reason is not None
        and finished_reason.get("type") == "stop"
        and isinstance(finished_reason.get("matched"), int)
        and not no_stop_trim
        and new_ids
        and new_ids[-1] == finished_reason["matched"]
    ):
        return list(new_ids[:-1])
    return list(new_ids)


def _advance(state: DecodeState, prefix_text: str, full_text: str, finished: bool) -> None:
    """Move the confirmed text forward unless the new text ends in a partial character."""
    if not finished and full_text.endswith(_REPLACEMENT_CHAR):
        return
    state.decoded_text += full_text[len(prefix_text) :]
    state.surr_offset = state.read_offset
    state.read_offset = len(state.ids)


def _emit_running(state: DecodeState, stop_str_max_len: int) -> str:
    """New text of a running rid, holding back what could be the start of a stop string."""
    end = len(state.decoded_text) - max(stop_str_max_len - 1, 0)
    end = max(end, state.sent_len)
    delta = state.decoded_text[state.sent_len : end]
    state.sent_len = end
    return delta


def _emit_finished(state: DecodeState, reason: dict[str, Any], no_stop_trim: bool) -> str:
    """All text not sent yet; a matched stop string and what follows it are cut off."""
    text = state.decoded_text
    matched = reason.get("matched")
    if reason.get("type") == "stop" and isinstance(matched, str) and matched and not no_stop_trim:
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos]
    return text[state.sent_len :]


def exit_when_parent_dies(poll_s: float = 1.0) -> None:
    """Start a daemon thread that ends this process once its parent process is gone.

    Polling ``getppid`` (rather than prctl's parent-death signal, which fires when the parent
    *thread* exits) keeps children alive under an Engine built in a short-lived thread, and
    still leaves no orphan when the launcher is SIGKILLed.
    """
    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        logger.warning("Parent process %d is gone; exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_detokenizer_process(
    server_args: ServerArgs, port_args: PortArgs, pipe_writer: Connection
) -> None:
    """Entry point of the detokenizer subprocess; runs until killed.

    PULL binds ``port_args.detokenizer_ipc_name`` (from the scheduler) and PUSH connects to
    ``port_args.tokenizer_ipc_name`` (the TokenizerManager); a second PUSH to
    ``port_args.scheduler_input_ipc_name`` aborts the requests whose decoding failed. Once
    the tokenizer is loaded it sends ``{"status": "ready"}`` through ``pipe_writer``; a
    failure before that is sent as ``{"status": "error", "message": ...}`` so that the
    launcher reports the cause itself. A later exception is logged and ends the process with
    a non-zero code, which the TokenizerManager's liveness check reports.
    """
    configure_logger(server_args.log_level, prefix=" Detokenizer")
    exit_when_parent_dies()
    from sglang.srt.hf_transformers_utils import get_tokenizer

    context = zmq.Context(2)
    try:
        recv_socket = get_zmq_socket(context, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
        send_socket = get_zmq_socket(context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)
        scheduler_socket = get_zmq_socket(
            context, zmq.PUSH, port_args.scheduler_input_ipc_name, bind=False
        )
        tokenizer = None
        if not server_args.skip_tokenizer_init:
            tokenizer = get_tokenizer(
                server_args.tokenizer_path or server_args.model_path, server_args.trust_remote_code
            )
    except Exception as e:  # reported to the launcher verbatim, like the scheduler's
        logger.exception("Detokenizer failed to start")
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    set_gc_threshold(server_args.gc_threshold, "Detokenizer")
    pipe_writer.send({"status": "ready"})
    pipe_writer.close()
    try:
        DetokenizerManager(tokenizer).event_loop(recv_socket, send_socket, scheduler_socket)
    except Exception:
        logger.exception("Detokenizer failed")
        raise
