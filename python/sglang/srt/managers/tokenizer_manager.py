"""TokenizerManager: the frontend of the engine, living in the caller's process.

It tokenizes and validates requests, sends them to the scheduler, and routes the
detokenizer's incremental outputs back to the callers by rid (DESIGN §3). It is the only owner
of the per-rid frontend state. Every async method runs on ONE asyncio loop, the one that calls
:meth:`TokenizerManager.start`; nothing here is thread-safe. Control methods (flush, pause,
continue, weights, memory, abort) may be awaited from any other loop and thread as well, as
RL frameworks do on an Engine's manager: they hop to the owning loop and back.

Failure model: when the scheduler or detokenizer process exits, or the scheduler reports a
``SchedulerErrorOutput``, every waiting caller and control call raises
``RuntimeError("scheduler died: ...")`` and every new call fails fast. Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from enum import Enum
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from sglang.srt import environ
from sglang.srt.hf_transformers_utils import get_tokenizer
from sglang.srt.managers.control_validation import check_control_request
from sglang.srt.managers.field_checks import InvalidRequestError
from sglang.srt.managers.io_struct import (
    AbortReq,
    AbortReqOutput,
    BatchStrOutput,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    LoRAPauseStateOutput,
    LoRAUpdateOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    PauseStateOutput,
    ProfileReq,
    ProfileReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    SchedulerErrorOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    UpdateWeightVersionReqInput,
    UpdateWeightVersionReqOutput,
    WeightsUpdateGroupReqOutput,
)
from sglang.srt.managers.memory_occupation import resolve_tags
from sglang.srt.managers.request_validation import (
    RequestLimits,
    check_generate_input,
    tokenize_texts,
    validate_request,
)
from sglang.srt.managers.tokenizer_req_state import (
    ReqState,
    logprob_entries,
    logprob_rows_in_slices,
)
from sglang.srt.managers.weights_update_group import WeightsUpdateGroups
from sglang.srt.parser.reasoning_parser import think_end_token
from sglang.srt.sampling.sampling_params import derive_seed
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils import TypeBasedDispatcher, dumps, loads
from sglang.srt.utils.multiprocessing_serializer import decode_named_tensors
from sglang.srt.utils.network import get_async_zmq_socket

if TYPE_CHECKING:
    import fastapi

logger = logging.getLogger(__name__)

# How often a waiting request checks whether its HTTP client went away.
_DISCONNECT_POLL_S = 0.5
# How often the liveness task checks the scheduler and detokenizer processes.
_WATCH_INTERVAL_S = 0.5
# After an abort that the scheduler says ended nothing, a still-unfinished targeted request is
# finished locally after this grace period (its final output may be in flight meanwhile).
_ABORT_GRACE_S = 1.0
# Outputs bigger than these (pickled bytes; logprob entries, see ``logprob_entries``) are
# unpickled in a worker thread / turned into logprob rows a slice at a time: in one go, the
# biggest allowed (a context-length prompt with 128 top logprobs per position) would hold the
# loop for a second or more.
_OFFLOAD_MESSAGE_BYTES = 1 << 20
_OFFLOAD_LOGPROB_ENTRIES = 16384
# Logprob entries built per slice (a few ms); the loop runs its other work between slices.
# Not a worker thread: one that builds Python rows holds the GIL, and the loop then waits for
# it at every switch interval of every step of a request (a /health reply took ~1 s).
_ROW_SLICE_ENTRIES = 2048


class ServerStatus(Enum):
    """Upstream's health flag of a TokenizerManager (``tokenizer_manager.server_status``); a
    launcher that sets ``UnHealthy`` makes /health answer 503."""

    Up = "Up"
    Starting = "Starting"
    UnHealthy = "UnHealthy"


class EnginePausedError(RuntimeError):
    """A generate request arrived while paused and ``--paused-admission reject`` is set."""


class QueueFullError(RuntimeError):
    """The scheduler refused a request: ``--max-queued-requests`` requests already wait."""


class TokenizerManager:
    """Frontend state of every rid and the ZMQ link to the scheduler and the detokenizer.

    ``scheduler_info`` is the scheduler's ready message (``context_length``, ``vocab_size``,
    ``max_req_input_len``, ...). Sockets are created by :meth:`start`, in the owning loop.
    """

    is_generation = True

    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict) -> None:
        self.server_args = server_args
        self.server_status = ServerStatus.Up
        self.port_args = port_args
        self.scheduler_info = scheduler_info
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name
        self.context_len: int = scheduler_info["context_length"]
        self.vocab_size: int = scheduler_info["vocab_size"]
        self.max_req_input_len: int = scheduler_info["max_req_input_len"]
        self.limits = RequestLimits.from_server_args(server_args, scheduler_info)
        # Loaded LoRA adapters (name -> path), mirrored from the scheduler's load replies:
        # a request naming another adapter is refused here (docs/lora.md).
        self.lora_adapters: dict[str, str] = server_args.lora_path_dict()
        self.tokenizer = (
            None
            if server_args.skip_tokenizer_init
            else get_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        )
        # meta_info["reasoning_tokens"] counts the output up to this token (None: no parser).
        self.think_end_id = _think_end_id(self.tokenizer, server_args.reasoning_parser)
        # Token id -> its text alone, for logprob entries: filled as ids are first asked for,
        # so it holds at most one string per vocabulary entry.
        self._token_texts: dict[int, str] = {}
        self.rid_to_state: dict[str, ReqState] = {}
        self._pending_controls: dict[str, asyncio.Future] = {}
        self._abort_targets: dict[str, list[ReqState]] = {}
        self._procs: list[Any] = []
        self._dead_reason: str | None = None
        # The scheduler's pause state as its last PauseStateOutput said (it owns the state and
        # its lease; this is a mirror for admission with --paused-admission reject).
        self._scheduler_paused = False
        self._paused_loras: set[str] = set()  # adapters paused by name, as last reported
        # Whether the scheduler's KV cache or weights are released (nothing decodes then).
        self.memory_released = False
        self.weights_update_groups = WeightsUpdateGroups()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._context: zmq.asyncio.Context | None = None
        self._zmq_finalizer: weakref.finalize | None = None  # closes the sockets (start())
        self._send_socket: zmq.asyncio.Socket | None = None
        self._recv_socket: zmq.asyncio.Socket | None = None
        self._dispatcher = TypeBasedDispatcher(
            [
                (BatchStrOutput, self._handle_batch_str_output),
                (AbortReqOutput, self._handle_abort_output),
                (FlushCacheReqOutput, self._handle_control_output),
                (GetInternalStateReqOutput, self._handle_control_output),
                (PauseGenerationReqOutput, self._handle_control_output),
                (ContinueGenerationReqOutput, self._handle_control_output),
                (UpdateWeightFromDiskReqOutput, self._handle_control_output),
                (UpdateWeightsFromTensorReqOutput, self._handle_control_output),
                (GetWeightsByNameReqOutput, self._handle_control_output),
                (UpdateWeightVersionReqOutput, self._handle_control_output),
                (WeightsUpdateGroupReqOutput, self._handle_control_output),
                (ReleaseMemoryOccupationReqOutput, self._handle_control_output),
                (ResumeMemoryOccupationReqOutput, self._handle_control_output),
                (LoRAUpdateOutput, self._handle_control_output),
                (ProfileReqOutput, self._handle_control_output),
                (LoRAPauseStateOutput, self._handle_lora_pause_state),
                (PauseStateOutput, self._handle_pause_state),
                (SchedulerErrorOutput, self._handle_scheduler_error),
            ]
        )

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Create the sockets and background tasks in the running loop (idempotent).

        Must be called from inside the loop that will own this manager; calling it later from
        another loop raises RuntimeError.
        """
        loop = asyncio.get_running_loop()
        if self._loop is not None:
            if self._loop is not loop:
                raise RuntimeError("TokenizerManager is already bound to another event loop")
            return
        self._loop = loop
        self._context = zmq.asyncio.Context(2)
        self._send_socket = get_async_zmq_socket(
            self._context, zmq.PUSH, self.port_args.scheduler_input_ipc_name, bind=False
        )
        self._recv_socket = get_async_zmq_socket(
            self._context, zmq.PULL, self.port_args.tokenizer_ipc_name, bind=True
        )
        self._tasks = [loop.create_task(self._recv_loop()), loop.create_task(self._watch_loop())]
        # Closes the sockets and context on close(), or when a manager never closed is
        # collected: zmq's term() would otherwise block that collection (and the process)
        # forever on the still-open sockets.
        self._zmq_finalizer = weakref.finalize(
            self, _close_zmq, self._context, [self._send_socket, self._recv_socket]
        )

    def watch_processes(self, procs: list[Any]) -> None:
        """Fail every caller when one of ``procs`` (objects with ``is_alive()``) exits."""
        self._procs = list(procs)

    @property
    def watched_processes(self) -> list[Any]:
        """The processes given to :meth:`watch_processes`."""
        return list(self._procs)

    async def close(self, reason: str = "engine is shut down") -> None:
        """Fail pending callers with ``reason``, stop the tasks and close the sockets."""
        self._fail_all(reason)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._zmq_finalizer is not None:
            self._zmq_finalizer()
            self._context, self._zmq_finalizer = None, None

    # ---- generation --------------------------------------------------------------------------
    async def generate_request(
        self, obj: GenerateReqInput, request: fastapi.Request | None = None
    ) -> AsyncGenerator[dict | list[dict], None]:
        """Validate, send and await ``obj``; yields outputs (see the module docstring).

        Non-stream: yields one dict (single request) or one list of dicts in input order
        (batch, or ``n > 1``). Stream: yields a dict per update with cumulative text and ids;
        for a batch each dict carries its ``index``. A ValueError is raised before anything is
        sent when a request is invalid. If ``request``'s client disconnects, the rids are
        aborted and the iterator ends. Closing the iterator early aborts unfinished rids.
        """
        self._check_alive()
        self.start()
        if self.server_args.paused_admission == "reject" and self.is_paused:
            raise EnginePausedError("Generation is paused; retry after continue_generation")
        self._check_lora_admission(obj)
        check_generate_input(obj, self.limits)
        obj.normalize_batch_and_arguments()
        text_ids = await tokenize_texts(self.tokenizer, obj)
        reqs, parents = self._tokenize_and_validate(obj, text_ids)
        is_list = not obj.is_single or len(reqs) > 1
        notify = asyncio.Event()
        decode_texts = self._text_decoder(obj.return_text_in_logprobs)
        states = [
            ReqState(req, notify, parent, decode_texts, self.tokenizer is not None,
                     self.think_end_id)
            for req, parent in zip(reqs, parents)
        ]
        for state in states:
            self.rid_to_state[state.rid] = state
        for req in reqs:
            self._send(req)
        try:
            async for out in self._wait_states(states, obj.stream, is_list, request):
                yield out
        finally:
            self._release(states)

    def _tokenize_and_validate(
        self, obj: GenerateReqInput, text_ids: list[list[int]] | None = None
    ) -> tuple[list[TokenizedGenerateReqInput], list[str | None]]:
        """Tokenized requests (``n`` copies expanded) and the parent rid of each copy.
        ``text_ids``: the token ids of the texts when already tokenized."""
        singles = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        if obj.text is not None:
            if self.tokenizer is None:
                raise ValueError(
                    "text input needs a tokenizer; with skip_tokenizer_init pass input_ids"
                )
            texts = [s.text for s in singles]
            all_ids = text_ids if text_ids is not None else self.tokenizer(texts)["input_ids"]
        else:
            all_ids = [s.input_ids for s in singles]
        reqs: list[TokenizedGenerateReqInput] = []
        parents: list[str | None] = []
        for single, input_ids in zip(singles, all_ids):
            req = validate_request(single, list(input_ids), self.limits)
            self._check_lora(req.lora_path)
            n = req.sampling_params.n
            if n == 1:
                reqs.append(req)
                parents.append(None)
                continue
            seed = req.sampling_params.sampling_seed
            for i in range(n):
                copy_req = copy.deepcopy(req)
                copy_req.rid = f"{req.rid}_{i}"
                copy_req.sampling_params.n = 1
                if seed is not None and i > 0:
                    # n samples, not n copies of one: copy i > 0 gets its own seed, derived
                    # from the request's (copy 0 keeps it, as an n = 1 request would).
                    copy_req.sampling_params.sampling_seed = derive_seed(seed, f"copy-{i}")
                reqs.append(copy_req)
                parents.append(req.rid)
        rids = [r.rid for r in reqs]
        if len(set(rids)) != len(rids):
            raise ValueError("Duplicate rid in the batch")
        active = [rid for rid in rids if rid in self.rid_to_state]
        if active:
            raise ValueError(f"Duplicate request id {active[0]!r}: a request with it is running")
        return reqs, parents

    async def _wait_states(
        self, states: list[ReqState], stream: bool, is_list: bool, request: Any
    ) -> AsyncIterator[dict | list[dict]]:
        """Yield the outputs of ``states`` (which share one notify event) as they arrive."""
        notify = states[0].notify
        while True:
            if not await self._wait_event(notify, request):
                return  # the caller's finally (_release) aborts what is unfinished
            notify.clear()
            for state in states:
                if state.error is not None:
                    raise RuntimeError(state.error)
                reason = state.finished_reason
                if isinstance(reason, dict) and reason.get("status_code") == 503:
                    # Refused before it started (--max-queued-requests): the call fails as a
                    # whole, as upstream's does; the caller's finally aborts the rest.
                    raise QueueFullError(reason.get("message") or "The request queue is full.")
            if stream:
                for index, state in enumerate(states):
                    if state.dirty:
                        state.dirty = False
                        out = state.to_output()
                        if is_list:
                            out["index"] = index
                        yield out
            # A final update may land while a stream is suspended at its yield: send it first
            # (its notify is set, so the next turn does not block).
            if stream and any(state.dirty for state in states):
                continue
            if all(state.finished for state in states):
                if not stream:
                    outs = [state.to_output() for state in states]
                    yield outs if is_list else outs[0]
                return

    async def _wait_event(self, notify: asyncio.Event, request: Any) -> bool:
        """Wait for ``notify``; False when ``request``'s client disconnected first."""
        if request is None:
            await notify.wait()
            return True
        while True:
            try:
                await asyncio.wait_for(notify.wait(), _DISCONNECT_POLL_S)
                return True
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    logger.info("Client disconnected; aborting its request(s)")
                    return False

    def _release(self, states: list[ReqState]) -> None:
        """Forget ``states``; the unfinished ones (iterator closed early) are aborted."""
        self._abort_unfinished(states)
        for state in states:
            if self.rid_to_state.get(state.rid) is state:
                del self.rid_to_state[state.rid]

    def _abort_unfinished(self, states: list[ReqState]) -> None:
        if self._dead_reason is not None:
            return
        for state in states:
            if not state.finished and self.rid_to_state.get(state.rid) is state:
                self.abort_request(state.rid)

    # ---- abort and control -------------------------------------------------------------------
    def abort_request(
        self, rid: str = "", abort_all: bool = False, match_prefix: bool = False
    ) -> None:
        """Ask the scheduler to abort ``rid`` (or everything); returns without waiting.

        A rid that names the parent of ``n > 1`` copies aborts every copy. Must be called on
        the owning loop or from any thread (it is then queued onto the owning loop). Each
        aborted caller gets one final output with finish type "abort". After the scheduler died
        this does nothing (every caller has already failed).
        """
        if self._dead_reason is not None:
            return
        if self._loop is not None and not self._on_own_loop():
            self._loop.call_soon_threadsafe(self.abort_request, rid, abort_all, match_prefix)
            return
        self.start()
        for req in self._abort_reqs(rid, abort_all, match_prefix):
            self._send(req)

    async def abort_request_async(
        self, rid: str = "", abort_all: bool = False, match_prefix: bool = False
    ) -> int:
        """Abort like :meth:`abort_request`; returns how many requests the scheduler ended."""
        self._check_alive()
        self.start()
        outs = await asyncio.gather(
            *(self._control(req) for req in self._abort_reqs(rid, abort_all, match_prefix))
        )
        return sum(out.num_aborted for out in outs)

    def _abort_reqs(self, rid: str, abort_all: bool, match_prefix: bool) -> list[AbortReq]:
        """The AbortReq messages for ``rid``, each remembering which states it targets."""
        if abort_all:
            targets = {"": list(self.rid_to_state.values())}
        elif match_prefix:
            targets = {rid: [s for r, s in self.rid_to_state.items() if r.startswith(rid)]}
        elif rid in self.rid_to_state or not rid:
            targets = {rid: [self.rid_to_state[rid]] if rid else []}
        else:
            children = [s for s in self.rid_to_state.values() if s.parent_rid == rid]
            targets = {s.rid: [s] for s in children} if children else {rid: []}
        reqs = []
        for target_rid, target_states in targets.items():
            req = AbortReq(rid=target_rid, abort_all=abort_all, match_prefix=match_prefix)
            self._abort_targets[req.req_id] = target_states
            reqs.append(req)
        return reqs

    # ---- LoRA adapters (docs/lora.md) --------------------------------------------------------
    def _check_lora(self, name: str | None) -> None:
        if name is None:
            return
        if not self.server_args.enable_lora:
            raise ValueError(f"lora_path {name!r}: LoRA is not enabled (start with --enable-lora)")
        if name not in self.lora_adapters:
            known = ", ".join(sorted(self.lora_adapters)) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")

    def _check_lora_admission(self, obj: GenerateReqInput) -> None:
        """--paused-admission reject: a request of an adapter paused by name gets 503."""
        if self.server_args.paused_admission != "reject" or not self._paused_loras:
            return
        names = obj.lora_path if isinstance(obj.lora_path, list) else [obj.lora_path]
        paused = sorted(self._paused_loras.intersection(n for n in names if n is not None))
        if paused:
            raise EnginePausedError(
                f"LoRA adapter {paused[0]!r} is paused; retry after continue_generation"
            )

    async def load_lora_adapter(
        self, obj: LoadLoRAAdapterReqInput, request: fastapi.Request | None = None
    ) -> LoRAUpdateOutput:
        """Load (or, over a paused adapter's name, update) an adapter; a refusal changes
        nothing and comes back as ``success=False``."""
        return await self._lora_update(obj)

    async def load_lora_adapter_from_tensors(
        self, obj: LoadLoRAAdapterFromTensorsReqInput, request: fastapi.Request | None = None
    ) -> LoRAUpdateOutput:
        """Load (or update) an adapter from PEFT-named tensors pushed in-process."""
        return await self._lora_update(obj)

    async def unload_lora_adapter(
        self, obj: UnloadLoRAAdapterReqInput, request: fastapi.Request | None = None
    ) -> LoRAUpdateOutput:
        return await self._lora_update(obj)

    async def _lora_update(
        self,
        obj: LoadLoRAAdapterReqInput | LoadLoRAAdapterFromTensorsReqInput
        | UnloadLoRAAdapterReqInput,
    ) -> LoRAUpdateOutput:
        """Send a load / unload; mirror the adapters its reply says are loaded (on every DP
        replica), refused or not: a refusal on one replica may still have changed the others
        (docs/lora.md), and a request may only name an adapter every replica has."""
        out: LoRAUpdateOutput = await self._control(obj)
        self.lora_adapters = dict(out.loaded_adapters)
        return out

    async def abort_lora_requests(self, lora_name: str) -> int:
        """Abort every request of adapter ``lora_name``; returns how many ended."""
        out = await self._control(AbortReq(lora_name=lora_name))
        return int(out.num_aborted)

    async def pause_generation(self, obj: PauseGenerationReqInput) -> PauseGenerationReqOutput:
        """Pause the scheduler (DESIGN §5); returns once the pause took effect.

        The scheduler handles requests in arrival order, so every request sent before this
        call is covered by it (an ``abort`` pause aborts them all). An invalid mode comes back
        as ``success=False`` with the state unchanged.
        """
        return await self._control(obj)

    async def continue_generation(
        self, obj: ContinueGenerationReqInput | None = None
    ) -> ContinueGenerationReqOutput:
        """Resume after a pause (a no-op reply when not paused)."""
        return await self._control(obj or ContinueGenerationReqInput())

    @property
    def is_paused(self) -> bool:
        """Whether the scheduler is paused (or draining), as it last reported. The scheduler
        sends its new state before the reply of the call that changed it, and by itself when
        a pause lease expires."""
        return self._scheduler_paused

    async def flush_cache(
        self, obj: FlushCacheReqInput | None = None, request: fastapi.Request | None = None
    ) -> FlushCacheReqOutput:
        """Ask the scheduler to flush the prefix cache; returns its reply (success or reason)."""
        return await self._control(obj or FlushCacheReqInput())

    async def get_internal_state(self) -> list[dict]:
        """The scheduler's internal state, one dict per scheduler (DESIGN §2 keys)."""
        out = await self._control(GetInternalStateReq())
        return out.internal_states or [out.internal_state]  # one per DP rank with --dp-size

    # ---- weights (docs/weights.md) -------------------------------------------------------------
    async def update_weights_from_disk(
        self, obj: UpdateWeightFromDiskReqInput, request: fastapi.Request | None = None
    ) -> UpdateWeightFromDiskReqOutput:
        """Load the checkpoint at ``obj.model_path`` into the running model (validated first;
        a refusal changes nothing). On success the reported model path follows it."""
        try:
            check_control_request(obj)
        except InvalidRequestError as e:  # refused like the scheduler refuses: success False
            return UpdateWeightFromDiskReqOutput(False, f"Update refused: {e}", req_id=obj.req_id)
        out = await self._control(obj)
        if out.success:
            self.model_path = obj.model_path
        return out

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: fastapi.Request | None = None
    ) -> UpdateWeightsFromTensorReqOutput:
        """Send ``obj.named_tensors`` (pickled) to the scheduler and copy them into the model.
        Upstream's ``serialized_named_tensors`` payload is decoded here first (with
        ``--tp-size > 1`` it is sent on as it is, one entry per rank, each rank decoding its
        own); one that does not decode to (name, tensor) pairs, or an invalid request, is
        refused (``success=False``) without reaching the scheduler. The reply unpacks as
        upstream's ``(success, message)``."""
        tp_size = self.server_args.tp_size
        if obj.serialized_named_tensors is not None and tp_size > 1:
            # One entry per tensor-parallel rank: each rank decodes its own (weight_updater).
            if len(obj.serialized_named_tensors) != tp_size:
                return UpdateWeightsFromTensorReqOutput(
                    False,
                    f"serialized_named_tensors has {len(obj.serialized_named_tensors)} entries; "
                    f"with --tp-size {tp_size} it needs one per tensor-parallel rank",
                    req_id=obj.req_id,
                )
        elif obj.serialized_named_tensors is not None:
            try:
                named = decode_named_tensors(
                    obj.serialized_named_tensors, load_format=obj.load_format
                )
            except ValueError as e:
                return UpdateWeightsFromTensorReqOutput(False, str(e), req_id=obj.req_id)
            obj = dataclasses.replace(obj, named_tensors=named, serialized_named_tensors=None)
        try:
            check_control_request(obj)
        except InvalidRequestError as e:  # refused like the scheduler refuses: success False
            return UpdateWeightsFromTensorReqOutput(False, str(e), req_id=obj.req_id)
        return await self._control(obj)

    async def init_weights_update_group(
        self, obj: InitWeightsUpdateGroupReqInput, request: fastapi.Request | None = None
    ) -> tuple[bool, str]:
        """Join the trainer's weight-broadcast group; returns upstream's ``(success,
        message)``. With one scheduler rank the frontend joins as ``rank_offset`` (see
        weights_update_group; only a worker thread blocks while the ranks meet); with several
        (``--tp-size``/``--dp-size`` > 1) every rank joins itself (see rank_weight_sync)."""
        ranks = self._scheduler_ranks()
        if ranks > 1:
            if not 1 <= obj.rank_offset <= obj.world_size - ranks:
                return False, (
                    f"Failed to initialize the weights update group: this engine's {ranks} "
                    f"scheduler ranks join as rank_offset .. rank_offset + {ranks - 1}, so "
                    f"rank_offset must be >= 1 and rank_offset + {ranks} <= world_size; got "
                    f"rank_offset {obj.rank_offset}, world_size {obj.world_size}"
                )
            out: WeightsUpdateGroupReqOutput = await self._control(obj)
            return out.success, out.message
        try:
            await asyncio.to_thread(self.weights_update_groups.init_group, obj)
        except (ValueError, RuntimeError) as e:
            return False, f"Failed to initialize the weights update group: {e}"
        return True, "Succeeded to initialize the weights update group."

    def _scheduler_ranks(self) -> int:
        """How many scheduler ranks this engine runs (each a member of a weight group)."""
        return self.server_args.tp_size * self.server_args.dp_size

    async def update_weights_from_distributed(
        self, obj: UpdateWeightsFromDistributedReqInput, request: fastapi.Request | None = None
    ) -> tuple[bool, str]:
        """Receive the tensors broadcast in group ``obj.group_name`` and load them like
        :meth:`update_weights_from_tensor`; returns ``(success, message)``. With several
        scheduler ranks the ranks receive the broadcast themselves."""
        if self._scheduler_ranks() > 1:
            update: UpdateWeightsFromTensorReqOutput = await self._control(obj)
            return update.success, update.message
        try:
            named = await asyncio.to_thread(self.weights_update_groups.receive, obj)
        except (ValueError, RuntimeError) as e:
            return False, f"Failed to receive the weights: {e}"
        out = await self.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(
                named, obj.load_format, obj.flush_cache, obj.abort_all_requests, obj.weight_version
            )
        )
        return out.success, out.message

    async def destroy_weights_update_group(
        self, obj: DestroyWeightsUpdateGroupReqInput, request: fastapi.Request | None = None
    ) -> tuple[bool, str]:
        """Leave group ``obj.group_name``; returns ``(success, message)``."""
        if self._scheduler_ranks() > 1:
            out: WeightsUpdateGroupReqOutput = await self._control(obj)
            return out.success, out.message
        try:
            self.weights_update_groups.destroy(obj.group_name)
        except ValueError as e:
            return False, str(e)
        return True, "Succeeded to destroy the weights update group."

    async def get_weights_by_name(self, obj: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        return await self._control(obj)

    async def update_weight_version(
        self, obj: UpdateWeightVersionReqInput
    ) -> UpdateWeightVersionReqOutput:
        """Relabel the current weights; aborts every request only when asked."""
        return await self._control(obj)

    # ---- profiling (docs/native_api.md#profiling) --------------------------------------------
    async def start_profile(
        self,
        output_dir: str | None = None,
        start_step: int | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
        profile_by_stage: bool = False,
        merge_profiles: bool = False,
        profile_prefix: str | None = None,
        profile_stages: list[str] | None = None,
    ) -> ProfileReqOutput:
        """Start the torch profiler in every scheduler rank (upstream's signature). Upstream's
        ``profile_by_stage``, ``merge_profiles`` and ``profile_stages`` are refused when set
        (ValueError); ``with_stack`` / ``record_shapes`` default to on, unless
        $SGLANG_PROFILE_WITH_STACK / $SGLANG_PROFILE_RECORD_SHAPES say false. RuntimeError when
        a rank refuses (one is running already, GPU asked without CUDA, ...)."""
        unsupported = [name for name, value in (("profile_by_stage", profile_by_stage),
                                                ("merge_profiles", merge_profiles),
                                                ("profile_stages", profile_stages)) if value]
        if unsupported:
            raise ValueError(f"not supported by this engine: {', '.join(unsupported)}")
        stack = with_stack is not False and environ.profile_flag("SGLANG_PROFILE_WITH_STACK")
        shapes = record_shapes is not False and environ.profile_flag(
            "SGLANG_PROFILE_RECORD_SHAPES")
        req = ProfileReq(
            "start", output_dir, start_step, num_steps, activities,
            with_stack=stack, record_shapes=shapes,
            profile_prefix=profile_prefix, profile_id=str(time.time()),
        )
        return self._profile_result(await self._control(req))

    async def stop_profile(self) -> ProfileReqOutput:
        """Stop the profiler in every rank and write the traces. RuntimeError when none runs."""
        return self._profile_result(await self._control(ProfileReq("stop")))

    @staticmethod
    def _profile_result(out: ProfileReqOutput) -> ProfileReqOutput:
        if not out.success:
            raise RuntimeError(out.message)
        return out

    # ---- memory occupation (docs/memory.md) --------------------------------------------------
    async def release_memory_occupation(
        self, obj: ReleaseMemoryOccupationReqInput, request: fastapi.Request | None = None
    ) -> ReleaseMemoryOccupationReqOutput:
        """Free the scheduler's KV cache and/or weights until resumed (refused while a request
        holds KV). ValueError for bad tags, before anything is sent."""
        resolve_tags(obj.tags)
        return self._note_memory(await self._control(obj))

    async def resume_memory_occupation(
        self, obj: ResumeMemoryOccupationReqInput, request: fastapi.Request | None = None
    ) -> ResumeMemoryOccupationReqOutput:
        resolve_tags(obj.tags)
        return self._note_memory(await self._control(obj))

    def _note_memory(self, out: Any) -> Any:
        self.memory_released = bool({"kv_cache", "weights"} & set(out.released_tags))
        return out

    async def _control(self, req: Any) -> Any:
        """Send a control request and await the reply carrying the same ``req_id``; an
        invalid one raises InvalidRequestError (a ValueError) before anything is sent. Awaited
        from a loop other than the owning one, it runs on the owning loop and returns there."""
        check_control_request(req)
        self._check_alive()
        if self._loop is not None and not self._on_own_loop():
            if not self._loop.is_running():
                raise RuntimeError("the TokenizerManager's event loop is not running")
            bridged = asyncio.run_coroutine_threadsafe(self._control(req), self._loop)
            return await asyncio.wrap_future(bridged)
        self.start()
        future = self._own_loop().create_future()
        self._pending_controls[req.req_id] = future
        self._send(req)
        try:
            return await future
        finally:
            self._pending_controls.pop(req.req_id, None)

    # ---- receiving ---------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        """Handle the messages one after the other, in arrival order. A big one is unpickled
        in a worker thread and its logprob rows are built a slice at a time, awaited here: the
        loop (``/health``, other callers) keeps running meanwhile and later messages still
        wait their turn."""
        sock = self._recv_socket
        assert sock is not None, "started before receiving"
        while True:
            data = await sock.recv()
            try:
                if len(data) > _OFFLOAD_MESSAGE_BYTES:
                    msg = await asyncio.to_thread(loads, data)
                else:
                    msg = loads(data)
                if (
                    isinstance(msg, BatchStrOutput)
                    and logprob_entries(msg) > _OFFLOAD_LOGPROB_ENTRIES
                ):
                    await self._handle_big_batch_str_output(msg)
                else:
                    self._dispatcher(msg)
            except Exception:
                logger.exception("Failed to handle a message from the scheduler/detokenizer")

    async def _handle_big_batch_str_output(self, msg: BatchStrOutput) -> None:
        """:meth:`_handle_batch_str_output` with the logprob rows built beforehand, a slice of
        about ``_ROW_SLICE_ENTRIES`` entries at a time with the loop's other work in between.
        A request aborted meanwhile is skipped when the rows are applied."""
        built: dict[int, tuple[ReqState, dict[str, list] | Exception]] = {}
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
            if state is None or state.finished:
                continue
            try:
                built[i] = (state, await logprob_rows_in_slices(state, msg, i, _ROW_SLICE_ENTRIES))
            except Exception as e:  # fails this request alone, when applied
                built[i] = (state, e)
        self._handle_batch_str_output(msg, built)

    def _handle_batch_str_output(
        self,
        msg: BatchStrOutput,
        prebuilt: dict[int, tuple[ReqState, dict[str, list] | Exception]] | None = None,
    ) -> None:
        """Accumulate each rid's increment and wake its waiter; unknown rids are ignored.
        ``prebuilt``: entry index -> (its state, its logprob rows or the error building them)."""
        for i, rid in enumerate(msg.rids):
            state = self.rid_to_state.get(rid)
            if state is None or state.finished:
                continue
            try:
                rows = None
                if prebuilt is not None and i in prebuilt and prebuilt[i][0] is state:
                    built = prebuilt[i][1]
                    if isinstance(built, Exception):
                        raise built
                    rows = built
                state.apply(msg, i, rows)
            except Exception as e:  # one bad increment fails its own request only
                logger.exception("Failed to apply the output of %s", rid)
                state.error = f"failed to assemble the output: {e!r}"
                self.abort_request(rid)
            if state.finished or state.error is not None:
                del self.rid_to_state[rid]
            state.notify.set()

    def _handle_control_output(self, msg: Any) -> None:
        future = self._pending_controls.pop(msg.req_id, None)
        if future is not None and not future.done():
            future.set_result(msg)

    def _handle_abort_output(self, msg: AbortReqOutput) -> None:
        self._handle_control_output(msg)
        targets = self._abort_targets.pop(msg.req_id, [])
        if msg.num_aborted == 0 and targets:
            self._own_loop().call_later(_ABORT_GRACE_S, self._finish_aborted_locally, targets)

    def _finish_aborted_locally(self, states: list[ReqState]) -> None:
        """Safety net: end requests the scheduler did not know, so their callers return."""
        for state in states:
            if state.finished:
                continue
            logger.warning("Abort of %s ended nothing in the scheduler; finishing it", state.rid)
            state.finish_locally({"type": "abort", "message": "Aborted"})
            if self.rid_to_state.get(state.rid) is state:
                del self.rid_to_state[state.rid]
            state.notify.set()

    def _handle_pause_state(self, msg: PauseStateOutput) -> None:
        self._scheduler_paused = msg.paused

    def _handle_lora_pause_state(self, msg: LoRAPauseStateOutput) -> None:
        self._paused_loras = set(msg.paused)

    def _handle_scheduler_error(self, msg: SchedulerErrorOutput) -> None:
        self._fail_all(f"scheduler died: {msg.message}")

    # ---- liveness ----------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        while self._dead_reason is None:
            for proc in self._procs:
                if not proc.is_alive():
                    name = getattr(proc, "name", "subprocess")
                    code = getattr(proc, "exitcode", None)
                    self._fail_all(f"scheduler died: process {name} exited with code {code}")
                    break
            await asyncio.sleep(_WATCH_INTERVAL_S)

    def _fail_all(self, reason: str) -> None:
        """Make every waiter and every later call raise RuntimeError(reason)."""
        if self._dead_reason is not None:
            return
        num_pending = len(self.rid_to_state) + len(self._pending_controls)
        if reason.startswith("scheduler died"):
            logger.error("%s; failing %d pending call(s)", reason, num_pending)
        elif num_pending:
            logger.warning("%s; failing %d pending call(s)", reason, num_pending)
        self._dead_reason = reason
        for state in self.rid_to_state.values():
            state.error = reason
            state.notify.set()
        for future in self._pending_controls.values():
            if not future.done():
                future.set_exception(RuntimeError(reason))

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise RuntimeError(self._dead_reason)

    # ---- helpers -----------------------------------------------------------------------------
    def _on_own_loop(self) -> bool:
        """Whether the caller runs on the loop this manager is bound to."""
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no running loop in this thread
            return False

    def _send(self, obj: Any) -> None:
        """Queue ``obj`` for the scheduler (zmq keeps the order of sends)."""
        if self._send_socket is None:
            raise RuntimeError("the TokenizerManager is not started")
        self._send_socket.send(dumps(obj))

    def _own_loop(self) -> asyncio.AbstractEventLoop:
        """The loop that owns this manager (set by :meth:`start`)."""
        if self._loop is None:
            raise RuntimeError("the TokenizerManager is not started")
        return self._loop

    def _text_decoder(self, enabled: bool) -> Callable[[list[int]], list[str]] | None:
        """A function ids -> texts for logprob entries, or None when texts are not asked."""
        if not enabled or self.tokenizer is None:
            return None
        return self._token_texts_of

    def _token_texts_of(self, ids: list[int]) -> list[str]:
        """The text of each token id decoded alone. Top logprobs repeat ids across positions
        and replies: each id is decoded once and its text kept (``_token_texts``)."""
        texts = self._token_texts
        missing = [i for i in dict.fromkeys(ids) if i not in texts]
        if missing:
            assert self.tokenizer is not None, "texts asked for without a tokenizer"
            texts.update(zip(missing, self.tokenizer.batch_decode([[i] for i in missing])))
        return list(map(texts.__getitem__, ids))


def _think_end_id(tokenizer: Any, reasoning_parser: str | None) -> int | None:
    """The id of the token that ends ``reasoning_parser``'s reasoning, when the server has a
    parser and the vocabulary holds that marker as one token (as upstream counts
    ``reasoning_tokens``); else None."""
    if tokenizer is None or reasoning_parser is None:
        return None
    marker = think_end_token(reasoning_parser)
    token_id = tokenizer.convert_tokens_to_ids(marker)
    unk = getattr(tokenizer, "unk_token_id", None)
    return token_id if isinstance(token_id, int) and token_id != unk else None


def _close_zmq(context: zmq.asyncio.Context, sockets: list[zmq.asyncio.Socket]) -> None:
    """Close ``sockets`` (unsent messages dropped) and terminate ``context``."""
    for sock in sockets:
        sock.close(linger=0)
    context.term()
